"""The recovery methods' names and parameters: one meaning for sim/ and real/ (DESIGN.md section 2).

Each method is a strict model with a `name` tag; `MethodConfig` is their discriminated union, so a
scenario file says `{"name": "checkpoint", "interval_iterations": 50}` and gets the rest from the
defaults below. sim/ and real/ each keep one policy class per name; a test checks that both
registries list exactly `METHOD_NAMES`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from .base import StrictModel, validate_model

GradientWeighting = Literal["squared_l2", "l2", "uniform"]


class NoneMethod(StrictModel):
    """Failures are ignored: the no-failure reference curve."""

    name: Literal["none"] = "none"


class CheckpointMethod(StrictModel):
    """Synchronous checkpointing: training blocks while every stage writes its state."""

    name: Literal["checkpoint"] = "checkpoint"
    interval_iterations: int = Field(50, ge=1)
    """Iterations between checkpoints (K)."""
    tier: str = "remote"
    """Name of the storage tier written to; must survive node loss to be useful."""
    rollback: Literal["all", "stage"] = "all"
    """`all`: every stage returns to the last complete checkpoint (the CheckFree paper's baseline);
    `stage`: only the failed stage loads its stale state."""


class AsyncCheckpointMethod(StrictModel):
    """Lazy asynchronous multi-level checkpointing (DataStates-LLM, HPDC'24)."""

    name: Literal["async_checkpoint"] = "async_checkpoint"
    interval_iterations: int = Field(10, ge=1)
    host_buffer_bytes: int | None = Field(None, gt=0)
    """Host buffer per stage; None means twice the stage's checkpoint size."""
    levels: tuple[str, ...] = ("local_disk", "remote")
    """Storage tiers the host buffer is flushed through, in order."""
    keep_per_level: int = Field(2, ge=1)
    rollback: Literal["all", "stage"] = "all"


class RedundantMethod(StrictModel):
    """Bamboo-style redundant computation: stage s holds and runs a replica of stage s+1."""

    name: Literal["redundant"] = "redundant"
    fallback_interval_iterations: int = Field(100, ge=1)
    """Checkpoint interval of the fallback used when two adjacent stages are lost together."""
    fallback_tier: str = "remote"


class _NeighbourRebuild(StrictModel):
    lr_scale: float = Field(1.1, gt=0)
    """Learning-rate multiplier of a rebuilt stage (the CheckFree paper: 1.1)."""


class CheckFreeMethod(_NeighbourRebuild):
    """CheckFree: rebuild a lost interior stage as a gradient-weighted average of its neighbours."""

    name: Literal["checkfree"] = "checkfree"
    weighting: GradientWeighting = "squared_l2"
    edge_fallback: Literal["copy", "random"] = "copy"
    """What the first/last stage, or a stage whose neighbour is also lost, starts from."""


class CheckFreePlusMethod(_NeighbourRebuild):
    """CheckFree+: out-of-order pipelining so that edge stages are rebuilt by copying their swap partner."""

    name: Literal["checkfree_plus"] = "checkfree_plus"
    weighting: GradientWeighting = "squared_l2"
    replica_refresh_iterations: int = Field(100, ge=1)
    """Iterations between refreshes of the (de)embedding replicas on the neighbouring stages."""


class CopyMethod(_NeighbourRebuild):
    """Ablation: copy the previous stage (the next one for stage 0)."""

    name: Literal["copy"] = "copy"


class UniformMethod(_NeighbourRebuild):
    """Ablation: 0.5/0.5 average of the two neighbours."""

    name: Literal["uniform"] = "uniform"


class RandomMethod(_NeighbourRebuild):
    """Ablation: a fresh random initialisation."""

    name: Literal["random"] = "random"


MethodConfig = Annotated[
    Union[
        NoneMethod,
        CheckpointMethod,
        AsyncCheckpointMethod,
        RedundantMethod,
        CheckFreeMethod,
        CheckFreePlusMethod,
        CopyMethod,
        UniformMethod,
        RandomMethod,
    ],
    Field(discriminator="name"),
]

METHOD_NAMES: tuple[str, ...] = (
    "none",
    "checkpoint",
    "async_checkpoint",
    "redundant",
    "checkfree",
    "checkfree_plus",
    "copy",
    "uniform",
    "random",
)

# Methods compared in the headline results (ablations are available but not swept by default).
HEADLINE_METHODS: tuple[str, ...] = ("checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus")


class _MethodHolder(StrictModel):
    method: MethodConfig


def method_from_name(name: str, **parameters: object) -> MethodConfig:
    """A method config with default parameters, e.g. `method_from_name("checkpoint", interval_iterations=20)`."""
    from .errors import InputError

    if name not in METHOD_NAMES:
        raise InputError(f"unknown method {name!r}: use one of {', '.join(METHOD_NAMES)}")
    return validate_model(_MethodHolder, {"method": {"name": name, **parameters}}, f"method {name}").method
