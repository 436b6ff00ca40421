"""Every figure `churnsim plot` makes, checked without looking at pixels: size, legends clear of the
data, no 'nan' in any text, titles naming the scenario and rate, marks for targets not reached."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from matplotlib.text import Text

from churnsim.calibration.tables import TRAJECTORY_COLUMNS
from churnsim.figures.make_all import render_figures
from churnsim.figures.style import FIGURE_DPI, NOT_REACHED_TEXT

from test_figures import _intervals, _runs, _spans, _summary, _validation
from test_setback_sensitivity_figure import _crossovers, _table

MAX_WIDTH_PX = 2400


def _results_directory(tmp_path, *, not_reached: bool = True):
    """A what-if's tables in which checkfree never reaches the target at the highest rate."""
    runs = _runs()
    summary = _summary(runs)
    trajectories = _trajectories()
    if not_reached:
        highest = summary["failure_probability_per_stage_hour"] == summary["failure_probability_per_stage_hour"].max()
        failing = highest & (summary["method"] == "checkfree")
        summary.loc[failing, ["fraction_reached"]] = 0.0
        summary.loc[failing, [c for c in summary.columns if c.startswith(("time_to_target_", "speedup_"))]] = np.nan
        partial = (summary["method"] == "redundant") & highest
        summary.loc[partial, "fraction_reached"] = 2 / 3
        # Its bounds, the missed run counted when it was stopped: 10 h at least, 0.5× at most.
        summary.loc[partial, "time_to_target_at_least_s"] = 10 * 3600.0
        summary.loc[partial, ["speedup_vs_checkpoint_at_most", "speedup_vs_redundant_at_most"]] = 0.5
    for name, table in {
        "runs": runs, "summary": summary, "trajectories": trajectories, "checkpoint_intervals": _intervals(),
        "validation": _validation_with_a_measured_zero(), "iteration_spans": _spans(),
        "setback_sensitivity": _setback_sensitivity_at_four_rates(), "setback_crossovers": _crossovers(),
    }.items():  # fmt: skip
        table.to_csv(tmp_path / f"{name}.csv", index=False)
    manifest = {"scenario": {"name": "tiny-10pct", "target": {"loss": 3.0}}, "interval_study_rate": 0.1}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


def _trajectories() -> pd.DataFrame:
    """Loss 6/(1 + 0.005 p), the target 3 at p = 200; at 20 %/h checkfree gives up at p = 25."""
    rows = []
    for rate in (0.05, 0.1, 0.2):
        for method, last_progress in (("none", 200), ("checkpoint", 200), ("redundant", 200), ("checkfree", 200 if rate < 0.2 else 25)):
            progress = np.linspace(0, last_progress, 41 if method != "none" else 2)
            time_s = np.linspace(0, 10_000 * (1 + rate) * last_progress / 200, len(progress))
            rows += [("tiny", rate, method, 0, t, p, 6.0 / (1 + 0.005 * p)) for t, p in zip(time_s, progress)]
    return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))


def _setback_sensitivity_at_four_rates() -> pd.DataFrame:
    table = _table()
    return pd.concat([table, table.assign(failure_probability_per_stage_hour=table["failure_probability_per_stage_hour"] / 2)])


def _validation_with_a_measured_zero() -> pd.DataFrame:
    validation = _validation()
    distance = validation[validation["quantity"] == validation["quantity"].iloc[0]].assign(
        quantity="loss_curve_distance", measured=0.0, predicted=0.2, relative_error=np.nan, predicted_ci95_low=np.nan, predicted_ci95_high=np.nan
    )
    stall = distance.assign(quantity="checkpoint_stall_s", measured=2.0, predicted=2.1, relative_error=0.05)
    return pd.concat([validation, distance, stall], ignore_index=True)


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    directory = _results_directory(tmp_path_factory.mktemp("results"))
    return {path.stem: figure for path, figure in render_figures(directory)}


def test_every_figure_of_a_whatif_is_made(figures):
    assert set(figures) == {
        "loss_vs_wallclock", "time_to_target", "speedup", "badput_breakdown", "checkpoint_interval",
        "optimal_interval", "validation", "pipeline_gantt", "setback_sensitivity",
    }  # fmt: skip


def test_every_figure_fits_a_page_width_at_the_saved_resolution(figures):
    for name, figure in figures.items():
        width_px, height_px = figure.get_size_inches() * FIGURE_DPI
        assert width_px <= MAX_WIDTH_PX and height_px <= MAX_WIDTH_PX, f"{name}: {width_px:.0f}×{height_px:.0f} px"


def _overlap_px(a, b) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(width, 0.0) * max(height, 0.0)


def test_no_legend_covers_any_axes(figures):
    for name, figure in figures.items():
        renderer = figure.canvas.get_renderer()
        legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None] + list(figure.legends)
        assert legends, f"{name} has no legend"
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax in figure.axes:
                if ax.axison:
                    assert _overlap_px(box, ax.get_window_extent(renderer)) < 1.0, f"{name}: a legend covers an axes"


def test_no_text_says_nan(figures):
    for name, figure in figures.items():
        texts = [text.get_text() for text in figure.findobj(Text)]
        assert not [text for text in texts if "nan" in text.lower().replace("nanoseconds", "")], name


def test_titles_name_the_scenario_and_the_failure_rate(figures):
    for name in ("loss_vs_wallclock", "time_to_target", "speedup", "badput_breakdown"):
        assert figures[name].get_suptitle() == "tiny", name
    for name in ("checkpoint_interval", "optimal_interval"):
        assert figures[name].get_suptitle() == "tiny-10pct"
        assert "10 %/h" in figures[name].axes[0].get_title()
    for name in ("loss_vs_wallclock", "badput_breakdown"):
        assert all("20 %/h" in ax.get_title() for ax in figures[name].axes)


def _not_reached_marks(figure, method: str):
    return [line for ax in figure.axes for line in ax.get_lines() if line.get_gid() == f"not_reached:{method}"]


def test_a_method_that_did_not_reach_the_target_gets_an_x_mark(figures):
    for name in ("time_to_target", "speedup"):
        marks = _not_reached_marks(figures[name], "checkfree")
        assert marks and all(mark.get_marker() == "x" for mark in marks), name
        assert all(mark.get_xdata()[0] == pytest.approx(20.0) for mark in marks)  # %/h
        assert not _not_reached_marks(figures[name], "checkpoint")
    loss = figures["loss_vs_wallclock"]
    (mark,) = _not_reached_marks(loss, "checkfree")
    assert mark.get_ydata()[0] == pytest.approx(6.0 / (1 + 0.005 * 25))
    assert any(NOT_REACHED_TEXT in text.get_text() for text in loss.axes[0].texts)


def test_x_marks_sit_above_every_data_point(figures):
    ax = figures["time_to_target"].axes[0]
    (mark,) = _not_reached_marks(figures["time_to_target"], "checkfree")
    data = [line.get_ydata() for line in ax.get_lines() if len(line.get_ydata()) and not str(line.get_gid()).startswith("not_reached")]
    top_of_data = max(np.nanmax(ydata) for ydata in data)
    low, high = ax.get_ylim()
    assert mark.get_ydata()[0] > (top_of_data - low) / (high - low)  # axes fraction


def test_a_partly_reached_point_says_how_many_replications_reached_and_its_bound(figures):
    texts = [text.get_text() for text in figures["time_to_target"].axes[0].texts]
    assert "≥ 10 h, 2/3 reached" in texts  # in the figure's unit
    over_checkpoint = figures["speedup"].axes[0]  # the partly reached method, redundant, is the other panel's baseline
    assert "≤ 0.50×, 2/3 reached" in [text.get_text() for text in over_checkpoint.texts]


def test_partly_reached_labels_stay_inside_their_axes(figures):
    """The labels sit right of their point; at the last rate the axis widens to hold them, since a
    legend may sit just outside it."""
    for name in ("time_to_target", "speedup"):
        figure = figures[name]
        renderer = figure.canvas.get_renderer()
        for ax in figure.axes:
            frame = ax.get_window_extent(renderer)
            for text in ax.texts:
                assert text.get_window_extent(renderer).x1 <= frame.x1 + 1, f"{name}: {text.get_text()!r} runs past its axes"


def test_badput_shows_hours_shares_and_goodput_on_its_own_scale(figures):
    hours, shares, goodput = figures["badput_breakdown"].axes
    assert "hours" in hours.get_ylabel() and "fraction" in shares.get_ylabel() and "goodput (%" in goodput.get_ylabel()
    assert hours.get_ylim()[1] > 1.0 and shares.get_ylim() == (0.0, 1.0)
    # Goodput is a sliver of the stacked bars; on its own axis its tallest bar fills most of the height.
    tallest = max(patch.get_height() for patch in goodput.patches)
    assert tallest / goodput.get_ylim()[1] > 0.5
    assert all(text.get_text().endswith(" %") for text in goodput.texts)


@pytest.mark.parametrize("name", ["validation", "setback_sensitivity"])
def test_many_panels_wrap_at_three_per_row(figures, name):
    visible = [ax for ax in figures[name].axes if ax.axison]
    assert len(visible) == 4
    assert len({round(ax.get_position().y0, 3) for ax in visible}) == 2


def test_the_no_failure_loss_curve_is_not_a_chord(figures):
    ax = figures["loss_vs_wallclock"].axes[0]
    (none,) = [line for line in ax.get_lines() if line.get_gid() == "none"]
    hours, loss = none.get_xdata(), none.get_ydata()
    assert len(hours) > 50
    # On the curve 6/(1 + 0.005 p), p linear in time (200 iterations in 12,000 s at the 20 %/h drawn);
    # a chord between the two table rows would lie above it by up to 0.9 nats/token.
    progress = 200 * hours * 3600 / 12_000
    np.testing.assert_allclose(loss, 6.0 / (1 + 0.005 * progress), rtol=0.005)


def test_gantt_compute_spans_are_at_least_the_minimum_visible_width(tmp_path):
    spans = _spans()
    # A long send makes each compute span a hairline against the iteration.
    spans = pd.concat([spans, spans.iloc[:1].assign(kind="send", start_s=0.0, end_s=1000.0)], ignore_index=True)
    spans.to_csv(tmp_path / "iteration_spans.csv", index=False)
    (path, figure), = render_figures(tmp_path)
    ax = figure.axes[0]
    xmin, xmax = ax.get_xlim()
    compute = [patch for patch in ax.patches if patch.get_gid() in ("forward", "backward", "optimizer")]
    assert compute and min(patch.get_width() for patch in compute) >= 0.005 * 1000.0 * 0.999
    assert "drawn" in ax.get_legend().get_title().get_text()


def test_every_text_lies_inside_the_figure(figures):
    for name, figure in figures.items():
        renderer = figure.canvas.get_renderer()
        frame = figure.bbox
        undrawn = set()  # labels of ticks outside the axis limits exist but are not drawn
        for ax in figure.axes:
            for axis in (ax.xaxis, ax.yaxis):
                low, high = sorted(axis.get_view_interval())
                for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                    if not low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                        undrawn |= {id(tick.label1), id(tick.label2)}
        for text in figure.findobj(Text):
            if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
                continue
            box = text.get_window_extent(renderer)
            inside = box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1
            assert inside, f"{name}: {text.get_text()!r} is cut off"
