"""Rebuild methods: `checkfree`, `checkfree_plus` and the ablations `copy`, `uniform`, `random`.

Training stops while a lost stage is rebuilt: wait for the replacement to join, `recovery.restart_s`,
then the transfers of the neighbours' weights into the new node, concurrently over the
processor-sharing links (source node → new node). Nothing rolls back; each rebuilt stage costs the
convergence setback `scenario.convergence.setback_iterations(method, position)`, applied when the
rebuild completes. Only the neighbours' transformer blocks are sent (the optimizer starts fresh; the
lost embedding or head is re-initialised, unless CheckFree+ restores it from its replica).

Which rule applies to a lost stage s, given the set L of stages lost together (a failure during a
rebuild joins L, and the plan is made again for the whole set):

- `checkfree`: s interior with both neighbours alive ⇒ average of both (interior setback); otherwise
  `edge_fallback`: `copy` from the nearest live stage (edge setback) or `random` (the `random`
  method's setback, no transfer).
- `checkfree_plus`: interior as `checkfree`; stage 0 (S − 1) copies its swap partner 1 (S − 2) and gets
  the embedding (head) from the replica the partner holds (edge setback); partner lost too ⇒ random
  init (the `random` setback); interior with a lost neighbour ⇒ copy the live neighbour (edge setback).
  Every `replica_refresh_iterations` the embedding and head replicas are sent to stages 1 and S − 2 in
  the background; a refresh still running at the next one blocks training (method overhead).
- `copy`: copy the previous stage (the next one for stage 0; the nearest live one if lost).
- `uniform`: 0.5/0.5 average of both neighbours when both are alive, otherwise copy one.
- `random`: fresh initialisation, no transfer.
With no live stage at all every rule falls back to random initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

from churnsim.calibration.convergence import stage_position

from .base import RecoveryPolicy, block_weight_bytes, embedding_weight_bytes, head_weight_bytes

if TYPE_CHECKING:
    from ..run import Run


@dataclass(frozen=True, kw_only=True)
class RebuildPlan:
    handled_as: str
    sources: tuple[tuple[int, float], ...]
    """(source stage, bytes) sent to the new node."""
    setback_iterations: float


class RebuildPolicy(RecoveryPolicy):
    """Shared recovery of the rebuild family; subclasses give `plan(stage, lost)`."""

    uses_setbacks = True

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self.rebuilding: set[int] = set()
        self.blocks_bytes = block_weight_bytes(scenario)
        self.num_rebuilds = 0

    # --- helpers for plans
    def alive(self, stage: int, lost: set[int]) -> bool:
        return 0 <= stage < self.num_stages and stage not in lost

    def nearest_alive(self, stage: int, lost: set[int]) -> int | None:
        for distance in range(1, self.num_stages):
            for candidate in (stage - distance, stage + distance):
                if self.alive(candidate, lost):
                    return candidate
        return None

    def setback(self, method: str, stage: int, *, edge: bool | None = None) -> float:
        position = stage_position(stage, self.num_stages) if edge is None else ("edge" if edge else "interior")
        return self.scenario.convergence.setback_iterations(method, position)

    def random_plan(self, stage: int) -> RebuildPlan:
        return RebuildPlan(handled_as="rebuild_random", sources=(), setback_iterations=self.setback("random", stage))

    def copy_plan(self, stage: int, source: int | None, method: str, handled_as: str) -> RebuildPlan:
        if source is None:
            return self.random_plan(stage)
        return RebuildPlan(
            handled_as=handled_as, sources=((source, self.blocks_bytes),), setback_iterations=self.setback(method, stage, edge=True)
        )

    def average_plan(self, stage: int, method: str) -> RebuildPlan:
        return RebuildPlan(
            handled_as="rebuild_interior",
            sources=((stage - 1, self.blocks_bytes), (stage + 1, self.blocks_bytes)),
            setback_iterations=self.setback(method, stage, edge=False),
        )

    def interior_with_both_neighbours(self, stage: int, lost: set[int]) -> bool:
        return 0 < stage < self.num_stages - 1 and self.alive(stage - 1, lost) and self.alive(stage + 1, lost)

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        raise NotImplementedError

    # --- the recovery
    def on_failures(self, run: "Run", failures) -> Generator:
        self.rebuilding.update(event.stage for event in failures)
        lost = set(self.rebuilding)
        plans = {stage: self.plan(stage, lost) for stage in sorted(lost)}
        for event in failures:
            run.record_failure(event, plans[event.stage].handled_as)
        start_s = run.now
        yield from run.wait_for_replacements(lost)
        yield from run.wait(self.scenario.recovery.restart_s, "recovery_downtime_s", "restart")
        transfers = [(run.node_link(source, stage), num_bytes) for stage, plan in plans.items() for source, num_bytes in plan.sources]
        if transfers:
            yield from run.wait(run.all_transfers_done(transfers), "recovery_downtime_s", "weight transfer")
        run.apply_setback(sum(plan.setback_iterations for plan in plans.values()))
        run.span(f"rebuild of stages {sorted(lost)}", "recovery", start_s)
        self.num_rebuilds += len(lost)
        self.rebuilding.clear()


class CheckFreePolicy(RebuildPolicy):
    name = "checkfree"

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        if self.interior_with_both_neighbours(stage, lost):
            return self.average_plan(stage, "checkfree")
        if self.config.edge_fallback == "random":
            return self.random_plan(stage)
        return self.copy_plan(stage, self.nearest_alive(stage, lost), "checkfree", "rebuild_edge_copy")


class CheckFreePlusPolicy(RebuildPolicy):
    name = "checkfree_plus"
    swap_odd_microbatches = True

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self._refresh_origin = 0
        self._refresh_done = None
        self.num_refreshes = 0

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        last = self.num_stages - 1
        if self.interior_with_both_neighbours(stage, lost):
            return self.average_plan(stage, "checkfree_plus")
        if stage in (0, last):
            partner = 1 if stage == 0 else last - 1
            if not self.alive(partner, lost):
                return self.random_plan(stage)
            replica = embedding_weight_bytes(self.scenario) if stage == 0 else head_weight_bytes(self.scenario)
            return RebuildPlan(
                handled_as="rebuild_edge_swap",
                sources=((partner, self.blocks_bytes + replica),),
                setback_iterations=self.setback("checkfree_plus", stage, edge=True),
            )
        return self.copy_plan(stage, self.nearest_alive(stage, lost), "checkfree_plus", "rebuild_adjacent_copy")

    def iterations_until_boundary(self, run: "Run") -> int:
        return self.config.replica_refresh_iterations - (run.iterations_executed - self._refresh_origin)

    def at_boundary(self, run: "Run") -> Generator:
        if self._refresh_done is not None and not self._refresh_done.processed:
            yield from run.wait(self._refresh_done, "method_overhead_s", "replica refresh backlog")
        last = self.num_stages - 1
        start_s = run.now
        done = run.all_transfers_done(
            [
                (run.node_link(0, 1), embedding_weight_bytes(self.scenario)),
                (run.node_link(last, last - 1), head_weight_bytes(self.scenario)),
            ]
        )
        done.callbacks.append(lambda _event: run.span("(de)embedding replica refresh", "flush", start_s))
        self._refresh_done = done
        self._refresh_origin = run.iterations_executed
        self.num_refreshes += 1


class CopyPolicy(RebuildPolicy):
    name = "copy"

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        source = stage - 1 if self.alive(stage - 1, lost) else stage + 1 if self.alive(stage + 1, lost) else self.nearest_alive(stage, lost)
        if source is None:
            return self.random_plan(stage)
        return RebuildPlan(handled_as="rebuild_copy", sources=((source, self.blocks_bytes),), setback_iterations=self.setback("copy", stage))


class UniformPolicy(RebuildPolicy):
    name = "uniform"

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        if self.interior_with_both_neighbours(stage, lost):
            return self.average_plan(stage, "uniform")
        return self.copy_plan(stage, self.nearest_alive(stage, lost), "uniform", "rebuild_edge_copy")


class RandomPolicy(RebuildPolicy):
    name = "random"

    def plan(self, stage: int, lost: set[int]) -> RebuildPlan:
        return self.random_plan(stage)
