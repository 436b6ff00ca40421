"""What a lost stage starts from under the rebuild methods: one rule, read by sim/ and real/.

`plan_rebuild(method_config, lost_stages, num_stages)` returns, per lost stage, a `RebuildPlan`:
pure data that the simulator turns into bytes, seconds and a setback (sim/model/methods/rebuild.py) and
that real runs carry out with tensors over the process group or from files
(real/methods/rebuild.py). Every rank of a real run computes the same plan.

The rule, for a set L of stages lost together (S stages; "surviving" = not in L; a failure during
a recovery joins L and the plan is made again for the whole set):

- Only surviving stages are ever sources: a stage lost in this failure holds fresh random weights,
  never the weights it had before (one of the reference code's bugs).
- The *nearest surviving stage* of s is s-1, s+1, s-2, s+2, ... (the previous one first: it
  produced this stage's inputs). A lost stage with no surviving immediate neighbour copies the
  nearest surviving stage at any distance. Why: every stage holds the same number of blocks, so a
  distant copy has the right shape, real runs can send it over the process group like a neighbour's,
  and trained blocks beat a random init (the CheckFree paper's ablation: copy 29 vs random 121
  perplexity). This is where the two wings used to disagree (real used to fall back to random).
  No surviving stage at all: random init.
- `checkfree`: interior s with both neighbours surviving: ω-weighted average of s-1 and s+1
  (interior setback). Edge stage (0 or S-1) by `edge_fallback`: `checkpoint` reloads the stage's own
  latest edge checkpoint, blocks, embedding/head and optimizer (no setback table: the stage is stale,
  charged as a stage-local rollback); `copy` copies the nearest surviving stage's blocks, the
  embedding/head stay random (checkfree edge setback); `random` random init (`random` setback).
  Interior s with a lost neighbour: `random` under `edge_fallback = "random"`, otherwise a copy of
  the nearest surviving stage (checkfree edge setback). Edge checkpoints cover only the two edge
  stages, so an interior stage never loads one.
- `checkfree_plus` (S >= 4): interior as `checkfree`; stage 0 (S-1) copies its swap partner 1 (S-2)
  and restores the embedding (head) from the replica the partner holds (checkfree_plus edge
  setback); the partner lost too means the replica is gone: random init (`random` setback). Interior
  with a lost neighbour: copy the nearest surviving stage (checkfree_plus edge setback).
- `copy`: copy the nearest surviving stage (copy setback at the stage's own position).
- `uniform`: interior with both neighbours surviving: 0.5/0.5 average (interior setback);
  otherwise copy the nearest surviving stage (uniform edge setback).
- `random`: random init (random setback at the stage's own position).

When every stage is lost together and each starts from random init (one stage; or all of them at
once with no checkpoint to reload), no trained weight is left anywhere: the model is back at its
initialisation and training restarts from iteration 0 (`leaves_no_trained_weights`). A setback of
so many iterations per stage would understate it without bound.

Under `checkfree` with `edge_stages_reliable`, stages 0 and S-1 never fail (`reliable_stages`):
both wings record their failures as ignored and leave their state alone, and `plan_rebuild` plans
only the other lost stages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .stage_positions import StagePosition, stage_position

Weighting = Literal["gradient", "uniform", "copy", "none"]
BlocksFrom = Literal["sources", "random_init", "edge_checkpoint"]
EdgePartFrom = Literal["not_held", "random_init", "replica", "edge_checkpoint"]


@dataclass(frozen=True, kw_only=True)
class RebuildPlan:
    """What one lost stage starts from; the same on every rank and in the simulator."""

    stage: int
    sources: tuple[int, ...]
    """Surviving stages whose transformer blocks are combined into this stage's (empty: none)."""
    weighting: Weighting
    """`gradient` (ω from each source's last gradient norm), `uniform`, `copy` (one source), `none`."""
    blocks_from: BlocksFrom
    """`sources` (combined as `weighting` says), `random_init`, or this stage's `edge_checkpoint`."""
    edge_part: EdgePartFrom
    """The embedding (stage 0) or final norm + lm_head (stage S-1): `not_held` by interior stages,
    `random_init`, the CheckFree+ `replica` held by `sources[0]`, or the `edge_checkpoint`."""
    handled_as: str
    """Label of the failure in run outputs, e.g. `rebuild_interior`, `edge_checkpoint_restore`."""
    setback_method: str | None
    """Whose setback table the simulator charges (`random` for a random fallback); None when the
    cost is a stale reload rather than a convergence setback."""
    setback_position: StagePosition
    """Row of that table: `interior` for a two-sided average, `edge` for copies and edge fallbacks."""

    @property
    def fresh_optimizer(self) -> bool:
        """True when the stage restarts its optimizer (at the method's `lr_scale`); a reloaded
        checkpoint brings its own optimizer state."""
        return self.blocks_from != "edge_checkpoint"

    @property
    def description(self) -> str:
        """Short label of the blocks' origin, e.g. `weighted_average(1,3)`, `copy(0)`, `random`."""
        if self.blocks_from == "edge_checkpoint":
            return "edge_checkpoint"
        if not self.sources:
            return "random"
        names = {"gradient": "weighted_average", "uniform": "uniform_average", "copy": "copy"}
        return f"{names[self.weighting]}({','.join(map(str, self.sources))})"


# ---------------------------------------------------------------- method traits read by both wings
def reliable_stages(method_config: Any, num_stages: int) -> frozenset[int]:
    """Stages whose failures the method ignores (CheckFree's `edge_stages_reliable`: 0 and S-1)."""
    if getattr(method_config, "edge_stages_reliable", False):
        return frozenset({0, num_stages - 1})
    return frozenset()


def uses_edge_checkpoints(method_config: Any) -> bool:
    """True when the edge stages write periodic checkpoints (CheckFree, `edge_fallback = "checkpoint"`,
    edges not declared reliable: a save that is never read would only cost time)."""
    return getattr(method_config, "edge_fallback", None) == "checkpoint" and not getattr(
        method_config, "edge_stages_reliable", False
    )


def edge_checkpoint_stages(method_config: Any, num_stages: int) -> tuple[int, ...]:
    """The stages that save edge checkpoints: (0, S-1), or () when the method writes none."""
    if not uses_edge_checkpoints(method_config):
        return ()
    return tuple(sorted({0, num_stages - 1}))


# ---------------------------------------------------------------- the rule
def nearest_surviving_stage(stage: int, lost: frozenset[int], num_stages: int) -> int | None:
    """s-1, s+1, s-2, s+2, ...: the first stage that exists and is not lost; None if every stage is."""
    for distance in range(1, num_stages):
        for candidate in (stage - distance, stage + distance):
            if 0 <= candidate < num_stages and candidate not in lost:
                return candidate
    return None


def plan_rebuild(method_config: Any, lost_stages: Iterable[int], num_stages: int) -> dict[int, RebuildPlan]:
    """Per lost stage (reliable stages left out), what it starts from; see the module docstring."""
    name = method_config.name
    # Each rebuild method's config names its own rule (`plan_stage`, calibration/methods.py), so a
    # new rebuild method brings its rule with it.
    planner = getattr(method_config, "plan_stage", None)
    if planner is None:
        raise ValueError(f"method {name!r} does not rebuild stages: its config has no plan_stage")
    minimum_stages = getattr(method_config, "minimum_stages", 1)
    if num_stages < minimum_stages:
        raise ValueError(f"{name} needs at least {minimum_stages} stages, got {num_stages}")
    lost = frozenset(lost_stages)
    outside = sorted(stage for stage in lost if not 0 <= stage < num_stages)
    if outside:
        raise ValueError(f"lost stages {outside} are outside 0..{num_stages - 1}")
    lost -= reliable_stages(method_config, num_stages)
    return {stage: planner(stage, lost, num_stages) for stage in sorted(lost)}


def leaves_no_trained_weights(plans: Mapping[int, RebuildPlan], num_stages: int) -> bool:
    """True when the plans rebuild every stage of the pipeline from random init: nothing trained
    survives, so training starts again from iteration 0."""
    return len(plans) == num_stages and all(plan.blocks_from == "random_init" for plan in plans.values())


def _is_edge(stage: int, num_stages: int) -> bool:
    return stage in (0, num_stages - 1)


def _edge_part(stage: int, num_stages: int, source: EdgePartFrom = "random_init") -> EdgePartFrom:
    return source if _is_edge(stage, num_stages) else "not_held"


def _random(stage: int, num_stages: int) -> RebuildPlan:
    return RebuildPlan(
        stage=stage,
        sources=(),
        weighting="none",
        blocks_from="random_init",
        edge_part=_edge_part(stage, num_stages),
        handled_as="rebuild_random",
        setback_method="random",
        setback_position=stage_position(stage, num_stages),
    )


def _copy_nearest(
    stage: int, lost: frozenset[int], num_stages: int, *, setback_method: str, position: StagePosition, handled_as: str
) -> RebuildPlan:
    source = nearest_surviving_stage(stage, lost, num_stages)
    if source is None:
        return _random(stage, num_stages)
    return RebuildPlan(
        stage=stage,
        sources=(source,),
        weighting="copy",
        blocks_from="sources",
        edge_part=_edge_part(stage, num_stages),
        handled_as=handled_as,
        setback_method=setback_method,
        setback_position=position,
    )


def _fallback_copy(method: str, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    """The copy a two-sided method falls back to: edge setback of its own table."""
    handled_as = "rebuild_edge_copy" if _is_edge(stage, num_stages) else "rebuild_adjacent_copy"
    return _copy_nearest(stage, lost, num_stages, setback_method=method, position="edge", handled_as=handled_as)


def _average(method: str, stage: int, weighting: Weighting) -> RebuildPlan:
    return RebuildPlan(
        stage=stage,
        sources=(stage - 1, stage + 1),
        weighting=weighting,
        blocks_from="sources",
        edge_part="not_held",
        handled_as="rebuild_interior",
        setback_method=method,
        setback_position="interior",
    )


def _both_neighbours_survive(stage: int, lost: frozenset[int], num_stages: int) -> bool:
    return 0 < stage < num_stages - 1 and stage - 1 not in lost and stage + 1 not in lost


def checkfree_stage_plan(config: Any, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    if _both_neighbours_survive(stage, lost, num_stages):
        return _average("checkfree", stage, "gradient")
    if config.edge_fallback == "random":
        return _random(stage, num_stages)
    if config.edge_fallback == "checkpoint" and _is_edge(stage, num_stages):
        return RebuildPlan(
            stage=stage,
            sources=(),
            weighting="none",
            blocks_from="edge_checkpoint",
            edge_part="edge_checkpoint",
            handled_as="edge_checkpoint_restore",
            setback_method=None,
            setback_position="edge",
        )
    return _fallback_copy("checkfree", stage, lost, num_stages)


def checkfree_plus_stage_plan(config: Any, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    if _both_neighbours_survive(stage, lost, num_stages):
        return _average("checkfree_plus", stage, "gradient")
    if not _is_edge(stage, num_stages):
        return _fallback_copy("checkfree_plus", stage, lost, num_stages)
    partner = 1 if stage == 0 else num_stages - 2
    if partner in lost:
        return _random(stage, num_stages)  # the replica lived on the partner
    return RebuildPlan(
        stage=stage,
        sources=(partner,),
        weighting="copy",
        blocks_from="sources",
        edge_part="replica",
        handled_as="rebuild_edge_swap",
        setback_method="checkfree_plus",
        setback_position="edge",
    )


def copy_stage_plan(config: Any, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    position = stage_position(stage, num_stages)
    return _copy_nearest(stage, lost, num_stages, setback_method="copy", position=position, handled_as="rebuild_copy")


def uniform_stage_plan(config: Any, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    if _both_neighbours_survive(stage, lost, num_stages):
        return _average("uniform", stage, "uniform")
    return _fallback_copy("uniform", stage, lost, num_stages)


def random_stage_plan(config: Any, stage: int, lost: frozenset[int], num_stages: int) -> RebuildPlan:
    return _random(stage, num_stages)

