"""The file contract: every model round-trips, rejects unknown keys and names what is wrong."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from churnsim.calibration.base import load_model, save_model, validate_model
from churnsim.calibration.calibration_file import (
    Calibration,
    LinkProfile,
    MeasuredDuration,
    Provenance,
    StageTimings,
)
from churnsim.calibration.errors import InputError
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, read_failure_schedule
from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.calibration.presets import PRESETS, preset
from churnsim.calibration.run_record import (
    METRICS_COLUMNS,
    SPANS_COLUMNS,
    SPANS_CPU_COLUMNS,
    RunManifest,
    make_run_record,
    read_run_record,
    write_run_record,
)
from churnsim.calibration.scenario import Scenario


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json(name, tmp_path):
    scenario = preset(name)
    save_model(scenario, tmp_path / "scenario.json")
    assert load_model(Scenario, tmp_path / "scenario.json") == scenario


def test_unknown_scenario_key_is_an_error_naming_the_field(tmp_path):
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["pipeline"]["num_stagez"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InputError) as error:
        load_model(Scenario, tmp_path / "bad.json")
    message = str(error.value)
    assert "pipeline.num_stagez" in message and "remove it" in message and "\n" not in message


def test_invalid_value_names_field_value_and_fix():
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["pipeline"]["num_microbatches"] = 0
    with pytest.raises(InputError, match=r"pipeline\.num_microbatches' = 0: .*greater than or equal to 1; use a larger value"):
        validate_model(Scenario, data, "scenario.json")


def test_more_stages_than_layers_is_rejected_with_a_fix():
    data = json.loads(preset("checkfree-124m-geo-10pct").model_dump_json())
    data["pipeline"]["num_stages"] = 13
    with pytest.raises(InputError, match="exceeds model.num_layers 12; reduce num_stages"):
        validate_model(Scenario, data, "scenario.json")


def test_a_scenario_narrowed_to_named_methods_keeps_their_configuration_in_that_order():
    scenario = preset("checkfree-124m-geo-10pct")
    own = {method.name: method for method in scenario.methods}
    narrowed = scenario.with_methods(["checkfree", "checkpoint"])
    assert [method.name for method in narrowed.methods] == ["checkfree", "checkpoint"]
    assert narrowed.methods[0] == own["checkfree"] and narrowed.methods[1] == own["checkpoint"]
    assert scenario.with_methods(["copy"]).methods == (method_from_name("copy"),)
    with pytest.raises(InputError, match="--method lists a method twice"):
        scenario.with_methods(["checkfree", "checkfree"])


def test_a_calibrated_preset_takes_settings_that_fit_only_the_methods_chosen():
    three_stages = {"pipeline.num_stages": 3, "model.num_layers": 6}
    with pytest.raises(InputError, match="'checkfree_plus' needs at least 4 pipeline stages"):
        preset("cpu-tiny", three_stages)
    scenario = preset("cpu-tiny", three_stages, methods=("checkpoint", "checkfree"))
    assert scenario.pipeline.num_stages == 3
    assert [method.name for method in scenario.methods] == ["checkpoint", "checkfree"]
    assert scenario.compute.block_forward_s != preset("cpu-tiny").compute.block_forward_s[:3]  # the compute model's, for 3 stages


def test_method_using_a_missing_storage_tier_is_rejected():
    data = json.loads(preset("checkfree-124m-geo-10pct").model_dump_json())
    data["storage"] = [tier for tier in data["storage"] if tier["name"] != "remote"]
    with pytest.raises(InputError, match="storage tier 'remote'"):
        validate_model(Scenario, data, "scenario.json")


def test_target_loss_below_the_floor_is_rejected():
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["target"]["loss"] = 1.0
    with pytest.raises(InputError, match="never reached"):
        validate_model(Scenario, data, "scenario.json")


@pytest.mark.parametrize("path", [
    "recovery.restart_s",  # failed an assertion in the simulator
    "model.checkpoint_bytes_per_parameter",  # hung the simulation
    "target.loss",  # reached at once
    "convergence.setbacks.checkfree.interior.mean_iterations",
])
def test_a_scenario_number_that_is_not_finite_is_refused_naming_it(path):
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    node = data
    for key in path.split(".")[:-1]:
        node = node[key]
    node[path.rsplit(".", 1)[-1]] = "Infinity"
    with pytest.raises(InputError, match=f"scenario.json: {path} is not a finite number; only a bandwidth may be Infinity"):
        validate_model(Scenario, data, "scenario.json")


def test_a_scenario_bandwidth_may_be_infinite():
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["network"]["same_site_bandwidth_bytes_per_s"] = "Infinity"
    data["storage"][0]["read_bandwidth_bytes_per_s"] = "Infinity"
    scenario = validate_model(Scenario, data, "scenario.json")
    assert math.isinf(scenario.network.same_site_bandwidth_bytes_per_s) and math.isinf(scenario.storage[0].read_bandwidth_bytes_per_s)


def test_wrong_schema_version_is_rejected():
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["schema_version"] = 2
    with pytest.raises(InputError, match="schema_version"):
        validate_model(Scenario, data, "scenario.json")


def test_malformed_json_names_the_line(tmp_path):
    (tmp_path / "broken.json").write_text('{"name": "x",\n  "model": }')
    with pytest.raises(InputError, match="broken.json: not valid JSON at line 2"):
        load_model(Scenario, tmp_path / "broken.json")


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_has_defaults_and_round_trips(name):
    method = method_from_name(name)
    assert method.name == name
    assert method_from_name(name, **method.model_dump(exclude={"name"})) == method


@given(
    interval=st.integers(min_value=1, max_value=10_000),
    rollback=st.sampled_from(["all", "stage"]),
)
@settings(max_examples=30, deadline=None)
def test_checkpoint_configs_round_trip(interval, rollback):
    method = method_from_name("checkpoint", interval_iterations=interval, rollback=rollback)
    again = method_from_name("checkpoint", **json.loads(method.model_dump_json(exclude={"name"})))
    assert again == method


@given(interval=st.integers(max_value=0))
@settings(max_examples=20, deadline=None)
def test_invalid_checkpoint_intervals_raise_clear_errors(interval):
    with pytest.raises(InputError, match="interval_iterations"):
        method_from_name("checkpoint", interval_iterations=interval)


finite_times = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)


@given(
    st.lists(
        st.tuples(st.one_of(st.none(), finite_times), st.integers(0, 10**6), st.integers(0, 63), st.sampled_from(["preemption", "burst", "failure"])),
        max_size=20,
    )
)
@settings(max_examples=50, deadline=None)
def test_failure_schedules_round_trip_through_csv(rows):
    schedule = FailureSchedule(
        failures=tuple(ScheduledFailure(time_s=t, iteration=i, stage=s, kind=k) for t, i, s, k in rows)
    )
    assert FailureSchedule.from_csv(schedule.to_csv()) == schedule


def test_failure_schedule_file_errors_name_the_line(tmp_path):
    path = tmp_path / "failures.csv"
    path.write_text("# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind\n12.5,,two,preemption\n")
    with pytest.raises(InputError, match="line 3"):
        read_failure_schedule(path)
    path.write_text("time,stage\n1,2\n")
    with pytest.raises(InputError, match="first line"):
        read_failure_schedule(path)
    with pytest.raises(InputError, match="no such failure schedule"):
        read_failure_schedule(tmp_path / "missing.csv")


def test_failure_stage_outside_the_pipeline_is_rejected():
    schedule = FailureSchedule(failures=(ScheduledFailure(iteration=3, stage=7),))
    with pytest.raises(InputError, match="stage 7 does not exist in a 4-stage pipeline"):
        schedule.validate_for(4)


def _tiny_calibration() -> Calibration:
    scenario = preset("checkfree-124m-geo-10pct")
    duration = MeasuredDuration(median_s=0.01, interquartile_range_s=0.001, num_samples=20)
    return Calibration(
        name="unit",
        provenance=Provenance(hardware={"machine": "x"}, package_versions={"torch": "2"}, created_utc="2026-01-01T00:00:00+00:00"),
        model=scenario.model,
        pipeline=scenario.pipeline,
        stage_timings=tuple(StageTimings(stage=s, block_forward=duration, block_backward=duration) for s in range(4)),
        optimizer_step=duration,
        activation_bytes=1024.0,
        link=LinkProfile(latency_s=1e-4, bandwidth_bytes_per_s=1e9, r_squared=0.99, num_points=8),
        convergence=scenario.convergence,
    )


def test_calibration_file_round_trips(tmp_path):
    calibration = _tiny_calibration()
    save_model(calibration, tmp_path / "calibration.json")
    assert load_model(Calibration, tmp_path / "calibration.json") == calibration


def test_run_record_round_trips_and_lands_atomically(tmp_path):
    manifest = RunManifest(run_id="r1", source="simulated", method="checkfree", seed=3, scenario=preset("checkfree-124m-geo-10pct"))
    metrics = [dict(step=i, iteration=i, wall_time_s=0.5 * i, train_loss=3.0 - 0.01 * i, eval_loss=math.nan) for i in range(5)]
    spans = [dict(rank=0, stage=0, iteration=0, kind="forward", microbatch=0, start_s=0.0, end_s=0.1)]
    failures = [ScheduledFailure(time_s=1.25, iteration=2, stage=1, kind="preemption")]
    record = make_run_record(manifest, metrics, spans, failures)
    directory = write_run_record(record, tmp_path / "run")
    again = read_run_record(directory)
    assert again.manifest == manifest
    assert again.failures == record.failures
    pd.testing.assert_frame_equal(again.metrics, record.metrics, check_dtype=False)
    pd.testing.assert_frame_equal(again.spans, record.spans, check_dtype=False)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging directory left behind


def test_spans_keep_their_cpu_clock_through_a_record_and_records_without_it_still_load(tmp_path):
    manifest = RunManifest(run_id="r1", source="real", method="none", seed=0)
    clocked = pd.DataFrame([dict(rank=0, stage=0, iteration=0, kind="forward", microbatch=0, start_s=0.0, end_s=0.1, cpu_start_s=1.5, cpu_end_s=1.59)])
    again = read_run_record(write_run_record(make_run_record(manifest, [], clocked, []), tmp_path / "clocked"))
    assert list(again.spans.columns) == list(SPANS_COLUMNS + SPANS_CPU_COLUMNS)
    assert again.spans.loc[0, "cpu_end_s"] - again.spans.loc[0, "cpu_start_s"] == pytest.approx(0.09)
    plain = read_run_record(write_run_record(make_run_record(manifest, [], clocked.drop(columns=list(SPANS_CPU_COLUMNS)), []), tmp_path / "plain"))
    assert list(plain.spans.columns) == list(SPANS_COLUMNS)


def test_malformed_run_record_names_file_and_field(tmp_path):
    manifest = RunManifest(run_id="r1", source="simulated", method="none", seed=0)
    directory = write_run_record(make_run_record(manifest, [], [], []), tmp_path / "run")
    (directory / "metrics.csv").write_text("step,iteration,wall_time\n0,0,1.0\n")
    with pytest.raises(InputError, match=r"metrics.csv: lacks column\(s\) wall_time_s, train_loss"):
        read_run_record(directory)
    (directory / "manifest.json").write_text(json.dumps({"run_id": "r1", "source": "alien", "method": "none", "seed": 0}))
    with pytest.raises(InputError, match=r"manifest.json: field 'source'"):
        read_run_record(directory)


def test_table_columns_are_unique():
    from churnsim.calibration import tables

    for name in dir(tables):
        if name.endswith("_COLUMNS"):
            columns = getattr(tables, name)
            assert len(set(columns)) == len(columns), name
    assert len(set(METRICS_COLUMNS)) == len(METRICS_COLUMNS) and len(set(SPANS_COLUMNS)) == len(SPANS_COLUMNS)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"checkpoint": [1, 2]}, "'checkpoint': [1, 2] is not a number of seconds"),
        ({"checkpoint": "fast"}, "'checkpoint': 'fast' is not a number of seconds"),
        ([1, 2, 3], "is not a mapping of method to seconds"),
    ],
)
def test_seconds_by_method_that_is_not_one_is_refused_in_one_line(extra, says):
    from churnsim.calibration.presets import preset

    data = json.loads(preset("cpu-tiny").model_dump_json())
    data["compute"]["method_iteration_extra_s"] = extra
    with pytest.raises(InputError) as refused:
        validate_model(type(preset("cpu-tiny")), data, "mine.json")
    message = str(refused.value)
    assert says in message and "\n" not in message and message.startswith("mine.json")


def test_a_loss_curve_that_reaches_the_target_beyond_any_number_of_iterations_is_refused_in_one_line():
    """A scale of 1e300 overflowed the power law and `whatif --calibration` ended in a traceback."""
    data = json.loads(preset("checkfree-500m-geo-10pct").model_dump_json())
    data["convergence"]["baseline"]["scale"] = 1e300
    with pytest.raises(InputError, match="reached after more iterations than a number can hold .*check convergence.baseline"):
        validate_model(Scenario, data, "scenario.json")


@pytest.mark.parametrize("field", ["latency_s", "fixed_cost_s"])
def test_a_storage_delay_past_the_longest_duration_is_refused_naming_it(field):
    """A remote tier's fixed cost of 1e300 s ran every replay to the 30-day limit, minutes per what-if;
    a storage delay is held to the simulator's 31.7 years like every latency."""
    data = json.loads(preset("spot-p3-trace").model_dump_json())
    data["storage"][-1][field] = 1e300
    with pytest.raises(InputError, match=rf"scenario.json: field 'storage.{len(data['storage']) - 1}.{field}' = 1e\+300: .*less than or equal to 1000000000"):
        validate_model(Scenario, data, "scenario.json")


def test_a_storage_tier_too_slow_for_one_checkpoint_in_31_7_years_is_refused():
    """At 1e-300 B/s every replay ran to the 30-day limit; like a link's, a tier's transfers must end."""
    data = json.loads(preset("spot-p3-trace").model_dump_json())
    data["storage"][-1]["write_bandwidth_bytes_per_s"] = 1e-300
    with pytest.raises(InputError, match=r"storage tier 'remote' \(1e-300 B/s\) would take more than 1e\+09 s \(31.7 years\) to write or read"):
        validate_model(Scenario, data, "scenario.json")
    data["storage"][-1]["write_bandwidth_bytes_per_s"] = 10.0  # slow, but a checkpoint still ends (in 12 years)
    assert validate_model(Scenario, data, "scenario.json").storage[-1].write_bandwidth_bytes_per_s == 10.0
