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

from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from .accounting import Ledger, split_time
from churnsim.calibration.failure_sampling import FailureEvent
from .iteration import IterationModel, simulate_iteration
from .pipeline_state import PipelineState
from .links import ProcessorSharingLink, all_transfers_done
from .methods import build_policy
from .methods.base import RecoveryPolicy
from .pipeline_state import build_pipeline_state, compute_only_state
from .results import HandledFailure, RunResult, TimelineEvent

_CREDIT_TOLERANCE = 1e-9  # relative: an interrupt at the exact end of an iteration credits it


def simulate_run(
    scenario: Scenario,
    method_config: MethodConfig,
    failures: tuple[FailureEvent, ...],
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
    """The state of one simulated run, and the services recovery policies use.

    Policies read `env`, `scenario`, `progress`, `iterations_executed`, `iteration_time_s`,
    `healthy_state`, `down_until`; they spend time only through `wait` (which books it) and change
    the run only through `rollback_to`, `apply_setback`, `lose_iterations`, `set_pipeline_state`,
    `record_failure` and `span`.
    """

    def __init__(
        self,
        scenario: Scenario,
        policy: RecoveryPolicy,
        failures: tuple[FailureEvent, ...],
        *,
        iteration_model: IterationModel,
        per_microbatch_everywhere: bool = False,
    ) -> None:
        self.env = simpy.Environment()
        self.scenario = scenario
        self.policy = policy
        self.failures = tuple(sorted(failures))
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
        self.healthy_state = policy.healthy_state()
        self.healthy_iteration_time_s = iteration_model.iteration_time_s(self.healthy_state)
        self._state = self.healthy_state
        self.iteration_time_s = self.healthy_iteration_time_s
        self.progress = 0.0
        self.iterations_executed = 0
        self.down_until: dict[int, float] = {}
        """Stage → time its replacement joins (kept after the join; compare with `env.now`)."""
        self.node_generation = [0] * self.num_stages
        self.pending_failures: list[FailureEvent] = []
        self.ledger = Ledger()
        self.trajectory: list[tuple[float, float]] = [(0.0, 0.0)]
        self.timeline: list[TimelineEvent] = []
        self.handled: list[HandledFailure] = []
        self.notes: list[str] = []
        self._links: dict[tuple, ProcessorSharingLink] = {}
        self._tier_links: dict[tuple, ProcessorSharingLink] = {}
        self._fraction_done = 0.0  # of the iteration in flight
        self._in_flight_s = 0.0  # time spent on the iteration in flight
        self._training = False
        self._interrupt_pending = False
        self._deadline_hit = False
        self.reached_target = False
        self._trainer: simpy.Process | None = None

    # ----------------------------------------------------------------- running
    def execute(self, *, replication: int = 0, seed: int = 0) -> RunResult:
        self._trainer = self.env.process(self._train_loop())
        self.env.process(self._churn())
        self.env.process(self._deadline())
        self.env.run(until=self._trainer)
        wall_clock_s = self.env.now
        goodput_s, badput = split_time(
            self.ledger,
            progress_iterations=self.progress,
            healthy_iteration_time_s=self.healthy_iteration_time_s,
            reference_iteration_time_s=self.reference_iteration_time_s,
            compute_only_iteration_time_s=self.compute_only_iteration_time_s,
            compute_only_bubble_fraction=self.compute_only_bubble_fraction,
            wall_clock_s=wall_clock_s,
        )
        if not self.scenario.convergence.calibrated and self.policy.config.uses_setbacks:
            self.notes.append("convergence setbacks are uncalibrated defaults (default_setback_iterations in calibration/methods.py)")
        return RunResult(
            method=self.policy.name,
            replication=replication,
            seed=seed,
            reached_target=self.reached_target,
            wall_clock_s=wall_clock_s,
            target_iterations=self.target_iterations,
            progress_iterations=self.progress,
            iterations_executed=self.ledger.iterations_executed,
            healthy_iteration_time_s=self.healthy_iteration_time_s,
            reference_iteration_time_s=self.reference_iteration_time_s,
            goodput_s=goodput_s,
            badput=badput,
            failures=tuple(self.handled),
            trajectory=tuple(self.trajectory),
            timeline=tuple(self.timeline),
            notes=tuple(self.notes),
        )

    def _train_loop(self) -> Generator:
        policy = self.policy
        policy.on_start(self)
        while not self._deadline_hit:
            try:
                if self.pending_failures:
                    batch = tuple(self.pending_failures)
                    self.pending_failures.clear()
                    yield from policy.on_failures(self, batch)
                    continue
                remaining = math.ceil(self.target_iterations - self.progress - 1e-9)
                if remaining <= 0:
                    self.reached_target = True
                    break
                until_boundary = policy.iterations_until_boundary(self)
                if until_boundary is not None and until_boundary <= 0:
                    yield from policy.at_boundary(self)
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
        goal = num_iterations
        while goal > 0:
            if self.per_microbatch_everywhere:
                self.iteration_time_s = simulate_iteration(self._state).time_s
            iteration_time_s = self.iteration_time_s
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
                self._book_training(start_s)
                if self.pending_failures or self._deadline_hit:
                    self.ledger.interrupted_iteration_s += self._in_flight_s
                    self._fraction_done = self._in_flight_s = 0.0
                    raise
                continue  # a state change: go on at the new iteration time
            self._training = False
            self._book_training(start_s)
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
        self.progress += iterations
        self.iterations_executed += iterations
        self.ledger.iterations_executed += iterations
        self.trajectory.append((self.env.now, self.progress))

    def _book_training(self, start_s: float) -> None:
        elapsed_s = self.env.now - start_s
        self.ledger.training_s += elapsed_s
        if elapsed_s > 0:
            degraded = self._state is not self.healthy_state and self._state != self.healthy_state
            self.span("degraded training" if degraded else "train", "degraded" if degraded else "train", start_s)

    def _churn(self) -> Generator:
        for event in self.failures:
            if event.time_s >= self.scenario.target.max_wall_clock_s:
                return
            if event.time_s > self.env.now:
                yield self.env.timeout(event.time_s - self.env.now)
            self._arrive(event)

    def _arrive(self, event: FailureEvent) -> None:
        now = self.env.now
        self.timeline.append(TimelineEvent(name=f"failure ({event.kind})", category="failure", stage=event.stage, start_s=now, end_s=now))
        if self.policy.config.ignores_failures or event.stage in self.policy.reliable_stages:
            self.record_failure(event, "ignored")
            return
        if now < self.down_until.get(event.stage, -math.inf):
            self.record_failure(event, "already_down")
            return
        self.down_until[event.stage] = now + self.scenario.recovery.join_delay_s
        self.node_generation[event.stage] += 1
        self.pending_failures.append(event)
        self._request_interrupt()

    def _deadline(self) -> Generator:
        yield self.env.timeout(self.scenario.target.max_wall_clock_s)
        self._deadline_hit = True
        self._request_interrupt()

    def _request_interrupt(self) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.is_alive and not self._interrupt_pending and trainer is not self.env.active_process:
            self._interrupt_pending = True
            trainer.interrupt()

    # ----------------------------------------------------------------- services for policies
    @property
    def now(self) -> float:
        return self.env.now

    @property
    def pipeline_state(self) -> PipelineState:
        return self._state

    def set_pipeline_state(self, state: PipelineState) -> None:
        """Switch to `state` (degraded or healthy); a chunk in progress goes on at the new speed."""
        if state is self._state or state == self._state:
            return
        self._state = state
        self.iteration_time_s = self.iteration_model.iteration_time_s(state)
        if self._training:
            self._request_interrupt()

    def wait(
        self, what: float | simpy.Event, category: str, name: str, *, stage: int = -1, span_category: str | None = None
    ) -> Generator:
        """Block training for a duration or until an event; book the time to `category` even if interrupted."""
        start_s = self.env.now
        try:
            if isinstance(what, simpy.Event):
                yield what
            elif what > 0:
                yield self.env.timeout(what)
        except Interrupt:
            self._book_wait(category, name, stage, span_category, start_s, interrupted=True)
            raise
        self._book_wait(category, name, stage, span_category, start_s, interrupted=False)

    def _book_wait(self, category, name, stage, span_category, start_s, *, interrupted: bool) -> None:
        self.ledger.charge_wait(category, self.env.now - start_s)
        if self.env.now > start_s:
            label = f"{name} (interrupted)" if interrupted else name
            self.span(label, span_category or _SPAN_CATEGORY[category], start_s, stage=stage)

    def wait_for_replacements(self, stages) -> Generator:
        """Wait (as recovery downtime) until every stage in `stages` has its replacement node."""
        join_s = max((self.down_until.get(stage, 0.0) for stage in stages), default=0.0)
        if join_s > self.env.now:
            yield from self.wait(join_s - self.env.now, "recovery_downtime_s", "join delay")

    def rollback_to(self, progress: float) -> float:
        """Return progress to `progress` (a checkpoint); the iterations lost are lost work."""
        lost = self.progress - progress
        if lost > 0:
            self.progress = progress
            self.ledger.rolled_back_iterations += lost
            self.trajectory.append((self.env.now, self.progress))
            return lost
        return 0.0

    def apply_setback(self, iterations: float) -> float:
        """Remove `iterations` of progress (a rebuild's convergence setback), not below 0."""
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.ledger.setback_iterations += applied
            self.trajectory.append((self.env.now, self.progress))
        return applied

    def lose_iterations(self, iterations: float) -> float:
        """Remove `iterations` of progress booked as lost work (a stale stage's rollback), not below 0."""
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.ledger.rolled_back_iterations += applied
            self.trajectory.append((self.env.now, self.progress))
        return applied

    def record_failure(self, event: FailureEvent, handled_as: str) -> None:
        self.handled.append(
            HandledFailure(time_s=event.time_s, stage=event.stage, kind=event.kind, handled_as=handled_as, iteration=int(self.progress))
        )

    def span(self, name: str, category: str, start_s: float, *, end_s: float | None = None, stage: int = -1) -> None:
        end = self.env.now if end_s is None else end_s
        self.timeline.append(TimelineEvent(name=name, category=category, stage=stage, start_s=start_s, end_s=end))

    def all_transfers_done(self, requests) -> simpy.Event:
        """Start `requests` ((link, bytes) pairs) in order; an event that fires as their `AllOf` would (cheaper)."""
        return all_transfers_done(self.env, requests)

    def tier_link(self, tier_name: str, direction: str, stage: int, *, generation: int = 0) -> ProcessorSharingLink:
        """The link to storage tier `tier_name` ("write" or "read") used by `stage`'s node."""
        # Looked up by a flat key first: this runs for every checkpoint part and flush.
        fast_key = (tier_name, direction, stage, generation, self.node_generation[stage])
        link = self._tier_links.get(fast_key)
        if link is None:
            link = self._tier_link(tier_name, direction, stage, generation)
            self._tier_links[fast_key] = link
        return link

    def _tier_link(self, tier_name: str, direction: str, stage: int, generation: int) -> ProcessorSharingLink:
        tier = self.scenario.tier(tier_name)
        bandwidth = tier.write_bandwidth_bytes_per_s if direction == "write" else tier.read_bandwidth_bytes_per_s
        owner = ("shared",) if tier.shared else (stage, self.node_generation[stage])
        key = ("tier", tier_name, direction, owner, generation)
        link = self._links.get(key)
        if link is None:
            link = ProcessorSharingLink(self.env, bandwidth_bytes_per_s=bandwidth, latency_s=tier.latency_s, name=f"{tier_name}-{direction}-{owner}")
            self._links[key] = link
        return link

    def node_link(self, source_stage: int, destination_stage: int) -> ProcessorSharingLink:
        """The network link from the node of `source_stage` to the node of `destination_stage`."""
        key = ("node", source_stage, destination_stage)
        link = self._links.get(key)
        if link is None:
            state = self.healthy_state
            link = ProcessorSharingLink(
                self.env,
                bandwidth_bytes_per_s=state.link_bandwidth_bytes_per_s[source_stage][destination_stage],
                latency_s=state.link_latency_s[source_stage][destination_stage],
                name=f"link-{source_stage}-{destination_stage}",
            )
            self._links[key] = link
        return link


_SPAN_CATEGORY = {"checkpoint_stall_s": "checkpoint", "recovery_downtime_s": "recovery", "method_overhead_s": "method"}
