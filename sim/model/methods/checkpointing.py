"""`checkpoint`: synchronous checkpointing, and the restart-from-checkpoint recovery other methods reuse.

Every K executed iterations (counted from the last checkpoint or restart) every stage writes its
weights + optimizer state (`stage parameters × checkpoint_bytes_per_parameter`) to the tier;
training is blocked until all writes are done (a shared tier makes them share one link). The bytes
per link and the serialization before the write come from the cost functions of `base.py`
(`tier_flow_bytes`: data-parallel sharding; `serialization_s`: the tier's serialization rate, paid
by every writer before its write, the slowest setting the wait). A write
interrupted by a failure is not a checkpoint; a checkpoint on a tier that does not survive node loss
is gone after any failure (a part of it died with the node). Progress 0 is an implicit checkpoint (the seeded
initialisation), so a failure before the first checkpoint needs no read.

CheckFree's edge checkpoints reuse `SyncCheckpointer` with `stages=(0, S-1)` and charge a reload with
`stale_stage_loss_iterations`, as `rollback = "stage"` does (sim/model/methods/rebuild.py).

Restart recovery (`RestartRecovery`): wait until every lost stage's replacement has joined, then
`recovery.restart_s` (rendezvous, process groups), then the checkpoint reads (all stages for
`rollback = "all"`, only the lost stages for `"stage"`) concurrently over the tier's read links.
With `"all"` progress returns to the checkpoint and the iterations since are lost work. With
`"stage"` (an approximation, chosen here): the other stages keep their state and the reloaded stage
is Δ = P − P_checkpoint iterations stale; as it holds 1/S of the model, the run loses Δ / S
iterations per reloaded stage, booked as lost work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generator, Iterable

from churnsim.calibration.scenario import Scenario

from .base import RecoveryPolicy, serialization_s, tier_flow_bytes

if TYPE_CHECKING:
    from churnsim.calibration.failure_sampling import FailureEvent
    from ..links import ProcessorSharingLink
    from ..run_context import RunContext


def stale_stage_loss_iterations(stale_iterations: float, num_reloaded_stages: int, num_stages: int) -> float:
    """Progress lost when stages reload state `stale_iterations` old while the others keep theirs
    (`rollback = "stage"`, CheckFree's edge checkpoints): each holds 1/S of the model."""
    return num_reloaded_stages * stale_iterations / num_stages


class SyncCheckpointer:
    """Blocking checkpoints to one storage tier every `interval_iterations` executed iterations.

    `stages` limits the writers (CheckFree's edge checkpoints: stages 0 and S-1); default all."""

    def __init__(self, scenario: Scenario, *, tier: str, interval_iterations: int, stages: Iterable[int] | None = None) -> None:
        self.tier = tier
        self.survives_node_loss = scenario.tier(tier).survives_node_loss
        self.interval_iterations = interval_iterations
        self.num_stages = scenario.pipeline.num_stages
        self.stage_bytes = tuple(tier_flow_bytes(scenario, stage, tier) for stage in range(self.num_stages))
        self.stages = tuple(range(self.num_stages)) if stages is None else tuple(stages)
        # Every writer serializes its part, then writes (torch.save); the slowest sets the wait.
        self.serialization_s = max((serialization_s(scenario, stage, tier) for stage in self.stages), default=0.0)
        self.committed_progress = 0.0
        self.has_checkpoint = False
        self.num_written = 0
        self._origin = 0

    def iterations_until(self, context: "RunContext") -> int:
        return self.interval_iterations - (context.iterations_executed - self._origin)

    def node_lost(self) -> None:
        """A node died: a checkpoint on a tier that dies with its node has lost a part."""
        if not self.survives_node_loss:
            self.committed_progress = 0.0
            self.has_checkpoint = False

    def restart_origin(self, context: "RunContext") -> None:
        self._origin = context.iterations_executed

    def write(self, context: "RunContext") -> Generator:
        if self.serialization_s > 0:
            yield from context.wait(self.serialization_s, "checkpoint_stall_s", f"checkpoint serialization ({self.tier})")
        writes = context.all_transfers_done((context.tier_link(self.tier, "write", stage), self.stage_bytes[stage]) for stage in self.stages)
        yield from context.wait(writes, "checkpoint_stall_s", f"checkpoint write ({self.tier})")
        self.committed_progress = context.progress
        self.has_checkpoint = True
        self.num_written += 1
        self._origin = context.iterations_executed

    def read_requests(self, context: "RunContext", stages: Iterable[int]) -> list[tuple["ProcessorSharingLink", float]]:
        """(link, bytes) of the reads restoring `stages`; none before the first checkpoint (the
        initial weights are regenerated from the seed)."""
        if not self.has_checkpoint:
            return []
        return [(context.tier_link(self.tier, "read", stage), self.stage_bytes[stage]) for stage in stages]

    def read(self, context: "RunContext", stages: Iterable[int]) -> Generator:
        requests = self.read_requests(context, stages)
        if not requests:
            return
        yield from context.wait(context.all_transfers_done(requests), "recovery_downtime_s", f"checkpoint read ({self.tier})")


class RestartRecovery:
    """A re-entrant restart from a checkpoint; failures during it are merged into it."""

    def __init__(self, scenario: Scenario, *, rollback: str, method: str) -> None:
        self.rollback = rollback
        self.num_stages = scenario.pipeline.num_stages
        self.restart_s = scenario.recovery.restart_s_for(method)
        self.stages: set[int] = set()
        self._stale_iterations = 0.0

    @property
    def in_progress(self) -> bool:
        return bool(self.stages)

    def recover(
        self,
        context: "RunContext",
        failures: tuple["FailureEvent", ...],
        *,
        restore_progress: float,
        read: Callable[["RunContext", Iterable[int]], Generator],
        handled_as: str | None = None,
    ) -> Generator:
        label = handled_as or ("rollback" if self.rollback == "all" else "stage_reload")
        for event in failures:
            context.record_failure(event, label)
        if not self.stages:
            self._stale_iterations = max(context.progress - restore_progress, 0.0)
        self.stages.update(event.stage for event in failures)
        if self.rollback == "all":
            context.rollback_to(restore_progress)
        start_s = context.now
        yield from context.wait_for_replacements(self.stages)
        yield from context.wait(self.restart_s, "recovery_downtime_s", "restart")
        readers = range(self.num_stages) if self.rollback == "all" else sorted(self.stages)
        yield from read(context, readers)
        if self.rollback == "stage":
            context.lose_iterations(stale_stage_loss_iterations(self._stale_iterations, len(self.stages), self.num_stages))
        context.span(f"restart of stages {sorted(self.stages)}", "recovery", start_s)
        self.stages.clear()


class CheckpointPolicy(RecoveryPolicy):
    name = "checkpoint"

    def __init__(self, config, scenario: Scenario) -> None:
        super().__init__(config, scenario)
        self.checkpointer = SyncCheckpointer(scenario, tier=config.tier, interval_iterations=config.interval_iterations)
        self.recovery = RestartRecovery(scenario, rollback=config.rollback, method=config.name)

    def iterations_until_boundary(self, context: "RunContext") -> int:
        return self.checkpointer.iterations_until(context)

    def at_boundary(self, context: "RunContext") -> Generator:
        yield from self.checkpointer.write(context)

    def on_failures(self, context: "RunContext", failures) -> Generator:
        self.checkpointer.node_lost()
        yield from self.recovery.recover(
            context, failures, restore_progress=self.checkpointer.committed_progress, read=self.checkpointer.read
        )
        self.checkpointer.restart_origin(context)
