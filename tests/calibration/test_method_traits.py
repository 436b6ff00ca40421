"""Each method's rule book: the traits its config class carries, and the validation path that looks
a method up by name in the open registry."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from churnsim.calibration.base import validate_model
from churnsim.calibration.convergence import default_setbacks
from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import (
    METHOD_CONFIGS,
    METHOD_NAMES,
    MethodConfigBase,
    method_from_name,
    method_names_where,
    method_traits,
    reference_method,
    speedup_baselines,
)
from churnsim.calibration.pipeline_schedule import MINIMUM_STAGES_FOR_SWAP
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.tables import SUMMARY_COLUMNS, speedup_columns

FAMILIES = {"reference", "checkpoint", "redundant", "rebuild"}


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_has_a_complete_rule_book(name):
    traits = method_traits(name)
    assert traits.method_name() == name and method_from_name(name).name == name
    assert traits.family in FAMILIES and traits.label and traits.minimum_stages >= 1
    assert not (traits.headline and traits.ablation)
    assert traits.uses_setbacks == (traits.family == "rebuild") == (traits.default_setback_iterations is not None)
    assert all(isinstance(tier, str) for tier in method_from_name(name).tiers_used)


def test_the_traits_hold_what_the_name_tables_used_to():
    assert reference_method() == "none" and method_traits("none").ignores_failures
    assert method_names_where(headline=True) == ("checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus")
    assert method_names_where(ablation=True) == ("copy", "uniform", "random")
    assert method_names_where(uses_setbacks=True) == ("checkfree", "checkfree_plus", "copy", "uniform", "random")
    assert set(method_names_where(plain_iteration=False)) == {"async_checkpoint", "redundant", "checkfree_plus"}
    assert method_names_where(blocking_checkpoint=True) == ("checkpoint",)
    assert method_names_where(supports_rollback=True) == ("checkpoint", "async_checkpoint")
    assert speedup_baselines() == ("checkpoint", "redundant")
    assert method_traits("checkfree_plus").minimum_stages == MINIMUM_STAGES_FOR_SWAP
    intervals = {name: method_traits(name).checkpoint_interval_field for name in METHOD_NAMES}
    assert intervals["checkpoint"] == intervals["async_checkpoint"] == "interval_iterations"
    assert intervals["redundant"] == "fallback_interval_iterations"


def test_default_setbacks_come_from_the_traits():
    setbacks = default_setbacks()
    assert set(setbacks) == set(method_names_where(uses_setbacks=True))
    assert (setbacks["checkfree"].interior.mean_iterations, setbacks["checkfree"].edge.mean_iterations) == (2.0, 6.0)
    assert setbacks["random"].interior.mean_iterations > setbacks["copy"].interior.mean_iterations


def test_storage_tiers_used_come_from_the_tier_fields():
    assert method_from_name("checkpoint", tier="local_disk").tiers_used == ("local_disk",)
    assert method_from_name("async_checkpoint").tiers_used == ("local_disk", "remote")
    assert method_from_name("redundant", fallback_tier="remote").tiers_used == ("remote",)
    assert method_from_name("none").tiers_used == ()


def test_summary_columns_hold_a_speedup_triple_per_baseline():
    for baseline in speedup_baselines():
        assert set(speedup_columns(baseline)) <= set(SUMMARY_COLUMNS)


def test_trait_queries_reject_unknown_traits_and_methods():
    with pytest.raises(AttributeError, match="not a method trait"):
        method_names_where(colour="red")
    with pytest.raises(InputError, match="unknown method 'magic': use one of none, checkpoint"):
        method_traits("magic")


def _scenario_data(**changes) -> dict:
    data = json.loads(preset("checkfree-124m-geo-10pct").model_dump_json())
    data.update(changes)
    return data


def test_a_method_below_its_minimum_stages_is_rejected_naming_method_and_fix():
    data = _scenario_data(methods=[{"name": "checkfree_plus"}])
    data["model"]["num_layers"] = 3
    data["pipeline"]["num_stages"] = 3
    with pytest.raises(InputError, match=r"method 'checkfree_plus' needs at least 4 pipeline stages, got 3; add stages"):
        validate_model(Scenario, data, "scenario.json")


def test_a_method_field_error_keeps_its_path_and_fix():
    data = _scenario_data(methods=[{"name": "none"}, {"name": "checkpoint", "interval_iterations": 0}])
    with pytest.raises(InputError, match=r"field 'methods\.1\.interval_iterations' = 0: .*use a larger value"):
        validate_model(Scenario, data, "scenario.json")


def test_an_unknown_method_key_is_an_error():
    data = _scenario_data(methods=[{"name": "checkpoint", "interval_iteration": 5}])
    with pytest.raises(InputError, match=r"field 'methods\.0\.interval_iteration'.*remove it or check its spelling"):
        validate_model(Scenario, data, "scenario.json")


def test_a_method_without_a_name_is_an_error_naming_the_tag():
    with pytest.raises(InputError, match=r"field 'methods\.0': Unable to extract tag using discriminator 'name'"):
        validate_model(Scenario, _scenario_data(methods=[{"interval_iterations": 5}]), "scenario.json")


def test_scenario_json_keeps_every_field_of_each_method():
    scenario = preset("checkfree-124m-geo-10pct")
    dumped = json.loads(scenario.model_dump_json())
    checkpoint = next(method for method in dumped["methods"] if method["name"] == "checkpoint")
    assert {"interval_iterations", "tier", "rollback"} <= set(checkpoint)
    assert Scenario.model_validate(dumped) == scenario


def test_an_incomplete_rule_book_is_a_programming_error():
    with pytest.raises(TypeError, match="supports_rollback"):

        class _Broken(MethodConfigBase):
            name: Literal["broken"] = "broken"
            rollback: Literal["all", "stage"] = "all"
            family = "checkpoint"
            label = "broken"
            on_stage_loss = "Every stage goes back to its initial weights."

    assert "broken" not in METHOD_CONFIGS


def test_methods_that_fit_a_setting_s_pipeline_leave_out_only_those_it_cannot_take():
    from churnsim.calibration.scenario_overrides import methods_that_fit

    scenario = preset("checkfree-124m-geo-10pct")  # 12 layers in 4 stages, every method
    every = [method.name for method in scenario.methods]
    assert methods_that_fit(scenario, {"pipeline.num_stages": 3}) == tuple(name for name in every if name != "checkfree_plus")
    unequal = methods_that_fit(scenario, {"pipeline.layers_per_stage": [2, 4, 4, 2]})
    assert unequal and not {"checkfree", "checkfree_plus", "copy", "uniform", "random"} & set(unequal)
    assert methods_that_fit(scenario, {"pipeline.num_stages": 6}) == ()  # every method fits: nothing to narrow
    assert methods_that_fit(scenario, {"recovery.restart_s": 1.0}) == ()  # not the pipeline
    assert methods_that_fit(scenario, {"pipeline.num_stages": -1}) == ()  # invalid: the scenario's validation says why
