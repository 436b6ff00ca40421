"""Where each microbatch goes and in which order each stage works: one meaning for sim/ and real/.

A microbatch's *route* is the ordered list of hops its forward pass makes; the backward pass walks
the same hops in reverse. A hop names the stage that does the work and which parts of that stage's
model it runs: the embedding (first stage only), its transformer blocks, and the head (final norm,
lm_head and loss; last stage only).

CheckFree+ ("All is Not Lost", Blagoev et al. 2025, arXiv 2506.15461) sends odd microbatches
through the first two and the last two stages in swapped order, so that stage 1 learns to act as a
first stage and stage S-2 as a last stage. The embedding and the head stay on their owners (stage 0
and stage S-1); an odd microbatch therefore makes two extra hops (stage 0 embeds and hands over to
stage 1; stage S-2 hands back to stage S-1 for the head). The indices are derived from S, unlike the
reference code which hard-codes them for six stages.

The per-stage operation order follows the stage's position in the in-order route:
GPipe runs all forwards then all backwards; 1F1B runs min(S - p - 1, M) warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", arXiv 2104.04473).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import InputError

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
MINIMUM_STAGES_FOR_SWAP = 4


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


def microbatch_route(num_stages: int, microbatch: int, *, swap_odd_microbatches: bool) -> tuple[Hop, ...]:
    """The forward hops of one microbatch; backward runs them in reverse."""
    if num_stages < 1:
        raise InputError(f"num_stages must be >= 1, got {num_stages}")
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
) -> tuple[StageOperation, ...]:
    """Every operation stage `stage` performs in one iteration, in the order it performs them."""
    if schedule not in SCHEDULES:
        raise InputError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise InputError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if not 0 <= stage < num_stages:
        raise InputError(f"stage {stage} is outside 0..{num_stages - 1}")
    if schedule == "gpipe":
        passes = [("forward", m) for m in range(num_microbatches)]
        passes += [("backward", m) for m in range(num_microbatches)]
    else:
        # Under swapped routes stage 1 computes odd microbatches before stage 0 does, so it needs
        # stage 0's warm-up depth; with one forward fewer, 1F1B deadlocks for odd S when M > S.
        position = 0 if (swap_odd_microbatches and stage == 1) else stage
        num_warmup = min(num_stages - position - 1, num_microbatches)
        passes = [("forward", m) for m in range(num_warmup)]
        next_backward = 0
        for m in range(num_warmup, num_microbatches):
            passes.append(("forward", m))
            passes.append(("backward", next_backward))
            next_backward += 1
        passes += [("backward", m) for m in range(next_backward, num_microbatches)]
    operations: list[StageOperation] = []
    for direction, microbatch in passes:
        route = microbatch_route(num_stages, microbatch, swap_odd_microbatches=swap_odd_microbatches)
        hop_indices = [index for index, hop in enumerate(route) if hop.stage == stage]
        if direction == "backward":
            hop_indices.reverse()
        operations.extend(
            StageOperation(direction=direction, microbatch=microbatch, hop_index=index)  # type: ignore[arg-type]
            for index in hop_indices
        )
    return tuple(operations)
