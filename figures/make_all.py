"""Every figure from a results directory: one PNG per figure whose input table is there.

Input tables (CSV, or Parquet beside it) as written by `churnsim whatif`, `simulate`, `validate`
and run records: runs, summary, trajectories, checkpoint_intervals, validation, iteration_spans
(or a run record's spans), setback_sensitivity (with setback_crossovers). Figures are `matplotlib.figure.Figure` objects rendered by Agg; pyplot
is never imported, so nothing here touches global figure state or needs a display.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from churnsim.calibration.methods import speedup_baselines
from churnsim.calibration.tables import (
    CROSSOVER_COLUMNS,
    GANTT_COLUMNS,
    INTERVAL_COLUMNS,
    RUN_COLUMNS,
    SENSITIVITY_COLUMNS,
    SUMMARY_COLUMNS,
    TRAJECTORY_COLUMNS,
    TUNED_INTERVAL_COLUMNS,
    VALIDATION_REQUIRED_COLUMNS,
    read_table,
)

from .badput import plot_badput_breakdown, plot_goodput_share
from .checkpoint_interval import plot_checkpoint_interval, plot_optimal_interval
from .gantt import gantt_methods, plot_pipeline_gantt
from .grid import grid_points
from .loss import plot_loss_vs_wallclock
from .selection import NothingToPlot
from .setback_sensitivity import plot_setback_sensitivity, sensitivity_rates
from .style import FIGURE_DPI, FIGURE_RC, is_ablation, ordered_methods, shared_legend_below, split_ablations
from .time_to_target import plot_speedup, plot_time_to_target
from .validation import plot_validation

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FigureSpec:
    name: str
    """File stem of the PNG."""
    tables: tuple[str, ...]
    """Stems of the input table, first found wins (e.g. iteration_spans, then spans)."""
    columns: tuple[str, ...]
    build: Callable[[pd.DataFrame, "_Context"], Figure]
    title: str | None = None
    """The figure's title when neither its table nor the manifest names its scenario."""
    manifest_scenario: bool = True
    """Whether the manifest's scenario is the table's (validation.csv holds real runs of their own)."""


@dataclass(frozen=True, kw_only=True)
class FigureReport:
    written: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(figure name, reason) for each figure not made."""


@dataclass(frozen=True, kw_only=True)
class _Context:
    target_loss: float | None
    results_directory: Path | None = None
    scenario_name: str | None = None
    """From the manifest: the figure title when the table has no scenario column."""
    interval_study_rate: float = math.nan
    """From the manifest: the failure rate of checkpoint_intervals.csv's simulated rows."""
    rate_setting: str | None = None
    """From the manifest: the field the what-if's rates set (None: the per-stage hourly probability)."""
    tuned_intervals: pd.DataFrame | None = None
    """tuned_intervals.csv, read once for every grid point's time-to-target figure; None without it."""
    cap_s: float | None = None
    """From the manifest: the wall-clock cap that stops a run short of the target (`target.max_wall_clock_s`)."""
    runs: pd.DataFrame | None = None
    """runs.csv, for the loss figure's reasons why a run missed the target; None without it."""


MAX_COLUMNS = 3
"""Panels per row of a many-panel figure, so that it stays within a page width."""


def _single(width: float = 8.2, height: float = 4.4) -> tuple[Figure, object]:
    # Wide enough for the data plus a legend to the right of it.
    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.add_subplot()


def _loss(trajectories: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    # Ablations crowd this figure (a random re-init saw-tooths across it); they stay in the others.
    headline = [method for method in ordered_methods(trajectories["method"].astype(str)) if not is_ablation(method)]
    plot_loss_vs_wallclock(ax, trajectories, target_loss=context.target_loss, methods=headline or None, runs=context.runs, cap_s=context.cap_s)
    return figure


def _time_to_target(summary: pd.DataFrame, context: _Context) -> Figure:
    contenders, ablations = split_ablations(summary["method"].astype(str))
    if not ablations:
        figure, ax = _single()
        plot_time_to_target(ax, summary, tuned=context.tuned_intervals, cap_s=context.cap_s)
        return figure
    # Ablations in a panel of their own (same y axis), so that their bounds do not crowd the contenders.
    figure = Figure(figsize=(13.0, 5.2), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    for ax, methods, title in ((axes[0], contenders, "Contenders"), (axes[1], ablations, "Ablations (and the no-failure run)")):
        plot_time_to_target(ax, summary, methods=methods, tuned=context.tuned_intervals, cap_s=context.cap_s)
        ax.set_title(f"Time to target vs failure rate: {title.lower()}" if ax is axes[0] else title)
    _one_legend_below(figure, axes)
    return figure


def _speedup(summary: pd.DataFrame, context: _Context) -> Figure:
    baselines = speedup_baselines()
    contenders, ablations = split_ablations(summary["method"].astype(str))
    groups = [contenders] + ([ablations] if ablations else [])
    figure = Figure(figsize=(11.0, 4.6 * len(groups) + 0.6), layout="constrained")
    grid = figure.subplots(len(groups), len(baselines), squeeze=False)
    reasons = []
    for row, methods in enumerate(groups):
        for ax, baseline in zip(grid[row], baselines):
            try:
                plot_speedup(ax, summary, baseline=baseline, cap_s=context.cap_s, methods=[m for m in methods if m in set(summary["method"])])
            except NothingToPlot as reason:
                reasons.append(str(reason))
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"no speed-up over {baseline}:\nno run of it reached the target", ha="center", va="center", transform=ax.transAxes)
            if row > 0 and ax.axison:
                ax.set_title(f"Ablations over {ax.get_title().removeprefix('Speed-up over ')}")
    if len(reasons) == grid.size:
        raise NothingToPlot("; ".join(reasons))
    _one_legend_below(figure, list(grid.ravel()))
    return figure


def _one_legend_below(figure: Figure, axes) -> None:
    """One legend under all panels: inside any of them it would cover the curves."""
    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    shared_legend_below(figure, axes)


def _badput(runs: pd.DataFrame, context: _Context) -> Figure:
    figure = Figure(figsize=(13.0, 8.0), layout="constrained")
    panels = figure.subplot_mosaic([["hours", "shares"], ["goodput", "goodput"]], height_ratios=[1.6, 1.0])
    plot_badput_breakdown(panels["hours"], runs, as_fraction=False, legend=False, cap_s=context.cap_s)
    plot_badput_breakdown(panels["shares"], runs, as_fraction=True, cap_s=context.cap_s)
    plot_goodput_share(panels["goodput"], runs, cap_s=context.cap_s)
    # The cap line is drawn in the hours panel; its legend entry joins the shares panel's.
    legend = panels["shares"].get_legend()
    cap_lines = [line for line in panels["hours"].get_lines() if line.get_gid() == "reference:cap"]
    if legend is not None and cap_lines:
        handles, labels = legend.legend_handles, [text.get_text() for text in legend.get_texts()]
        legend.remove()
        panels["shares"].legend([*handles, cap_lines[0]], [*labels, cap_lines[0].get_label()], loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return figure


def _checkpoint_interval(intervals: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    plot_checkpoint_interval(ax, intervals, failure_probability=context.interval_study_rate, rate_setting=context.rate_setting, cap_s=context.cap_s)
    return figure


def _optimal_interval(intervals: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    plot_optimal_interval(ax, intervals, failure_probability=context.interval_study_rate, rate_setting=context.rate_setting, cap_s=context.cap_s)
    return figure


def _validation(validation: pd.DataFrame, context: _Context) -> Figure:
    finite = validation[np.isfinite(validation["measured"].astype(float)) & np.isfinite(validation["predicted"].astype(float))]
    quantities = list(dict.fromkeys(finite["quantity"].astype(str)))
    if not quantities:
        raise NothingToPlot("the validation table has no finite measured and simulated pair")
    figure, axes = _panels(len(quantities), width=4.0, height=3.7)
    for ax, quantity in zip(axes, quantities):
        plot_validation(ax, finite, quantity=quantity, legend=False)
    shared_legend_below(figure, axes)
    return figure


def _gantt(spans: pd.DataFrame, context: _Context) -> Figure:
    methods = gantt_methods(spans)
    num_stages = max(int(spans["stage"].nunique()), 1) if not spans.empty else 1
    panel_height = 0.45 * num_stages + 1.3
    figure = Figure(figsize=(10.0, panel_height * len(methods)), layout="constrained")
    axes = figure.subplots(len(methods), 1, squeeze=False)[:, 0]
    for ax, method in zip(axes, methods):
        plot_pipeline_gantt(ax, spans, method=method)
    return figure


def _setback_sensitivity(table: pd.DataFrame, context: _Context) -> Figure:
    rates = sensitivity_rates(table)
    crossovers_path = _find_table(context.results_directory, ("setback_crossovers",)) if context.results_directory else None
    crossovers = read_table(crossovers_path, CROSSOVER_COLUMNS) if crossovers_path is not None else None
    figure, axes = _panels(len(rates), width=4.3, height=3.9)
    for ax, rate in zip(axes, rates):
        plot_setback_sensitivity(ax, table, failure_probability=None if math.isnan(rate) else rate, crossovers=crossovers, legend=False, cap_s=context.cap_s)
    shared_legend_below(figure, axes)
    return figure


def _panels(count: int, *, width: float, height: float) -> tuple[Figure, list]:
    """`count` panels in rows of at most MAX_COLUMNS (unused cells hidden), room below for a legend."""
    columns = min(count, MAX_COLUMNS)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(width * columns, height * rows + 0.8), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_axis_off()
    return figure, list(axes[:count])


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(name="loss_vs_wallclock", tables=("trajectories",), columns=TRAJECTORY_COLUMNS, build=_loss),
    FigureSpec(name="time_to_target", tables=("summary",), columns=SUMMARY_COLUMNS, build=_time_to_target),
    FigureSpec(name="speedup", tables=("summary",), columns=SUMMARY_COLUMNS, build=_speedup),
    FigureSpec(name="badput_breakdown", tables=("runs",), columns=RUN_COLUMNS, build=_badput),
    FigureSpec(name="checkpoint_interval", tables=("checkpoint_intervals",), columns=INTERVAL_COLUMNS, build=_checkpoint_interval),
    FigureSpec(name="optimal_interval", tables=("checkpoint_intervals",), columns=INTERVAL_COLUMNS, build=_optimal_interval),
    FigureSpec(
        name="validation", tables=("validation",), columns=VALIDATION_REQUIRED_COLUMNS, build=_validation,
        title="Validation: simulated against measured runs", manifest_scenario=False,
    ),
    FigureSpec(name="pipeline_gantt", tables=("iteration_spans", "spans"), columns=GANTT_COLUMNS, build=_gantt),
    FigureSpec(name="setback_sensitivity", tables=("setback_sensitivity",), columns=SENSITIVITY_COLUMNS, build=_setback_sensitivity),
)


def make_figures(results_directory: str | Path, output_directory: str | Path | None = None) -> FigureReport:
    """Make every figure whose input table is in `results_directory`; report what was written and skipped.

    PNGs go to `output_directory` (default: `results_directory/figures`); a sweep's tables give one
    figure per grid point, in a sub-directory named after the point (`figures/grid.py`). A missing or
    empty input table skips its figure; a table with missing columns raises InputError.
    """
    results_directory = Path(results_directory)
    output_directory = Path(output_directory) if output_directory is not None else results_directory / "figures"
    report = FigureReport()
    for relative_path, figure in render_figures(results_directory, skipped=report.skipped):
        target = output_directory / relative_path
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(target, dpi=FIGURE_DPI)
        report.written.append(target)
    return report


def render_figures(results_directory: str | Path, *, skipped: list[tuple[str, str]] | None = None) -> list[tuple[Path, Figure]]:
    """Every figure of `results_directory` as (relative PNG path, Figure), drawn but not saved;
    `skipped` (when given) gets (figure name, reason) for each figure not made."""
    results_directory = Path(results_directory)
    context = _context(results_directory)
    skipped = [] if skipped is None else skipped
    figures: list[tuple[Path, Figure]] = []
    tables: dict[Path, pd.DataFrame] = {}
    for spec in FIGURES:
        path = _find_table(results_directory, spec.tables)
        if path is None:
            skipped.append((spec.name, f"no {' or '.join(t + '.csv' for t in spec.tables)} in {results_directory}"))
            continue
        if path not in tables:
            tables[path] = read_table(path, spec.columns)
        if tables[path].empty:
            skipped.append((spec.name, f"{path.name} has no rows"))
            continue
        # A sweep's table holds several grid points: one figure each, in a folder named after it.
        for point in grid_points(tables[path], spec.columns):
            name = f"{point.directory}/{spec.name}" if point.directory else spec.name
            try:
                with matplotlib.rc_context(FIGURE_RC):
                    figure = spec.build(point.rows, context)
                    title = point.title or _title(spec, point.rows, context)
                    if title:
                        figure.suptitle(title, fontsize=FIGURE_RC["axes.titlesize"] + 1)
                    # Draw now with Agg, inside the rc context, so the layout is final before anyone saves.
                    FigureCanvasAgg(figure).draw()
            except NothingToPlot as reason:
                skipped.append((name, str(reason)))
                continue
            figures.append((Path(f"{name}.png"), figure))
    return figures


def make_all_figures(results_directory: str | Path, output_directory: str | Path | None = None) -> list[Path]:
    """Make every figure whose input exists (see `make_figures`); returns the PNGs written.

    Skipped figures are logged at INFO level with the reason; call `make_figures` to get them as data.
    """
    report = make_figures(results_directory, output_directory)
    for name, reason in report.skipped:
        logger.info("skipped figure %s: %s", name, reason)
    return report.written


def _find_table(directory: Path, stems: tuple[str, ...]) -> Path | None:
    for stem in stems:
        # CSV is always written (Parquet only on request, and reading it needs pyarrow).
        for suffix in (".csv", ".parquet"):
            path = directory / f"{stem}{suffix}"
            if path.is_file():
                return path
    return None


def _context(directory: Path) -> _Context:
    """What the figures need from the directory's manifest.json (target loss, scenario name,
    the interval study's failure rate), each left out when the manifest lacks it, and its
    tuned_intervals table."""
    manifest_path = directory / "manifest.json"
    manifest: dict = {}
    if manifest_path.is_file():
        try:
            from churnsim.calibration.safe_files import read_json_file

            loaded = read_json_file(manifest_path)
            manifest = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            manifest = {}
    scenario = manifest.get("scenario") if isinstance(manifest.get("scenario"), dict) else {}
    target = scenario.get("target") if isinstance(scenario.get("target"), dict) else {}
    name = scenario.get("name")
    interval_study_rate = _finite_or_none(manifest.get("interval_study_rate"))
    tuned_path = _find_table(directory, ("tuned_intervals",))
    return _Context(
        target_loss=_finite_or_none(target.get("loss")),
        results_directory=directory,
        scenario_name=name if isinstance(name, str) else None,
        interval_study_rate=math.nan if interval_study_rate is None else interval_study_rate,
        rate_setting=manifest.get("rate_setting") if isinstance(manifest.get("rate_setting"), str) else None,
        tuned_intervals=read_table(tuned_path, TUNED_INTERVAL_COLUMNS) if tuned_path is not None else None,
        cap_s=_finite_or_none(target.get("max_wall_clock_s")),
        runs=read_table(runs_path, RUN_COLUMNS) if (runs_path := _find_table(directory, ("runs",))) is not None else None,
    )


def _finite_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _title(spec: FigureSpec, rows: pd.DataFrame, context: _Context) -> str | None:
    """The scenario a figure shows: the table's scenario column, else the manifest's name (unless
    the table's rows are runs of their own, as validation.csv's are), else the spec's title."""
    if "scenario" in rows.columns and not rows.empty:
        return str(rows["scenario"].iloc[0])
    if spec.manifest_scenario and context.scenario_name:
        return context.scenario_name
    return spec.title
