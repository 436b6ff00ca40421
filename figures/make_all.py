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
import pandas as pd
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
    VALIDATION_COLUMNS,
    read_table,
)

from .badput import plot_badput_breakdown
from .checkpoint_interval import plot_checkpoint_interval, plot_optimal_interval
from .gantt import gantt_methods, plot_pipeline_gantt
from .grid import grid_points
from .loss import plot_loss_vs_wallclock
from .selection import NothingToPlot
from .setback_sensitivity import plot_setback_sensitivity, sensitivity_rates
from .style import FIGURE_DPI, FIGURE_RC, is_ablation, ordered_methods
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


@dataclass(frozen=True, kw_only=True)
class FigureReport:
    written: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(figure name, reason) for each figure not made."""


@dataclass(frozen=True, kw_only=True)
class _Context:
    target_loss: float | None
    results_directory: Path | None = None


def _single(width: float = 6.4, height: float = 4.2) -> tuple[Figure, object]:
    figure = Figure(figsize=(width, height), layout="constrained")
    return figure, figure.add_subplot()


def _loss(trajectories: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    # Ablations crowd this figure (a random re-init saw-tooths across it); they stay in the others.
    headline = [method for method in ordered_methods(trajectories["method"].astype(str)) if not is_ablation(method)]
    plot_loss_vs_wallclock(ax, trajectories, target_loss=context.target_loss, methods=headline or None)
    return figure


def _time_to_target(summary: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    plot_time_to_target(ax, summary)
    return figure


def _speedup(summary: pd.DataFrame, context: _Context) -> Figure:
    figure = Figure(figsize=(11.0, 4.2), layout="constrained")
    baselines = speedup_baselines()
    axes = figure.subplots(1, len(baselines), squeeze=False)[0]
    reasons = []
    for ax, baseline in zip(axes, baselines):
        try:
            plot_speedup(ax, summary, baseline=baseline)
        except NothingToPlot as reason:
            reasons.append(str(reason))
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"no speed-up over {baseline}:\nno run of it reached the target", ha="center", va="center", transform=ax.transAxes)
    if len(reasons) == len(baselines):
        raise NothingToPlot("; ".join(reasons))
    return figure


def _badput(runs: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single(8.0, 4.4)
    plot_badput_breakdown(ax, runs)
    return figure


def _checkpoint_interval(intervals: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    plot_checkpoint_interval(ax, intervals)
    return figure


def _optimal_interval(intervals: pd.DataFrame, context: _Context) -> Figure:
    figure, ax = _single()
    plot_optimal_interval(ax, intervals)
    return figure


def _validation(validation: pd.DataFrame, context: _Context) -> Figure:
    quantities = list(dict.fromkeys(validation["quantity"].astype(str)))
    if not quantities:
        raise NothingToPlot("the validation table is empty")
    figure = Figure(figsize=(4.6 * len(quantities), 4.6), layout="constrained")
    axes = figure.subplots(1, len(quantities), squeeze=False)[0]
    for ax, quantity in zip(axes, quantities):
        plot_validation(ax, validation, quantity=quantity)
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
    figure = Figure(figsize=(5.6 * len(rates), 4.4), layout="constrained")
    axes = figure.subplots(1, len(rates), squeeze=False)[0]
    for ax, rate in zip(axes, rates):
        plot_setback_sensitivity(ax, table, failure_probability=None if math.isnan(rate) else rate, crossovers=crossovers)
    return figure


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(name="loss_vs_wallclock", tables=("trajectories",), columns=TRAJECTORY_COLUMNS, build=_loss),
    FigureSpec(name="time_to_target", tables=("summary",), columns=SUMMARY_COLUMNS, build=_time_to_target),
    FigureSpec(name="speedup", tables=("summary",), columns=SUMMARY_COLUMNS, build=_speedup),
    FigureSpec(name="badput_breakdown", tables=("runs",), columns=RUN_COLUMNS, build=_badput),
    FigureSpec(name="checkpoint_interval", tables=("checkpoint_intervals",), columns=INTERVAL_COLUMNS, build=_checkpoint_interval),
    FigureSpec(name="optimal_interval", tables=("checkpoint_intervals",), columns=INTERVAL_COLUMNS, build=_optimal_interval),
    FigureSpec(name="validation", tables=("validation",), columns=VALIDATION_COLUMNS, build=_validation),
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
    context = _Context(target_loss=_target_loss(results_directory), results_directory=results_directory)
    report = FigureReport()
    tables: dict[Path, pd.DataFrame] = {}
    for spec in FIGURES:
        path = _find_table(results_directory, spec.tables)
        if path is None:
            report.skipped.append((spec.name, f"no {' or '.join(t + '.csv' for t in spec.tables)} in {results_directory}"))
            continue
        if path not in tables:
            tables[path] = read_table(path, spec.columns)
        if tables[path].empty:
            report.skipped.append((spec.name, f"{path.name} has no rows"))
            continue
        # A sweep's table holds several grid points: one figure each, in a folder named after it.
        for point in grid_points(tables[path], spec.columns):
            directory = output_directory / point.directory if point.directory else output_directory
            name = f"{point.directory}/{spec.name}" if point.directory else spec.name
            try:
                with matplotlib.rc_context(FIGURE_RC):
                    figure = spec.build(point.rows, context)
                    if point.title:
                        figure.suptitle(point.title)
                    directory.mkdir(parents=True, exist_ok=True)
                    target = directory / f"{spec.name}.png"
                    figure.savefig(target, dpi=FIGURE_DPI)
            except NothingToPlot as reason:
                report.skipped.append((name, str(reason)))
                continue
            report.written.append(target)
    return report


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


def _target_loss(directory: Path) -> float | None:
    """The scenario's target loss from the directory's manifest.json, when it names one."""
    manifest = directory / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        loss = json.loads(manifest.read_text())["scenario"]["target"]["loss"]
    except (ValueError, KeyError, TypeError):
        return None
    return float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None
