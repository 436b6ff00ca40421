"""Figures from small synthetic tables with the columns of calibration/tables.py."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import METHOD_NAMES
from churnsim.calibration.tables import (
    GANTT_COLUMNS,
    INTERVAL_COLUMNS,
    RUN_COLUMNS,
    SUMMARY_COLUMNS,
    TRAJECTORY_COLUMNS,
    VALIDATION_COLUMNS,
)
from churnsim.figures import (
    make_all_figures,
    make_figures,
    plot_badput_breakdown,
    plot_checkpoint_interval,
    plot_loss_vs_wallclock,
    plot_optimal_interval,
    plot_pipeline_gantt,
    plot_speedup,
    plot_time_to_target,
    plot_validation,
)
from churnsim.calibration.statistics import mean_with_ci95
from churnsim.calibration.tables import TIME_CATEGORIES
from churnsim.figures.style import METHOD_COLORS, METHOD_MARKERS, is_ablation, method_color, method_label, method_linestyle

METHODS = ("checkpoint", "redundant", "checkfree")
RATES = (0.05, 0.1, 0.2)
NUM_REPLICATIONS = 3
BADPUT = TIME_CATEGORIES[1:]


def _runs() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for rate in RATES:
        for method_index, method in enumerate(METHODS):
            for replication in range(NUM_REPLICATIONS):
                badput = {category: float(rng.uniform(0, 200)) for category in BADPUT}
                goodput = 3600.0 * (1 + method_index)
                wall = goodput + sum(badput.values())
                rows.append(
                    dict(
                        scenario="tiny", failure_probability_per_stage_hour=rate, method=method, replication=replication,
                        seed=replication, reached_target=True, wall_clock_s=wall, time_to_target_s=wall,
                        target_iterations=100, progress_iterations=100, iterations_executed=110,
                        healthy_iteration_time_s=10.0, num_failures=2, goodput_s=goodput, setbacks_calibrated=False,
                        **badput,
                    )
                )  # fmt: skip
    return pd.DataFrame(rows, columns=list(RUN_COLUMNS))


def _summary(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (rate, method), group in runs.groupby(["failure_probability_per_stage_hour", "method"], sort=False):
        mean, low, high = mean_with_ci95(group["time_to_target_s"])
        row = dict(
            scenario="tiny", failure_probability_per_stage_hour=rate, method=method, num_replications=len(group),
            fraction_reached=1.0, time_to_target_mean_s=mean, time_to_target_ci95_low_s=low,
            time_to_target_ci95_high_s=high, setbacks_calibrated=False,
        )  # fmt: skip
        for baseline in ("checkpoint", "redundant"):
            base = runs[(runs["failure_probability_per_stage_hour"] == rate) & (runs["method"] == baseline)]
            ratios = base["time_to_target_s"].to_numpy() / group["time_to_target_s"].to_numpy()
            speed, speed_low, speed_high = mean_with_ci95(ratios)
            row |= {f"speedup_vs_{baseline}_mean": speed, f"speedup_vs_{baseline}_ci95_low": speed_low, f"speedup_vs_{baseline}_ci95_high": speed_high}
        rows.append(row)
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def _trajectories() -> pd.DataFrame:
    rows = []
    for rate in RATES:
        for method_index, method in enumerate(METHODS):
            for step in range(20):
                time_s = 600.0 * step * (1 + 0.2 * method_index)
                rows.append(("tiny", rate, method, 0, time_s, 10 * step, 6.0 / (1 + 0.3 * step)))
    return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))


def _intervals() -> pd.DataFrame:
    rows = []
    for method, stall_scale in (("checkpoint", 1.0), ("async_checkpoint", 0.2)):
        for interval in (5, 10, 20, 50, 100):
            stall = stall_scale * 2.0 / interval
            hours = 3600.0 * (1.0 + stall + interval / 200)
            rows.append(("simulated", method, interval, stall, hours, 0.95 * hours, 1.05 * hours, 31.6, 27.9))
        rows.append(("real", method, 10, stall_scale * 0.25, np.nan, np.nan, np.nan, np.nan, np.nan))
    return pd.DataFrame(rows, columns=list(INTERVAL_COLUMNS))


def _validation() -> pd.DataFrame:
    rows = []
    for run_index, method in enumerate(METHODS):
        for quantity, measured in (("total_wall_clock_s", 500.0 + 50 * run_index), ("steady_iteration_s", 1.0 + 0.1 * run_index)):
            predicted = measured * (1.0 + 0.02 * (run_index - 1))
            error = (predicted - measured) / measured
            low, high = (0.95 * predicted, 1.05 * predicted) if quantity == "total_wall_clock_s" else (np.nan, np.nan)
            rows.append((f"run{run_index}", method, 0.1, quantity, measured, predicted, error, predicted, error, low, high, "4 stages", True, 1.0))
    return pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS))


def _spans(*, num_stages: int = 3, num_microbatches: int = 4, iterations: tuple[int, ...] = (0,)) -> pd.DataFrame:
    """GPipe-shaped spans with unit forward and backward times; sends are short and overlap compute."""
    rows = []
    for iteration in iterations:
        offset = 100.0 * iteration
        for stage in range(num_stages):
            for m in range(num_microbatches):
                start = offset + stage + m
                rows.append(dict(rank=stage, stage=stage, iteration=iteration, kind="forward", microbatch=m, start_s=start, end_s=start + 1))
                rows.append(dict(rank=stage, stage=stage, iteration=iteration, kind="send", microbatch=m, start_s=start + 1, end_s=start + 1.1))
                back = offset + 2 * (num_microbatches + num_stages - 1) - stage - m - 1
                rows.append(dict(rank=stage, stage=stage, iteration=iteration, kind="backward", microbatch=m, start_s=back - 1, end_s=back))
            end = offset + 2 * (num_microbatches + num_stages - 1)
            rows.append(dict(rank=stage, stage=stage, iteration=iteration, kind="optimizer", microbatch=-1, start_s=end, end_s=end + 0.5))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    runs = _runs()
    return dict(
        runs=runs, summary=_summary(runs), trajectories=_trajectories(), checkpoint_intervals=_intervals(),
        validation=_validation(), iteration_spans=_spans(),
    )  # fmt: skip


def _axes():
    return Figure().add_subplot()


def _colours_by_method(artists) -> dict[str, str]:
    colours = {}
    for artist in artists:
        colour = artist.get_color() if hasattr(artist, "get_color") and not hasattr(artist, "get_facecolor") else artist.get_facecolor()
        colour = np.asarray(colour).reshape(-1, 4)[0] if not isinstance(colour, str) else colour
        colours[artist.get_gid()] = to_hex(colour)
    return colours


def test_every_method_name_has_its_own_colour_marker_and_display_name():
    assert set(METHOD_COLORS) == set(METHOD_NAMES) == set(METHOD_MARKERS)
    assert len(set(METHOD_COLORS.values())) == len(METHOD_NAMES)
    assert len(set(METHOD_MARKERS.values())) == len(METHOD_NAMES)
    labels = [method_label(name) for name in METHOD_NAMES]
    assert len(set(labels)) == len(labels) and all(label != name for label, name in zip(labels, METHOD_NAMES))


def test_labels_line_styles_and_ablations_come_from_the_method_traits():
    assert method_label("checkfree_plus") == "CheckFree+"
    assert method_linestyle("none") == ":" and method_linestyle("checkpoint") == "-"
    assert [name for name in METHOD_NAMES if is_ablation(name)] == ["copy", "uniform", "random"]
    # A method this installation does not know (from saved results) is drawn under its own name.
    assert (method_label("magic"), method_linestyle("magic"), is_ablation("magic")) == ("magic", "-", False)


def test_loss_figure_draws_one_line_per_method_and_the_target(tables):
    ax = _axes()
    drawn = plot_loss_vs_wallclock(ax, tables["trajectories"], failure_probability=0.1, target_loss=3.0)
    assert [line.get_gid() for line in drawn["lines"]] == list(METHODS)
    assert len(drawn["target"]) == 1 and drawn["target"][0].get_ydata()[0] == 3.0
    # Wall-clock is shown in hours: the last checkpoint point is at 19 × 600 s.
    assert drawn["lines"][0].get_xdata()[-1] == pytest.approx(19 * 600 / 3600)


def test_loss_figure_rejects_a_failure_rate_the_table_lacks(tables):
    with pytest.raises(InputError, match="failure_probability"):
        plot_loss_vs_wallclock(_axes(), tables["trajectories"], failure_probability=0.3)


def test_time_to_target_draws_a_line_and_a_ci_band_per_method(tables):
    drawn = plot_time_to_target(_axes(), tables["summary"])
    assert len(drawn["lines"]) == len(drawn["bands"]) == len(METHODS)
    checkpoint = tables["summary"].query("method == 'checkpoint'").sort_values("failure_probability_per_stage_hour")
    np.testing.assert_allclose(drawn["lines"][0].get_xdata(), [5.0, 10.0, 20.0])  # %/h
    np.testing.assert_allclose(drawn["lines"][0].get_ydata(), checkpoint["time_to_target_mean_s"] / 3600)


def test_time_to_target_marks_the_tuned_intervals_hollow(tables):
    from churnsim.calibration.tables import TUNED_INTERVAL_COLUMNS

    summary = tables["summary"]
    row = {column: np.nan for column in TUNED_INTERVAL_COLUMNS}
    row.update(scenario=summary["scenario"].iloc[0], failure_probability_per_stage_hour=0.2, method="checkpoint",
               interval_field="interval_iterations", configured_interval_iterations=20, tuned_interval_iterations=8,
               tuned_by="Daly's optimum", intervals_tried="8 20", fraction_reached=1.0, time_to_target_mean_s=7200.0)
    other = dict(row, scenario="another scenario", time_to_target_mean_s=3600.0)
    drawn = plot_time_to_target(_axes(), summary, tuned=pd.DataFrame([row, other]))
    (markers,) = drawn["tuned"]  # the other scenario's row is not this figure's
    assert markers.get_gid() == "checkpoint" and to_hex(markers.get_edgecolor()[0]) == to_hex(method_color("checkpoint"))
    np.testing.assert_allclose(markers.get_offsets(), [[20.0, 2.0]])  # %/h, hours
    assert len(markers.get_facecolor()) == 0 or markers.get_facecolor()[0][3] == 0  # hollow
    assert plot_time_to_target(_axes(), summary)["tuned"] == []


def test_a_sweep_points_tuned_intervals_are_matched_by_its_swept_field(tables):
    # grid.grid_points renames a point's scenario ("pipeline.num_microbatches = 8"); the tuned rows
    # keep the run's name and are matched by the swept field instead.
    from churnsim.calibration.tables import TUNED_INTERVAL_COLUMNS

    summary = tables["summary"].assign(**{"pipeline.num_microbatches": 8}).assign(scenario="pipeline.num_microbatches = 8")
    rows = []
    for microbatches, hours in ((8, 2.0), (4, 1.0)):
        row = {column: np.nan for column in TUNED_INTERVAL_COLUMNS}
        row.update(scenario=f"geo[pipeline.num_microbatches={microbatches}]", failure_probability_per_stage_hour=0.2, method="checkpoint",
                   fraction_reached=1.0, time_to_target_mean_s=3600.0 * hours, **{"pipeline.num_microbatches": microbatches})
        rows.append(row)
    (markers,) = plot_time_to_target(_axes(), summary, tuned=pd.DataFrame(rows))["tuned"]
    np.testing.assert_allclose(markers.get_offsets(), [[20.0, 2.0]])


@pytest.mark.parametrize("baseline", ["checkpoint", "redundant"])
def test_speedup_omits_its_baseline_and_draws_the_line_at_one(tables, baseline):
    drawn = plot_speedup(_axes(), tables["summary"], baseline=baseline)
    assert [line.get_gid() for line in drawn["lines"]] == [m for m in METHODS if m != baseline]
    assert len(drawn["bands"]) == len(METHODS) - 1
    assert drawn["reference"][0].get_ydata()[0] == 1.0


def test_badput_stacks_methods_times_categories_bars_that_sum_to_one(tables):
    drawn = plot_badput_breakdown(_axes(), tables["runs"], failure_probability=0.2)
    assert len(drawn["bars"]) == len(TIME_CATEGORIES)
    assert sum(len(container.patches) for container in drawn["bars"]) == len(METHODS) * len(TIME_CATEGORIES)
    tops = [max(patch.get_y() + patch.get_height() for patch in (c.patches[i] for c in drawn["bars"])) for i in range(len(METHODS))]
    np.testing.assert_allclose(tops, 1.0)
    assert len(drawn["errorbars"]) == 1


def test_checkpoint_interval_draws_simulated_lines_and_real_markers(tables):
    ax = _axes()
    drawn = plot_checkpoint_interval(ax, tables["checkpoint_intervals"])
    assert [line.get_gid() for line in drawn["lines"]] == ["checkpoint", "async_checkpoint"]
    assert [points.get_gid() for points in drawn["points"]] == ["checkpoint", "async_checkpoint"]
    assert ax.get_xscale() == "log"  # intervals span 5..100


def test_optimal_interval_marks_young_and_daly(tables):
    drawn = plot_optimal_interval(_axes(), tables["checkpoint_intervals"])
    assert len(drawn["lines"]) == len(drawn["bands"]) == 2
    assert [line.get_xdata()[0] for line in drawn["reference"]] == [31.6, 27.9]


def test_validation_draws_points_per_method_the_identity_and_the_band(tables):
    drawn = plot_validation(_axes(), tables["validation"], quantity="total_wall_clock_s")
    assert len(drawn["points"]) == len(METHODS)
    assert all(len(points.get_offsets()) == 1 for points in drawn["points"])
    assert len(drawn["identity"]) == len(drawn["band"]) == 1
    # Every run has its prediction's speed interval: one bar per method.
    assert len(drawn["intervals"]) == len(METHODS)
    steady = plot_validation(_axes(), tables["validation"], quantity="steady_iteration_s")
    assert steady["intervals"] == []
    # A table of a validator before the interval existed is still drawn, without bars.
    older = tables["validation"].drop(columns=["predicted_ci95_low", "predicted_ci95_high"])
    assert plot_validation(_axes(), older, quantity="total_wall_clock_s")["intervals"] == []


def test_gantt_draws_every_span_of_one_iteration_with_microbatch_numbers():
    spans = _spans(iterations=(0, 1))
    drawn = plot_pipeline_gantt(_axes(), spans, iteration=1)
    one_iteration = spans[spans["iteration"] == 1]
    assert sum(len(container.patches) for container in drawn["bars"]) == len(one_iteration)
    assert {container.patches[0].get_gid() for container in drawn["bars"]} == {"forward", "backward", "send", "optimizer"}
    # 3 stages × 4 microbatches × (forward + backward); sends are too thin, the optimizer has no microbatch.
    assert len(drawn["labels"]) == 3 * 4 * 2
    first_forward = drawn["bars"][0].patches[0]
    assert first_forward.get_x() == 0.0  # times are relative to the iteration's first span


def test_gantt_draws_real_spans_with_only_the_lowest_rank_of_each_stage():
    spans = _spans()
    second_replica = spans.assign(rank=spans["rank"] + 3)  # data-parallel degree 2
    drawn = plot_pipeline_gantt(_axes(), pd.concat([spans, second_replica])[[*GANTT_COLUMNS, "rank"]])
    assert sum(len(container.patches) for container in drawn["bars"]) == len(spans)


def test_a_method_has_the_same_colour_in_every_figure(tables):
    loss = _colours_by_method(plot_loss_vs_wallclock(_axes(), tables["trajectories"])["lines"])
    time = _colours_by_method(plot_time_to_target(_axes(), tables["summary"])["lines"])
    validation = _colours_by_method(plot_validation(_axes(), tables["validation"])["points"])
    for method in METHODS:
        assert loss[method] == time[method] == validation[method] == to_hex(method_color(method))


@pytest.mark.parametrize(
    "draw, x_unit, y_unit",
    [
        (lambda ax, t: plot_loss_vs_wallclock(ax, t["trajectories"]), "(hours)", "(nats/token)"),
        (lambda ax, t: plot_time_to_target(ax, t["summary"]), "(%/h)", "(hours)"),
        (lambda ax, t: plot_speedup(ax, t["summary"]), "(%/h)", "(×)"),
        (lambda ax, t: plot_badput_breakdown(ax, t["runs"]), "", "(fraction)"),
        (lambda ax, t: plot_checkpoint_interval(ax, t["checkpoint_intervals"]), "(iterations)", "(% of wall-clock)"),
        (lambda ax, t: plot_optimal_interval(ax, t["checkpoint_intervals"]), "(iterations)", "(minutes)"),  # its runs take minutes
        (lambda ax, t: plot_validation(ax, t["validation"], quantity="steady_iteration_s"), "(s)", "(s)"),
        (lambda ax, t: plot_pipeline_gantt(ax, t["iteration_spans"]), "(s)", ""),
    ],
)
def test_axis_labels_carry_units_and_every_figure_has_a_title_and_legend(tables, draw, x_unit, y_unit):
    ax = _axes()
    draw(ax, tables)
    assert x_unit in ax.get_xlabel() and y_unit in ax.get_ylabel()
    assert ax.get_title() and ax.get_legend() is not None


def test_make_all_figures_writes_pngs_and_skips_missing_inputs(tables, tmp_path):
    for name in ("runs", "summary", "trajectories", "iteration_spans"):
        tables[name].to_csv(tmp_path / f"{name}.csv", index=False)
    (tmp_path / "manifest.json").write_text(json.dumps({"scenario": {"target": {"loss": 3.0}}}))
    written = make_all_figures(tmp_path)
    assert sorted(path.name for path in written) == sorted(
        ["loss_vs_wallclock.png", "time_to_target.png", "speedup.png", "badput_breakdown.png", "pipeline_gantt.png"]
    )
    assert all(path.parent == tmp_path / "figures" and path.read_bytes()[:4] == b"\x89PNG" for path in written)
    skipped = dict(make_figures(tmp_path, tmp_path / "again").skipped)
    assert set(skipped) == {"checkpoint_interval", "optimal_interval", "validation", "setback_sensitivity"}


def test_make_all_figures_skips_an_empty_interval_table(tables, tmp_path):
    pd.DataFrame(columns=list(INTERVAL_COLUMNS)).to_csv(tmp_path / "checkpoint_intervals.csv", index=False)
    tables["validation"].to_csv(tmp_path / "validation.csv", index=False)
    report = make_figures(tmp_path)
    assert [path.name for path in report.written] == ["validation.png"]
    assert "has no rows" in dict(report.skipped)["checkpoint_interval"]


def test_importing_the_figures_package_leaves_pyplot_unloaded():
    code = "import sys, churnsim.figures; print('matplotlib.pyplot' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "False"


def test_time_to_target_at_a_single_failure_rate_draws_error_bars(tables):
    one_rate = tables["summary"][tables["summary"]["failure_probability_per_stage_hour"] == 0.1]
    drawn = plot_time_to_target(_axes(), one_rate)
    assert len(drawn["bands"]) == len(METHODS)
    assert all(child.get_gid() == method for band, method in zip(drawn["bands"], METHODS) for child in band.get_children())


def test_gantt_draws_the_chosen_method_of_a_simulated_spans_table():
    spans = pd.concat([_spans().assign(method="checkpoint"), _spans(num_stages=2).assign(method="redundant")])
    ax = _axes()
    drawn = plot_pipeline_gantt(ax, spans, method="redundant")
    assert sum(len(container.patches) for container in drawn["bars"]) == len(_spans(num_stages=2))
    assert "redundant (Bamboo)" in ax.get_title()
    with pytest.raises(InputError, match="method"):
        plot_pipeline_gantt(_axes(), spans, method="checkfree")


def test_loss_between_two_rows_follows_the_loss_curve_not_a_straight_line():
    curve = lambda progress: 6.0 / (1 + 0.05 * progress)  # noqa: E731
    dense = [("tiny", 0.1, "checkfree", 0, 10.0 * p, p, curve(p)) for p in range(0, 101, 5)]
    sparse = [("tiny", 0.1, "none", 0, 0.0, 0, curve(0)), ("tiny", 0.1, "none", 0, 800.0, 100, curve(100))]
    trajectories = pd.DataFrame(dense + sparse, columns=list(TRAJECTORY_COLUMNS))
    ax = _axes()
    drawn = plot_loss_vs_wallclock(ax, trajectories, methods=["none"])
    (line,) = drawn["lines"]
    assert ax.get_xlabel() == "wall-clock time (minutes)"  # 800 s: minutes read best
    minutes, loss = line.get_xdata(), line.get_ydata()
    halfway = np.argmin(np.abs(minutes - 400.0 / 60))
    assert loss[halfway] == pytest.approx(curve(50), rel=0.02)  # a straight line would give ≈ 3.27
    assert (loss[0], loss[-1]) == (curve(0), curve(100))


def test_methods_argument_restricts_the_lines_and_rejects_absent_methods(tables):
    drawn = plot_time_to_target(_axes(), tables["summary"], methods=["checkfree", "checkpoint"])
    assert [line.get_gid() for line in drawn["lines"]] == ["checkpoint", "checkfree"]  # fixed order
    with pytest.raises(InputError, match="async_checkpoint"):
        plot_badput_breakdown(_axes(), tables["runs"], methods=["async_checkpoint"])
