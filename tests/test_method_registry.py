"""The three method registries (contract, simulator, real runs) agree, and a new method needs no edit
to any module: a toy method defined only here validates in a Scenario and runs in the simulator."""

from __future__ import annotations

import json
from typing import ClassVar, Literal

import pytest
from churnsim.calibration.base import validate_model
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import FailureEvent
from churnsim.calibration.methods import (
    METHOD_CONFIGS,
    METHOD_NAMES,
    MethodConfigBase,
    method_from_name,
    register_method_config,
)
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import Scenario
from churnsim.real.methods import (
    METHODS,
    RecoveryMethod,
    RecoveryOutcome,
    build_method,
    register_method,
)
from churnsim.sim.model.methods import POLICIES, RecoveryPolicy, register_policy
from churnsim.sim.model.run import simulate_run
from pydantic import Field

TOY = "toy_restart"


class ToyRestartConfig(MethodConfigBase):
    """Toy: a failure sends the whole pipeline back to its initial weights (progress 0)."""

    name: Literal["toy_restart"] = "toy_restart"
    restart_penalty_s: float = Field(0.0, ge=0)
    """Extra downtime of a restart."""

    family = "checkpoint"  # the seeded initialisation is its only checkpoint
    label = "restart from scratch (toy)"
    on_stage_loss = "Every stage goes back to its initial weights."


class ToyRestartPolicy(RecoveryPolicy):
    name = TOY

    def on_failures(self, run, failures):
        for event in failures:
            run.record_failure(event, "restart_from_scratch")
        yield from run.wait_for_replacements({event.stage for event in failures})
        yield from run.wait(self.scenario.recovery.restart_s + self.config.restart_penalty_s, "recovery_downtime_s", "restart")
        run.rollback_to(0.0)


class ToyRestartMethod(RecoveryMethod):
    name: ClassVar[str] = TOY

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        return RecoveryOutcome(failed_stages=failed_stages, resume_iteration=0, rebuilt_from={stage: "initial weights" for stage in failed_stages})


@pytest.fixture
def toy_restart():
    register_method_config(ToyRestartConfig)
    register_policy(ToyRestartPolicy)
    register_method(ToyRestartMethod)
    try:
        yield
    finally:
        for registry in (POLICIES, METHODS, METHOD_CONFIGS):
            registry.pop(TOY, None)


def _registries() -> tuple[set[str], ...]:
    return set(METHOD_CONFIGS), set(METHOD_NAMES), set(POLICIES), set(METHODS)


def test_contract_simulator_and_real_registries_name_the_same_methods():
    contract, names, sim, real = _registries()
    assert contract == names == sim == real
    assert all(POLICIES[name].name == name and METHODS[name].name == name for name in METHOD_NAMES)
    assert list(METHOD_NAMES)[:2] == ["none", "checkpoint"]  # registration order is the display order


def test_a_wing_cannot_register_a_method_the_contract_does_not_know():
    with pytest.raises(ValueError, match="register_method_config"):
        register_policy(ToyRestartPolicy)
    with pytest.raises(ValueError, match="register_method_config"):
        register_method(ToyRestartMethod)
    assert TOY not in POLICIES and TOY not in METHODS


def _cpu_tiny_with(methods: list[dict]) -> dict:
    data = json.loads(preset("cpu-tiny").model_dump_json())
    data["methods"] = methods
    return data


def test_a_toy_method_registered_only_in_this_test_validates_and_runs_in_the_simulator(toy_restart):
    assert _registries()[0] == _registries()[2] == _registries()[3] and TOY in METHOD_NAMES
    scenario = validate_model(Scenario, _cpu_tiny_with([{"name": TOY, "restart_penalty_s": 5.0}]), "scenario.json")
    toy = scenario.methods[0]
    assert isinstance(toy, ToyRestartConfig) and toy.restart_penalty_s == 5.0
    assert method_from_name(TOY, restart_penalty_s=5.0) == toy
    # JSON round trip keeps every field of the registered class.
    assert validate_model(Scenario, json.loads(scenario.model_dump_json()), "again.json") == scenario

    clean = simulate_run(scenario, toy, ())
    failure_s = 0.5 * clean.wall_clock_s
    failed = simulate_run(scenario, toy, (FailureEvent(time_s=failure_s, stage=2, kind="failure"),))
    assert [f.handled_as for f in failed.failures] == ["restart_from_scratch"]
    assert clean.reached_target and failed.reached_target
    # Everything before the failure is lost, then join delay, restart and the toy's penalty.
    downtime_s = scenario.recovery.join_delay_s + scenario.recovery.restart_s + 5.0
    assert failed.wall_clock_s == pytest.approx(failure_s + downtime_s + clean.wall_clock_s, rel=1e-9)

    # The real-run registry builds it too (running it needs processes; the wings' own tests do that).
    method = build_method(toy, context=None)
    assert isinstance(method, ToyRestartMethod) and method.destroys_state_on_failure


def test_the_toy_method_is_gone_after_its_test():
    assert TOY not in METHOD_NAMES and TOY not in POLICIES and TOY not in METHODS


def test_an_unknown_method_name_is_one_line_naming_the_field_and_the_known_names():
    with pytest.raises(InputError) as error:
        validate_model(Scenario, _cpu_tiny_with([{"name": TOY}]), "scenario.json")
    message = str(error.value)
    assert "\n" not in message and "field 'methods.0'" in message and "'toy_restart'" in message
    assert "'checkpoint'" in message and "use one of the allowed values" in message
