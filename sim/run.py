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
`already_down` and has no effect. Failures that strike while a recovery runs interrupt it and are
handed to the policy, which merges them into the recovery in progress.

Storage tiers and network links for checkpoint writes, flushes, reads and weight transfers are
`ProcessorSharingLink`s: a `shared` tier is one link per direction for all stages, otherwise one per
stage (and per node incarnation, so a dead node's unfinished transfers do not slow its replacement).
Approximation: these links are separate from the activation traffic inside an iteration (the
iteration model has its own links), so a background flush over a pipeline link does not slow
training, and a transfer cannot be cancelled: an abandoned one finishes on its own link.
Time accounting: see `sim/accounting.py`.
"""

from __future__ import annotations

import math
from typing import Generator

import simpy
from simpy import Interrupt

from churnsim.calibration.failure_sampling import FailureEvent, LazyFailurePath
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from .accounting import split_time
from .iteration import IterationModel, simulate_iteration
from .methods import build_policy
from .methods.base import RecoveryPolicy
from .pipeline_state import build_pipeline_state, compute_only_state
from .results import RunResult, TimelineEvent
from .run_context import RunContext

_CREDIT_TOLERANCE = 1e-9  # relative: an interrupt at the exact end of an iteration credits it


def simulate_run(
    scenario: Scenario,
    method_config: MethodConfig,
    failures: tuple[FailureEvent, ...] | LazyFailurePath,
    *,
    replication: int = 0,
    seed: int = 0,
    iteration_model: IterationModel | None = None,
    per_microbatch_everywhere: bool = False,
) -> RunResult:
    """Simulate one run of `method_config` on `scenario` under the failure path `failures`.

    `per_microbatch_everywhere=True` advances one iteration at a time and simulates every iteration
    per microbatch without the cache: same result, much slower (for the benchmark of the two levels).
    """
    policy = build_policy(method_config, scenario)
    run = Run(
        scenario,
        policy,
        failures,
        iteration_model=iteration_model or IterationModel(),
        per_microbatch_everywhere=per_microbatch_everywhere,
    )
    return run.execute(replication=replication, seed=seed)


class Run:
    """One simulated run: the trainer loop, the churn and the deadline. Policies never see it: they
    get its `RunContext` (sim/run_context.py), the state and services they share with the trainer."""

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
        # A lazy path is already in time order and must not be sampled to its end up front.
        self.failures = failures if isinstance(failures, LazyFailurePath) else tuple(sorted(failures))
        self.iteration_model = iteration_model
        self.per_microbatch_everywhere = per_microbatch_everywhere
        self.num_stages = scenario.pipeline.num_stages
        self.target_iterations = scenario.target_iterations
        reference_state = build_pipeline_state(scenario)
        reference = iteration_model.result(reference_state)
        self.reference_iteration_time_s = reference.time_s
        compute_only = iteration_model.result(compute_only_state(reference_state))
        self.compute_only_iteration_time_s = compute_only.time_s
        self.compute_only_bubble_fraction = compute_only.bubble_fraction
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

    # ----------------------------------------------------------------- running
    def execute(self, *, replication: int = 0, seed: int = 0) -> RunResult:
        context = self.context
        self._trainer = self.env.process(self._train_loop())
        self.env.process(self._churn())
        self.env.process(self._deadline())
        self.env.run(until=self._trainer)
        wall_clock_s = self.env.now
        goodput_s, badput = split_time(
            context.ledger,
            progress_iterations=context.progress,
            healthy_iteration_time_s=self.healthy_iteration_time_s,
            reference_iteration_time_s=self.reference_iteration_time_s,
            compute_only_iteration_time_s=self.compute_only_iteration_time_s,
            compute_only_bubble_fraction=self.compute_only_bubble_fraction,
            wall_clock_s=wall_clock_s,
        )
        if self.policy.config.uses_setbacks:
            context.notes.append(self._setback_note())
        return RunResult(
            method=self.policy.name,
            replication=replication,
            seed=seed,
            reached_target=self.reached_target,
            wall_clock_s=wall_clock_s,
            target_iterations=self.target_iterations,
            progress_iterations=context.progress,
            iterations_executed=context.ledger.iterations_executed,
            healthy_iteration_time_s=self.healthy_iteration_time_s,
            reference_iteration_time_s=self.reference_iteration_time_s,
            goodput_s=goodput_s,
            badput=badput,
            failures=tuple(context.handled),
            trajectory=tuple(context.trajectory),
            timeline=tuple(context.timeline),
            notes=tuple(context.notes),
        )

    def _setback_note(self) -> str:
        """Where this run's setbacks come from and the values it charged (its replication's draw, if drawn)."""
        convergence = self.scenario.convergence
        method = self.policy.name
        interior, edge = (convergence.setback_iterations(method, position) for position in ("interior", "edge"))
        words = {"measured": "measured", "paper_fitted": "fitted to the CheckFree paper's ablation", "default": "uncalibrated defaults"}
        source = words.get(convergence.setback_source or "default", str(convergence.setback_source))
        return f"convergence setbacks {source}: {interior:.3g} (interior), {edge:.3g} (edge) iterations per rebuilt stage"

    def _train_loop(self) -> Generator:
        context = self.context
        policy = self.policy
        policy.on_start(context)
        while not self._deadline_hit:
            try:
                if self.pending_failures:
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
            start_s = self.env.now
            self._training = True
            try:
                yield self.env.timeout((goal - self._fraction_done) * iteration_time_s)
            except Interrupt:
                self._training = False
                self._interrupt_pending = False
                elapsed_s = self.env.now - start_s
                goal -= self._credit(elapsed_s, iteration_time_s, goal)
                if goal == 0:
                    self._fraction_done = self._in_flight_s = 0.0
                self._book_training(start_s, iteration_time_s)
                if self.pending_failures or self._deadline_hit:
                    context.ledger.interrupted_iterations += self._fraction_done
                    self._fraction_done = self._in_flight_s = 0.0
                    raise
                continue  # a state change: go on at the new iteration time
            self._training = False
            self._book_training(start_s, iteration_time_s)
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
        context.trajectory.append((self.env.now, context.progress))

    def _book_training(self, start_s: float, iteration_time_s: float) -> None:
        """Book the time since `start_s`, trained at `iteration_time_s` (the state's before any change)."""
        context = self.context
        elapsed_s = self.env.now - start_s
        context.ledger.book_training(elapsed_s, iteration_time_s)
        if elapsed_s > 0:
            degraded = context.pipeline_state is not context.healthy_state and context.pipeline_state != context.healthy_state
            context.span("degraded training" if degraded else "train", "degraded" if degraded else "train", start_s)

    def _churn(self) -> Generator:
        for event in self.failures:
            if event.time_s >= self.scenario.target.max_wall_clock_s:
                return
            if event.time_s > self.env.now:
                yield self.env.timeout(event.time_s - self.env.now)
            self._arrive(event)

    def _arrive(self, event: FailureEvent) -> None:
        context = self.context
        now = self.env.now
        context.timeline.append(TimelineEvent(name=f"failure ({event.kind})", category="failure", stage=event.stage, start_s=now, end_s=now))
        if self.policy.config.ignores_failures or event.stage in self.policy.reliable_stages:
            context.record_failure(event, "ignored")
            return
        if now < context.down_until.get(event.stage, -math.inf):
            context.record_failure(event, "already_down")
            return
        context.down_until[event.stage] = now + self.scenario.recovery.join_delay_s
        context.node_generation[event.stage] += 1
        self.pending_failures.append(event)
        self._request_interrupt()

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
