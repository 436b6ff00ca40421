"""Replications, confidence intervals, and sweeps that give the same numbers wherever they run."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.calibration.statistics import mean_with_ci95
from churnsim.sim.studies.replicate import ReplicationTask, run_replication, runs_table, summary_table
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.scenario_overrides import apply_settings, parse_grid_setting
from churnsim.sim.studies.sweep import build_tasks, grid_points, run_sweep


def small_scenario(replications: int = 2):
    scenario = preset("checkfree-124m-geo-33pct")
    methods = tuple(method_from_name(name) for name in ("checkpoint", "redundant", "checkfree"))
    return scenario.model_copy(update={"replications": replications, "methods": methods})


def test_every_method_of_a_replication_sees_the_same_failures():
    scenario = small_scenario()
    path = failures_for_replication(scenario, replication=1)
    results = run_replication(ReplicationTask(scenario=scenario, replication=1, methods=scenario.methods))
    assert path, "the scenario must fail at all for this test to mean anything"
    for result in results:
        seen = [(failure.time_s, failure.stage) for failure in result.failures]
        expected = [(event.time_s, event.stage) for event in path if event.time_s <= result.wall_clock_s]
        assert seen == expected, result.method
    # ... and another replication sees another path.
    assert failures_for_replication(scenario, replication=0) != path


def test_mean_with_ci95_is_the_student_t_interval():
    values = [10.0, 12.0, 11.0, 15.0]
    mean, low, high = mean_with_ci95(values)
    half = stats.t.ppf(0.975, 3) * stats.tstd(values) / 2.0
    assert mean == pytest.approx(12.0) and low == pytest.approx(12.0 - half) and high == pytest.approx(12.0 + half)
    assert mean_with_ci95([3.0]) == (3.0, 3.0, 3.0)
    assert all(math.isnan(value) for value in mean_with_ci95([math.nan]))


def test_speedups_are_paired_ratios_within_each_replication():
    runs = pd.DataFrame(
        {
            "scenario": "s", "failure_probability_per_stage_hour": 0.1, "replication": [0, 0, 1, 1],
            "method": ["checkpoint", "checkfree", "checkpoint", "checkfree"],
            "time_to_target_s": [200.0, 100.0, 300.0, 100.0], "reached_target": True, "setbacks_calibrated": False,
        }
    )
    summary = summary_table(runs).set_index("method")
    # The geometric mean of the paired ratios 2 and 3, with the t interval of their logs: pairing
    # shows in the interval, which rests on the spread of the per-replication ratios.
    logs = [math.log(2.0), math.log(3.0)]
    half = stats.t.ppf(0.975, 1) * stats.tstd(logs) / math.sqrt(2)
    assert summary.loc["checkfree", "speedup_vs_checkpoint_mean"] == pytest.approx(math.sqrt(6.0))
    assert summary.loc["checkfree", "speedup_vs_checkpoint_ci95_low"] == pytest.approx(math.exp(sum(logs) / 2 - half))
    assert summary.loc["checkfree", "speedup_vs_checkpoint_ci95_high"] == pytest.approx(math.exp(sum(logs) / 2 + half))
    assert summary.loc["checkpoint", "speedup_vs_checkpoint_mean"] == pytest.approx(1.0)
    assert math.isnan(summary.loc["checkfree", "speedup_vs_redundant_mean"])  # no redundant runs


def test_points_of_a_grid_that_share_a_scenario_name_are_summarised_apart():
    """A what-if's interval study runs every interval under the scenario's own name: replication 0
    at interval 10 and at interval 20 are different runs, not one."""
    runs = pd.DataFrame(
        {
            "scenario": "s", "failure_probability_per_stage_hour": 0.1, "interval_iterations": [10, 10, 20, 20],
            "replication": [0, 0, 0, 0], "method": ["checkpoint", "checkfree"] * 2,
            "time_to_target_s": [200.0, 100.0, 400.0, 100.0], "wall_clock_s": [200.0, 100.0, 400.0, 100.0],
            "reached_target": True, "setbacks_calibrated": False,
        }
    )
    summary = summary_table(runs, ["interval_iterations"]).set_index(["interval_iterations", "method"])
    assert len(summary) == 4
    assert summary.loc[(10, "checkfree"), "speedup_vs_checkpoint_mean"] == pytest.approx(2.0)
    assert summary.loc[(20, "checkfree"), "speedup_vs_checkpoint_at_most"] == pytest.approx(4.0)
    assert summary.loc[(20, "checkpoint"), "time_to_target_mean_s"] == pytest.approx(400.0)


def test_grid_settings_parse_and_expand():
    assert parse_grid_setting("pipeline.num_microbatches=2,4") == ("pipeline.num_microbatches", (2, 4))
    # A JSON list keeps its commas; a quoted string too.
    assert parse_grid_setting("pipeline.layers_per_stage=[6,6],[4,8]") == ("pipeline.layers_per_stage", ([6, 6], [4, 8]))
    assert parse_grid_setting('a={"b":[1,2]},"c,d",e') == ("a", ({"b": [1, 2]}, "c,d", "e"))
    points = grid_points([("a", (1, 2)), ("b", ("x",))])
    assert points == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    changed = apply_settings(small_scenario(), {"pipeline.num_microbatches": 8})
    assert changed.pipeline.num_microbatches == 8 and "num_microbatches=8" in changed.name


@pytest.mark.parametrize(
    "text, fragment",
    [("a=1,,2", "value 2 is empty"), ("a=1,", "value 2 is empty"), ("a=", "the grid is empty"), ("a=,", "value 1 is empty"), ("=1", "no field before '='")],
)
def test_a_grid_setting_with_an_empty_value_is_refused(text, fragment):
    with pytest.raises(InputError, match=fragment):
        parse_grid_setting(text)


def test_a_grid_that_repeats_a_value_is_refused():
    # 0.1 and 0.10 are one point: its replications would be counted twice, as if independent.
    with pytest.raises(InputError, match="the value 0.1 is given twice"):
        grid_points([parse_grid_setting("churn.failure_probability_per_stage_hour=0.1,0.10")])


def test_local_pool_and_inline_runs_give_identical_tables():
    scenario = small_scenario()
    tasks = build_tasks(scenario, [parse_grid_setting("churn.failure_probability_per_stage_hour=0.1,0.33")])
    inline = run_sweep(tasks, workers=1)
    pooled = run_sweep(tasks, workers=2)
    pd.testing.assert_frame_equal(inline.runs, pooled.runs)


def test_dask_local_cluster_returns_the_numbers_of_the_local_pool():
    distributed = pytest.importorskip("distributed")
    scenario = small_scenario()
    tasks = build_tasks(scenario, [parse_grid_setting("churn.failure_probability_per_stage_hour=0.1,0.33")])
    local = run_sweep(tasks, workers=1)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            on_dask = run_sweep(tasks, client=client)
    pd.testing.assert_frame_equal(local.runs, on_dask.runs)
    pd.testing.assert_frame_equal(local.summary, on_dask.summary)


def test_runs_table_has_the_contract_columns():
    from churnsim.calibration.tables import RUN_COLUMNS

    scenario = small_scenario(replications=1)
    results = run_replication(ReplicationTask(scenario=scenario, replication=0, methods=scenario.methods))
    table = runs_table(scenario, results)
    assert list(table.columns) == list(RUN_COLUMNS)
    total = table[[c for c in RUN_COLUMNS if c.endswith("_s") and c not in ("wall_clock_s", "time_to_target_s", "healthy_iteration_time_s")]].sum(axis=1)
    assert (abs(total - table["wall_clock_s"]) <= 1e-6 * table["wall_clock_s"]).all()


def test_a_lazily_sampled_failure_path_gives_the_results_of_the_whole_path():
    """Replications sample failures only as far as their runs get; results equal the eager path's."""
    from churnsim.calibration.failure_sampling import FailurePathSpec, LazyFailurePath
    from churnsim.calibration.presets import preset
    from churnsim.sim.model.run import simulate_run

    scenario = preset("checkfree-124m-geo-33pct")
    for replication in (0, 1):
        eager = failures_for_replication(scenario, replication=replication)
        lazy = LazyFailurePath(FailurePathSpec.of(scenario, replication=replication))
        for method in scenario.methods:
            expected = simulate_run(scenario, method, eager, replication=replication)
            got = simulate_run(scenario, method, lazy, replication=replication)
            assert (got.wall_clock_s, got.failures, got.progress_iterations) == (expected.wall_clock_s, expected.failures, expected.progress_iterations), method.name
        # Only as far as the longest run needed, not the 30-day cap.
        assert lazy._horizon_s < scenario.target.max_wall_clock_s
