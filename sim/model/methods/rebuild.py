"""Rebuild methods: `checkfree`, `checkfree_plus` and the ablations `copy`, `uniform`, `random`.

What a lost stage starts from is decided by the contract, `calibration.rebuild_plan.plan_rebuild`
(the same rule real runs carry out); this module only charges it. Training stops while lost stages
are rebuilt: wait for the replacements to join, `recovery.restart_s`, then the transfers of the
sources' transformer blocks into the new nodes, concurrently over the processor-sharing links
(source node → new node), together with the reads of any edge checkpoint. Each rebuilt stage then
costs the convergence setback `scenario.convergence.setback_iterations(plan.setback_method,
plan.setback_position)`, applied when the rebuild completes (all the progress made, when every stage
restarts from random init: `leaves_no_trained_weights`); a stage reloaded from its edge
checkpoint instead costs the stage-local rollback of `checkpoint` with `rollback = "stage"`
(`stale_stage_loss_iterations`, booked as lost work). A failure during a rebuild joins the set of
lost stages and the plan is made again for the whole set, so nothing is charged twice.

Steady state: CheckFree with `edge_fallback = "checkpoint"` writes stages 0 and S-1 every
`edge_checkpoint_interval_iterations` with the blocking `SyncCheckpointer` of `checkpoint`; CheckFree+
sends the embedding and head replicas to stages 1 and S-2 every `replica_refresh_iterations` in the
background (a refresh still running at the next one blocks training: method overhead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Generator

from churnsim.calibration.rebuild_plan import RebuildPlan, edge_checkpoint_stages, leaves_no_trained_weights, plan_rebuild

from .base import RecoveryPolicy, block_weight_bytes, embedding_weight_bytes, head_weight_bytes
from .checkpointing import SyncCheckpointer, stale_stage_loss_iterations

if TYPE_CHECKING:
    from ..run_context import RunContext


class RebuildPolicy(RecoveryPolicy):
    """Shared recovery of the rebuild family: charges the contract's plan in bytes, seconds and setbacks."""

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self.rebuilding: set[int] = set()
        self.blocks_bytes = block_weight_bytes(scenario)
        self.num_rebuilds = 0
        self.num_edge_restores = 0
        self._noted_random_edge_parts = False
        self._noted_restart_from_scratch = False
        edge_stages = edge_checkpoint_stages(config, self.num_stages)
        self.edge_checkpointer = (
            SyncCheckpointer(
                scenario,
                tier=config.edge_checkpoint_tier,
                interval_iterations=config.edge_checkpoint_interval_iterations,
                stages=edge_stages,
            )
            if edge_stages
            else None
        )

    def plan(self, lost: Iterable[int]) -> dict[int, RebuildPlan]:
        """What each of the stages lost together starts from (the contract's rule, not a copy of it)."""
        return plan_rebuild(self.config, lost, self.num_stages)

    def setback_iterations(self, plan: RebuildPlan, progress: float) -> float:
        if plan.setback_method is None:
            return 0.0  # a stale reload, charged as lost work
        return self.scenario.convergence.setback_iterations(plan.setback_method, plan.setback_position, progress)

    def rebuild_setback_iterations(self, context: "RunContext", plans: dict[int, RebuildPlan]) -> float:
        """Progress the rebuild of `plans` costs: the stages' setbacks summed, or all of it when no
        trained weight survives (both engines call this)."""
        if self.scenario.convergence.restart_from_scratch_costs_progress and leaves_no_trained_weights(plans, self.num_stages):
            if not self._noted_restart_from_scratch:
                self._noted_restart_from_scratch = True
                context.notes.append(
                    f"{self.name}: every stage was lost with no trained weights left to rebuild from "
                    "(no surviving stage, no checkpoint): training restarted from iteration 0"
                )
            return context.progress
        progress = context.progress
        setback = 0.0
        for plan in plans.values():
            setback += self.setback_iterations(plan, progress)
        return setback

    def setback_grows_with_progress(self, plan: RebuildPlan) -> bool:
        """Whether `setback_iterations(plan, progress)` depends on `progress` (else it is one number)."""
        return plan.setback_method is not None and self.scenario.convergence.setback_grows_with_progress(plan.setback_method, plan.setback_position)

    def source_bytes(self, plan: RebuildPlan, source_index: int) -> float:
        """Bytes one source sends: its blocks, plus the CheckFree+ (de)embedding replica it holds."""
        if plan.edge_part == "replica" and source_index == 0:
            replica = embedding_weight_bytes(self.scenario) if plan.stage == 0 else head_weight_bytes(self.scenario)
            return self.blocks_bytes + replica
        return self.blocks_bytes

    # --- steady state: the edge checkpoints (CheckFree+ overrides both with its replica refresh)
    def iterations_until_boundary(self, context: "RunContext") -> int | None:
        return None if self.edge_checkpointer is None else self.edge_checkpointer.iterations_until(context)

    def at_boundary(self, context: "RunContext") -> Generator:
        if self.edge_checkpointer is not None:
            yield from self.edge_checkpointer.write(context)

    # --- the recovery
    def on_failures(self, context: "RunContext", failures) -> Generator:
        self.rebuilding.update(event.stage for event in failures)
        lost = set(self.rebuilding)
        plans = self.plan(lost)
        for event in failures:
            context.record_failure(event, plans[event.stage].handled_as)
        self._note_random_edge_parts(context, plans)
        restored = sorted(stage for stage, plan in plans.items() if plan.blocks_from == "edge_checkpoint")
        if restored:
            assert self.edge_checkpointer is not None
            self.edge_checkpointer.node_lost()  # a save on a tier that dies with its node is gone
        start_s = context.now
        yield from context.wait_for_replacements(lost)
        yield from context.wait(self.scenario.recovery.restart_s_for(self.config.name), "recovery_downtime_s", "restart")
        transfers = [
            (context.node_link(source, stage), self.source_bytes(plan, index))
            for stage, plan in plans.items()
            for index, source in enumerate(plan.sources)
        ]
        if restored:
            assert self.edge_checkpointer is not None
            transfers.extend(self.edge_checkpointer.read_requests(context, restored))
        if transfers:
            name = "weight transfer and edge checkpoint read" if restored else "weight transfer"
            yield from context.wait(context.all_transfers_done(transfers), "recovery_downtime_s", name)
        # Staleness first: it is measured against the progress the reloaded stage had reached.
        stale_iterations = 0.0
        if restored:
            assert self.edge_checkpointer is not None
            stale_iterations = max(context.progress - self.edge_checkpointer.committed_progress, 0.0)
        context.apply_setback(self.rebuild_setback_iterations(context, plans))
        if restored:
            context.lose_iterations(stale_stage_loss_iterations(stale_iterations, len(restored), self.num_stages))
            self.num_edge_restores += len(restored)
        context.span(f"rebuild of stages {sorted(lost)}", "recovery", start_s)
        self.num_rebuilds += len(lost)
        self.rebuilding.clear()

    def _note_random_edge_parts(self, context: "RunContext", plans: dict[int, RebuildPlan]) -> None:
        """A copied edge stage keeps a random embedding or head: say once that its setback may be small."""
        copied = sorted(stage for stage, plan in plans.items() if plan.edge_part == "random_init" and plan.sources)
        if copied and not self._noted_random_edge_parts:
            self._noted_random_edge_parts = True
            context.notes.append(
                f"{self.name}: edge stage {copied[0]} was rebuilt by copying blocks; its embedding or final norm "
                "and lm_head restart from random init, which sends a real run's loss back towards chance "
                "(checkfree's edge_fallback='checkpoint' avoids it); the edge setback charged is only as "
                "good as its calibration"
            )


class CheckFreePolicy(RebuildPolicy):
    name = "checkfree"


class CheckFreePlusPolicy(RebuildPolicy):
    name = "checkfree_plus"
    swap_odd_microbatches = True

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self._refresh_origin = 0
        self._refresh_done = None
        self.num_refreshes = 0

    def iterations_until_boundary(self, context: "RunContext") -> int:
        return self.config.replica_refresh_iterations - (context.iterations_executed - self._refresh_origin)

    def at_boundary(self, context: "RunContext") -> Generator:
        if self._refresh_done is not None and not self._refresh_done.processed:
            yield from context.wait(self._refresh_done, "method_overhead_s", "replica refresh backlog")
        last = self.num_stages - 1
        start_s = context.now
        done = context.all_transfers_done(
            [
                (context.node_link(0, 1), embedding_weight_bytes(self.scenario)),
                (context.node_link(last, last - 1), head_weight_bytes(self.scenario)),
            ]
        )
        links = f"links 0→1, {last}→{last - 1}"
        done.callbacks.append(lambda _event: context.span("(de)embedding replica refresh", "flush", start_s, track=links))
        self._refresh_done = done
        self._refresh_origin = context.iterations_executed
        self.num_refreshes += 1


class CopyPolicy(RebuildPolicy):
    name = "copy"


class UniformPolicy(RebuildPolicy):
    name = "uniform"


class RandomPolicy(RebuildPolicy):
    name = "random"
