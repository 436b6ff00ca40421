"""The scenario fields for layouts and checkpoint costs: validation names the field, defaults keep today's behaviour."""

from __future__ import annotations

import json

import pytest

from churnsim.calibration.base import load_model, validate_model
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import PRESETS, datastates, preset
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.scenario_overrides import apply_settings


def _data(name: str = "spot-p3-trace") -> dict:
    return json.loads(preset(name).model_dump_json())


def _error(data: dict) -> str:
    with pytest.raises(InputError) as error:
        validate_model(Scenario, data, "scenario")
    message = str(error.value)
    assert "\n" not in message
    return message


def test_new_fields_default_to_todays_layout():
    pipeline = preset("checkfree-500m-geo-10pct").pipeline
    assert (pipeline.layers_per_stage, pipeline.embedding_placement, pipeline.checkpoint_sharding) == (None, "edge_stages", "whole_stage")
    assert all(tier.serialization_bytes_per_s is None for tier in preset("checkfree-500m-geo-10pct").storage)


@pytest.mark.parametrize(
    "layers, fragment",
    [
        ([12, 12, 12], "pipeline.layers_per_stage lists 3 stages but pipeline.num_stages is 12"),
        ([4] * 11 + [5], "pipeline.layers_per_stage [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5] adds up to 49 layers but model.num_layers is 48"),
        ([0] + [4] * 10 + [8], "pipeline.layers_per_stage.0"),
    ],
)
def test_layers_per_stage_errors_name_the_field(layers, fragment):
    data = _data()
    data["pipeline"]["layers_per_stage"] = layers
    assert fragment in _error(data)


def test_an_indivisible_layer_count_points_to_layers_per_stage():
    data = _data()
    data["model"]["num_layers"] = 50
    assert "give pipeline.layers_per_stage" in _error(data)


def test_rebuild_methods_refuse_unequal_stages_naming_the_field_and_the_method():
    data = _data()
    data["pipeline"]["layers_per_stage"] = [5] * 6 + [3] * 6
    message = _error(data)
    assert "pipeline.layers_per_stage" in message and "'checkfree'" in message and "equal stages" in message
    # Without neighbour-rebuilding methods an unequal split is fine.
    data["methods"] = [method for method in data["methods"] if method["name"] in ("none", "checkpoint", "async_checkpoint", "redundant")]
    scenario = validate_model(Scenario, data, "scenario")
    assert scenario.stage_layer_counts == (5,) * 6 + (3,) * 6
    with pytest.raises(ValueError, match="use stage_layers"):
        scenario.layers_per_stage


@pytest.mark.parametrize(
    "path, value, fragment",
    [
        (("pipeline", "embedding_placement"), "own_node", "pipeline.embedding_placement"),
        (("pipeline", "checkpoint_sharding"), "zero3", "pipeline.checkpoint_sharding"),
        (("storage", 0, "serialization_bytes_per_s"), 0, "storage.0.serialization_bytes_per_s"),
    ],
)
def test_bad_values_name_the_field(path, value, fragment):
    data = _data()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert fragment in _error(data)


def test_set_overrides_reach_the_new_fields():
    scenario = apply_settings(preset("spot-p3-trace"), {"pipeline.embedding_placement": "separate_node", "pipeline.checkpoint_sharding": "data_parallel"})
    assert scenario.pipeline.embedding_placement == "separate_node"
    with pytest.raises(InputError, match="pipeline.embedding_placement"):
        apply_settings(preset("spot-p3-trace"), {"pipeline.embedding_placement": "elsewhere"})


def test_a_scenario_file_with_the_new_fields_round_trips(tmp_path):
    scenario = datastates("30b", data_parallel_degree=4)
    path = tmp_path / "scenario.json"
    path.write_text(scenario.model_dump_json())
    assert load_model(Scenario, path) == scenario
    assert scenario.pipeline.layers_per_stage == (8, 8, 8, 8, 7, 7, 7, 7)


def test_real_runs_refuse_the_simulator_only_layouts_in_one_line():
    tiny = preset("cpu-tiny")
    tiny.check_real_run_layout()  # today's layout passes
    separate = apply_settings(tiny, {"pipeline.embedding_placement": "separate_node"})
    with pytest.raises(InputError, match=r"pipeline.embedding_placement = 'separate_node': real runs keep the embedding"):
        separate.check_real_run_layout()
    data = _data()
    data["methods"] = [method for method in data["methods"] if method["name"] in ("none", "checkpoint")]
    data["pipeline"]["layers_per_stage"] = [5] * 6 + [3] * 6
    unequal = validate_model(Scenario, data, "scenario")
    with pytest.raises(InputError, match="pipeline.layers_per_stage .*real runs split the layers equally"):
        unequal.check_real_run_layout()


def test_every_checkfree_preset_states_its_layout():
    for name in PRESETS:
        if name.startswith("checkfree-"):
            scenario = preset(name)
            emulator = "-embedding-node-" in name or name.startswith("checkfree-emulator-")
            expected = "separate_node" if emulator else "edge_stages"
            assert scenario.pipeline.embedding_placement == expected, name
            if expected == "separate_node":
                # The authors' emulator: the (de)embedding node in Australia, node S, the last site.
                assert scenario.network.sites[-1] == "Australia"
                assert len(scenario.network.sites) == scenario.pipeline.num_stages + 1
