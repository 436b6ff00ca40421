"""Where a stage sits in the pipeline: an edge stage (the first, which holds the embedding, or the
last, which holds the head) or an interior one. Setbacks (`convergence.py`) and rebuild plans
(`rebuild_plan.py`) are both told apart by it, so it lives below both."""

from typing import Literal

StagePosition = Literal["interior", "edge"]


def stage_position(stage: int, num_stages: int) -> StagePosition:
    return "edge" if stage in (0, num_stages - 1) else "interior"
