"""The run model: one training run under churn, as a SimPy environment (DESIGN.md section 3).

One trainer process advances in chunks of whole iterations between events: the method's next
periodic boundary (checkpoint, replica refresh), the target, a state change, a failure. A chunk is
one `timeout(k · T_iter)`; a churn process replays the given failure path and interrupts it. On a
failure the trainer credits the iterations that completed, and the iteration in flight is lost work
(a failure destroys the iteration in flight, for every method that reacts to failures); then the
recovery policy runs. T_iter comes from the cached iteration model and is recomputed only when the
pipeline state changes (degraded, healthy again); a state change in the middle of a chunk keeps the
finished fraction of the iteration in flight and runs the rest at the new speed.

Failures: a stage whose node is lost is *down* until its replacement joins
(`scenario.recovery.join_delay_s` later); a failure of a stage that is down is recorded as
`already_down` and has no effect. Hard failures under an agent that restarts every worker
(`Scenario.survivor_restart_charged_s` > 0): before the policy sees a batch of stage losses,
training waits for the survivors' restart (booked to `survivor_restart_s`); the replacement's join
delay runs meanwhile, so the policy's wait for it is what remains. A failure during that wait
restarts the survivors again. A data-parallel node loss healed from a replica restarts them too
(a heal that struck during a wait is charged its restart once that wait ends). Failures that strike while a recovery runs interrupt it and are
handed to the policy, which merges them into the recovery in progress.
Data parallelism (D = `pipeline.data_parallel_degree` > 1): a failure event is the loss of one node
(stage, replica), and a replica layer (`sim/model/replicas.py`) sees it before the policy. A node
whose stage keeps a replica heals from it in the background (join delay, then a copy over the
all-reduce link), the iteration in flight lost if training; meanwhile the complete replica pipelines
train with the batch model's share of progress per iteration, or training pauses (booked to
`replica_heal_s`). Only a stage loss (no replica left) reaches the policy, as the same event would
at D = 1. With D = 1 the layer is absent and every loss is a stage loss, as before.
Coinciding instants: a failure arriving at instant t is handled before anything else that ends at
t, so a transfer, flush, restart or replacement ending exactly then has not happened when it
strikes (an iteration ending exactly then is still credited: `_CREDIT_TOLERANCE`). Trace replays
(removals at whole minutes) with round hop times make such ties common; both engines order them so.

Storage tiers and network links for checkpoint writes, flushes, reads and weight transfers are
`ProcessorSharingLink`s: a `shared` tier is one link per direction for all stages, otherwise one per
stage (and per node incarnation, so a dead node's unfinished transfers do not slow its replacement).
Approximation: these links are separate from the activation traffic inside an iteration (the
iteration model has its own links), so a background flush over a pipeline link does not slow
training, and a transfer cannot be cancelled: an abandoned one finishes on its own link.
Time accounting: see `sim/model/accounting.py`.

Two engines compute this model. `Run` below is the event model: every chunk, checkpoint write, flush
and failure is a SimPy event; it is the reference (`simulate_run(..., reference_events=True)`).
By default `simulate_run` uses the closed-form engine (`sim/model/closed_form/`), which computes the same
run between failures without scheduling events where nothing contends, and falls back to `Run`
where it cannot (`NeedsEventModel`, or a policy without a closed-form twin); the differential test
`tests/sim/test_closed_form_equivalence.py` holds both to the same results. The environment variable
CHURNSIM_REFERENCE_EVENTS=1 makes the event model the default (benchmarks, debugging).
Python's garbage collector is paused while a run is simulated: a run only appends to its result
lists, and full collections over them (and over the caller's sweep) would otherwise dominate.
"""

from __future__ import annotations

import gc
import math
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Generator, Iterator

import simpy
from simpy import Interrupt

from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from .accounting import split_time
from .iteration import IterationModel, shared_iteration_model, simulate_iteration
from .method_extras import with_measured_method_extra
from .methods import build_policy
from .methods.base import RecoveryPolicy
from .pipeline_state import PipelineState, build_pipeline_state, compute_only_state
from .replicas import ALREADY_DOWN, FEWER_REPLICAS_LABEL, HEAL, HEAL_CATEGORY, PAUSE_LABEL, heal_track, replica_group_for, replica_heal_note
from .results import (
    HANDLED_ROW_WIDTH,
    TIMELINE_ROW_WIDTH,
    TRAJECTORY_ROW_WIDTH,
    RecordSequence,
    RunResult,
    handled_failure_from_row,
    timeline_event_from_row,
)
from .run_context import RunContext

if TYPE_CHECKING:  # imported where needed: it imports numpy, which `import churnsim.sim.model.run` need not
    from churnsim.calibration.failure_sampling import FailureEvent, LazyFailurePath

_CREDIT_TOLERANCE = 1e-9  # relative: an interrupt at the exact end of an iteration credits it
SURVIVOR_RESTART_LABEL = "survivors restart"


REFERENCE_EVENTS_VARIABLE = "CHURNSIM_REFERENCE_EVENTS"


def simulate_run(
    scenario: Scenario,
    method_config: MethodConfig,
    failures: tuple[FailureEvent, ...] | LazyFailurePath,
    *,
    replication: int = 0,
    seed: int = 0,
    iteration_model: IterationModel | None = None,
    per_microbatch_everywhere: bool = False,
    reference_events: bool | None = None,
) -> RunResult:
    """Simulate one run of `method_config` on `scenario` under the failure path `failures`.

    `reference_events=True` simulates it event by event (the reference model, `Run`); the default
    (None: unless CHURNSIM_REFERENCE_EVENTS=1) computes the same result in closed form.
    `per_microbatch_everywhere=True` advances one iteration at a time and simulates every iteration
    per microbatch without the cache: same result, much slower (for the benchmark of the two levels).
    """
    return simulate_run_and_policy(
        scenario,
        method_config,
        failures,
        replication=replication,
        seed=seed,
        iteration_model=iteration_model,
        per_microbatch_everywhere=per_microbatch_everywhere,
        reference_events=reference_events,
    ).result


class SimulatedRun:
    """A run's result, the policy object after it (its counters: checkpoints written, rebuilds...),
    and the engine that computed it: "closed_form" or "event_model"."""

    __slots__ = ("result", "policy", "engine")

    def __init__(self, result: RunResult, policy: RecoveryPolicy, engine: str) -> None:
        self.result = result
        self.policy = policy
        self.engine = engine


def simulate_run_and_policy(
    scenario: Scenario,
    method_config: MethodConfig,
    failures: tuple[FailureEvent, ...] | LazyFailurePath,
    *,
    replication: int = 0,
    seed: int = 0,
    iteration_model: IterationModel | None = None,
    per_microbatch_everywhere: bool = False,
    reference_events: bool | None = None,
) -> SimulatedRun:
    """`simulate_run`, also returning the policy object and which engine computed the run."""
    if reference_events is None:
        reference_events = os.environ.get(REFERENCE_EVENTS_VARIABLE, "") not in ("", "0")
    iteration_model = iteration_model or shared_iteration_model()
    from churnsim.calibration.failure_sampling import LazyFailurePath, sorted_events

    # A calibrated scenario's measured steady extra of this method (a no-op for any other).
    scenario = with_measured_method_extra(scenario, method_config)

    # A lazy path is already in time order and must not be sampled to its end up front.
    failures = failures if isinstance(failures, LazyFailurePath) else sorted_events(failures)
    with _collector_paused():
        if not reference_events and not per_microbatch_everywhere:
            from .closed_form import NeedsEventModel, twin_for

            policy = build_policy(method_config, scenario)
            twin = twin_for(policy, scenario)
            if twin is not None:
                try:
                    result = _closed_form_result(scenario, policy, twin, failures, iteration_model, replication, seed)
                    return SimulatedRun(result, policy, "closed_form")
                except NeedsEventModel:
                    pass  # simulated again below, from the start, event by event
        policy = build_policy(method_config, scenario)
        run = Run(scenario, policy, failures, iteration_model=iteration_model, per_microbatch_everywhere=per_microbatch_everywhere)
        return SimulatedRun(run.execute(replication=replication, seed=seed), policy, "event_model")


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (if it runs) while a run is simulated."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _reference_iteration_times(scenario: Scenario, iteration_model: IterationModel) -> tuple[float, float, float]:
    """(plain pipeline's iteration time, compute-only iteration time, compute-only bubble fraction)."""
    reference_state = build_pipeline_state(scenario)
    reference = iteration_model.result(reference_state)
    compute_only = iteration_model.result(compute_only_state(reference_state))
    return reference.time_s, compute_only.time_s, compute_only.bubble_fraction


def _closed_form_result(scenario, policy, twin, failures, iteration_model, replication: int, seed: int) -> RunResult:
    from .closed_form import ClosedFormRun

    reference_s, compute_only_s, compute_only_bubble = _reference_iteration_times(scenario, iteration_model)
    run = ClosedFormRun(scenario, policy, twin, failures, iteration_model=iteration_model, healthy_state=policy.healthy_state())
    healthy_s = run.iteration_time_s
    run.execute()
    return _run_result(
        scenario,
        policy,
        ledger=run.ledger(),
        progress=run.progress,
        wall_clock_s=run.now,
        reached_target=run.reached_target,
        healthy_iteration_time_s=healthy_s,
        reference_times=(reference_s, compute_only_s, compute_only_bubble),
        handled=run.handled,
        trajectory=run.trajectory,
        timeline=run.timeline,
        background_timeline=run.background_timeline,
        notes=run.notes,
        replication=replication,
        seed=seed,
    )


def _run_result(
    scenario: Scenario,
    policy: RecoveryPolicy,
    *,
    ledger,
    progress: float,
    wall_clock_s: float,
    reached_target: bool,
    healthy_iteration_time_s: float,
    reference_times: tuple[float, float, float],
    handled: list,
    trajectory: list,
    timeline: list,  # flat lists of fields (results.py `RecordSequence`)
    notes: list,
    replication: int,
    seed: int,
    background_timeline: list | None = None,
) -> RunResult:
    """The `RunResult` of a finished run, whichever engine simulated it."""
    reference_s, compute_only_s, compute_only_bubble = reference_times
    goodput_s, badput = split_time(
        ledger,
        progress_iterations=progress,
        healthy_iteration_time_s=healthy_iteration_time_s,
        reference_iteration_time_s=reference_s,
        compute_only_iteration_time_s=compute_only_s,
        compute_only_bubble_fraction=compute_only_bubble,
        wall_clock_s=wall_clock_s,
    )
    if policy.config.uses_setbacks:
        notes.append(_setback_note(scenario, policy.name))
    note = replica_heal_note(scenario, policy.config)
    if note is not None:
        notes.append(note)
    return RunResult(
        method=policy.name,
        replication=replication,
        seed=seed,
        reached_target=reached_target,
        wall_clock_s=wall_clock_s,
        target_iterations=scenario.target_iterations,
        progress_iterations=progress,
        iterations_executed=ledger.iterations_executed,
        healthy_iteration_time_s=healthy_iteration_time_s,
        reference_iteration_time_s=reference_s,
        goodput_s=goodput_s,
        badput=badput,
        failures=RecordSequence(handled, HANDLED_ROW_WIDTH, handled_failure_from_row),
        trajectory=RecordSequence(trajectory, TRAJECTORY_ROW_WIDTH),
        timeline=RecordSequence(timeline, TIMELINE_ROW_WIDTH, timeline_event_from_row, background_fields=background_timeline),
        notes=tuple(notes),
    )


def _setback_note(scenario: Scenario, method: str) -> str:
    """Where this run's setbacks come from and the values it charged (its replication's draw, if drawn)."""
    convergence = scenario.convergence
    interior, edge = (convergence.setback_description(method, position) for position in ("interior", "edge"))
    words = {"measured": "measured", "paper_fitted": "fitted to the CheckFree paper's ablation", "default": "uncalibrated defaults"}
    source = words.get(convergence.setback_source or "default", str(convergence.setback_source))
    return f"convergence setbacks {source}, in iterations per rebuilt stage: {interior} (interior), {edge} (edge)"


class _UrgentTimeout(simpy.events.Event):
    """A timeout processed before every ordinary event due at the same instant.

    SimPy orders events due at one instant by priority, then by when each was scheduled. A failure
    arrival waits on one of these so that at a tie it comes first whatever was scheduled earlier:
    the order is part of the model (module docstring), not an accident of scheduling. It is
    `simpy.Timeout` with `URGENT` instead of `NORMAL`.
    """

    def __init__(self, env: simpy.Environment, delay_s: float) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, simpy.events.URGENT, delay_s)


class Run:
    """One simulated run: the trainer loop, the churn and the deadline. Policies never see it: they
    get its `RunContext` (sim/model/run_context.py), the state and services they share with the trainer."""

    def __init__(
        self,
        scenario: Scenario,
        policy: RecoveryPolicy,
        failures: tuple[FailureEvent, ...] | LazyFailurePath,
        *,
        iteration_model: IterationModel,
        per_microbatch_everywhere: bool = False,
    ) -> None:
        self.env = simpy.Environment()
        self.scenario = scenario
        self.policy = policy
        from churnsim.calibration.failure_sampling import LazyFailurePath, sorted_events

        # A lazy path is already in time order and must not be sampled to its end up front.
        self.failures = failures if isinstance(failures, LazyFailurePath) else sorted_events(failures)
        self.iteration_model = iteration_model
        self.per_microbatch_everywhere = per_microbatch_everywhere
        self.num_stages = scenario.pipeline.num_stages
        self.target_iterations = scenario.target_iterations
        self.reference_times = _reference_iteration_times(scenario, iteration_model)
        self.reference_iteration_time_s = self.reference_times[0]
        self.context = RunContext(
            scenario, env=self.env, healthy_state=policy.healthy_state(), iteration_model=iteration_model
        )
        self.context.on_state_change = self._on_state_change
        self.healthy_iteration_time_s = self.context.iteration_time_s
        self.pending_failures: list[FailureEvent] = []
        self._fraction_done = 0.0  # of the iteration in flight
        self._in_flight_s = 0.0  # time spent on the iteration in flight
        self._training = False
        self._interrupt_pending = False
        self._deadline_hit = False
        self.reached_target = False
        self._trainer: simpy.Process | None = None
        self.replicas = replica_group_for(scenario, policy.config)
        """Data parallelism's replica layer (sim/model/replicas.py); None when D is 1."""
        self._replica_lost = False
        """A node loss healed from a survivor struck while training: the iteration in flight is lost."""
        self._survivors_restart_pending = False
        """A node loss healed from a survivor under an agent that restarts every worker: the
        survivors' restart is still to wait (`Scenario.survivor_restart_charged_s`)."""

    # ----------------------------------------------------------------- running
    def execute(self, *, replication: int = 0, seed: int = 0) -> RunResult:
        context = self.context
        self._trainer = self.env.process(self._train_loop())
        self.env.process(self._churn())
        self.env.process(self._deadline())
        self.env.run(until=self._trainer)
        return _run_result(
            self.scenario,
            self.policy,
            ledger=context.ledger,
            progress=context.progress,
            wall_clock_s=self.env.now,
            reached_target=self.reached_target,
            healthy_iteration_time_s=self.healthy_iteration_time_s,
            reference_times=self.reference_times,
            handled=context.handled,
            trajectory=context.trajectory,
            timeline=context.timeline,
            notes=context.notes,
            replication=replication,
            seed=seed,
        )

    def _train_loop(self) -> Generator:
        context = self.context
        policy = self.policy
        survivor_restart_s = self.scenario.survivor_restart_charged_s
        policy.on_start(context)
        while not self._deadline_hit:
            try:
                if self.pending_failures or self._survivors_restart_pending:
                    if survivor_restart_s > 0:
                        # The agent restarts every worker, on a replica's loss as on a stage's: the
                        # survivors' restart comes before the method's recovery; a death during it
                        # starts another (the batch waits).
                        self._survivors_restart_pending = False
                        yield from context.wait(survivor_restart_s, "survivor_restart_s", SURVIVOR_RESTART_LABEL)
                    if not self.pending_failures:
                        continue
                    batch = tuple(self.pending_failures)
                    self.pending_failures.clear()
                    yield from policy.on_failures(context, batch)
                    continue
                remaining = math.ceil(self.target_iterations - context.progress - 1e-9)
                if remaining <= 0:
                    self.reached_target = True
                    break
                until_boundary = policy.iterations_until_boundary(context)
                if until_boundary is not None and until_boundary <= 0:
                    yield from policy.at_boundary(context)
                    continue
                if self.replicas is not None and self.replicas.paused:
                    yield from self._wait_for_heals()
                    continue
                chunk = remaining if until_boundary is None else min(until_boundary, remaining)
                if self.per_microbatch_everywhere:
                    chunk = 1
                yield from self._train(chunk)
            except Interrupt:
                # A failure or the deadline stopped what the trainer was doing; the loop decides next.
                self._interrupt_pending = False

    def _train(self, num_iterations: int) -> Generator:
        """Run until `num_iterations` more iterations have completed; re-raise failures and the deadline."""
        context = self.context
        goal = num_iterations
        while goal > 0:
            if self.per_microbatch_everywhere:
                context.iteration_time_s = simulate_iteration(context.pipeline_state).time_s
            iteration_time_s = context.iteration_time_s
            state = context.pipeline_state  # the state trained in, whatever it is when this is booked
            # An iteration with fewer replica pipelines is credited as its share of a full one.
            share = 1.0 if self.replicas is None else self.replicas.batch_share
            step_s = iteration_time_s if share == 1.0 else iteration_time_s / share
            start_s = self.env.now
            self._training = True
            try:
                yield self.env.timeout((goal - self._fraction_done) * step_s)
            except Interrupt:
                self._training = False
                self._interrupt_pending = False
                elapsed_s = self.env.now - start_s
                goal -= self._credit(elapsed_s, step_s, goal)
                if goal == 0:
                    self._fraction_done = self._in_flight_s = 0.0
                self._book_training(start_s, iteration_time_s, state, share)
                if self.pending_failures or self._deadline_hit or self._replica_lost:
                    self._replica_lost = False
                    context.ledger.interrupted_iterations += self._fraction_done
                    self._fraction_done = self._in_flight_s = 0.0
                    raise
                continue  # a state change: go on at the new iteration time
            self._training = False
            self._book_training(start_s, iteration_time_s, state, share)
            self._complete(goal)
            self._fraction_done = self._in_flight_s = 0.0
            goal = 0

    def _credit(self, elapsed_s: float, iteration_time_s: float, goal: int) -> int:
        total = self._fraction_done + elapsed_s / iteration_time_s
        whole = min(goal, int(math.floor(total + _CREDIT_TOLERANCE)))
        if whole >= 1:
            self._fraction_done = max(total - whole, 0.0)
            self._in_flight_s = self._fraction_done * iteration_time_s
            self._complete(whole)
        else:
            self._fraction_done = total
            self._in_flight_s += elapsed_s
        return whole

    def _complete(self, iterations: int) -> None:
        context = self.context
        context.progress += iterations
        context.iterations_executed += iterations
        context.ledger.iterations_executed += iterations
        context.trajectory.extend((self.env.now, context.progress))

    def _book_training(self, start_s: float, iteration_time_s: float, state: PipelineState, share: float = 1.0) -> None:
        """Book the time since `start_s`, trained in `state` at `iteration_time_s` (a state change
        that stopped it has already replaced the context's state), each iteration worth `share` of a
        full one (fewer replica pipelines training)."""
        context = self.context
        elapsed_s = self.env.now - start_s
        if share != 1.0:
            context.ledger.book_training_with_fewer_replicas(elapsed_s, iteration_time_s, share)
            if elapsed_s > 0:
                context.span(FEWER_REPLICAS_LABEL, HEAL_CATEGORY, start_s)
            return
        context.ledger.book_training(elapsed_s, iteration_time_s)
        if elapsed_s > 0:
            degraded = state is not context.healthy_state and state != context.healthy_state
            context.span("degraded training" if degraded else "train", "degraded" if degraded else "train", start_s)

    def _churn(self) -> Generator:
        for event in self.failures:
            if event.time_s >= self.scenario.target.max_wall_clock_s:
                return
            if event.time_s > self.env.now:
                yield _UrgentTimeout(self.env, event.time_s - self.env.now)
            self._arrive(event)

    def _arrive(self, event: FailureEvent) -> None:
        context = self.context
        now = self.env.now
        context.timeline.extend((f"failure ({event.kind})", "failure", event.stage, now, now, None))
        if self.policy.config.ignores_failures or event.stage in self.policy.reliable_stages:
            context.record_failure(event, "ignored")
            return
        if now < context.down_until.get(event.stage, -math.inf):
            context.record_failure(event, "already_down")
            return
        if self.replicas is not None and not self._node_lost(event):
            return
        context.down_until[event.stage] = now + self.scenario.recovery.join_delay_s
        context.node_generation[event.stage] += 1
        self.pending_failures.append(event)
        self._request_interrupt()

    # ----------------------------------------------------------------- data parallelism (sim/model/replicas.py)
    def _node_lost(self, event: FailureEvent) -> bool:
        """The replica layer's part of an arrival: True for a stage loss (handed to the policy as at
        D = 1); otherwise the loss is booked here (a heal, or a node not yet back) and False."""
        replicas = self.replicas
        assert replicas is not None
        context = self.context
        now = self.env.now
        outcome, scheduled, abandoned = replicas.lose(event.stage, event.replica, now)
        for node, heal in abandoned:
            context.span("replica heal (abandoned)", HEAL_CATEGORY, heal.lost_s, stage=node[0], track=heal_track(*node))
        if outcome == ALREADY_DOWN:
            context.record_failure(event, ALREADY_DOWN)
            return False
        if outcome != HEAL:
            return True
        context.record_failure(event, HEAL)
        for node, delay_s, token in scheduled:
            self.env.process(self._heal(node, delay_s, token))
        if self.scenario.survivor_restart_charged_s > 0:
            self._survivors_restart_pending = True
        if self._training:
            self._replica_lost = True  # the iteration in flight is lost, as on any failure
            self._request_interrupt()
        return False

    def _heal(self, node: tuple[int, int], delay_s: float, token: int) -> Generator:
        """One heal's end, `delay_s` after it was (re)planned; a no-op if abandoned or restarted since."""
        yield self.env.timeout(delay_s)
        replicas = self.replicas
        assert replicas is not None
        heal = replicas.complete(node, token)
        if heal is None:
            return
        context = self.context
        context.span("replica heal", HEAL_CATEGORY, heal.lost_s, stage=node[0], track=heal_track(*node))
        setback = replicas.reinitialised_setback_iterations(heal)
        if setback > 0:
            context.apply_setback(setback)
        if self._training:
            self._request_interrupt()  # the batch share changed: the rest of the chunk is re-timed

    def _wait_for_heals(self) -> Generator:
        """While no replica pipeline can train: wait until heals let one (then the loop looks again)."""
        replicas = self.replicas
        assert replicas is not None
        delay_s = replicas.pause_end_s() - self.env.now
        if delay_s > 0:
            yield from self.context.wait(delay_s, "replica_heal_s", PAUSE_LABEL)
        else:
            yield self.env.timeout(0)  # a heal due now ends first

    def _deadline(self) -> Generator:
        yield self.env.timeout(self.scenario.target.max_wall_clock_s)
        self._deadline_hit = True
        self._request_interrupt()

    def _on_state_change(self) -> None:
        if self._training:
            self._request_interrupt()

    def _request_interrupt(self) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.is_alive and not self._interrupt_pending and trainer is not self.env.active_process:
            self._interrupt_pending = True
            trainer.interrupt()
