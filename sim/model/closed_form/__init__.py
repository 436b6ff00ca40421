"""The closed-form run engine and the closed-form twins of the built-in recovery policies.

`simulate_run` (sim/model/run.py) uses this engine unless asked for the event model
(`reference_events=True`); see `engine.py` for what is computed in closed form and how it stays
equal to the event model. A policy class without a registered twin (one a user adds with
`register_policy`) runs in the event model; `register_twin` adds one.

A regular install runs this package compiled by mypyc (setup.py), an editable one runs its source;
both give the same results. `COMPILED` says which one this process runs.
"""

from __future__ import annotations

from churnsim.calibration.scenario import Scenario

from ..methods.async_checkpoint import AsyncCheckpointPolicy
from ..methods.base import RecoveryPolicy
from ..methods.checkpointing import CheckpointPolicy
from ..methods.none import NonePolicy
from ..methods.rebuild import CheckFreePlusPolicy, CheckFreePolicy, CopyPolicy, RandomPolicy, UniformPolicy
from ..methods.redundant import RedundantPolicy
from .async_checkpoint import AsyncCheckpointTwin
from .checkpointing import CheckpointTwin
from . import engine
from .engine import ClosedFormPolicy, ClosedFormRun
from .interrupts import Interrupted, NeedsEventModel
from .rebuild import CheckFreePlusTwin, RebuildTwin
from .redundant import RedundantTwin

COMPILED = not engine.__file__.endswith(".py")
"""Whether the engine runs as mypyc's extension modules (a regular install) or from its source."""

TWINS: dict[type[RecoveryPolicy], type[ClosedFormPolicy]] = {}


def register_twin(policy_class: type[RecoveryPolicy], twin_class: type[ClosedFormPolicy]) -> None:
    """Run `policy_class` (exactly that class, not its subclasses) in closed form with `twin_class`."""
    TWINS[policy_class] = twin_class


def twin_for(policy: RecoveryPolicy, scenario: Scenario) -> ClosedFormPolicy | None:
    twin_class = TWINS.get(type(policy))
    return None if twin_class is None else twin_class(policy, scenario)


class _NoneTwin(ClosedFormPolicy):
    """`none`: failures never reach the policy (the run books them as ignored)."""

    def on_failures(self, run: ClosedFormRun, failures) -> None:
        for event in failures:
            run.record_failure(event, "ignored")


for _policy_class, _twin_class in (
    (NonePolicy, _NoneTwin),
    (CheckpointPolicy, CheckpointTwin),
    (AsyncCheckpointPolicy, AsyncCheckpointTwin),
    (RedundantPolicy, RedundantTwin),
    (CheckFreePolicy, RebuildTwin),
    (CheckFreePlusPolicy, CheckFreePlusTwin),
    (CopyPolicy, RebuildTwin),
    (UniformPolicy, RebuildTwin),
    (RandomPolicy, RebuildTwin),
):
    register_twin(_policy_class, _twin_class)

__all__ = ["COMPILED", "ClosedFormPolicy", "ClosedFormRun", "Interrupted", "NeedsEventModel", "TWINS", "register_twin", "twin_for"]
