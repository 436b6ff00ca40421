"""The closed-form run engine: the run model of `sim/run.py` with no SimPy event where nothing contends.

`sim/run.py`'s `Run` (the reference, `simulate_run(..., reference_events=True)`) advances a SimPy
environment: a chunk of iterations is a timeout, every checkpoint write, flush and read goes through
processor-sharing links as events, and a failure interrupts a process. Between failures everything
is deterministic, so this engine computes it instead, in the same order and, wherever that is
cheap, with the same floating-point operations:

- The trainer loop is the same loop (`ClosedFormRun._train_loop` mirrors `Run._train_loop`, `_train`,
  `_credit`), but a chunk or a wait is one comparison of its end with the next thing that can stop
  it: the next failure arrival (replayed as the churn process does, with its clock's arithmetic),
  the deadline, or a background event that changes the pipeline state while training.
- A transfer group (checkpoint writes, reads, weight transfers) on idle links ends at the instant
  the event model's wake-up chain gives (`fluid_links.processor_sharing_end_s`), computed as a
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
  replacements, replica refreshes) is each method's own recurrence (`sim/closed_form/*.py`), a
  completion scheduled on a small heap, evaluated when the run reaches its time, or, where the
  completion changes nothing until its owner looks (CheckFree+'s refresh, a redundant successor's
  replica), a background group whose `end_s` the owner reads when it gets there: no event at all.
- A failure during a recovery raises `Interrupted` out of the wait in progress, books the
  interrupted part, and the method's recovery is called again with the new failures, exactly as the
  event model re-enters it: the remaining wait is recomputed, never replayed event by event.

Each recovery method has a closed-form twin (`ClosedFormPolicy`, registered per policy class in
`sim/closed_form/__init__.py`) that drives the policy object's own state (checkpointers, restart
recoveries, rebuild sets) and mirrors its generators line by line; a policy without a twin (one a
user registers) runs in the event model. Where transfers would truly share a link with something the
twin cannot re-time (a background transfer joining a link the trainer is waiting on, a shared
first-level flush tier with a backlog), the twin raises `NeedsEventModel` and the whole run is
simulated again in the event model (`sim/run.py`), so the answer never depends on the engine.

Exactness: the results equal the event model's to floating-point rounding (the differential test
`tests/sim/test_closed_form_equivalence.py` asserts 1e-9 relative): chunks, waits and uncontended
transfers to the bit (unequal parts on one link: to a few units in the last place, `IdleDuration`); transfers on a link that other flows share (`FluidLink`) to rounding.
Instants that coincide exactly follow the model's rule (sim/run.py, "Coinciding instants"): a
failure arrival comes before a background completion, a chunk end or a transfer end at its instant,
and training is labelled by the state it ran in, so a state change at a chunk's end may come either
side of it. Other ties are ordered as the event model usually orders them (the deadline first,
sim/closed_form/async_checkpoint.py for flush rounds); the event model orders those by when SimPy
scheduled each event (a chunk that ends exactly at the deadline: the event model may complete it
and start the boundary's work first, which changes only the counters of work started at that
instant); with a deadline that is no exact multiple of the iteration and generic bandwidths they do
not occur. Spans that end at the same instant may be listed in another order.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from typing import TYPE_CHECKING, Callable

from mypy_extensions import mypyc_attr

from churnsim.calibration.scenario import Scenario

from ..accounting import WAIT_CATEGORIES, Ledger
from ..iteration import IterationModel
from ..pipeline_state import PipelineState
from .fluid_links import FlowBatch, FluidLink, processor_sharing_end_s

if TYPE_CHECKING:
    from churnsim.calibration.failure_sampling import FailureEvent
    from ..methods.base import RecoveryPolicy
    from .checkpointing import SyncCheckpointerTwin

_CREDIT_TOLERANCE = 1e-9  # relative: as sim/run.py
_SPAN_CATEGORY = {"checkpoint_stall_s": "checkpoint", "recovery_downtime_s": "recovery", "method_overhead_s": "method"}
_INFINITY = math.inf
_LINK_OF_REQUEST = operator.itemgetter(0)


class Interrupted(Exception):
    """A failure or the deadline stopped the trainer's wait or chunk (the event model's `Interrupt`)."""


_INTERRUPTED = Interrupted()  # raised for every interrupt (it carries nothing), its traceback cleared each time


class NeedsEventModel(Exception):
    """The run reached a case its closed form does not re-time exactly: simulate it in the event model."""


class TransferGroup:
    """Transfers started together and waited for together (the event model's `all_transfers_done`)."""

    __slots__ = ("batches", "instant_end_s", "end_s", "unregistered", "background", "on_done", "version", "waited")

    def __init__(self, on_done: Callable[[], None] | None = None, *, background: bool = False) -> None:
        self.batches: list[FlowBatch] = []
        self.instant_end_s = -_INFINITY
        """Latest end of its latency-only transfers (zero bytes, infinite bandwidth)."""
        self.end_s = -_INFINITY
        self.unregistered: list[FlowBatch] = []
        """Batches timed in closed form on idle links and not (yet) known to them."""
        self.background = background or on_done is not None
        """Nobody waits for it as it starts: its batches are put on their links, and a later flow
        that shares one re-times its `end_s`."""
        self.on_done = on_done
        """A background group's completion callback (called at `end_s`), if it has one."""
        self.version = 0
        self.waited = False
        """True while the trainer waits for it: a later flow that moves its end is out of the closed form."""

    def refresh_end(self) -> None:
        end_s = self.instant_end_s
        for batch in self.batches:
            if batch.end_s > end_s:
                end_s = batch.end_s
        self.end_s = end_s


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's twin (`register_twin`) is plain Python
class ClosedFormPolicy:
    """The closed-form twin of one `RecoveryPolicy`: its generators as plain calls on a `ClosedFormRun`.

    A twin works on the policy object's own state; its calls spend time only through the run's
    `wait`, `wait_until`, `wait_group` and `wait_tier_group`, which raise `Interrupted`.
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


class TierTransfers:
    """One stage set's transfers to one storage tier in one direction, with their idle-link closed form.

    The event model resolves one link per stage (or one shared link) and waits for all; when no
    registered flow is in flight, `idle_end_s` gives the instant it would resume at, without
    resolving the links (this runs for every checkpoint write, read and flush round): the
    `IdleDuration` of one batch per stage, or of one batch of every part on a shared link. Per-stage
    links give the event model's instant to the bit; unequal parts on a shared link to a few units
    in the last place (their chain is run once, see `IdleDuration`).
    """

    __slots__ = ("tier_name", "direction", "stages", "sizes", "shared", "generation", "family", "_idle")

    def __init__(self, scenario: Scenario, tier_name: str, direction: str, stages, sizes, *, generation: int = 0) -> None:
        tier = scenario.tier(tier_name)
        self.tier_name = tier_name
        self.direction = direction
        self.stages = tuple(stages)
        self.sizes = tuple(float(size) for size in sizes)
        self.shared = tier.shared
        self.generation = generation
        self.family = (tier_name, direction, generation)
        latency_s = float(tier.total_latency_s)
        bandwidth = float(tier.write_bandwidth_bytes_per_s if direction == "write" else tier.read_bandwidth_bytes_per_s)
        if self.shared:
            batches = [(latency_s, bandwidth, self.sizes)] if self.stages else []
        else:
            batches = [(latency_s, bandwidth, (size,)) for size in self.sizes]
        self._idle = IdleDuration(batches)

    def idle_end_s(self, now_s: float) -> float:
        return self._idle.end_s(now_s)

    def idle_from(self, run: "ClosedFormRun", start_s: float) -> bool:
        """Whether `wait_tier_group` started at `start_s` would take its closed form (no flow of the tier in flight)."""
        return not (run._busy_until_s > start_s and run._family_busy_until_s.get(self.family, -_INFINITY) > start_s)

    def requests(self, run: "ClosedFormRun", generations) -> list[tuple[FluidLink, float]]:
        if self.shared and self.stages:
            link = run.tier_link(self.tier_name, self.direction, self.stages[0], generation=self.generation)
            return [(link, size) for size in self.sizes]
        return [
            (run.tier_link(self.tier_name, self.direction, stage, generation=self.generation, node_generation=generations[stage]), size)
            for stage, size in zip(self.stages, self.sizes)
        ]


class NodeTransfers:
    """Transfers between stages' nodes ((node link, bytes) pairs, in order) with their idle-link closed form."""

    __slots__ = ("requests", "idle_duration")

    def __init__(self, requests: list[tuple[FluidLink, float]]) -> None:
        self.requests = requests
        self.idle_duration = IdleDuration.of_requests(requests)

    def idle_end_s(self, now_s: float) -> float:
        return self.idle_duration.end_s(now_s)

    def idle_from(self, run: "ClosedFormRun", start_s: float) -> bool:
        """Whether `wait_transfers` started at `start_s` would take its closed form (each link idle)."""
        if run._busy_until_s <= start_s:
            return True
        return not run._abandoned and all(link.busy_until_s <= start_s for link, _ in self.requests)


class ClosedFormRun:
    """One run in closed form; also the context its twin reads and changes (the `RunContext` API)."""

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
        self._next_stop_s = self.deadline_s
        """The earliest of the next arrival, the next background event and the deadline: a chunk or
        a wait that ends before it needs no look at either."""
        self._load_next_arrival()
        self._sequence = 0
        # Links: registered flows exist only after an abandoned or background group.
        self._links: dict[tuple, FluidLink] = {}
        self._busy_until_s = -_INFINITY
        self._family_busy_until_s: dict[object, float] = {}
        """Per storage tier and direction (a link family): when its last flow in flight arrives."""
        self._abandoned: dict[object, list[tuple]] = {}
        """Per family, abandoned tier transfers not yet registered on their links: (transfers, node
        incarnations, start, end). Most never meet a later transfer (their links are idle again
        first), so they are registered only when a later group finds the family busy."""
        self._tiers = {tier.name: tier for tier in scenario.storage}
        self._waited_group: TransferGroup | None = None
        self._tier_link_ids: set[int] = set()
        self._fast_wait: str | list[tuple[FluidLink, float]] | None = None
        """While the trainer waits on transfers timed in closed form and not registered: "tier" (their
        links not resolved: any storage link) or their requests. A background transfer joining one of
        their links would slow them, which the closed form did not count."""
        self._fraction_done = 0.0
        self._training = False
        self._state_changed = False

    # ----------------------------------------------------------------- the trainer (sim/run.py)
    def execute(self) -> None:
        try:
            self._train_loop()
        finally:
            # The shared exception keeps the frames of its last raise, and with them this run and its
            # records, until the next raise (of a later run): let them go when the run does.
            _INTERRUPTED.__traceback__ = None

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
        while not self.deadline_hit:
            try:
                if pending:
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
                chunk = remaining if until_boundary is None or remaining < until_boundary else until_boundary
                # `_train` for a chunk nothing stops (the usual case), inline.
                iteration_time_s = self.iteration_time_s
                start_s = self.now
                end_s = start_s + (chunk - 0.0) * iteration_time_s
                if end_s < self._next_stop_s and self._state is self.healthy_state:
                    self.book_unstopped_chunk(start_s, end_s, chunk, iteration_time_s)
                    continue
                self._train(chunk)  # False when a failure or the deadline stopped it: the loop decides next
            except Interrupted:
                pass
        twin.finish(self)
        # Drop the reference cycles that would keep the run alive until a collection: the last busy
        # periods' batch ↔ group, and background callbacks (a redundant replacement holds the run)
        # that will never be called.
        for link in self._links.values():
            for finished in link.batches:
                finished.group = None
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
            if not transfers.idle_from(self, now):
                return False
            written_s = now + serialization_s if serialization_s > 0 else now
            end_s = transfers.idle_end_s(written_s)
            if end_s >= self._next_stop_s:
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
        while self._state is self.healthy_state and not self.pending:
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
            if end_s >= self._next_stop_s:
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
            start_s = self.now
            end_s = start_s + (goal - self._fraction_done) * iteration_time_s
            if end_s < self._next_stop_s:
                stopped_s = None
            else:
                self._training = True
                stopped_s = self._advance(end_s)
                self._training = False
            if stopped_s is None:
                self.now = end_s
                self._book_training(start_s, iteration_time_s, state)
                self._complete(goal)
                self._fraction_done = 0.0
                return True
            self.now = stopped_s
            # `Run._credit`: whole iterations done (an interrupt at the very end of one credits it).
            total = self._fraction_done + (stopped_s - start_s) / iteration_time_s
            whole = min(goal, int(math.floor(total + _CREDIT_TOLERANCE)))
            if whole >= 1:
                self._fraction_done = max(total - whole, 0.0)
                self._complete(whole)
            else:
                self._fraction_done = total
            goal -= whole
            if goal == 0:
                self._fraction_done = 0.0
            self._book_training(start_s, iteration_time_s, state)
            if self.pending or self.deadline_hit:
                self.interrupted_iterations += self._fraction_done
                self._fraction_done = 0.0
                return False
            # a state change: go on at the new iteration time
        return True

    def _complete(self, iterations: int) -> None:
        self.progress += iterations
        self.iterations_executed += iterations
        self.trajectory.extend((self.now, self.progress))

    def _book_training(self, start_s: float, iteration_time_s: float, state: PipelineState) -> None:
        elapsed_s = self.now - start_s
        by_time = self.training_s_by_iteration_time
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
    def _advance(self, end_s: float) -> float | None:
        """Replay arrivals and background events up to `end_s`; the instant the trainer is stopped, or None.

        A failure that needs handling (not ignored, its stage not already down) stops it at its
        arrival; so does the deadline, and, while training, a background event that changes the
        pipeline state. Arrivals that change nothing are booked on the way.
        """
        if end_s < self._next_stop_s:
            return None
        deadline_s = self.deadline_s
        while True:
            arrival_s = self._arrival_s
            background_s = self._background_s
            if background_s < arrival_s:  # a failure at the same instant comes first (sim/run.py)
                if background_s > end_s or background_s >= deadline_s:
                    break
                _, _, callback = heapq.heappop(self._background)
                self._background_s = self._background[0][0] if self._background else _INFINITY
                self._next_stop_s = min(self._arrival_s, self._background_s, self.deadline_s)
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
        self._next_stop_s = min(self._arrival_s, self._background_s, self.deadline_s)

    def _arrive(self) -> bool:
        """The arrival of the next failure event (sim/run.py `Run._arrive`); True if it needs handling."""
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
            self.handled.extend((event.time_s, stage, event.kind, "ignored", int(self.progress)))
            return False
        if now < self.down_until.get(stage, -_INFINITY):
            self.handled.extend((event.time_s, stage, event.kind, "already_down", int(self.progress)))
            return False
        self.down_until[stage] = now + self._join_delay_s
        self.node_generation[stage] += 1
        self.pending.append(event)
        return True

    def schedule(self, time_s: float, callback: Callable[[], None]) -> None:
        """Call `callback` when the run reaches `time_s` (background work; it may change the state)."""
        self._sequence += 1
        heapq.heappush(self._background, (time_s, self._sequence, callback))
        if time_s < self._background_s:
            self._background_s = time_s
            if time_s < self._next_stop_s:
                self._next_stop_s = time_s

    # ----------------------------------------------------------------- waits (sim/run_context.py)
    def wait(self, duration_s: float, category: str, name: str, *, stage: int = -1, span_category: str | None = None) -> None:
        """Block training for `duration_s`, booked to `category` even if interrupted (raises `Interrupted`)."""
        if duration_s > 0:
            start_s = self.now
            end_s = start_s + duration_s
            stopped_s = None if end_s < self._next_stop_s else self._advance(end_s)
            if stopped_s is not None:
                self.now = stopped_s
                self._book_wait(category, name, stage, span_category, start_s, True)
                raise _INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - start_s
            if end_s > start_s:
                self.timeline.extend((name, span_category or _SPAN_CATEGORY[category], stage, start_s, end_s, None))

    def wait_until(self, end_s: float, category: str, name: str, *, stage: int = -1, span_category: str | None = None) -> None:
        """Block training until the instant `end_s` (an event's), booked to `category`."""
        start_s = self.now
        if end_s > start_s:
            stopped_s = None if end_s < self._next_stop_s else self._advance(end_s)
            if stopped_s is not None:
                self.now = stopped_s
                self._book_wait(category, name, stage, span_category, start_s, True)
                raise _INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - start_s
            self.timeline.extend((name, span_category or _SPAN_CATEGORY[category], stage, start_s, end_s, None))

    def _book_wait(self, category, name, stage, span_category, start_s, interrupted: bool) -> None:
        now = self.now
        self.waits_s[category] += now - start_s
        if now > start_s:
            label = f"{name} (interrupted)" if interrupted else name
            self.timeline.extend((label, span_category or _SPAN_CATEGORY[category], stage, start_s, now, None))

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
        elif transfers.idle_from(self, restarted_s):
            end_s = transfers.idle_end_s(restarted_s)
        else:
            return False
        if end_s >= self._next_stop_s:
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

    # ----------------------------------------------------------------- progress (sim/run_context.py)
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
        self.handled.extend((event.time_s, event.stage, event.kind, handled_as, int(self.progress)))

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
        )

    # ----------------------------------------------------------------- links and transfers
    def tier_link(self, tier_name: str, direction: str, stage: int, *, generation: int = 0, node_generation: int | None = None) -> FluidLink:
        """The link to tier `tier_name` of `stage`'s node (of its incarnation `node_generation`, default the current)."""
        tier = self._tiers.get(tier_name) or self.scenario.tier(tier_name)
        incarnation = self.node_generation[stage] if node_generation is None else node_generation
        owner = ("shared",) if tier.shared else (stage, incarnation)
        key = ("tier", tier_name, direction, owner, generation)
        link = self._links.get(key)
        if link is None:
            bandwidth = tier.write_bandwidth_bytes_per_s if direction == "write" else tier.read_bandwidth_bytes_per_s
            link = FluidLink(
                bandwidth_bytes_per_s=bandwidth,
                latency_s=tier.total_latency_s,
                name=f"{tier_name}-{direction}-{owner}",
                family=(tier_name, direction, generation),
            )
            self._links[key] = link
            self._tier_link_ids.add(id(link))
        return link

    def node_link(self, source_stage: int, destination_stage: int) -> FluidLink:
        key = ("node", source_stage, destination_stage)
        link = self._links.get(key)
        if link is None:
            bandwidths, latencies = self.healthy_state.link_bandwidth_bytes_per_s, self.healthy_state.link_latency_s
            assert bandwidths is not None and latencies is not None, "a built pipeline state has its link matrices"
            link = FluidLink(
                bandwidth_bytes_per_s=bandwidths[source_stage][destination_stage],
                latency_s=latencies[source_stage][destination_stage],
                name=f"link-{source_stage}-{destination_stage}",
            )
            self._links[key] = link
        return link

    def start_transfers(self, requests, *, on_done: Callable[[], None] | None = None, background: bool = False) -> TransferGroup:
        """Start `requests` ((link, bytes) pairs, in order) now, as `all_transfers_done` does.

        For the trainer to wait for (neither argument), a batch on an idle link is timed in closed
        form and not registered. In the background (`background`, or an `on_done`) every batch is
        registered and the group's `end_s` follows later flows that delay it; `on_done`, if given,
        is called when the last transfer arrives. A background group without one costs no event:
        its owner reads `end_s` when it gets there.
        """
        if self._abandoned:
            for link, _ in requests:
                if link.family in self._abandoned:
                    self._register_abandoned(link.family)
        now = self.now
        group = TransferGroup(on_done, background=background)
        background = group.background
        end_s = now
        if len(requests) == 1:
            link, num_bytes = requests[0]
            end_s = max(end_s, self._start_batch(group, link, [num_bytes], now, background))
        else:
            for link, same_link in itertools.groupby(requests, key=_LINK_OF_REQUEST):  # consecutive requests on one link: one batch
                end_s = max(end_s, self._start_batch(group, link, [num_bytes for _, num_bytes in same_link], now, background))
        group.end_s = end_s
        if on_done is not None:
            self._schedule_group(group)
        return group

    def _start_batch(self, group: TransferGroup, link: FluidLink, sizes: list[float], now: float, background: bool) -> float:
        latency_s = link.latency_s
        positive: tuple[float, ...]
        if len(sizes) == 1:
            positive = (sizes[0],) if sizes[0] > 0 else ()
        else:
            positive = tuple(size for size in sizes if size > 0)
        end_s = -_INFINITY
        if link.instant or len(positive) < len(sizes):
            end_s = now + latency_s
            if end_s > group.instant_end_s:
                group.instant_end_s = end_s
        if link.instant or not positive:
            return end_s
        admit_s = now + latency_s if latency_s > 0 else now
        batch = FlowBatch(admit_s, positive, group, link)
        group.batches.append(batch)
        if not background and link.busy_until_s <= admit_s:
            batch.end_s = processor_sharing_end_s(admit_s, positive, link.bandwidth_bytes_per_s)
            group.unregistered.append(batch)
        else:
            if background:
                fast_wait = self._fast_wait
                if fast_wait is not None and (
                    id(link) in self._tier_link_ids if isinstance(fast_wait, str) else any(link is used for used, _ in fast_wait)
                ):
                    raise NeedsEventModel(f"a background transfer joins {link.name} during a transfer the trainer waits for")
                self._check_trainer_group_untouched(link, admit_s)
            self._add_to_link(batch)
        return max(end_s, batch.end_s)

    def _check_trainer_group_untouched(self, link: FluidLink, admit_s: float) -> None:
        waited = self._waited_group
        if waited is not None:
            for batch in waited.unregistered:
                if batch.link is link and batch.end_s > admit_s:
                    raise NeedsEventModel(f"a background transfer joins {link.name}, which the trainer is waiting on")

    def _add_to_link(self, batch: FlowBatch) -> None:
        link = batch.link
        # Re-time only the batches something waits for: a background group's, the trainer's.
        watched: list[FlowBatch] | tuple[()]
        if batch.admit_s >= link.busy_until_s:
            watched = ()  # an idle link: nothing earlier to re-time
        else:
            watched = [
                earlier for earlier in link.batches
                if earlier.group is not None and (earlier.group.background or earlier.group.waited)
            ]
        moved = link.add(batch, watched=watched)
        if link.busy_until_s > self._busy_until_s:
            self._busy_until_s = link.busy_until_s
        family = link.family
        if family is not None and link.busy_until_s > self._family_busy_until_s.get(family, -_INFINITY):
            self._family_busy_until_s[family] = link.busy_until_s
        for earlier in moved:
            group = earlier.group
            if group is None:
                continue
            group.refresh_end()
            if group.waited:
                raise NeedsEventModel(f"a transfer joins {link.name} while the trainer waits for an earlier one there")
            if group.on_done is not None:
                self._schedule_group(group)

    def _schedule_group(self, group: TransferGroup) -> None:
        group.version += 1
        version = group.version

        on_done = group.on_done
        assert on_done is not None

        def done() -> None:
            if group.version == version:
                on_done()

        self.schedule(group.end_s, done)

    def _register(self, group: TransferGroup) -> None:
        """The trainer abandoned `group`: its flows go on, and slow whatever later shares their links."""
        for batch in group.unregistered:
            self._add_to_link(batch)
        group.unregistered = []

    def wait_group(self, group: TransferGroup, category: str, name: str) -> None:
        """Wait for `group` (started with `start_transfers` without `on_done`) to complete."""
        group.waited = True
        self._waited_group = group
        try:
            self.wait_until(group.end_s, category, name)
        except Interrupted:
            self._register(group)
            raise
        finally:
            group.waited = False
            self._waited_group = None

    def wait_transfers(self, transfers: NodeTransfers, category: str, name: str) -> None:
        """Start `transfers` and wait for them all; timed by their idle-link closed form when every link is idle."""
        requests = transfers.requests
        now = self.now
        if self._busy_until_s > now:
            if self._abandoned:
                for link, _ in requests:
                    if link.family in self._abandoned:
                        self._register_abandoned(link.family)
            for link, _ in requests:
                if link.busy_until_s > now:
                    self.wait_group(self.start_transfers(requests), category, name)
                    return
        # Every link is idle: each link's batch ends at its closed form; nothing to register unless abandoned.
        end_s = transfers.idle_end_s(now)
        if end_s > now:
            self._fast_wait = requests
            stopped_s = self._advance(end_s)
            self._fast_wait = None
            if stopped_s is not None:
                self.now = now
                self._register(self.start_transfers(requests))
                self.now = stopped_s
                self._book_wait(category, name, -1, None, now, True)
                raise _INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - now
            self.timeline.extend((name, _SPAN_CATEGORY[category], -1, now, end_s, None))

    def wait_tier_group(self, transfers: TierTransfers, category: str, name: str) -> None:
        """Start `transfers` and wait for them; in closed form, without resolving links, when no flow is in flight."""
        now = self.now
        family = transfers.family
        if not transfers.idle_from(self, now):
            self._register_abandoned(family)
            self.wait_group(self.start_transfers(transfers.requests(self, self.node_generation)), category, name)
            return
        end_s = transfers.idle_end_s(now)
        if end_s > now:
            generations = self.node_generation[:]  # the incarnations it writes from (a failure changes them)
            self._fast_wait = "tier"
            stopped_s = None if end_s < self._next_stop_s else self._advance(end_s)
            self._fast_wait = None
            if stopped_s is not None:
                # Its flows go on, on the links of the node incarnations at the start.
                self._abandoned.setdefault(family, []).append((transfers, generations, now, end_s))
                if end_s > self._busy_until_s:
                    self._busy_until_s = end_s
                if end_s > self._family_busy_until_s.get(family, -_INFINITY):
                    self._family_busy_until_s[family] = end_s
                self.now = stopped_s
                self._book_wait(category, name, -1, None, now, True)
                raise _INTERRUPTED.with_traceback(None)
            self.now = end_s
            self.waits_s[category] += end_s - now
            self.timeline.extend((name, _SPAN_CATEGORY[category], -1, now, end_s, None))

    def _register_abandoned(self, family: object) -> None:
        """Register the abandoned transfers of `family` still in flight on their links, in start order."""
        pending = self._abandoned.pop(family, None)
        if not pending:
            return
        now = self.now
        for transfers, generations, start_s, end_s in pending:
            if end_s > now:  # one that has arrived can slow nothing any more
                self.now = start_s
                self._register(self.start_transfers(transfers.requests(self, generations)))
        self.now = now


class IdleDuration:
    """When batches of transfers started together on idle links have all arrived, worked out once.

    A batch is (latency, bandwidth, sizes): the flows one link starts together. Its instant part (a
    zero-byte transfer, an infinite bandwidth) ends one latency after the start, its flows one
    latency plus their processor-sharing chain later: one flow's quotient bytes / bandwidth, as the
    event model computes it (to the bit); equal flows' one step, size × count / bandwidth (to the
    bit); unequal flows' chain length, run once from admission 0 (the event model runs it from the
    admission instant: a few units in the last place). Batches of one latency keep only their
    longest flows, which rounding, being monotonic, makes the latest end.
    """

    __slots__ = ("_instant_latency_s", "_flows")

    def __init__(self, batches) -> None:
        instant_latency_s: float | None = None
        longest_flows_s: dict[float, float] = {}
        for latency_s, bandwidth_bytes_per_s, sizes in batches:
            positive = [size for size in sizes if size > 0]
            instant = bandwidth_bytes_per_s == _INFINITY
            if instant or len(positive) < len(sizes):
                instant_latency_s = latency_s if instant_latency_s is None else max(instant_latency_s, latency_s)
            if instant or not positive:
                continue
            if len(positive) == 1:
                flows_s = max(positive[0], 0.0) * 1 / bandwidth_bytes_per_s
            else:
                flows_s = processor_sharing_end_s(0.0, positive, bandwidth_bytes_per_s)
            longest_flows_s[latency_s] = max(longest_flows_s.get(latency_s, flows_s), flows_s)
        self._instant_latency_s = instant_latency_s
        self._flows = tuple(longest_flows_s.items())

    @classmethod
    def of_requests(cls, requests) -> "IdleDuration":
        """For (link, bytes) pairs in order: consecutive ones on one link start as one batch."""
        batches: list[tuple[FluidLink, list[float]]] = []
        for link, num_bytes in requests:
            if batches and batches[-1][0] is link:
                batches[-1][1].append(num_bytes)
            else:
                batches.append((link, [num_bytes]))
        return cls((link.latency_s, link.bandwidth_bytes_per_s, sizes) for link, sizes in batches)

    def end_s(self, now: float) -> float:
        end_s = now
        if self._instant_latency_s is not None and now + self._instant_latency_s > end_s:
            end_s = now + self._instant_latency_s
        for latency_s, flows_s in self._flows:
            batch_end_s = (now + latency_s if latency_s > 0 else now) + flows_s
            if batch_end_s > end_s:
                end_s = batch_end_s
        return end_s
