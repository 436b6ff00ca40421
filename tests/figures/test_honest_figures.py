"""Figures that do not mislead, checked on the Axes' artists rather than on pixels: a method that
missed the target in some replications is drawn at its bound, runs stopped at the wall-clock cap are
marked, labels neither overlap nor are crossed by reference lines, ablations are lighter than the
contenders, and the palette stays distinct for colour-blind viewers."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb, to_rgba
from matplotlib.figure import Figure
from matplotlib.text import Text

from churnsim.calibration.methods import METHOD_NAMES
from churnsim.calibration.statistics import mean_with_ci95
from churnsim.calibration.tables import RUN_COLUMNS, SUMMARY_COLUMNS, TIME_CATEGORIES, TRAJECTORY_COLUMNS
from churnsim.figures.gallery import GALLERY_FIGURES, draw_gallery
from churnsim.figures.make_all import render_figures
from churnsim.figures.style import COMMUNICATION_KINDS, METHOD_COLORS, SPAN_KIND_COLORS, STOPPED_AT_CAP_TEXT, is_ablation, place_labels

from test_figures import _intervals, _spans

CAP_S = 10 * 3600.0
RATES = (0.05, 0.1, 0.2)
REPLICATIONS = 10
CONTENDERS = ("none", "checkpoint", "redundant", "checkfree", "checkfree_plus")
ABLATIONS = ("copy", "uniform", "random")
PARTIAL = "checkfree"
"""At the highest rate 7 of its 10 replications reach the target, the other 3 hit the cap."""
NEVER = ("checkfree_plus", "copy", "random")
"""At the highest rate none of their replications reaches the target: all hit the cap, at one bound."""


def _hours(method: str, rate: float, replication: int) -> float:
    base = {"none": 3.0, "checkpoint": 5.0, "redundant": 4.0, "checkfree": 4.5, "checkfree_plus": 6.0, "copy": 6.5, "uniform": 7.0, "random": 8.0}
    return base[method] * (1 + rate) + 0.05 * replication


def _missed(method: str, rate: float, replication: int) -> bool:
    if rate != max(RATES):
        return False
    return method in NEVER or (method == PARTIAL and replication >= 7)


def _runs() -> pd.DataFrame:
    rows = []
    for rate, method, replication in itertools.product(RATES, CONTENDERS + ABLATIONS, range(REPLICATIONS)):
        missed = _missed(method, rate, replication)
        wall = CAP_S if missed else 3600.0 * _hours(method, rate, replication)
        badput = {category: 0.0 for category in TIME_CATEGORIES}
        goodput = 0.004 * wall  # a sliver, as on a WAN
        badput |= {"goodput_s": goodput, "communication_s": 0.6 * wall, "convergence_setback_s": (0.4 - 0.004) * wall}
        rows.append(dict(
            scenario="tiny", failure_probability_per_stage_hour=rate, method=method, replication=replication, seed=replication,
            reached_target=not missed, wall_clock_s=wall, time_to_target_s=np.nan if missed else wall, target_iterations=200,
            progress_iterations=20 if missed else 200, iterations_executed=300, healthy_iteration_time_s=10.0, num_failures=40,
            setbacks_calibrated=False, **badput,
        ))  # fmt: skip
    return pd.DataFrame(rows, columns=list(RUN_COLUMNS))


def _summary(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (rate, method), group in runs.groupby(["failure_probability_per_stage_hour", "method"], sort=False):
        reached = group["reached_target"].to_numpy(dtype=bool)
        mean, low, high = mean_with_ci95(group.loc[reached, "time_to_target_s"])
        row = dict(
            scenario="tiny", failure_probability_per_stage_hour=rate, method=method, num_replications=len(group),
            fraction_reached=reached.mean(), time_to_target_mean_s=mean, time_to_target_ci95_low_s=low,
            time_to_target_ci95_high_s=high, time_to_target_at_least_s=group["wall_clock_s"].mean(), setbacks_calibrated=False,
        )  # fmt: skip
        for baseline in ("checkpoint", "redundant"):
            base = runs[(runs["failure_probability_per_stage_hour"] == rate) & (runs["method"] == baseline)]
            ratios = base["wall_clock_s"].to_numpy() / group["wall_clock_s"].to_numpy()
            speed = mean_with_ci95(ratios[reached]) if reached.any() else (np.nan,) * 3
            row |= dict(zip([f"speedup_vs_{baseline}_{s}" for s in ("mean", "ci95_low", "ci95_high")], speed))
            row[f"speedup_vs_{baseline}_at_most"] = ratios.mean()
        rows.append(row)
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def _trajectories() -> pd.DataFrame:
    """Loss 6/(1 + 0.02 p) toward target 2 at p = 200; a method that never reaches it is set back to
    p = 0 again and again until the cap."""
    rows = []
    for rate, method in itertools.product(RATES, CONTENDERS + ABLATIONS):
        if _missed(method, rate, 0):
            progress = np.tile([0.0, 10.0, 20.0], 10)
            time_s = np.linspace(0, CAP_S, len(progress))
        else:
            progress = np.linspace(0, 200, 21)
            time_s = np.linspace(0, 3600.0 * _hours(method, rate, 0), len(progress))
        rows += [("tiny", rate, method, 0, t, p, 6.0 / (1 + 0.01 * p)) for t, p in zip(time_s, progress)]
    return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("results")
    runs = _runs()
    intervals = _intervals()
    # Intervals of 100 and more never reach the target: every run there hit the cap.
    intervals.loc[(intervals["source"] == "simulated") & (intervals["interval_iterations"] >= 100), "time_to_target_mean_s"] = np.nan
    for name, table in {
        "runs": runs, "summary": _summary(runs), "trajectories": _trajectories(), "checkpoint_intervals": intervals, "iteration_spans": _spans(),
    }.items():  # fmt: skip
        table.to_csv(directory / f"{name}.csv", index=False)
    manifest = {"scenario": {"name": "tiny", "target": {"loss": 2.0, "max_wall_clock_s": CAP_S}}, "interval_study_rate": 0.1}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.fixture(scope="module")
def figures(results) -> dict[str, Figure]:
    return {path.stem: figure for path, figure in render_figures(results)}


def _lines(figure: Figure, gid: str) -> list:
    return [line for ax in figure.axes for line in ax.get_lines() if line.get_gid() == gid]


def _legend_texts(figure: Figure) -> list[str]:
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None] + list(figure.legends)
    return [text.get_text() for legend in legends for text in legend.get_texts()]


# A method that missed the target in some replications: at its bound, never at its mean -----------


def test_a_partial_method_is_drawn_at_its_bound_with_an_upward_triangle(figures):
    summary = _summary(_runs())
    partial = summary[(summary["method"] == PARTIAL) & (summary["failure_probability_per_stage_hour"] == max(RATES))].iloc[0]
    assert 0 < partial["fraction_reached"] < 1
    (bound,) = _lines(figures["time_to_target"], f"bound:{PARTIAL}")
    assert bound.get_marker() == "^" and to_rgba(bound.get_markerfacecolor())[:3] == (1.0, 1.0, 1.0)  # open triangle
    np.testing.assert_allclose(bound.get_xdata(), [100 * max(RATES)])
    np.testing.assert_allclose(bound.get_ydata(), [partial["time_to_target_at_least_s"] / 3600])
    # No artist of the method shows the optimistic mean of the 7 runs that reached it.
    optimistic_hours = partial["time_to_target_mean_s"] / 3600
    assert optimistic_hours < partial["time_to_target_at_least_s"] / 3600 - 0.5
    for ax in figures["time_to_target"].axes:
        for line in ax.get_lines():
            if str(line.get_gid()).endswith(PARTIAL) and not str(line.get_gid()).startswith("bound"):
                points = np.column_stack([line.get_xdata(), line.get_ydata()])
                assert not np.any(np.isclose(points[:, 0], 100 * max(RATES)) & np.isclose(points[:, 1], optimistic_hours))


def test_a_partial_speedup_is_drawn_at_its_upper_bound_with_a_downward_triangle(figures):
    summary = _summary(_runs())
    partial = summary[(summary["method"] == PARTIAL) & (summary["failure_probability_per_stage_hour"] == max(RATES))].iloc[0]
    bounds = _lines(figures["speedup"], f"bound:{PARTIAL}")
    assert len(bounds) == 2  # one panel per baseline
    assert all(line.get_marker() == "v" for line in bounds)
    drawn = sorted(float(line.get_ydata()[0]) for line in bounds)
    assert drawn == pytest.approx(sorted([partial["speedup_vs_checkpoint_at_most"], partial["speedup_vs_redundant_at_most"]]))


def test_the_bound_label_says_it_is_a_bound_and_how_many_reached(figures):
    labels = [text.get_text() for ax in figures["time_to_target"].axes for text in ax.texts if text.get_gid() == f"bound_label:{PARTIAL}"]
    assert len(labels) == 1 and re.fullmatch(r"≥ \d+ h, 7/10 reached", labels[0])
    speedups = [text.get_text() for ax in figures["speedup"].axes for text in ax.texts if text.get_gid() == f"bound_label:{PARTIAL}"]
    assert len(speedups) == 2 and all(re.fullmatch(r"≤ \d\.\d\d×, 7/10 reached", text) for text in speedups)


# Runs stopped at the wall-clock cap: marked in every figure that shows them ------------------------


def test_every_figure_that_shows_capped_runs_says_stopped_at_cap(figures):
    for name in ("time_to_target", "speedup", "badput_breakdown", "optimal_interval", "checkpoint_interval"):
        assert any(STOPPED_AT_CAP_TEXT in text for text in _legend_texts(figures[name])), name
    reasons = [text.get_text() for text in figures["loss_vs_wallclock"].axes[0].texts if str(text.get_gid()).startswith("reason:")]
    assert reasons and all("stopped at the 10 h cap" in reason for reason in reasons)


def test_badput_hatches_the_bars_of_methods_with_capped_runs_and_draws_the_cap(figures):
    hours, shares, goodput = figures["badput_breakdown"].axes
    labels = [tick.get_text() for tick in hours.get_xticklabels()]
    for ax in (hours, shares, goodput):
        hatched_positions = {round(patch.get_x() + patch.get_width() / 2, 6) for patch in ax.patches if patch.get_hatch()}
        ticks = {round(tick, 6): label for tick, label in zip(ax.get_xticks(), labels)}
        hatched = {ticks[position] for position in hatched_positions}
        assert hatched == {"CheckFree", "CheckFree+", "copy (ablation)", "random init (ablation)"}
    (cap,) = _lines(figures["badput_breakdown"], "reference:cap")
    assert cap.get_ydata()[0] == pytest.approx(CAP_S / 3600)
    counts = sorted(text.get_text() for text in hours.texts)
    assert counts == sorted(["3/10\ncapped", "10/10\ncapped", "10/10\ncapped", "10/10\ncapped"])


def test_the_loss_figure_gives_a_reason_drawn_from_the_data(figures):
    (reason,) = [text for text in figures["loss_vs_wallclock"].axes[0].texts if text.get_gid() == "reason:checkfree_plus"]
    # Nine set-backs to p = 0 in the trajectory, never past 20 of 200 iterations; 40 failures and 60 %
    # communication wait in runs.csv.
    assert "progress set back 9 times, never past 20 of 200 iterations" in reason.get_text()
    assert "after 40 failures" in reason.get_text() and "60 % of its wall-clock went to communication wait" in reason.get_text()


def test_the_stall_figure_carries_no_instruction_and_rings_capped_intervals(figures):
    texts = _legend_texts(figures["checkpoint_interval"])
    assert not [text for text in texts if re.search(r"append|\.py|benchmarks/", text)]
    rings = _lines(figures["checkpoint_interval"], "capped:checkpoint")
    assert rings and sorted(rings[0].get_xdata()) == [100.0]


# Labels: never on top of each other, never struck through ----------------------------------------


def _labels(ax) -> list:
    return [text for text in ax.texts if text.get_visible() and text.get_text().strip()]


def _box(text, renderer):
    """The box of a label's words: an Annotation's own extent also spans its leader line."""
    if hasattr(text, "update_positions"):
        text.update_positions(renderer)
    return Text.get_window_extent(text, renderer)


def _horizontal_reference_lines(ax) -> list:
    return [
        line for line in ax.get_lines()
        if str(line.get_gid()).startswith("reference") or line.get_gid() == "not_reached_rule"
    ]  # fmt: skip


def _overlap_px(a, b) -> float:
    return max(min(a.x1, b.x1) - max(a.x0, b.x0), 0.0) * max(min(a.y1, b.y1) - max(a.y0, b.y0), 0.0)


def test_no_two_labels_overlap_in_any_figure(figures):
    checked = 0
    for name, figure in figures.items():
        if name == "pipeline_gantt":
            continue  # its numbers sit inside their bars, which the synthetic schedule lets overlap
        renderer = figure.canvas.get_renderer()
        for ax in figure.axes:
            boxes = [(text.get_text(), _box(text, renderer)) for text in _labels(ax)]
            for (first, a), (second, b) in itertools.combinations(boxes, 2):
                checked += 1
                assert _overlap_px(a, b) < 1.0, f"{name}: {first!r} overlaps {second!r}"
    # Three methods share one bound at the highest rate: the check is not vacuous.
    assert checked > 10


def test_no_label_is_crossed_by_a_reference_line(figures):
    checked = 0
    for name, figure in figures.items():
        renderer = figure.canvas.get_renderer()
        for ax in figure.axes:
            for line in _horizontal_reference_lines(ax):
                path = line.get_transform().transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
                if np.ptp(path[:, 1]) > 0.5:
                    continue  # not horizontal
                y, x0, x1 = path[0, 1], path[:, 0].min(), path[:, 0].max()
                for text in _labels(ax):
                    box = _box(text, renderer)
                    checked += 1
                    crosses = box.y0 < y < box.y1 and box.x0 < x1 and x0 < box.x1
                    assert not crosses, f"{name}: {line.get_gid()} strikes through {text.get_text()!r}"
    assert checked > 0


def test_the_placer_moves_labels_that_share_a_point_apart_and_off_a_line():
    figure = Figure(figsize=(4, 3))
    ax = figure.add_subplot()
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10)
    line = ax.axhline(5.0, gid="reference:test")
    labels = [ax.annotate(f"label {n}", (5.0, 5.0), xytext=(4, 0), textcoords="offset points", va="center") for n in range(3)]
    place_labels(ax, labels, [line])
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure).draw()
    renderer = figure.canvas.get_renderer()
    boxes = [label.get_window_extent(renderer) for label in labels]
    assert all(_overlap_px(a, b) < 1.0 for a, b in itertools.combinations(boxes, 2))
    y = ax.transData.transform((0, 5.0))[1]
    assert not any(box.y0 < y < box.y1 for box in boxes)
    # Drawing again places them the same way.
    FigureCanvasAgg(figure).draw()
    assert [label.get_window_extent(renderer).y0 for label in labels] == pytest.approx([box.y0 for box in boxes])


# Ablations lighter than contenders ---------------------------------------------------------------


def test_ablations_are_in_a_panel_of_their_own_and_lighter(figures):
    contenders, ablations = figures["time_to_target"].axes[:2]
    assert {line.get_gid() for line in ablations.get_lines()} & set(ABLATIONS)
    assert not {line.get_gid() for line in contenders.get_lines()} & set(ABLATIONS)
    for figure_name in ("time_to_target", "speedup"):
        lines = [line for ax in figures[figure_name].axes for line in ax.get_lines() if line.get_gid() in METHOD_COLORS]
        light = [line for line in lines if is_ablation(line.get_gid())]
        heavy = [line for line in lines if not is_ablation(line.get_gid())]
        assert light and heavy
        assert max(line.get_alpha() or 1.0 for line in light) < min(line.get_alpha() or 1.0 for line in heavy)
        assert max(line.get_linewidth() for line in light) < min(line.get_linewidth() for line in heavy)
    hours = figures["badput_breakdown"].axes[0]
    labels = [tick.get_text() for tick in hours.get_xticklabels()]
    ablation_positions = [tick for tick, label in zip(hours.get_xticks(), labels) if "ablation" in label]
    for patch in hours.patches:
        centre = patch.get_x() + patch.get_width() / 2
        alpha = patch.get_alpha() if patch.get_alpha() is not None else 1.0
        assert (alpha < 1.0) == any(np.isclose(centre, ablation_positions)), centre


# A palette for colour-blind viewers --------------------------------------------------------------

# Machado, Oliveira & Fernandes (2009), severity 1, on linear RGB.
DEUTERANOPIA = np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]])
PROTANOPIA = np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]])
MIN_DELTA_E = 12.0
"""CIE76 distance below which two colours are easily confused at the size of a marker or a line."""


def _linear(rgb: np.ndarray) -> np.ndarray:
    return np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)


def _lab(linear_rgb: np.ndarray) -> np.ndarray:
    to_xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = to_xyz @ np.clip(linear_rgb, 0.0, 1.0) / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


@pytest.mark.parametrize("vision", [np.eye(3), DEUTERANOPIA, PROTANOPIA], ids=["typical", "deuteranopia", "protanopia"])
def test_every_two_method_colours_stay_apart_for_colour_blind_viewers(vision):
    assert set(METHOD_COLORS) == set(METHOD_NAMES)
    seen = {method: _lab(vision @ _linear(np.array(to_rgb(colour)))) for method, colour in METHOD_COLORS.items()}
    for (first, a), (second, b) in itertools.combinations(seen.items(), 2):
        assert np.linalg.norm(a - b) >= MIN_DELTA_E, f"{first} and {second}"


def test_the_checking_simulation_does_confuse_red_and_green():
    # The check above can fail: under deuteranopia a pure red and a green of similar lightness meet.
    red, green = (_lab(DEUTERANOPIA @ _linear(np.array(to_rgb(colour)))) for colour in ("#D00000", "#6F8F00"))
    assert np.linalg.norm(red - green) < MIN_DELTA_E


# The gallery ---------------------------------------------------------------------------------------


def test_the_gallery_writes_only_its_figures_into_the_directory_given(results, tmp_path):
    written = draw_gallery(results, tmp_path / "gallery")
    assert [path.stem for path in written] == list(GALLERY_FIGURES)
    assert sorted(path.name for path in (tmp_path / "gallery").iterdir()) == sorted(f"{name}.png" for name in GALLERY_FIGURES)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gallery"]


def test_every_gallery_figure_is_committed_and_shown_in_the_docs():
    root = Path(__file__).resolve().parents[2]
    committed = sorted(path.stem for path in (root / "figures" / "gallery").glob("*.png"))
    assert committed == sorted(GALLERY_FIGURES)
    page = (root / "docs" / "gallery.md").read_text(encoding="utf-8")
    shown = re.findall(r"!\[[^\]]*\]\(gallery/([a-z_]+)\.png\)", page)
    assert sorted(shown) == sorted(GALLERY_FIGURES)


@pytest.mark.parametrize("vision", [np.eye(3), DEUTERANOPIA, PROTANOPIA], ids=["typical", "deuteranopia", "protanopia"])
def test_compute_span_colours_of_the_gantt_chart_stay_apart_for_colour_blind_viewers(vision):
    compute = {kind: colour for kind, colour in SPAN_KIND_COLORS.items() if kind not in COMMUNICATION_KINDS}
    seen = {kind: _lab(vision @ _linear(np.array(to_rgb(colour)))) for kind, colour in compute.items()}
    for (first, a), (second, b) in itertools.combinations(seen.items(), 2):
        assert np.linalg.norm(a - b) >= MIN_DELTA_E, f"{first} and {second}"


def test_setback_sensitivity_draws_a_partial_point_at_its_bound():
    from churnsim.figures import plot_setback_sensitivity
    from test_setback_sensitivity_figure import _table

    table = _table()
    partial = (table["method"] == "checkfree") & (table["setback_scale"] == 3.0) & (table["failure_probability_per_stage_hour"] == 0.33)
    table.loc[partial, ["fraction_reached", "time_to_target_at_least_s"]] = [2 / 3, 400.0 * 3600]
    ax = Figure().add_subplot()
    drawn = plot_setback_sensitivity(ax, table, failure_probability=0.33, cap_s=CAP_S)
    (triangle,) = [line for line in drawn["bounds"] if line.get_gid() == "bound:checkfree"]
    assert triangle.get_marker() == "^"
    np.testing.assert_allclose(np.column_stack([triangle.get_xdata(), triangle.get_ydata()]), [[3.0, 400.0]])
    (line,) = [line for line in drawn["lines"] if line.get_gid() == "checkfree"]
    assert 3.0 not in list(line.get_xdata())  # the optimistic mean is not on the line
    assert [text.get_text() for text in drawn["labels"]] == ["≥ 400 h, 2/3 reached"]
