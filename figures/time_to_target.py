"""Time to target and speed-ups against the per-stage failure rate, with 95 % confidence intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.container import Container

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import speedup_baselines
from churnsim.calibration.tables import SUMMARY_COLUMNS, TUNED_INTERVAL_COLUMNS, speedup_at_most_column, speedup_columns

from .grid import grid_columns
from .selection import (
    NothingToPlot,
    rate_axis,
    require_columns,
    require_rows,
    select_methods,
    select_scenario,
    time_unit,
)
from .style import (
    add_not_reached_key,
    legend_outside,
    make_room_for_not_reached,
    mark_not_reached,
    method_color,
    method_label,
    method_marker,
    method_style,
    ordered_methods,
    style_axes,
)

def plot_time_to_target(
    ax: Axes,
    summary: pd.DataFrame,
    *,
    scenario: str | None = None,
    methods: Sequence[str] | None = None,
    tuned: pd.DataFrame | None = None,
) -> dict[str, list[Artist]]:
    """Draw the mean wall-clock to the target loss against the failure rate, one line per method (in
    hours, or minutes or seconds for runs that short: `selection.time_unit`).

    How to read it: lower is better; the shaded band is the 95 % confidence interval over
    replications, so where two bands do not overlap the difference is not noise. A method whose
    line stops did not reach the target within the time limit at the higher rates. A point labelled
    "7/10, ≥532" is the mean of the 7 replications of 10 that reached the target, optimistic; with
    the other 3 counted at the time they were stopped the mean is at least 532.

    `summary` has the columns of `calibration.tables.SUMMARY_COLUMNS`. `tuned` (tuned_intervals.csv,
    `calibration.tables.TUNED_INTERVAL_COLUMNS`) adds a hollow marker of the method's colour at each
    rate where its checkpoint interval, tuned there, was clearly faster than the configured one.
    Returns {"lines": one Line2D per method, "bands": one 95 % band per method (a PolyCollection, or
    an ErrorbarContainer when the method has a single failure rate), "tuned": one marker set per
    tuned method}; every artist's gid (an ErrorbarContainer's children's) is the method name.
    """
    require_columns(summary, SUMMARY_COLUMNS, "summary")
    rows, _ = select_scenario(summary, scenario)
    rows = select_methods(rows, methods)
    seconds_per_unit, unit = time_unit(rows["time_to_target_mean_s"])
    drawn = _lines_against_rate(
        ax,
        rows,
        mean_column="time_to_target_mean_s",
        low_column="time_to_target_ci95_low_s",
        high_column="time_to_target_ci95_high_s",
        scale=1.0 / seconds_per_unit,
        methods=ordered_methods(rows["method"]),
        what="the time-to-target figure",
        bound=PartialBound("time_to_target_at_least_s", lambda value: f"≥{value:.0f}"),
    )
    drawn["tuned"] = _mark_tuned(ax, tuned, rows, 1.0 / seconds_per_unit) if tuned is not None else []
    ax.set_ylabel(f"time to target loss ({unit})")
    ax.set_title("Time to target vs failure rate")
    legend_outside(ax)
    return drawn


def _same_point(tuned: pd.DataFrame, rows: pd.DataFrame) -> pd.Series:
    """Which rows of `tuned` belong to the scenario or sweep point `rows` draws: by a sweep's swept
    fields where it has any (`grid.grid_points` renames a point's scenario), else by scenario name
    (a rate sweep's points share the name before their settings)."""
    swept = [column for column in grid_columns(rows, SUMMARY_COLUMNS) if column in tuned.columns]
    if swept:
        mask = pd.Series(True, index=tuned.index)
        for column in swept:
            mask &= tuned[column].isin(rows[column].unique())
        return mask
    def base(names: pd.Series) -> pd.Series:
        return names.astype(str).str.split("[", n=1).str[0]

    return base(tuned["scenario"]).isin(set(base(rows["scenario"])))


def _mark_tuned(ax: Axes, tuned: pd.DataFrame, rows: pd.DataFrame, scale: float) -> list[Artist]:
    """Hollow markers at the tuned intervals' times to target, for the scenario and methods drawn."""
    require_columns(tuned, TUNED_INTERVAL_COLUMNS, "tuned_intervals")
    axis = rate_axis(rows)
    if axis.column not in tuned.columns:
        return []
    tuned = tuned[_same_point(tuned, rows) & np.isfinite(tuned["time_to_target_mean_s"].astype(float))]
    markers: list[Artist] = []
    for method in ordered_methods(tuned["method"]):
        if method not in set(rows["method"]):
            continue
        at = tuned[tuned["method"] == method]
        markers.append(ax.scatter(
            axis.scale * at[axis.column].to_numpy(dtype=float), scale * at["time_to_target_mean_s"].to_numpy(dtype=float),
            marker=method_marker(method), facecolors="none", edgecolors=method_color(method), s=60, linewidths=1.4, zorder=3,
            gid=method,
        ))
    if markers:
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="#444444", s=60, linewidths=1.4,
                   label="hollow: checkpoint interval\ntuned at that rate")
    return markers


def plot_speedup(
    ax: Axes,
    summary: pd.DataFrame,
    *,
    baseline: str | None = None,
    scenario: str | None = None,
    methods: Sequence[str] | None = None,
) -> dict[str, list[Artist]]:
    """Draw each method's speed-up over `baseline` (a method with the `speedup_baseline` trait, by
    default the first: checkpoint) against the failure rate.

    How to read it: the speed-up is T_baseline / T_method paired by replication (same failures), so
    above the line at 1 the method reaches the target sooner than the baseline; bands are 95 %
    confidence intervals. The baseline itself is not drawn. A point labelled "7/10, ≤1.11" covers the
    7 replications of 10 that reached the target; over all 10, the others counted at the time they
    were stopped, the speed-up is at most 1.11.

    Returns {"lines": one Line2D per method other than the baseline, "bands": one 95 % band per
    such method, "reference": [the Line2D at speed-up 1]}.
    """
    baselines = speedup_baselines()
    baseline = baselines[0] if baseline is None else baseline
    if baseline not in baselines:
        raise InputError(f"baseline = {baseline!r}: use one of {', '.join(baselines)}")
    require_columns(summary, (*SUMMARY_COLUMNS, *speedup_columns(baseline)), "summary")
    rows, _ = select_scenario(summary, scenario)
    rows = select_methods(rows, methods)
    mean_column, low_column, high_column = speedup_columns(baseline)
    methods = [method for method in ordered_methods(rows["method"]) if method != baseline]
    drawn = _lines_against_rate(
        ax,
        rows,
        mean_column=mean_column,
        low_column=low_column,
        high_column=high_column,
        scale=1.0,
        methods=methods,
        what=f"the speed-up figure over {baseline} (no run of {baseline} reached the target?)",
        bound=PartialBound(speedup_at_most_column(baseline), lambda value: f"≤{value:.2f}"),
    )
    drawn["reference"] = [ax.axhline(1.0, color="#444444", linestyle="--", linewidth=1.0)]
    ax.set_ylabel(f"speed-up over {method_label(baseline)} (×)")
    ax.set_title(f"Speed-up over {method_label(baseline)}")
    legend_outside(ax)
    return drawn


def _lines_against_rate(
    ax: Axes,
    rows: pd.DataFrame,
    *,
    mean_column: str,
    low_column: str,
    high_column: str,
    scale: float,
    methods: list[str],
    what: str,
    bound: "PartialBound",
) -> dict[str, list[Artist]]:
    axis = rate_axis(rows)
    rows = rows[np.isfinite(rows[axis.column].astype(float)) & rows["method"].isin(methods)]
    reached = np.isfinite(rows[mean_column].astype(float))
    require_rows(rows[reached], what)
    lines: list[Artist] = []
    bands: list[Artist] = []
    not_reached: list[Artist] = []
    for method in methods:
        missing = rows[(rows["method"] == method) & ~reached]
        # A rate at which no replication reached the target has no mean: an × at the top says so.
        not_reached += mark_not_reached(ax, axis.scale * missing[axis.column].to_numpy(dtype=float), method, row=len(not_reached))
        method_rows = rows[(rows["method"] == method) & reached].sort_values(axis.column)
        if method_rows.empty:
            continue
        rate_on_axis = axis.scale * method_rows[axis.column].to_numpy(dtype=float)
        mean = scale * method_rows[mean_column].to_numpy(dtype=float)
        # A missing interval (one replication) collapses to the mean rather than hiding the point.
        low = np.where(np.isfinite(method_rows[low_column]), scale * method_rows[low_column].to_numpy(dtype=float), mean)
        high = np.where(np.isfinite(method_rows[high_column]), scale * method_rows[high_column].to_numpy(dtype=float), mean)
        (line,) = ax.plot(rate_on_axis, mean, **method_style(method))
        lines.append(line)
        if len(rate_on_axis) > 1:
            band = ax.fill_between(rate_on_axis, low, high, color=method_color(method), alpha=0.2, linewidth=0)
        else:
            band = ax.errorbar(
                rate_on_axis, mean, yerr=[mean - low, high - mean], fmt="none", ecolor=method_color(method), capsize=3
            )
        for artist in band.get_children() if isinstance(band, Container) else [band]:
            artist.set_gid(method)
        bands.append(band)
    if not lines:
        raise NothingToPlot(f"no rows to plot for {what}")
    _label_partial_reach(ax, rows, mean_column, scale, methods, axis.column, axis.scale, bound)
    if not_reached:
        make_room_for_not_reached(ax, len(not_reached))
        add_not_reached_key(ax)
    ax.set_xlabel(axis.label)
    style_axes(ax)
    return {"lines": lines, "bands": bands, "not_reached": not_reached}


@dataclass(frozen=True)
class PartialBound:
    """The summary column that bounds a point whose mean covers only the replications that reached
    the target (`calibration.tables`), and how its label writes the bound in the figure's unit."""

    column: str
    text: Callable[[float], str]


def _label_partial_reach(
    ax: Axes,
    rows: pd.DataFrame,
    mean_column: str,
    scale: float,
    methods: list[str],
    rate_column: str,
    rate_scale: float,
    bound: PartialBound,
) -> None:
    """'7/10, ≥532' beside each point whose mean covers only the replications that reached the
    target: how many did, and the bound with the others counted at the time they were stopped (left
    out where unknown); labels at one failure rate are spread apart vertically so they never overlap."""
    if "fraction_reached" not in rows or "num_replications" not in rows:
        return
    partial = rows[(rows["fraction_reached"].astype(float) < 1.0) & np.isfinite(rows[mean_column].astype(float))]
    low, high = ax.get_ylim()
    spacing = 0.05 * (high - low)
    last_rate = float(rows[rate_column].astype(float).max())
    longest_at_last_rate = 0
    for rate, at_rate in partial.groupby(rate_column):
        placed = -np.inf
        for _, row in at_rate.assign(y=scale * at_rate[mean_column].astype(float)).sort_values("y").iterrows():
            if row["method"] not in methods:
                continue
            y = max(float(row["y"]), placed + spacing)
            placed = y
            total = float(row["num_replications"])
            label = f"{round(float(row['fraction_reached']) * total):.0f}/{total:.0f}"
            bound_value = float(row[bound.column]) if bound.column in row.index else math.nan
            if math.isfinite(bound_value):
                label += ", " + bound.text(scale * bound_value)
            ax.annotate(
                label, (rate_scale * float(rate), y),
                xytext=(LABEL_OFFSET_PT, 0), textcoords="offset points", fontsize=LABEL_FONT_PT,
                color=method_color(str(row["method"])), va="center",
            )  # fmt: skip
            if float(rate) == last_rate:
                longest_at_last_rate = max(longest_at_last_rate, len(label))
    if longest_at_last_rate:
        _make_room_on_the_right(ax, rate_scale * last_rate, longest_at_last_rate)


LABEL_FONT_PT = 7.5
LABEL_OFFSET_PT = 8.0


def _make_room_on_the_right(ax: Axes, last_x: float, characters: int) -> None:
    """Widen the x axis so that a label of `characters` beside the point at `last_x` stays inside
    the axes (a legend may sit just outside). The width is estimated before layout, at about 0.62
    em per character, with a few points to spare, so it errs on the roomy side."""
    label_pt = LABEL_OFFSET_PT + 0.62 * LABEL_FONT_PT * characters + 4.0
    axes_pt = ax.get_position().width * ax.figure.get_figwidth() * 72.0
    fraction = min(label_pt / axes_pt, 0.5) if axes_pt > 0 else 0.0
    left, right = ax.get_xlim()
    needed_right = left + (last_x - left) / (1.0 - fraction)
    if needed_right > right:
        ax.set_xlim(left, needed_right)
