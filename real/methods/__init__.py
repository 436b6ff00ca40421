"""Registry of the real-run recovery methods, keyed by the names in calibration/methods.py.

The registry is open: `register_method(cls)` adds a class (a test double, a new method). `build_method` is the only way the trainer
gets a method, so the training loop never branches on a method's name.
"""

from __future__ import annotations

from typing import Any

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import METHOD_NAMES

from .base import MethodContext, RecoveryMethod, RecoveryOutcome, StageRuntime
from .checkpointing import AsyncCheckpointMethod, CheckpointMethod
from .rebuild import CheckFreeMethod, CheckFreePlusMethod, CopyMethod, RandomMethod, UniformMethod
from .none import NoneMethod
from .redundant import RedundantMethod

METHODS: dict[str, type[RecoveryMethod]] = {}


def register_method(method_class: type[RecoveryMethod]) -> type[RecoveryMethod]:
    """Add `method_class` under its `name` (usable as a class decorator)."""
    if method_class.name not in METHOD_NAMES:
        raise ValueError(
            f"method name {method_class.name!r} is not a registered method config; "
            "register its config first with calibration.methods.register_method_config"
        )
    METHODS[method_class.name] = method_class
    return method_class


for _method_class in (
    NoneMethod,
    CheckpointMethod,
    AsyncCheckpointMethod,
    RedundantMethod,
    CheckFreeMethod,
    CheckFreePlusMethod,
    CopyMethod,
    UniformMethod,
    RandomMethod,
):
    register_method(_method_class)


def build_method(config: Any, context: MethodContext) -> RecoveryMethod:
    """The method object for `config` (a calibration.methods model) on this rank."""
    method_class = METHODS.get(config.name)
    if method_class is None:
        raise InputError(
            f"method {config.name!r} is not available in real runs yet: use one of {', '.join(sorted(METHODS))}"
        )
    return method_class(config, context)


__all__ = [
    "METHODS",
    "MethodContext",
    "RecoveryMethod",
    "RecoveryOutcome",
    "StageRuntime",
    "build_method",
    "register_method",
]
