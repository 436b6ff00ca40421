"""What a recovery policy may read and do in a simulated run: one small object, the `RunContext`.

The trainer (`sim/model/run.py`) owns a run's context and drives it: it advances `progress`, books
training time, and tells the context how to interrupt it. A policy (`sim/model/methods/`) receives only
the context, never the trainer, so it can:

- read the clock (`env`, `now`), `progress`, `iterations_executed`, `iteration_time_s`,
  `healthy_state`, `pipeline_state`, `down_until`, and add `notes`;
- spend time only through `wait` and `wait_for_replacements`, which book it to a badput category;
- change the run only through `rollback_to`, `apply_setback`, `lose_iterations`,
  `set_pipeline_state`, `record_failure` and `span`;
- move bytes over `node_link` and `tier_link` (processor-sharing links) with `all_transfers_done`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generator

import simpy
from simpy import Interrupt

from churnsim.calibration.scenario import Scenario

from .accounting import Ledger
from .iteration import IterationModel
from .links import ProcessorSharingLink, all_transfers_done
from .pipeline_state import PipelineState

if TYPE_CHECKING:
    from churnsim.calibration.failure_sampling import FailureEvent


class RunContext:
    """The state of one simulated run that policies share with the trainer, and the services they use."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        env: simpy.Environment,
        healthy_state: PipelineState,
        iteration_model: IterationModel,
    ) -> None:
        self.env = env
        self.scenario = scenario
        self.num_stages = scenario.pipeline.num_stages
        self.iteration_model = iteration_model
        self.healthy_state = healthy_state
        self.iteration_time_s = iteration_model.iteration_time_s(healthy_state)
        self._state = healthy_state
        self.progress = 0.0
        self.iterations_executed = 0
        self.down_until: dict[int, float] = {}
        """Stage → time its replacement joins (kept after the join; compare with `env.now`)."""
        self.node_generation = [0] * self.num_stages
        self.ledger = Ledger()
        # Records as flat lists of fields (results.py `RecordSequence` builds the records on first read).
        self.trajectory: list[float] = [0.0, 0.0]
        """Points (time_s, progress_iterations), two fields each."""
        self.timeline: list = []
        """`TimelineEvent`s: (name, category, stage, start_s, end_s, track), six fields each."""
        self.handled: list = []
        """`HandledFailure`s: (time_s, stage, kind, handled_as, iteration, replica), six fields each."""
        self.notes: list[str] = []
        self._links: dict[tuple, ProcessorSharingLink] = {}
        self._tier_links: dict[tuple, ProcessorSharingLink] = {}
        self.on_state_change: Callable[[], None] = lambda: None
        """Set by the trainer: a state change in the middle of a chunk re-times the rest of it."""

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
        self.on_state_change()

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
            self.trajectory.extend((self.env.now, self.progress))
            return lost
        return 0.0

    def apply_setback(self, iterations: float) -> float:
        """Remove `iterations` of progress (a rebuild's convergence setback), not below 0."""
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.ledger.setback_iterations += applied
            self.trajectory.extend((self.env.now, self.progress))
        return applied

    def lose_iterations(self, iterations: float) -> float:
        """Remove `iterations` of progress booked as lost work (a stale stage's rollback), not below 0."""
        if not self.scenario.convergence.stale_reload_costs_progress:
            return 0.0
        applied = min(max(iterations, 0.0), self.progress)
        if applied > 0:
            self.progress -= applied
            self.ledger.rolled_back_iterations += applied
            self.trajectory.extend((self.env.now, self.progress))
        return applied

    def record_failure(self, event: FailureEvent, handled_as: str) -> None:
        self.handled.extend((event.time_s, event.stage, event.kind, handled_as, int(self.progress), event.replica))

    def span(
        self, name: str, category: str, start_s: float, *, end_s: float | None = None, stage: int = -1, track: str | None = None
    ) -> None:
        end = self.env.now if end_s is None else end_s
        self.timeline.extend((name, category, stage, start_s, end, track))

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
            link = ProcessorSharingLink(self.env, bandwidth_bytes_per_s=bandwidth, latency_s=tier.total_latency_s, name=f"{tier_name}-{direction}-{owner}")
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


_SPAN_CATEGORY = {"checkpoint_stall_s": "checkpoint", "recovery_downtime_s": "recovery", "method_overhead_s": "method", "replica_heal_s": "heal", "survivor_restart_s": "recovery"}
