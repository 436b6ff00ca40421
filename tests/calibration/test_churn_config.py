"""Churn models of the scenario contract: validation, conversions, trace path lookup."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from churnsim.calibration.base import StrictModel, validate_model
from churnsim.calibration.churn import (
    CHURN_KINDS,
    P3_TRACE_BURST_SIZE_PROBABILITIES,
    TRACE_DIRECTORY,
    BurstChurn,
    ChurnConfig,
    NoChurn,
    PoissonChurn,
    ScheduleChurn,
    StageHourlyChurn,
    TraceChurn,
    WeibullChurn,
    builtin_trace_files,
    churn_with_rate_scaled,
    parse_churn_config,
    rate_sweep,
    resolve_trace_path,
    stage_hourly_probability_to_rate_per_s,
    stage_hourly_to_per_iteration_probability,
)
from churnsim.calibration.errors import InputError


class _Holder(StrictModel):
    """Stands in for the Scenario model that embeds `ChurnConfig`."""

    churn: ChurnConfig


def _load(churn: dict) -> ChurnConfig:
    return validate_model(_Holder, {"churn": churn}, "scenario.json").churn


def test_each_kind_is_selected_by_its_kind_field():
    examples = {
        "none": ({"kind": "none"}, NoChurn),
        "stage_hourly": ({"kind": "stage_hourly", "failure_probability_per_stage_hour": 0.1}, StageHourlyChurn),
        "poisson": ({"kind": "poisson", "failures_per_node_hour": 0.6}, PoissonChurn),
        "weibull": ({"kind": "weibull", "shape": 0.7, "mean_lifetime_s": 3600.0}, WeibullChurn),
        "burst": ({"kind": "burst", "bursts_per_hour": 0.3}, BurstChurn),
        "trace": ({"kind": "trace", "path": "bamboo/p3-trace.csv", "format": "bamboo_csv"}, TraceChurn),
        "schedule": ({"kind": "schedule", "path": "run/failures.csv"}, ScheduleChurn),
    }
    assert set(examples) == set(CHURN_KINDS)
    for data, model_type in examples.values():
        assert isinstance(_load(data), model_type)
        assert isinstance(parse_churn_config(data), model_type)


def test_burst_defaults_to_the_p3_trace_size_distribution():
    burst = _load({"kind": "burst", "bursts_per_hour": 1.0})
    assert burst.burst_size_probabilities == P3_TRACE_BURST_SIZE_PROBABILITIES
    assert math.isclose(sum(P3_TRACE_BURST_SIZE_PROBABILITIES), 1.0)
    # simulators.md §5: 1 (0.5), 2 (0.16), 3 (0.19), 4 (0.09), 5-6 (0.06 together)
    assert P3_TRACE_BURST_SIZE_PROBABILITIES[:4] == (0.5, 0.16, 0.19, 0.09)
    assert math.isclose(sum(P3_TRACE_BURST_SIZE_PROBABILITIES[4:]), 0.06)


def test_trace_defaults_replay_the_whole_trace_once_at_its_own_speed():
    trace = _load({"kind": "trace", "path": "bamboo/p3-trace.csv", "format": "bamboo_csv"})
    assert (trace.time_scale, trace.window_start_s, trace.window_end_s, trace.repeat) == (1.0, 0.0, None, False)


@pytest.mark.parametrize(
    ("churn", "field", "value", "fix"),
    [
        ({"kind": "stage_hourly", "failure_probability_per_stage_hour": 1.0}, "failure_probability_per_stage_hour", "1.0", "smaller"),
        ({"kind": "stage_hourly", "failure_probability_per_stage_hour": -0.1}, "failure_probability_per_stage_hour", "-0.1", "larger"),
        ({"kind": "poisson", "failures_per_node_hour": -1}, "failures_per_node_hour", "-1", "larger"),
        ({"kind": "weibull", "shape": 0, "mean_lifetime_s": 10}, "shape", "0", "larger"),
        ({"kind": "weibull", "shape": 1, "mean_lifetime_s": -5}, "mean_lifetime_s", "-5", "larger"),
        ({"kind": "burst", "bursts_per_hour": 1, "burst_size_probabilities": [0.5, 0.4]}, "burst_size_probabilities", "0.4", "sum to 1"),
        ({"kind": "burst", "bursts_per_hour": 1, "burst_size_probabilities": []}, "burst_size_probabilities", "[]", "at least one"),
        ({"kind": "burst", "bursts_per_hour": 1, "burst_size_probabilities": [1.5, -0.5]}, "burst_size_probabilities", "1.5", "probabilities"),
        ({"kind": "trace", "path": "a.csv", "format": "bamboo_csv", "time_scale": 0}, "time_scale", "0", "larger"),
        ({"kind": "trace", "path": "a.csv", "format": "csv"}, "format", "csv", "allowed values"),
        (
            {"kind": "trace", "path": "a.csv", "format": "bamboo_csv", "window_start_s": 100, "window_end_s": 50},
            "window_end_s",
            "50",
            "later end",
        ),
        ({"kind": "poisson", "failures_per_node_hour": 0.5, "rate": 1}, "rate", "1", "spelling"),
        ({"kind": "meteor", "failures_per_node_hour": 0.5}, "churn", "meteor", "allowed values"),
    ],
)
def test_invalid_churn_values_name_field_value_and_fix(churn, field, value, fix):
    with pytest.raises(InputError) as raised:
        _load(churn)
    message = str(raised.value)
    assert "scenario.json" in message
    assert field in message
    assert value in message
    assert fix in message
    assert "\n" not in message


def test_stage_hourly_rate_is_minus_log_of_survival_per_hour():
    config = StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.1)
    assert math.isclose(config.rate_per_stage_s * 3600.0, -math.log(0.9))
    assert math.isclose(config.rate_per_stage_s * 3600.0, 0.10536, rel_tol=1e-4)  # simulators.md §5
    assert stage_hourly_probability_to_rate_per_s(0.0) == 0.0


@pytest.mark.parametrize(
    ("hourly", "iteration_time_s", "published_per_iteration"),
    # CheckFree's simulate_training configs and the iteration times they imply (checkfree.md §4.3).
    [(0.05, 63.0, 0.0009), (0.10, 68.0, 0.002), (0.16, 83.0, 0.004), (0.33, 90.0, 0.01), (0.10, 20.5, 0.0006)],
)
def test_per_iteration_probability_reproduces_checkfree_configs(hourly, iteration_time_s, published_per_iteration):
    per_iteration = stage_hourly_to_per_iteration_probability(hourly, iteration_time_s)
    # The published values are rounded by hand to one significant figure.
    assert math.isclose(per_iteration, published_per_iteration, rel_tol=0.05)


@given(
    hourly=st.floats(min_value=0.0, max_value=0.99),
    iteration_time_s=st.floats(min_value=0.01, max_value=3600.0),
)
@example(hourly=1.192092896e-07, iteration_time_s=0.0625)  # once lost precision in the check itself
def test_per_iteration_probabilities_compound_back_to_the_hourly_probability(hourly, iteration_time_s):
    per_iteration = stage_hourly_to_per_iteration_probability(hourly, iteration_time_s)
    assert 0.0 <= per_iteration <= hourly + 1e-12
    iterations_per_hour = 3600.0 / iteration_time_s
    # Compounded with log1p/expm1: (1 − p)^n in plain floats loses the digits of a tiny p.
    compounded = -math.expm1(iterations_per_hour * math.log1p(-per_iteration))
    assert math.isclose(compounded, hourly, rel_tol=1e-6, abs_tol=1e-12)


def test_per_iteration_probability_rejects_bad_inputs_with_the_fix():
    with pytest.raises(InputError, match="probability_per_stage_hour = 1.5.*0.1 for 10"):
        stage_hourly_to_per_iteration_probability(1.5, 60.0)
    with pytest.raises(InputError, match="iteration_time_s = 0"):
        stage_hourly_to_per_iteration_probability(0.1, 0.0)


def test_weibull_scale_matches_the_requested_mean():
    assert math.isclose(WeibullChurn(kind="weibull", shape=1.0, mean_lifetime_s=500.0).scale_s, 500.0)
    shape_two = WeibullChurn(kind="weibull", shape=2.0, mean_lifetime_s=500.0)
    assert math.isclose(shape_two.scale_s * math.gamma(1.5), 500.0)


_valid_churn = st.one_of(
    st.builds(NoChurn, kind=st.just("none")),
    st.builds(StageHourlyChurn, kind=st.just("stage_hourly"),
              failure_probability_per_stage_hour=st.floats(min_value=0.0, max_value=0.999)),
    st.builds(PoissonChurn, kind=st.just("poisson"), failures_per_node_hour=st.floats(min_value=0.0, max_value=1e3)),
    st.builds(WeibullChurn, kind=st.just("weibull"), shape=st.floats(min_value=0.05, max_value=20.0),
              mean_lifetime_s=st.floats(min_value=1.0, max_value=1e7)),
    st.builds(BurstChurn, kind=st.just("burst"), bursts_per_hour=st.floats(min_value=0.0, max_value=10.0)),
    st.builds(TraceChurn, kind=st.just("trace"), path=st.just("bamboo/p3-trace.csv"), format=st.just("bamboo_csv"),
              time_scale=st.floats(min_value=0.01, max_value=100.0), window_start_s=st.floats(min_value=0.0, max_value=1e4),
              repeat=st.booleans()),
)


@given(churn=_valid_churn)
def test_churn_configs_round_trip_through_json(churn):
    holder = _Holder(churn=churn)
    assert _Holder.model_validate_json(holder.model_dump_json()) == holder


def test_relative_trace_paths_resolve_to_the_builtin_directory_first(tmp_path, monkeypatch):
    shadow = tmp_path / "bamboo" / "p3-trace.csv"
    shadow.parent.mkdir()
    shadow.write_text("0,add,node1\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_trace_path("bamboo/p3-trace.csv") == TRACE_DIRECTORY / "bamboo" / "p3-trace.csv"


def test_relative_trace_paths_fall_back_to_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "mine.csv").write_text("0,add,node1\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_trace_path("mine.csv").resolve() == (tmp_path / "mine.csv").resolve()
    config = TraceChurn(kind="trace", path="mine.csv", format="bamboo_csv")
    assert config.resolved_path().read_text() == "0,add,node1\n"


def test_missing_trace_file_names_the_path_and_lists_the_builtin_traces(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"churn.path = 'no-such.csv'.*bamboo/p3-trace.csv"):
        resolve_trace_path("no-such.csv")
    with pytest.raises(InputError, match="no such file"):
        resolve_trace_path(tmp_path / "absent.csv")


def test_builtin_traces_ship_with_their_licences_and_sources():
    names = {path.relative_to(TRACE_DIRECTORY).as_posix() for path in builtin_trace_files()}
    assert {
        "bamboo/p3-trace.csv",
        "bamboo/gcloud-v100x1-east1c.txt",
        "parcae/gpt-1.5b_trace_hh_55_65.jsonl",
        "parcae/gpt-1.5b_trace_hl_15_25.jsonl",
    } <= names
    assert sum(name.startswith("bamboo/aws-spot-instances-") for name in names) == 4
    for source in ("bamboo", "parcae", "checkfree"):
        assert list((TRACE_DIRECTORY / source).glob("LICENSE*")), source
    assert (TRACE_DIRECTORY / "SOURCES.md").is_file()
    for rate in (10, 16, 33):
        assert (TRACE_DIRECTORY / "checkfree" / f"failure_p_configs_{rate}.json").is_file()
    assert (TRACE_DIRECTORY / "checkfree" / "geo_latency_bandwidth_pairs.csv").is_file()


@pytest.mark.parametrize(
    "churn",
    [
        StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.16),
        PoissonChurn(kind="poisson", failures_per_node_hour=240.0),
        WeibullChurn(kind="weibull", shape=0.7, mean_lifetime_s=5000.0),
        BurstChurn(kind="burst", bursts_per_hour=0.4),
        TraceChurn(kind="trace", path="bamboo/p3-trace.csv", format="bamboo_csv", time_scale=2.0),
    ],
    ids=lambda churn: churn.kind,
)
@pytest.mark.parametrize("factor", [0.5, 2.0, 3.0])
def test_a_churn_scaled_by_a_factor_fails_that_many_times_as_often_and_keeps_its_shape(churn, factor):
    from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s

    scaled = churn_with_rate_scaled(churn, factor)
    assert type(scaled) is type(churn)
    assert mean_stage_failure_rate_per_s(scaled, num_stages=6) == pytest.approx(factor * mean_stage_failure_rate_per_s(churn, num_stages=6), rel=1e-12)
    unscaled_fields = {"stage_hourly": "kind", "poisson": "kind", "weibull": "shape", "burst": "burst_size_probabilities", "trace": "window_start_s"}
    field = unscaled_fields[churn.kind]
    assert getattr(scaled, field) == getattr(churn, field)


def test_churn_without_a_rate_is_not_scaled_and_a_bad_factor_is_refused():
    assert churn_with_rate_scaled(NoChurn(kind="none"), 2.0) is None
    assert churn_with_rate_scaled(ScheduleChurn(kind="schedule", path="failures.csv"), 2.0) is None
    with pytest.raises(InputError, match="must be a positive number"):
        churn_with_rate_scaled(PoissonChurn(kind="poisson", failures_per_node_hour=1.0), 0.0)


def test_the_sweep_of_a_churns_own_rate_names_its_field_at_half_once_and_twice_its_rate():
    assert rate_sweep(PoissonChurn(kind="poisson", failures_per_node_hour=240.0)) == ("churn.failures_per_node_hour", (0.0, 120.0, 240.0, 480.0))
    assert rate_sweep(BurstChurn(kind="burst", bursts_per_hour=0.4)) == ("churn.bursts_per_hour", (0.0, 0.2, 0.4, 0.8))
    assert rate_sweep(WeibullChurn(kind="weibull", shape=0.7, mean_lifetime_s=5000.0)) == ("churn.mean_lifetime_s", (10000.0, 5000.0, 2500.0))
    trace = TraceChurn(kind="trace", path="bamboo/p3-trace.csv", format="bamboo_csv")
    assert rate_sweep(trace) == ("churn.time_scale", (2.0, 1.0, 0.5))
    assert rate_sweep(ScheduleChurn(kind="schedule", path="failures.csv")) is None
    assert rate_sweep(NoChurn(kind="none")) is None
    assert rate_sweep(PoissonChurn(kind="poisson", failures_per_node_hour=0.0)) == ("churn.failures_per_node_hour", (0.0,))