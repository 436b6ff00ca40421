"""Methods that rebuild a lost stage from surviving stages' blocks (DESIGN.md section 2).

What each lost stage starts from is the contract's `calibration.rebuild_plan.plan_rebuild` (the
simulator charges the same plan); this module carries it out on the process group. Every rank
computes the same plans, then:

- sources send their block weights and ω to each target (any surviving stage may be a source: the
  blocks of every stage have the same shapes), and the target loads Σ ω_i W_i / Σ ω_i. CheckFree
  (Blagoev et al., "All is Not Lost", arXiv 2506.15461): ω is the squared L2 norm of that source's
  last block gradient (options `l2`, `uniform`); the ablations use ω = 1;
- a rebuilt stage gets a fresh optimizer at base LR × `lr_scale` (not compounding on a second
  failure);
- CheckFree with `edge_fallback = "checkpoint"`: stages 0 and S-1 save their whole state (weights,
  optimizer, RNG) every `edge_checkpoint_interval_iterations` through the synchronous engine of
  `checkpoint` (`CheckpointKeeper`, real/methods/checkpointing.py); a lost edge reloads its newest
  save that survived (the initial weights before the first), stale by the iterations since, while
  the other stages keep going;
- the embedding (stage 0) or final norm + lm_head (stage S-1) of a copied edge stays at its random
  init (a note says so: the loss returns towards chance), except under CheckFree+, which restores
  them from replicas held by stages 1 and S-2.

Choices, where the reference code differs (reference sheet section 6):
- ω is the norm of the block gradients *before* clipping (the reference uses the clipped norm + 1e-4,
  which is ≈ uniform once raw norms exceed the clip); a stage that has not stepped since it was
  (re)built reports ω = 1, as the reference initialises it.
- Only stages that survived this failure are sources (never a lost stage's pre-failure weights).
- Stage indices come from S; the first and last stages can fail.
- The ablations copy or average real weights (the reference's ablations zeroed them).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from churnsim.calibration.pipeline_schedule import swapped_block_order
from churnsim.calibration.rebuild_plan import RebuildPlan, edge_checkpoint_stages, plan_rebuild

from .base import METHOD_TAG_BASE, MethodContext, RecoveryMethod, RecoveryOutcome
from .checkpointing import CheckpointDirectories, CheckpointKeeper, restore_newest_agreed, synchronous_engine


def gradient_weight(gradient_norm: float, weighting: str) -> float:
    """ω of a neighbour from the L2 norm of its last block gradient."""
    if weighting == "squared_l2":
        return gradient_norm**2
    if weighting == "l2":
        return gradient_norm
    return 1.0


def flatten_parameters(parameters: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in parameters.values()])


def load_flat_parameters(parameters: dict[str, torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.copy_(flat[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
    assert offset == flat.numel()


def combine_blocks(
    plan: RebuildPlan, received: dict[int, tuple[torch.Tensor, float]], weighting: str
) -> tuple[torch.Tensor, str | None]:
    """Σ ω_i W_i / Σ ω_i over the plan's sources' flat block weights (`received`: source → (flat
    weights, last gradient norm)), and a note when the gradient weights were unusable. Shared by
    real runs and the convergence lab (real/convergence_lab.py)."""
    note = None
    if plan.weighting == "gradient":
        weights = [gradient_weight(received[source][1], weighting) for source in plan.sources]
        if not all(math.isfinite(w) for w in weights) or sum(weights) <= 0.0:
            note = f"stage {plan.stage}: gradient weights {weights} unusable, averaged uniformly"
            weights = [1.0] * len(plan.sources)
    else:
        weights = [1.0] * len(plan.sources)
    total = sum(weights)
    combined = sum(received[source][0].double() * (weight / total) for source, weight in zip(plan.sources, weights))
    assert isinstance(combined, torch.Tensor)
    return combined.float(), note


class NeighbourRebuildMethod(RecoveryMethod):
    """Shared machinery: gradient-norm bookkeeping, edge checkpoints, the block transfer and the combination."""

    weighting: str = "uniform"

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        self.last_gradient_norm = 1.0
        self.edge_keeper: CheckpointKeeper | None = None
        """Saves and reloads this stage's state when it is an edge stage with edge checkpoints."""
        if context.stage in edge_checkpoint_stages(config, context.num_stages):
            directories = CheckpointDirectories(context)
            self.edge_keeper = CheckpointKeeper(
                context,
                synchronous_engine(context, directories, config.edge_checkpoint_tier),
                directories,
                interval_iterations=config.edge_checkpoint_interval_iterations,
                rollback="stage",
            )

    def plan(self, failed_stages: frozenset[int]) -> dict[int, RebuildPlan]:
        """What each stage lost together starts from: the contract's rule, the same on every rank."""
        return plan_rebuild(self.config, failed_stages, self.context.num_stages)

    def before_optimizer_step(self, iteration: int) -> float:
        gradients = [p.grad for p in self.context.runtime.module.part_parameters("blocks").values() if p.grad is not None]
        if gradients:
            self.last_gradient_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gradients])))
        return self.edge_keeper.before_optimizer_step() if self.edge_keeper is not None else 0.0

    def after_optimizer_step(self, iteration: int) -> None:
        if self.edge_keeper is not None:
            self.edge_keeper.after_optimizer_step(iteration)

    def forget_node_state(self) -> None:
        self.last_gradient_norm = 1.0
        if self.edge_keeper is not None:
            self.edge_keeper.forget_node_state()

    def close(self) -> None:
        if self.edge_keeper is not None:
            self.edge_keeper.close()

    def heal_state(self) -> dict[str, Any]:
        return {"last_gradient_norm": self.last_gradient_norm}

    def adopt_heal_state(self, state: dict[str, Any]) -> None:
        self.last_gradient_norm = float(state["last_gradient_norm"])

    def replicated_metadata(self) -> Any:
        return {"edge_keeper": self.edge_keeper.replicated_metadata() if self.edge_keeper is not None else None}

    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        if self.edge_keeper is not None:
            self.edge_keeper.adopt_replicated_metadata([each["edge_keeper"] for each in survivors if each is not None])

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        context = self.context
        plans = self.plan(failed_stages)
        own = plans.get(context.stage)
        notes: list[str] = []
        with context.spans.span("recovery.transfer"):
            received = self._exchange_blocks(list(plans.values()))
        with context.spans.span("recovery.rebuild"):
            if own is not None and own.blocks_from == "sources":
                note = self._combine(own, received)
                if note:
                    notes.append(note)
            if own is not None and own.fresh_optimizer:
                context.runtime.optimizer = context.make_optimizer(self.config.lr_scale)
                context.runtime.lr_scale = self.config.lr_scale
        rebuilt_from = {stage: plan.description for stage, plan in plans.items()}
        restored_from, restore_notes = self._restore_edge_checkpoints(plans, iteration)
        rebuilt_from.update(restored_from)
        notes.extend(restore_notes)
        notes.extend(self._recover_other_parts(plans, iteration))
        rebuilt = any(plan.fresh_optimizer for plan in plans.values())
        return RecoveryOutcome(
            failed_stages=failed_stages,
            lr_scale=self.config.lr_scale if rebuilt else 1.0,
            rebuilt_from=rebuilt_from,
            notes=tuple(notes),
        )

    def _restore_edge_checkpoints(self, plans: dict[int, RebuildPlan], iteration: int) -> tuple[dict[int, str], list[str]]:
        """Lost edge stages reload their own newest save; the tags are shared so every rank reports the same."""
        restored = sorted(stage for stage, plan in plans.items() if plan.blocks_from == "edge_checkpoint")
        if not restored:
            return {}, []
        if self.context.stage in restored:
            assert self.edge_keeper is not None, "an edge stage with edge checkpoints holds a keeper"
        tag = restore_newest_agreed(self.context, self.edge_keeper, lost=self.context.stage in restored)
        tags = self.context.communicator.all_gather_objects(tag)
        rebuilt_from, notes = {}, []
        for stage in restored:
            stage_tag = tags[stage]
            rebuilt_from[stage] = f"edge_checkpoint(iteration {stage_tag})" if stage_tag > 0 else "edge_checkpoint(initial weights)"
            notes.append(
                f"stage {stage}: reloaded its edge checkpoint of iteration {stage_tag}, "
                f"{iteration - stage_tag} iteration(s) stale; the other stages kept theirs"
            )
        return rebuilt_from, notes

    def _edge_part_name(self, stage: int) -> str:
        parts = []
        if stage == 0:
            parts.append("embedding")
        if stage == self.context.num_stages - 1:
            parts.append("final norm and lm_head")
        return " and ".join(parts)

    def _recover_other_parts(self, plans: dict[int, RebuildPlan], iteration: int) -> list[str]:
        """Embedding / head of lost edge stages the plan leaves at random init (CheckFree+ restores replicas)."""
        notes = []
        for stage, plan in sorted(plans.items()):
            if plan.edge_part != "random_init":
                continue
            if plan.sources:
                reason = f"only blocks were copied from stage {plan.sources[0]}; the loss returns towards chance until it retrains"
            else:
                reason = "no replica or checkpoint"
            notes.append(f"stage {stage} {self._edge_part_name(stage)}: random init ({reason})")
        return notes

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
                flat = flatten_parameters(blocks).to(context.device)
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
        combined, note = combine_blocks(plan, received, self.weighting)
        load_flat_parameters(self.context.runtime.module.part_parameters("blocks"), combined)
        return note


class CheckFreeMethod(NeighbourRebuildMethod):
    name: ClassVar[str] = "checkfree"

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        self.weighting = config.weighting


class CopyMethod(NeighbourRebuildMethod):
    """Ablation: copy the nearest surviving stage (the previous one first)."""

    name: ClassVar[str] = "copy"


class UniformMethod(NeighbourRebuildMethod):
    """Ablation: 0.5/0.5 average of the two neighbours; edges and adjacent losses copy a survivor."""

    name: ClassVar[str] = "uniform"


class RandomMethod(NeighbourRebuildMethod):
    """Ablation: the lost stage keeps the fresh random initialisation."""

    name: ClassVar[str] = "random"


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

    def replicated_metadata(self) -> Any:
        return super().replicated_metadata() | {"replica_valid": dict(self.replica_valid)}

    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        super().adopt_replicated_metadata(survivors)
        for each in survivors:
            if each is not None and "replica_valid" in each:
                self.replica_valid = {part: bool(valid) for part, valid in each["replica_valid"].items()}
                break

    def forget_node_state(self) -> None:
        super().forget_node_state()
        self.replicas.clear()

    def heal_state(self) -> dict[str, Any]:
        return super().heal_state() | {f"replica.{part}": flat for part, flat in self.replicas.items()}

    def adopt_heal_state(self, state: dict[str, Any]) -> None:
        super().adopt_heal_state(state)
        self.replicas = {key.split(".", 1)[1]: value for key, value in state.items() if key.startswith("replica.")}

    def after_optimizer_step(self, iteration: int) -> None:
        super().after_optimizer_step(iteration)
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
            context.communicator.send(flatten_parameters(context.runtime.module.part_parameters(part)), holder, tag)
        elif context.stage == holder:
            self.replicas[part] = context.communicator.recv((self._part_numel(part),), torch.float32, owner, tag)
        self.replica_valid[part] = True

    def _recover_other_parts(self, plans: dict[int, RebuildPlan], iteration: int) -> list[str]:
        # The plan restores a replica exactly when its holder (the swap partner) survived; whether
        # one was ever refreshed is only known here, at run time.
        context = self.context
        failed_stages = frozenset(plans)
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
                    load_flat_parameters(context.runtime.module.part_parameters(part), flat)
        # Replicas whose owner or holder was replaced are re-sent now, so both sides agree again.
        with context.spans.span("recovery.transfer"):
            for part, (owner, holder) in self.replica_placement.items():
                if owner in failed_stages or holder in failed_stages:
                    self._refresh_replica(part)
        return notes
