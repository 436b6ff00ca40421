"""The simulator's recovery policies, one class per method name of `calibration.methods.METHOD_NAMES`.

The registry is open: `register_policy(cls)` adds a policy for a method already registered in the
contract (`calibration.methods.register_method_config`). `build_policy` is the only way the run
model gets a policy, so the simulator loop never branches on a method's name.
"""

from __future__ import annotations

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import METHOD_CONFIGS, MethodConfig
from churnsim.calibration.scenario import Scenario

from .async_checkpoint import AsyncCheckpointPolicy
from .base import RecoveryPolicy
from .checkpointing import CheckpointPolicy
from .none import NonePolicy
from .rebuild import CheckFreePlusPolicy, CheckFreePolicy, CopyPolicy, RandomPolicy, UniformPolicy
from .redundant import RedundantPolicy

POLICIES: dict[str, type[RecoveryPolicy]] = {}


def register_policy(policy_class: type[RecoveryPolicy]) -> type[RecoveryPolicy]:
    """Add `policy_class` under its `name`, which the contract must know (usable as a class decorator)."""
    if policy_class.name not in METHOD_CONFIGS:
        raise ValueError(
            f"policy name {policy_class.name!r} is not a registered method config; "
            "register its config first with calibration.methods.register_method_config"
        )
    POLICIES[policy_class.name] = policy_class
    return policy_class


for _policy_class in (
    NonePolicy,
    CheckpointPolicy,
    AsyncCheckpointPolicy,
    RedundantPolicy,
    CheckFreePolicy,
    CheckFreePlusPolicy,
    CopyPolicy,
    UniformPolicy,
    RandomPolicy,
):
    register_policy(_policy_class)


def build_policy(method_config: MethodConfig, scenario: Scenario) -> RecoveryPolicy:
    """The policy object for one method config on one scenario."""
    try:
        policy_type = POLICIES[method_config.name]
    except KeyError:
        raise InputError(f"method {method_config.name!r} has no simulator policy; use one of {', '.join(POLICIES)}") from None
    return policy_type(method_config, scenario)


__all__ = ["POLICIES", "RecoveryPolicy", "build_policy", "register_policy"]
