"""Methods that rebuild a lost stage from its surviving neighbours' blocks (DESIGN.md section 2).

CheckFree (Blagoev et al., "All is Not Lost", arXiv 2506.15461): a lost interior stage s becomes
W_s = (ω_{s-1}·W_{s-1} + ω_{s+1}·W_{s+1}) / (ω_{s-1} + ω_{s+1}) over its block parameters, with ω
the squared L2 norm of that neighbour's last gradient (options `l2`, `uniform`). The neighbours
send their block weights and ω over the process group. The rebuilt stage gets a fresh optimizer at
base LR × `lr_scale` (not compounding on a second failure).

Choices, where the reference code differs (reference sheet section 6):
- ω is the norm of the block gradients *before* clipping (the reference uses the clipped norm + 1e-4,
  which is ≈ uniform once raw norms exceed the clip); a stage that has not stepped since it was
  (re)built reports ω = 1, as the reference initialises it.
- A stage is only ever rebuilt from neighbours that survived this failure: two adjacent lost stages
  each fall back to their other, surviving neighbour (copy) or to the fresh random init.
- Stage indices come from S; the first and last stages can fail.
- The ablations copy or average real weights (the reference's ablations zeroed them).
- The embedding (stage 0) and head (stage S-1) of a rebuilt edge stage stay randomly initialised,
  except under CheckFree+, which restores them from replicas held by stages 1 and S-2.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from churnsim.calibration.pipeline_schedule import swapped_block_order

from .base import METHOD_TAG_BASE, MethodContext, RecoveryMethod, RecoveryOutcome


@dataclass(frozen=True, kw_only=True)
class RebuildPlan:
    """Where one lost stage's blocks come from; computed identically on every rank."""

    stage: int
    sources: tuple[int, ...]
    """Surviving stages whose blocks are combined (empty: keep the fresh random init)."""
    weighting: str
    """`gradient` (ω from the sources' gradient norms), `uniform` or `copy` (one source)."""

    @property
    def description(self) -> str:
        if not self.sources:
            return "random"
        names = {"gradient": "weighted_average", "uniform": "uniform_average", "copy": "copy"}
        return f"{names[self.weighting]}({','.join(map(str, self.sources))})"


def surviving_neighbours(stage: int, num_stages: int, failed: frozenset[int]) -> tuple[int, ...]:
    """The previous then the next stage, each only if it exists and did not just fail."""
    return tuple(n for n in (stage - 1, stage + 1) if 0 <= n < num_stages and n not in failed)


def gradient_weight(gradient_norm: float, weighting: str) -> float:
    """ω of a neighbour from the L2 norm of its last block gradient."""
    if weighting == "squared_l2":
        return gradient_norm**2
    if weighting == "l2":
        return gradient_norm
    return 1.0


def _flatten(parameters: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in parameters.values()])


def _load_flat(parameters: dict[str, torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.copy_(flat[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
    assert offset == flat.numel()


class NeighbourRebuildMethod(RecoveryMethod):
    """Shared machinery: gradient-norm bookkeeping, the block transfer and the weighted combination."""

    weighting: str = "uniform"

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        self.last_gradient_norm = 1.0

    @abstractmethod
    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        """Where lost stage `stage`'s blocks come from, given every stage lost in this failure."""

    def before_optimizer_step(self, iteration: int) -> float:
        gradients = [p.grad for p in self.context.runtime.module.part_parameters("blocks").values() if p.grad is not None]
        if gradients:
            self.last_gradient_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gradients])))
        return 0.0

    def forget_node_state(self) -> None:
        self.last_gradient_norm = 1.0

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        context = self.context
        plans = [self.plan_stage(stage, failed_stages) for stage in sorted(failed_stages)]
        notes: list[str] = []
        with context.spans.span("recovery.transfer"):
            received = self._exchange_blocks(plans)
        with context.spans.span("recovery.rebuild"):
            for plan in plans:
                if plan.stage == context.stage and plan.sources:
                    note = self._combine(plan, received)
                    if note:
                        notes.append(note)
            if context.stage in failed_stages:
                context.runtime.optimizer = context.make_optimizer(self.config.lr_scale)
                context.runtime.lr_scale = self.config.lr_scale
        notes.extend(self._recover_other_parts(failed_stages, iteration))
        return RecoveryOutcome(
            failed_stages=failed_stages,
            lr_scale=self.config.lr_scale,
            rebuilt_from={plan.stage: plan.description for plan in plans},
            notes=tuple(notes),
        )

    def _recover_other_parts(self, failed_stages: frozenset[int], iteration: int) -> list[str]:
        """Embedding / head of lost edge stages: kept random here; CheckFree+ restores replicas."""
        last = self.context.num_stages - 1
        parts = {0: "embedding", last: "final norm and lm_head"}
        return [f"stage {stage} {parts[stage]}: random init (no replica)" for stage in sorted(failed_stages & {0, last})]

    def _tag(self, target: int, source: int, kind: int) -> int:
        return METHOD_TAG_BASE + ((target * self.context.num_stages + source) * 4 + kind) * 2

    def _exchange_blocks(self, plans: list[RebuildPlan]) -> dict[int, tuple[torch.Tensor, float]]:
        """Sources send (block weights, gradient norm) to their targets; returns what this rank received."""
        context = self.context
        communicator = context.communicator
        blocks = context.runtime.module.part_parameters("blocks")
        pending = []
        for plan in plans:
            if context.stage in plan.sources:
                flat = _flatten(blocks).to(context.device)
                norm = torch.tensor([self.last_gradient_norm], dtype=torch.float64, device=context.device)
                pending.append((communicator.isend(flat, plan.stage, self._tag(plan.stage, context.stage, 0)), flat))
                pending.append((communicator.isend(norm, plan.stage, self._tag(plan.stage, context.stage, 1)), norm))
        received: dict[int, tuple[torch.Tensor, float]] = {}
        numel = sum(p.numel() for p in blocks.values())
        for plan in plans:
            if plan.stage != context.stage:
                continue
            for source in plan.sources:
                flat = communicator.recv((numel,), torch.float32, source, self._tag(plan.stage, source, 0))
                norm = communicator.recv((1,), torch.float64, source, self._tag(plan.stage, source, 1))
                received[source] = (flat, float(norm.item()))
        for work, _ in pending:
            communicator.wait(work)
        return received

    def _combine(self, plan: RebuildPlan, received: dict[int, tuple[torch.Tensor, float]]) -> str | None:
        """Load Σ ω_i W_i / Σ ω_i into this stage's blocks; returns a note if weights degenerated."""
        note = None
        if plan.weighting == "gradient":
            weights = [gradient_weight(received[source][1], self.weighting) for source in plan.sources]
            if not all(math.isfinite(w) for w in weights) or sum(weights) <= 0.0:
                note = f"stage {plan.stage}: gradient weights {weights} unusable, averaged uniformly"
                weights = [1.0] * len(plan.sources)
        else:
            weights = [1.0] * len(plan.sources)
        total = sum(weights)
        combined = sum(received[source][0].double() * (weight / total) for source, weight in zip(plan.sources, weights))
        assert isinstance(combined, torch.Tensor)
        _load_flat(self.context.runtime.module.part_parameters("blocks"), combined.float())
        return note


class CheckFreeMethod(NeighbourRebuildMethod):
    name: ClassVar[str] = "checkfree"

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        self.weighting = config.weighting

    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        num_stages = self.context.num_stages
        neighbours = surviving_neighbours(stage, num_stages, failed)
        if 0 < stage < num_stages - 1 and len(neighbours) == 2:
            return RebuildPlan(stage=stage, sources=neighbours, weighting="gradient")
        if self.config.edge_fallback == "copy" and neighbours:
            return RebuildPlan(stage=stage, sources=neighbours[:1], weighting="copy")
        return RebuildPlan(stage=stage, sources=(), weighting="copy")


class CopyMethod(NeighbourRebuildMethod):
    """Ablation: copy the previous stage (the next one for stage 0, or when the previous is lost too)."""

    name: ClassVar[str] = "copy"

    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        neighbours = surviving_neighbours(stage, self.context.num_stages, failed)
        return RebuildPlan(stage=stage, sources=neighbours[:1], weighting="copy")


class UniformMethod(NeighbourRebuildMethod):
    """Ablation: 0.5/0.5 average of the two neighbours; edges and adjacent losses copy the survivor."""

    name: ClassVar[str] = "uniform"

    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        neighbours = surviving_neighbours(stage, self.context.num_stages, failed)
        if len(neighbours) == 2:
            return RebuildPlan(stage=stage, sources=neighbours, weighting="uniform")
        return RebuildPlan(stage=stage, sources=neighbours, weighting="copy")


class RandomMethod(NeighbourRebuildMethod):
    """Ablation: the lost stage keeps the fresh random initialisation."""

    name: ClassVar[str] = "random"

    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        return RebuildPlan(stage=stage, sources=(), weighting="copy")


class CheckFreePlusMethod(NeighbourRebuildMethod):
    """CheckFree+: swapped routes on odd microbatches; edges copy their swap partner and restore the
    embedding / head from replicas on stages 1 and S-2, refreshed every `replica_refresh_iterations`
    (after the optimizer step of iterations 0, R, 2R, ...; a replica is a snapshot, not trained)."""

    name: ClassVar[str] = "checkfree_plus"
    _REPLICA_TAG = METHOD_TAG_BASE + (1 << 22)

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        self.weighting = config.weighting
        swapped_block_order(context.num_stages)  # raises InputError below 4 stages
        last = context.num_stages - 1
        # part -> (owner stage, holder stage)
        self.replica_placement = {"embedding": (0, 1), "head": (last, last - 1)}
        self.replicas: dict[str, torch.Tensor] = {}  # flat copies this rank holds
        self.replica_valid = {part: False for part in self.replica_placement}  # known on every rank

    @property
    def swap_odd_microbatches(self) -> bool:
        return True

    def plan_stage(self, stage: int, failed: frozenset[int]) -> RebuildPlan:
        last = self.context.num_stages - 1
        partner = {0: 1, last: last - 1}.get(stage)
        if partner is not None:
            sources = (partner,) if partner not in failed else ()
            return RebuildPlan(stage=stage, sources=sources, weighting="copy")
        neighbours = surviving_neighbours(stage, self.context.num_stages, failed)
        if len(neighbours) == 2:
            return RebuildPlan(stage=stage, sources=neighbours, weighting="gradient")
        return RebuildPlan(stage=stage, sources=neighbours[:1], weighting="copy")

    def forget_node_state(self) -> None:
        super().forget_node_state()
        self.replicas.clear()

    def after_optimizer_step(self, iteration: int) -> None:
        if iteration % self.config.replica_refresh_iterations == 0:
            with self.context.spans.span("replica_refresh"):
                for part in self.replica_placement:
                    self._refresh_replica(part)

    def _part_numel(self, part: str) -> int:
        config = self.context.model_config
        return config.vocab_size * config.dim + (config.dim if part == "head" else 0)

    def _refresh_replica(self, part: str) -> None:
        """The owner sends its current part to the holder, which keeps it as the replica."""
        owner, holder = self.replica_placement[part]
        context = self.context
        tag = self._REPLICA_TAG + (0 if part == "embedding" else 2)
        if context.stage == owner:
            context.communicator.send(_flatten(context.runtime.module.part_parameters(part)), holder, tag)
        elif context.stage == holder:
            self.replicas[part] = context.communicator.recv((self._part_numel(part),), torch.float32, owner, tag)
        self.replica_valid[part] = True

    def _recover_other_parts(self, failed_stages: frozenset[int], iteration: int) -> list[str]:
        context = self.context
        notes: list[str] = []
        for part, (owner, holder) in self.replica_placement.items():
            if holder in failed_stages:
                self.replica_valid[part] = False  # the holder's memory died with it
            if owner not in failed_stages:
                continue
            if not self.replica_valid[part]:
                reason = f"holder stage {holder} also lost" if holder in failed_stages else "no replica refreshed yet"
                notes.append(f"stage {owner} {part}: replica unavailable ({reason}), random init")
                continue
            tag = self._REPLICA_TAG + (4 if part == "embedding" else 6)
            with context.spans.span("recovery.transfer"):
                if context.stage == holder:
                    context.communicator.send(self.replicas[part], owner, tag)
                elif context.stage == owner:
                    flat = context.communicator.recv((self._part_numel(part),), torch.float32, holder, tag)
                    _load_flat(context.runtime.module.part_parameters(part), flat)
        # Replicas whose owner or holder was replaced are re-sent now, so both sides agree again.
        with context.spans.span("recovery.transfer"):
            for part, (owner, holder) in self.replica_placement.items():
                if owner in failed_stages or holder in failed_stages:
                    self._refresh_replica(part)
        return notes
