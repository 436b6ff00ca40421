"""The closed-form run engine: the run model of `sim/model/run.py` with no SimPy event where nothing contends.

`sim/model/run.py`'s `Run` (the reference, `simulate_run(..., reference_events=True)`) advances a SimPy
environment: a chunk of iterations is a timeout, every checkpoint write, flush and read goes through
processor-sharing links as events, and a failure interrupts a process. Between failures everything
is deterministic, so this engine computes it instead, in the same order and, wherever that is
cheap, with the same floating-point operations:

- The trainer loop is the same loop (`ClosedFormRun._train_loop` mirrors `Run._train_loop`, `_train`,
  `_credit`), but a chunk or a wait is one comparison of its end with the next thing that can stop
  it: the next failure arrival (replayed as the churn process does, with its clock's arithmetic),
  the deadline, or a background event that changes the pipeline state while training.
- Transfers are the run's links' (`RunLinks`, `transfers.py`). A transfer group (checkpoint
  writes, reads, weight transfers) on idle links ends at the instant the event model's wake-up chain gives (`fluid_links.processor_sharing_end_s`), computed as a
  number, worked out once per set of transfers and added to each start (`IdleDuration`).
  A group abandoned by the trainer (a failure struck first) goes on in the event model and
  slows whatever later shares its links: it is remembered, and put on its links (`FluidLink`) only
  if a later group finds them still busy; that group is then timed with it. Background groups
  (replica refreshes, a redundant replacement's weights) are always put on their links.
- Whole cycles of "iterations up to the next checkpoint, then its write" run in one tight loop
  (`_cycles`) while nothing can stop them; the first part that something could stop goes through
  the general path. Likewise a recovery's join delay, restart and transfers (weights or a
  checkpoint read) are booked in one step (`recover_unstopped`) when they end before anything can
  stop them on idle links, else waited for one by one.
- Background work that the event model runs as processes (lazy asynchronous flushes, redundant
  replacements, replica refreshes) is each method's own recurrence (`sim/model/closed_form/*.py`), a
  completion scheduled on a small heap, evaluated when the run reaches its time, or, where the
  completion changes nothing until its owner looks (CheckFree+'s refresh, a redundant successor's
  replica), a background group whose `end_s` the owner reads when it gets there: no event at all.
- A failure during a recovery raises `Interrupted` out of the wait in progress, books the
  interrupted part, and the method's recovery is called again with the new failures, exactly as the
  event model re-enters it: the remaining wait is recomputed, never replayed event by event.

- Data parallelism: the replica layer (`sim/model/replicas.py`) is the event model's, called at each
  arrival; a heal's end is a background completion (`schedule`), which while training re-times the
  chunk as a state change does; the fast paths (whole chunks, cycles) run only while no node is
  missing.

Each recovery method has a closed-form twin (`ClosedFormPolicy`, registered per policy class in
`sim/model/closed_form/__init__.py`) that drives the policy object's own state (checkpointers, restart
recoveries, rebuild sets) and mirrors its generators line by line; a policy without a twin (one a
user registers) runs in the event model. Where transfers would truly share a link with something the
twin cannot re-time (a background transfer joining a link the trainer is waiting on, a shared
first-level flush tier with a backlog), the twin raises `NeedsEventModel` and the whole run is
simulated again in the event model (`sim/model/run.py`), so the answer never depends on the engine.

Exactness: the results equal the event model's to floating-point rounding (the differential test
`tests/sim/test_closed_form_equivalence.py` asserts 1e-9 relative): chunks, waits and uncontended
transfers to the bit (unequal parts on one link: to a few units in the last place, `IdleDuration`); transfers on a link that other flows share (`FluidLink`) to rounding.
Instants that coincide exactly follow the model's rule (sim/model/run.py, "Coinciding instants"): a
failure arrival comes before a background completion, a chunk end or a transfer end at its instant,
and training is labelled by the state it ran in, so a state change at a chunk's end may come either
side of it. Other ties are ordered as the event model usually orders them (the deadline first,
sim/model/closed_form/async_checkpoint.py for flush rounds); the event model orders those by when SimPy
scheduled each event (a chunk that ends exactly at the deadline: the event model may complete it
and start the boundary's work first, which changes only the counters of work started at that
instant); with a deadline that is no exact multiple of the iteration and generic bandwidths they do
not occur. Spans that end at the same instant may be listed in another order.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Callable

from mypy_extensions import mypyc_attr

from churnsim.calibration.scenario import Scenario

from ..accounting import WAIT_CATEGORIES, Ledger
from ..iteration import IterationModel
from ..pipeline_state import PipelineState
from ..replicas import ALREADY_DOWN, FEWER_REPLICAS_LABEL, HEAL, HEAL_CATEGORY, PAUSE_LABEL, ReplicaGroup, heal_track, replica_group_for
from .interrupts import INTERRUPTED, Interrupted
from .transfers import NodeTransfers, RunLinks, TierTransfers

if TYPE_CHECKING:
    from churnsim.calibration.failure_sampling import FailureEvent
    from ..methods.base import RecoveryPolicy
    from .checkpointing import SyncCheckpointerTwin

_CREDIT_TOLERANCE = 1e-9  # relative: as sim/model/run.py
_SPAN_CATEGORY = {"checkpoint_stall_s": "checkpoint", "recovery_downtime_s": "recovery", "method_overhead_s": "method", "replica_heal_s": "heal", "survivor_restart_s": "recovery"}
_INFINITY = math.inf


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's twin (`register_twin`) is plain Python
class ClosedFormPolicy:
    """The closed-form twin of one `RecoveryPolicy`: its generators as plain calls on a `ClosedFormRun`.

    A twin works on the policy object's own state; its calls spend time only through the run's
    `wait` and `wait_until` and its links' `wait_group`, `wait_transfers` and `wait_tier_group`
    (`run.links`), which raise `Interrupted`.
    """

    def __init__(self, policy: "RecoveryPolicy", scenario: Scenario) -> None:
        self.policy = policy
        self.scenario = scenario
        self.num_stages = scenario.pipeline.num_stages

    periodic_writer: "SyncCheckpointerTwin | None" = None
    """A `SyncCheckpointerTwin` whose write is all of `at_boundary` (the engine then runs whole
    cycles of iterations and writes inline: `ClosedFormRun._cycles`), or None."""

    cycles: "Callable[[ClosedFormRun], None] | None" = None
    """Where the boundary work is not a plain write: the twin's own loop over whole cycles of
    (iterations up to the boundary, the boundary work) that nothing can stop, called where the
    engine would run `_cycles`; it returns at the first part the general path must do."""

    def on_start(self, run: "ClosedFormRun") -> None:
        """Before training (the policy's `on_start`)."""

    def iterations_until_boundary(self, run: "ClosedFormRun") -> int | None:
        return self.policy.iterations_until_boundary(run)  # type: ignore[arg-type]  # a run offers the RunContext API it reads

    def at_boundary(self, run: "ClosedFormRun") -> None:
        """The periodic work (the policy's `at_boundary`)."""

    def on_failures(self, run: "ClosedFormRun", failures: tuple[FailureEvent, ...]) -> None:
        raise NotImplementedError

    def finish(self, run: "ClosedFormRun") -> None:
        """After the trainer stopped at `run.now`: book background work completed by then."""


class ClosedFormRun:
    """One run in closed form; also the context its twin reads and changes (the `RunContext` API).
    Its transfers and the links they share are `links` (`RunLinks`)."""

    def __init__(
        self,
        scenario: Scenario,
        policy: "RecoveryPolicy",
        twin: ClosedFormPolicy,
        failures,
        *,
        iteration_model: IterationModel,
        healthy_state: PipelineState,
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.twin = twin
        self.num_stages = scenario.pipeline.num_stages
        self.target_iterations = scenario.target_iterations
        self.iteration_model = iteration_model
        self.healthy_state = healthy_state
        self.iteration_time_s = iteration_model.iteration_time_s(healthy_state)
        self._state = healthy_state
        self.progress = 0.0
        self.iterations_executed = 0
        self.down_until: dict[int, float] = {}
        self.node_generation = [0] * self.num_stages
        self.trajectory: list[float] = [0.0, 0.0]  # flat fields, as RunContext's
        self.timeline: list = []
        self.background_timeline: list = []
        """Spans of background work booked late (lazy flushes), each with a marker (`background_span`)."""
        self.handled: list = []  # flat fields, as RunContext's
        self.notes: list[str] = []
        self.waits_s = {name: 0.0 for name in WAIT_CATEGORIES}
        self.training_s_by_iteration_time: dict[float, float] = {}
        self.interrupted_iterations = 0.0
        self.rolled_back_iterations = 0.0
        self.setback_iterations = 0.0
        self.replica_shortfall_s = 0.0
        self.now = 0.0
        self.deadline_s = scenario.target.max_wall_clock_s
        self.deadline_hit = False
        self.reached_target = False
        self.pending: list[FailureEvent] = []
        self._join_delay_s = scenario.recovery.join_delay_s
        self._ignores_failures = policy.config.ignores_failures
        self._reliable_stages = policy.reliable_stages
        self._failure_labels: dict[str, str] = {}
        self._degraded_label: dict[int, bool] = {}
        self._equal_states: dict[tuple[int, int], tuple] = {}
        # The churn process's replay: its own clock advances by (time − clock) per event.
        self._failure_iterator = iter(failures)
        self._churn_now = 0.0
        self._next_event: FailureEvent | None = None
        self._arrival_s = _INFINITY
        self._arrival_same_step = False
        # Background completions: (time, sequence, callback).
        self._background: list[tuple[float, int, Callable[[], None]]] = []
        self._background_s = _INFINITY
        self.next_stop_s = self.deadline_s
        """The earliest of the next arrival, the next background event and the deadline: a chunk or
        a wait that ends before it needs no look at either."""
        self._load_next_arrival()
        self._sequence = 0
        self.links = RunLinks(self)
        """The run's links and the transfers on them (`start_transfers`, `wait_group`, `wait_transfers`, `wait_tier_group`)."""
        self._fraction_done = 0.0
        self._training = False
        self._state_changed = False
        self.replicas: ReplicaGroup | None = replica_group_for(scenario, policy.config)
        """Data parallelism's replica layer (sim/model/replicas.py); None when D is 1."""
        self._all_replicas_train = True
        """No node is missing: the fast paths (whole chunks, cycles) may run."""
        self._replica_lost = False
        """A node loss healed from a survivor struck while training: the iteration in flight is lost."""
        self._survivors_restart_pending = False
        """A healed node loss under an agent that restarts every worker (`Run._survivors_restart_pending`)."""

    # ----------------------------------------------------------------- the trainer (sim/model/run.py)
    def execute(self) -> None:
        try:
            self._train_loop()
        finally:
            # The shared exception keeps the frames of its last raise, and with them this run and its
            # records, until the next raise (of a later run): let them go when the run does.
            INTERRUPTED.__traceback__ = None

    def _train_loop(self) -> None:
        twin = self.twin
        twin.on_start(self)
        pending = self.pending
        target_iterations = self.target_iterations
        # The twin's own rule, or the policy's plain arithmetic on its state (one call fewer).
        if type(twin).iterations_until_boundary is ClosedFormPolicy.iterations_until_boundary:
            iterations_until_boundary: Callable[[ClosedFormRun], int | None] = self.policy.iterations_until_boundary  # type: ignore[assignment]
        else:
            iterations_until_boundary = twin.iterations_until_boundary
        at_boundary = twin.at_boundary
        writer = twin.periodic_writer
        cycles = twin.cycles
        survivor_restart_s = self.scenario.survivor_restart_charged_s
        while not self.deadline_hit:
            try:
                if pending or self._survivors_restart_pending:
                    if survivor_restart_s > 0:  # as sim/model/run.py: the agent restarts the survivors first
                        self._survivors_restart_pending = False
                        self.wait(survivor_restart_s, "survivor_restart_s", "survivors restart")
                    if not pending:
                        continue
                    batch = tuple(pending)
                    pending.clear()
                    twin.on_failures(self, batch)
                    continue
                if writer is not None:
                    self._cycles(writer)
                elif cycles is not None:
                    cycles(self)
                remaining = math.ceil(target_iterations - self.progress - 1e-9)
                if remaining <= 0:
                    self.reached_target = True
                    break
                until_boundary = iterations_until_boundary(self)
                if until_boundary is not None and until_boundary <= 0:
                    at_boundary(self)
                    continue
                if not self._all_replicas_train and self._wait_for_heals():
                    continue
                chunk = remaining if until_boundary is None or remaining < until_boundary else until_boundary
                # `_train` for a chunk nothing stops (the usual case), inline.
                iteration_time_s = self.iteration_time_s
                start_s = self.now
                end_s = start_s + (chunk - 0.0) * iteration_time_s
                if end_s < self.next_stop_s and self._state is self.healthy_state and self._all_replicas_train:
                    self.book_unstopped_chunk(start_s, end_s, chunk, iteration_time_s)
                    continue
                self._train(chunk)  # False when a failure or the deadline stopped it: the loop decides next
            except Interrupted:
                pass
        twin.finish(self)
        # Drop the reference cycles that would keep the run alive until a collection: the last busy
        # periods' batch ↔ group, and background callbacks (a redundant replacement holds the run)
        # that will never be called.
        self.links.release()
        self._background.clear()

    def _cycles(self, writer) -> None:
        """Whole cycles of (iterations up to the next checkpoint, its write) that nothing can stop, inline.

        `run_cycles` with `writer.write` (a `SyncCheckpointerTwin`, the twin's `periodic_writer`) as
        the boundary work, for as long as the write ends before the next arrival, background event
        and the deadline, with the tier idle: booked as the general path books it.
        """
        checkpointer = writer.checkpointer
        transfers = writer.writes
        serialization_s = checkpointer.serialization_s
        timeline, waits = self.timeline, self.waits_s
        write_label, serialization_label = writer.write_label, writer.serialization_label

        def write() -> bool:
            now = self.now
            if not transfers.idle_from(self.links, now):
                return False
            written_s = now + serialization_s if serialization_s > 0 else now
            end_s = transfers.idle_end_s(written_s)
            if end_s >= self.next_stop_s:
                return False
            if serialization_s > 0:
                waits["checkpoint_stall_s"] += written_s - now
                if written_s > now:
                    timeline.extend((serialization_label, "checkpoint", -1, now, written_s, None))
            if end_s > written_s:
                waits["checkpoint_stall_s"] += end_s - written_s
                timeline.extend((write_label, "checkpoint", -1, written_s, end_s, None))
            self.now = end_s
            checkpointer.committed_progress = self.progress
            checkpointer.has_checkpoint = True
            checkpointer.num_written += 1
            checkpointer._origin = self.iterations_executed
            return True

        self.run_cycles(checkpointer.interval_iterations, lambda: checkpointer._origin, write)

    def run_cycles(self, interval: int, origin_of: Callable[[], int], boundary_work: Callable[[], bool]) -> None:
        """Whole cycles of (iterations up to the next boundary, the boundary's work) that nothing can
        stop, in the healthy state: the loop of `_train_loop` without its checks. A boundary comes
        `interval` iterations after `origin_of()`; `boundary_work` does the boundary's work and
        returns True, or returns False having booked nothing when something could stop it. Returns
        at the first part the general path must do (nothing of it booked).
        """
        iteration_time_s = self.iteration_time_s
        target_iterations = self.target_iterations
        while self._state is self.healthy_state and not self.pending and self._all_replicas_train:
            remaining = math.ceil(target_iterations - self.progress - 1e-9)
            if remaining <= 0:
                return
            until_boundary = interval - (self.iterations_executed - origin_of())
            if until_boundary <= 0:
                if not boundary_work():
                    return
                continue
            chunk = remaining if remaining < until_boundary else until_boundary
            now = self.now
            end_s = now + (chunk - 0.0) * iteration_time_s
            if end_s >= self.next_stop_s:
                return
            self.book_unstopped_chunk(now, end_s, chunk, iteration_time_s)

    def book_unstopped_chunk(self, start_s: float, end_s: float, chunk: int, iteration_time_s: float) -> None:
        """`chunk` healthy iterations from `start_s` to `end_s` that nothing stopped, booked as `_train`
        books them (the fast paths of `_train_loop` and the cycle loops)."""
        self.now = end_s
        by_time = self.training_s_by_iteration_time
        by_time[iteration_time_s] = by_time.get(iteration_time_s, 0.0) + (end_s - start_s)
        if end_s > start_s:
            self.timeline.extend(("train", "train", -1, start_s, end_s, None))
        self.progress += chunk
        self.iterations_executed += chunk
        self.trajectory.extend((end_s, self.progress))

    def _train(self, num_iterations: int) -> bool:
        """`Run._train`: run until `num_iterations` more iterations have completed (True), or until a
        failure or the deadline stops it (False: the event model's `Interrupt`, without raising it).
        A state change goes on at the new iteration time."""
        goal = num_iterations
        while goal > 0:
            iteration_time_s = self.iteration_time_s
            state = self._state  # the state trained in, whatever it is when this is booked
            # An iteration with fewer replica pipelines is credited as its share of a full one.
            share = 1.0 if self.replicas is None else self.replicas.batch_share
            step_s = iteration_time_s if share == 1.0 else iteration_time_s / share
            start_s = self.now
            end_s = start_s + (goal - self._fraction_done) * step_s
            if end_s < self.next_stop_s:
                stopped_s = None
            else:
                self._training = True
                stopped_s = self.advance(end_s)
                self._training = False
            if stopped_s is None:
                self.now = end_s
                self._book_training(start_s, iteration_time_s, state, share)
                self._complete(goal)
                self._fraction_done = 0.0
                return True
            self.now = stopped_s
            # `Run._credit`: whole iterations done (an interrupt at the very end of one credits it).
            total = self._fraction_done + (stopped_s - start_s) / step_s
            whole = min(goal, int(math.floor(total + _CREDIT_TOLERANCE)))
            if whole >= 1:
                self._fraction_done = max(total - whole, 0.0)
                self._complete(whole)
            else:
                self._fraction_done = total
            goal -= whole
            if goal == 0:
                self._fraction_done = 0.0
            self._book_training(start_s, iteration_time_s, state, share)
            if self.pending or self.deadline_hit or self._replica_lost:
                self._replica_lost = False
                self.interrupted_iterations += self._fraction_done
                self._fraction_done = 0.0
                return False
            # a state change: go on at the new iteration time
        return True

    def _complete(self, iterations: int) -> None:
        self.progress += iterations
        self.iterations_executed += iterations
        self.trajectory.extend((self.now, self.progress))

    def _book_training(self, start_s: float, iteration_time_s: float, state: PipelineState, share: float = 1.0) -> None:
        elapsed_s = self.now - start_s
        by_time = self.training_s_by_iteration_time
        if share != 1.0:  # `Ledger.book_training_with_fewer_replicas`
            delivered_s = elapsed_s * share
            by_time[iteration_time_s] = by_time.get(iteration_time_s, 0.0) + delivered_s
            self.replica_shortfall_s += elapsed_s - delivered_s
            if elapsed_s > 0:
                self.timeline.extend((FEWER_REPLICAS_LABEL, HEAL_CATEGORY, -1, start_s, self.now, None))
            return
        by_time[iteration_time_s] = by_time.get(iteration_time_s, 0.0) + elapsed_s
        if elapsed_s > 0:
            if state is self.healthy_state:
                degraded = False
            else:
                known = self._degraded_label.get(id(state))
                if known is None:
                    known = self._degraded_label[id(state)] = state != self.healthy_state
                degraded = known
            if degraded:
                self.timeline.extend(("degraded training", "degraded", -1, start_s, self.now, None))
            else:
                self.timeline.extend(("train", "train", -1, start_s, self.now, None))

    # ----------------------------------------------------------------- what can stop a chunk or a wait
    def advance(self, end_s: float) -> float | None:
        """Replay arrivals and background events up to `end_s`; the instant the trainer is stopped, or None.

        A failure that needs handling (not ignored, its stage not already down) stops it at its
        arrival; so does the deadline, and, while training, a background event that changes the
        pipeline state. Arrivals that change nothing are booked on the way.
        """
        if end_s < self.next_stop_s:
            return None
        deadline_s = self.deadline_s
        while True:
            arrival_s = self._arrival_s
            background_s = self._background_s
            if background_s < arrival_s:  # a failure at the same instant comes first (sim/model/run.py)
                if background_s > end_s or background_s >= deadline_s:
                    break
                _, _, callback = heapq.heappop(self._background)
                self._background_s = self._background[0][0] if self._background else _INFINITY
                self.next_stop_s = min(self._arrival_s, self._background_s, self.deadline_s)
                self.now = background_s
                callback()
                if self._state_changed:
                    self._state_changed = False
                    return background_s
                continue
            if arrival_s > end_s or arrival_s == _INFINITY:  # no failure left; end_s may be infinite too
                break
            self.now = arrival_s
            effective = self._arrive()
            while self._arrival_same_step:  # the churn process delivers same-instant events in one step
                effective = self._arrive() or effective
            if effective:
                return arrival_s
        if deadline_s <= end_s:
            self.now = deadline_s
            self.deadline_hit = True
            return deadline_s
        return None

    def _load_next_arrival(self) -> None:
        event = next(self._failure_iterator, None)
        if event is None or event.time_s >= self.deadline_s:
            self._next_event = None
            self._arrival_s = _INFINITY
            self._arrival_same_step = False
        else:
            self._next_event = event
            churn_now = self._churn_now
            if event.time_s > churn_now:
                self._churn_now = churn_now + (event.time_s - churn_now)
                self._arrival_same_step = False
            else:
                self._arrival_same_step = True
            self._arrival_s = self._churn_now
        self.next_stop_s = min(self._arrival_s, self._background_s, self.deadline_s)

    def _arrive(self) -> bool:
        """The arrival of the next failure event (sim/model/run.py `Run._arrive`); True if it needs handling."""
        event = self._next_event
        assert event is not None
        self._load_next_arrival()
        now = self.now
        stage = event.stage
        label = self._failure_labels.get(event.kind)
        if label is None:
            label = self._failure_labels[event.kind] = f"failure ({event.kind})"
        self.timeline.extend((label, "failure", stage, now, now, None))
        if self._ignores_failures or stage in self._reliable_stages:
            self.handled.extend((event.time_s, stage, event.kind, "ignored", int(self.progress), event.replica))
            return False
        if now < self.down_until.get(stage, -_INFINITY):
            self.handled.extend((event.time_s, stage, event.kind, "already_down", int(self.progress), event.replica))
            return False
        if self.replicas is not None:
            outcome = self._node_lost(event)
            if outcome is not None:
                return outcome
        self.down_until[stage] = now + self._join_delay_s
        self.node_generation[stage] += 1
        self.pending.append(event)
        return True

    # ----------------------------------------------------------------- data parallelism (sim/model/replicas.py)
    def _node_lost(self, event: FailureEvent) -> bool | None:
        """The replica layer's part of an arrival (`Run._node_lost`): True or False as `_arrive`
        returns, or None for a stage loss, which goes on to the policy as at D = 1."""
        replicas = self.replicas
        assert replicas is not None
        now = self.now
        outcome, scheduled, abandoned = replicas.lose(event.stage, event.replica, now)
        for node, heal in abandoned:
            self.timeline.extend(("replica heal (abandoned)", HEAL_CATEGORY, node[0], heal.lost_s, now, heal_track(*node)))
        if outcome == ALREADY_DOWN:
            self.handled.extend((event.time_s, event.stage, event.kind, ALREADY_DOWN, int(self.progress), event.replica))
            return False
        self._all_replicas_train = not replicas.missing
        if outcome != HEAL:
            return None
        self.handled.extend((event.time_s, event.stage, event.kind, HEAL, int(self.progress), event.replica))
        for node, delay_s, token in scheduled:
            self.schedule(now + delay_s, self._heal_callback(node, token))
        if self.scenario.survivor_restart_charged_s > 0:
            self._survivors_restart_pending = True
        if self._training:
            self._replica_lost = True
            return True
        return False

    def _heal_callback(self, node: tuple[int, int], token: int) -> Callable[[], None]:
        return lambda: self._heal_done(node, token)

    def _heal_done(self, node: tuple[int, int], token: int) -> None:
        replicas = self.replicas
        assert replicas is not None
        heal = replicas.complete(node, token)
        if heal is None:
            return  # abandoned (a stage loss) or restarted (its source was lost)
        self.timeline.extend(("replica heal", HEAL_CATEGORY, node[0], heal.lost_s, self.now, heal_track(*node)))
        setback = replicas.reinitialised_setback_iterations(heal)
        if setback > 0:
            self.apply_setback(setback)
        self._all_replicas_train = not replicas.missing
        if self._training:
            self._state_changed = True

    def _wait_for_heals(self) -> bool:
        """While no replica pipeline can train: wait until heals let one (`Run._wait_for_heals`);
        True if it waited (the loop looks again), False if training may go on."""
        replicas = self.replicas
        assert replicas is not None
        if not replicas.paused:
            return False
        delay_s = replicas.pause_end_s() - self.now
        if delay_s > 0:
            self.wait(delay_s, "replica_heal_s", PAUSE_LABEL)
        else:
            self.advance(self.now)  # a heal due now ends first
        return True

    def schedule(self, time_s: float, callback: Callable[[], None]) -> None:
        """Call `callback` when the run reaches `time_s` (background work; it may change the state)."""
        self._sequence += 1
        heapq.heappush(self._background, (time_s, self._sequence, callback))
        if time_s < self._background_s:
            self._background_s = time_s
            if time_s < self.next_stop_s:
                self.next_stop_s = time_s

    # ----------------------------------------------------------------- waits (sim/model/run_context.py)
    def wait(self, duration_s: float, category: str, name: str, *, stage: int = -1, span_category: str | None = None) -> None:
        """Block training for `duration_s`, booked to `category` even if interrupted (raises `Interrupted`)."""
        if duration_s > 0:
            start_s = self.now
            end_s = start_s + duration_s
            stopped_s = None if end_s < self.next_stop_s else self.advance(end_s)
            if stopped_s is not None:
                self.now = stopped_s
                self.book_wait(category, name, stage, span_category, start_s, True)
                raise INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - start_s
            if end_s > start_s:
                self.timeline.extend((name, span_category or _SPAN_CATEGORY[category], stage, start_s, end_s, None))

    def wait_until(self, end_s: float, category: str, name: str, *, stage: int = -1, span_category: str | None = None) -> None:
        """Block training until the instant `end_s` (an event's), booked to `category`."""
        start_s = self.now
        if end_s > start_s:
            stopped_s = None if end_s < self.next_stop_s else self.advance(end_s)
            if stopped_s is not None:
                self.now = stopped_s
                self.book_wait(category, name, stage, span_category, start_s, True)
                raise INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - start_s
            self.timeline.extend((name, span_category or _SPAN_CATEGORY[category], stage, start_s, end_s, None))

    def book_wait(self, category, name, stage, span_category, start_s, interrupted: bool) -> None:
        now = self.now
        self.waits_s[category] += now - start_s
        if now > start_s:
            label = f"{name} (interrupted)" if interrupted else name
            self.timeline.extend((label, span_category or _SPAN_CATEGORY[category], stage, start_s, now, None))

    def book_completed_wait(self, category: str, name: str, start_s: float, end_s: float) -> None:
        """A wait from `start_s` that nothing stopped, until `end_s` (a transfer's wait, `RunLinks`)."""
        self.now = end_s
        self.waits_s[category] += end_s - start_s
        self.timeline.extend((name, _SPAN_CATEGORY[category], -1, start_s, end_s, None))

    def _joined_s(self, stages) -> float:
        """When the last replacement node of `stages` has joined (0 if none is down)."""
        down_until = self.down_until
        join_s = 0.0
        for stage in stages:
            until_s = down_until.get(stage, 0.0)
            if until_s > join_s:
                join_s = until_s
        return join_s

    def wait_for_replacements(self, stages) -> None:
        join_s = self._joined_s(stages)
        now = self.now
        if join_s > now:
            self.wait(join_s - now, "recovery_downtime_s", "join delay")

    def recover_unstopped(self, stages, restart_s: float, transfers: "NodeTransfers | TierTransfers | None", transfer_label: str) -> bool:
        """A recovery's three waits at once: the join delay of `stages`, the restart, then `transfers`
        (weight transfers or a checkpoint read, None for none). Booked as `wait_for_replacements`,
        `wait` and `wait_transfers` or `wait_tier_group` book them when nothing can stop them and their
        links are idle; otherwise False, having booked nothing (the caller then waits step by step).
        """
        now = self.now
        join_s = self._joined_s(stages)
        joined_s = now + (join_s - now) if join_s > now else now
        restarted_s = joined_s + restart_s if restart_s > 0 else joined_s
        if transfers is None:
            end_s = restarted_s
        elif transfers.idle_from(self.links, restarted_s):
            end_s = transfers.idle_end_s(restarted_s)
        else:
            return False
        if end_s >= self.next_stop_s:
            return False
        waits, timeline = self.waits_s, self.timeline
        if joined_s > now:
            waits["recovery_downtime_s"] += joined_s - now
            timeline.extend(("join delay", "recovery", -1, now, joined_s, None))
        if restart_s > 0:
            waits["recovery_downtime_s"] += restarted_s - joined_s
            if restarted_s > joined_s:
                timeline.extend(("restart", "recovery", -1, joined_s, restarted_s, None))
        if end_s > restarted_s:
            waits["recovery_downtime_s"] += end_s - restarted_s
            timeline.extend((transfer_label, "recovery", -1, restarted_s, end_s, None))
        self.now = end_s
        return True

    # ----------------------------------------------------------------- progress (sim/model/run_context.py)
    @property
    def pipeline_state(self) -> PipelineState:
        return self._state

    def set_pipeline_state(self, state: PipelineState) -> None:
        current = self._state
        if state is current:
            return
        # `state == current` as the event model asks it, remembered per pair: policies keep their
        # state objects, and comparing two states field by field costs more than the rest of a change.
        key = (id(state), id(current))
        known = self._equal_states.get(key)
        if known is None or known[0] is not state or known[1] is not current:
            known = self._equal_states[key] = (state, current, state == current)  # holds both: ids stay theirs
        if known[2]:
            return
        self._state = state
        self.iteration_time_s = self.iteration_model.iteration_time_s(state)
        if self._training:
            self._state_changed = True

    def rollback_to(self, progress: float) -> float:
        lost = self.progress - progress
        if lost > 0:
            self.progress = progress
            self.rolled_back_iterations += lost
            self.trajectory.extend((self.now, self.progress))
            return lost
        return 0.0

    def apply_setback(self, iterations: float) -> float:
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.setback_iterations += applied
            self.trajectory.extend((self.now, self.progress))
        return applied

    def lose_iterations(self, iterations: float) -> float:
        if not self.scenario.convergence.stale_reload_costs_progress:
            return 0.0
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.rolled_back_iterations += applied
            self.trajectory.extend((self.now, self.progress))
        return applied

    def record_failure(self, event: FailureEvent, handled_as: str) -> None:
        self.handled.extend((event.time_s, event.stage, event.kind, handled_as, int(self.progress), event.replica))

    def span(self, name: str, category: str, start_s: float, *, end_s: float | None = None, stage: int = -1, track: str | None = None) -> None:
        self.timeline.extend((name, category, stage, start_s, self.now if end_s is None else end_s, track))

    def background_span(self, name: str, category: str, start_s: float, end_s: float, marker: int, *, track: str | None = None) -> None:
        """A span of background work booked late: `marker` is `timeline_length()` when the work began."""
        self.background_timeline.extend((name, category, -1, start_s, end_s, track, marker))

    def timeline_length(self) -> int:
        return len(self.timeline) // 6

    def ledger(self) -> Ledger:
        return Ledger(
            waits_s=dict(self.waits_s),
            training_s_by_iteration_time=dict(self.training_s_by_iteration_time),
            interrupted_iterations=self.interrupted_iterations,
            rolled_back_iterations=self.rolled_back_iterations,
            setback_iterations=self.setback_iterations,
            iterations_executed=self.iterations_executed,
            replica_shortfall_s=self.replica_shortfall_s,
        )
