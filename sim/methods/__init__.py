"""The simulator's recovery policies, one class per method name of `calibration.methods.METHOD_NAMES`."""

from __future__ import annotations

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from .async_checkpoint import AsyncCheckpointPolicy
from .base import RecoveryPolicy
from .checkpointing import CheckpointPolicy
from .none import NonePolicy
from .rebuild import CheckFreePlusPolicy, CheckFreePolicy, CopyPolicy, RandomPolicy, UniformPolicy
from .redundant import RedundantPolicy

POLICIES: dict[str, type[RecoveryPolicy]] = {
    policy.name: policy
    for policy in (
        NonePolicy,
        CheckpointPolicy,
        AsyncCheckpointPolicy,
        RedundantPolicy,
        CheckFreePolicy,
        CheckFreePlusPolicy,
        CopyPolicy,
        UniformPolicy,
        RandomPolicy,
    )
}


def build_policy(method_config: MethodConfig, scenario: Scenario) -> RecoveryPolicy:
    """The policy object for one method config on one scenario."""
    try:
        policy_type = POLICIES[method_config.name]
    except KeyError:
        raise InputError(f"method {method_config.name!r} has no simulator policy; use one of {', '.join(POLICIES)}") from None
    return policy_type(method_config, scenario)


__all__ = ["POLICIES", "RecoveryPolicy", "build_policy"]
