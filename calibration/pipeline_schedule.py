"""Where each microbatch goes and in which order each stage works: one meaning for sim/ and real/.

A microbatch's *route* is the ordered list of hops its forward pass makes; the backward pass walks
the same hops in reverse. A hop names the stage that does the work and which parts of that stage's
model it runs: the embedding (first stage only), its transformer blocks, and the head (final norm,
lm_head and loss; last stage only).

CheckFree+ ("All is Not Lost", Blagoev et al. 2025, arXiv 2506.15461) sends odd microbatches
through the first two and the last two stages in swapped order, so that stage 1 learns to act as a
first stage and stage S-2 as a last stage. The indices are derived from S, unlike the reference
code which hard-codes them for six stages. Where the embedding and the head run is the
`embedding_placement` (a scenario's `pipeline.embedding_placement`):

- `edge_stages` (default): they stay on their owners (stage 0 and stage S-1); an odd microbatch
  therefore makes two extra hops (stage 0 embeds and hands over to stage 1; stage S-2 hands back to
  stage S-1 for the head).
- `separate_node`: they run on a node of their own, named by the stage index S (`EMBEDDING_NODE`
  is S; "node S" in the network), as the CheckFree authors' emulator does with its stage 0
  (reference/checkfree.md §2, §3.3: "S0.embed → S2 → S1 → S3 … → S_S → S_{S−1} → S0.forward_end").
  Every microbatch goes node S → the block stages → node S, in order or swapped, with the same
  number of hops: the swap adds none.

The per-stage operation order follows the stage's position in the in-order route (under
`separate_node` node S's embedding is position 0, stage s is position s + 1, node S's head is
position S + 1; node S is scheduled as two parts, `part="embedding"` and `part="head"`):
GPipe runs all forwards then all backwards; 1F1B runs min(P - p - 1, M) warm-up forwards (P
positions), then alternates one forward and one backward, then drains the remaining backwards
(Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters", arXiv 2104.04473).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import InputError

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
MINIMUM_STAGES_FOR_SWAP = 4
EMBEDDING_PLACEMENTS: tuple[str, ...] = ("edge_stages", "separate_node")
EMBEDDING_NODE_PARTS: tuple[str, ...] = ("embedding", "head")


@dataclass(frozen=True, kw_only=True)
class Hop:
    """One stop of a microbatch's forward pass."""

    stage: int
    runs_embedding: bool = False
    runs_blocks: bool = True
    runs_head: bool = False


@dataclass(frozen=True, kw_only=True)
class StageOperation:
    """One unit of work a stage performs: the forward or backward pass of a microbatch's hop."""

    direction: Literal["forward", "backward"]
    microbatch: int
    hop_index: int  # index into microbatch_route(...) of this microbatch


def swapped_block_order(num_stages: int) -> tuple[int, ...]:
    """Order in which odd microbatches visit the stages' transformer blocks under CheckFree+."""
    if num_stages < MINIMUM_STAGES_FOR_SWAP:
        raise InputError(
            f"checkfree_plus needs num_stages >= {MINIMUM_STAGES_FOR_SWAP}, got {num_stages}: "
            "use more stages or the checkfree method"
        )
    order = list(range(num_stages))
    order[0], order[1] = order[1], order[0]
    order[-1], order[-2] = order[-2], order[-1]
    return tuple(order)


def _check_placement(embedding_placement: str) -> bool:
    """True for the separate (de)embedding node."""
    if embedding_placement not in EMBEDDING_PLACEMENTS:
        raise InputError(f"embedding_placement {embedding_placement!r} is unknown: use one of {', '.join(EMBEDDING_PLACEMENTS)}")
    return embedding_placement == "separate_node"


def microbatch_route(
    num_stages: int, microbatch: int, *, swap_odd_microbatches: bool, embedding_placement: str = "edge_stages"
) -> tuple[Hop, ...]:
    """The forward hops of one microbatch; backward runs them in reverse.

    Under `embedding_placement="separate_node"` the first hop (embedding) and the last (head) run
    on the (de)embedding node, named by the stage index `num_stages`; every other hop runs blocks."""
    if num_stages < 1:
        raise InputError(f"num_stages must be >= 1, got {num_stages}")
    if _check_placement(embedding_placement):
        swapped = swap_odd_microbatches and microbatch % 2 == 1
        order = swapped_block_order(num_stages) if swapped else tuple(range(num_stages))
        return (
            Hop(stage=num_stages, runs_embedding=True, runs_blocks=False),
            *(Hop(stage=stage) for stage in order),
            Hop(stage=num_stages, runs_blocks=False, runs_head=True),
        )
    last = num_stages - 1
    if not (swap_odd_microbatches and microbatch % 2 == 1):
        return tuple(
            Hop(stage=stage, runs_embedding=stage == 0, runs_blocks=True, runs_head=stage == last)
            for stage in range(num_stages)
        )
    order = swapped_block_order(num_stages)
    hops = [Hop(stage=0, runs_embedding=True, runs_blocks=False)]
    hops.extend(Hop(stage=stage) for stage in order)
    hops.append(Hop(stage=last, runs_blocks=False, runs_head=True))
    return tuple(hops)


def stage_operation_order(
    schedule: str,
    *,
    num_stages: int,
    num_microbatches: int,
    stage: int,
    swap_odd_microbatches: bool = False,
    embedding_placement: str = "edge_stages",
    part: str | None = None,
) -> tuple[StageOperation, ...]:
    """Every operation stage `stage` performs in one iteration, in the order it performs them.

    Under `embedding_placement="separate_node"`, `stage=num_stages` is the (de)embedding node and
    `part` ("embedding" or "head") picks which of its two hops the order is for."""
    if schedule not in SCHEDULES:
        raise InputError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise InputError(f"num_microbatches must be >= 1, got {num_microbatches}")
    separate = _check_placement(embedding_placement)
    if separate and stage == num_stages:
        if part not in EMBEDDING_NODE_PARTS:
            raise InputError(f"part {part!r}: the (de)embedding node's order is for one of its parts, {' or '.join(EMBEDDING_NODE_PARTS)}")
    elif not 0 <= stage < num_stages:
        raise InputError(f"stage {stage} is outside 0..{num_stages - (0 if separate else 1)}")
    elif part is not None:
        raise InputError(f"part {part!r} is only for the (de)embedding node (stage {num_stages} under embedding_placement 'separate_node')")
    if schedule == "gpipe":
        passes = [("forward", m) for m in range(num_microbatches)]
        passes += [("backward", m) for m in range(num_microbatches)]
    else:
        # Under swapped routes stage 1 computes odd microbatches before stage 0 does, so it needs
        # stage 0's warm-up depth; with one forward fewer, 1F1B deadlocks for odd S when M > S.
        block_stage = 0 if (swap_odd_microbatches and stage == 1) else stage
        if separate:
            # Likewise, with the head on its own node, stage S-2 computes odd microbatches after
            # stage S-1 (and hands them to the head): it gets stage S-1's warm-up depth.
            if swap_odd_microbatches and stage == num_stages - 2 and num_stages >= MINIMUM_STAGES_FOR_SWAP:
                block_stage = num_stages - 1
            num_positions = num_stages + 2
            position = {"embedding": 0, "head": num_stages + 1}[part] if stage == num_stages else block_stage + 1
        else:
            num_positions, position = num_stages, block_stage
        num_warmup = min(num_positions - position - 1, num_microbatches)
        passes = [("forward", m) for m in range(num_warmup)]
        next_backward = 0
        for m in range(num_warmup, num_microbatches):
            passes.append(("forward", m))
            passes.append(("backward", next_backward))
            next_backward += 1
        passes += [("backward", m) for m in range(next_backward, num_microbatches)]
    operations: list[StageOperation] = []
    for direction, microbatch in passes:
        route = microbatch_route(
            num_stages, microbatch, swap_odd_microbatches=swap_odd_microbatches, embedding_placement=embedding_placement
        )
        hop_indices = [
            index
            for index, hop in enumerate(route)
            if hop.stage == stage and (part is None or (hop.runs_embedding if part == "embedding" else hop.runs_head))
        ]
        if direction == "backward":
            hop_indices.reverse()
        operations.extend(
            StageOperation(direction=direction, microbatch=microbatch, hop_index=index)  # type: ignore[arg-type]
            for index in hop_indices
        )
    return tuple(operations)
