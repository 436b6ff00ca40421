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
    BOUND_MARKERS,
    LABEL_BACKGROUND,
    add_bound_key,
    add_not_reached_key,
    band_alpha,
    method_alpha,
    place_labels,
    text_alpha,
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
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw the mean wall-clock to the target loss against the failure rate, one line per method (in
    hours, or minutes or seconds for runs that short: `selection.time_unit`).

    How to read it: lower is better; the shaded band is the 95 % confidence interval over
    replications, so where two bands do not overlap the difference is not noise. Where some
    replications were stopped at the wall-clock cap (`target.max_wall_clock_s`, `cap_s` names it in
    the legend) before the target, the point is a hollow upward triangle at the bound, labelled
    "≥ 532 h, 7/10 reached": counting the missed runs at the time they were stopped, the mean is at
    least 532 h; the truth lies above the triangle (the mean of the runs that did reach it would be
    optimistic and is not drawn). A dashed segment joins it to its neighbours.

    `summary` has the columns of `calibration.tables.SUMMARY_COLUMNS`. `tuned` (tuned_intervals.csv,
    `calibration.tables.TUNED_INTERVAL_COLUMNS`) adds a hollow marker of the method's colour at each
    rate where its checkpoint interval, tuned there, was clearly faster than the configured one.
    Returns {"lines": one Line2D per method with a fully reached rate, "bands": its 95 % band (a
    PolyCollection, or an ErrorbarContainer when the line has a single point), "bounds": per method
    with a bound the triangles (gid "bound:METHOD") and dashed links ("bound_link:METHOD"),
    "labels": the bound labels, "not_reached": × marks, "tuned": one marker set per tuned method};
    lines, bands and tuned markers carry the method name as gid.
    """
    require_columns(summary, SUMMARY_COLUMNS, "summary")
    rows, _ = select_scenario(summary, scenario)
    rows = select_methods(rows, methods)
    # The unit fits the bounds too (a bound can be far above every mean).
    seconds_per_unit, unit = time_unit(pd.concat([rows["time_to_target_mean_s"], rows["time_to_target_at_least_s"]]))
    unit_abbreviation = UNIT_ABBREVIATIONS[unit]
    drawn = _lines_against_rate(
        ax,
        rows,
        mean_column="time_to_target_mean_s",
        low_column="time_to_target_ci95_low_s",
        high_column="time_to_target_ci95_high_s",
        scale=1.0 / seconds_per_unit,
        methods=ordered_methods(rows["method"]),
        what="the time-to-target figure",
        bound=PartialBound("time_to_target_at_least_s", "at_least", lambda value: f"≥ {value:.0f} {unit_abbreviation}"),
        cap_s=cap_s,
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
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw each method's speed-up over `baseline` (a method with the `speedup_baseline` trait, by
    default the first: checkpoint) against the failure rate.

    How to read it: the speed-up is T_baseline / T_method paired by replication (same failures), so
    above the line at 1 the method reaches the target sooner than the baseline; bands are 95 %
    confidence intervals. The baseline itself is not drawn. Where some replications of a method
    were stopped at the wall-clock cap before the target, the point is a hollow downward triangle
    at the bound, labelled "≤ 1.11×, 7/10 reached": over all 10, the missed runs counted at the
    time they were stopped, the speed-up is at most 1.11.

    Returns what `plot_time_to_target` does (without "tuned") and "reference": [the Line2D at
    speed-up 1], which no label crosses.
    """
    baselines = speedup_baselines()
    baseline = baselines[0] if baseline is None else baseline
    if baseline not in baselines:
        raise InputError(f"baseline = {baseline!r}: use one of {', '.join(baselines)}")
    require_columns(summary, (*SUMMARY_COLUMNS, *speedup_columns(baseline)), "summary")
    rows, _ = select_scenario(summary, scenario)
    rows = select_methods(rows, methods)
    mean_column, low_column, high_column = speedup_columns(baseline)
    # Drawn first (under the data) so the labels can be kept off it.
    reference = ax.axhline(1.0, color="#444444", linestyle="--", linewidth=1.0, gid="reference:speedup_1", zorder=1.0)
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
        bound=PartialBound(speedup_at_most_column(baseline), "at_most", lambda value: f"≤ {value:.2f}×"),
        cap_s=cap_s,
        reference_lines=[reference],
    )
    drawn["reference"] = [reference]
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
    cap_s: float | None = None,
    reference_lines: Sequence[Artist] = (),
) -> dict[str, list[Artist]]:
    """One line per method through the means of the rates at which every replication reached the
    target, with its 95 % band; where only some did (or none), a hollow triangle at the bound
    (`bound.column`: the missed runs counted at the time the cap stopped them) joined by a dashed
    segment, never the optimistic mean of the runs that reached it; an × at the top where neither
    a mean nor a bound is known."""
    axis = rate_axis(rows)
    rows = rows[np.isfinite(rows[axis.column].astype(float)) & rows["method"].isin(methods)]
    mean = rows[mean_column].astype(float)
    bound_value = rows[bound.column].astype(float) if bound.column in rows.columns else pd.Series(np.nan, index=rows.index)
    fraction = rows["fraction_reached"].astype(float) if "fraction_reached" in rows.columns else pd.Series(1.0, index=rows.index)
    # A point is drawn at its bound when some replication missed and the bound is known.
    at_bound = (fraction < 1.0) & np.isfinite(bound_value)
    at_mean = np.isfinite(mean) & ~at_bound
    require_rows(rows[at_mean | at_bound], what)
    drawn: dict[str, list[Artist]] = {"lines": [], "bands": [], "bounds": [], "not_reached": []}
    for method in methods:
        of_method = rows["method"] == method
        missing = rows[of_method & ~at_mean & ~at_bound]
        # Neither a mean nor a bound (an older table): an × at the top says no run reached the target.
        drawn["not_reached"] += mark_not_reached(
            ax, axis.scale * missing[axis.column].to_numpy(dtype=float), method, row=len(drawn["not_reached"])
        )
        method_rows = rows[of_method & at_mean].sort_values(axis.column)
        if not method_rows.empty:
            line, band = _mean_line(ax, method_rows, method, axis, mean_column, low_column, high_column, scale)
            drawn["lines"].append(line)
            drawn["bands"].append(band)
        bound_rows = rows[of_method & at_bound].sort_values(axis.column)
        if not bound_rows.empty:
            drawn["bounds"] += _bound_points(ax, rows[of_method & (at_mean | at_bound)], bound_rows, method, axis, mean_column, bound, scale)
    if not drawn["lines"] and not drawn["bounds"]:
        raise NothingToPlot(f"no rows to plot for {what}")
    labels = _label_bounds(ax, rows[at_bound], scale, axis.column, axis.scale, bound)
    if drawn["not_reached"]:
        make_room_for_not_reached(ax, len(drawn["not_reached"]))
        add_not_reached_key(ax)
    if drawn["bounds"]:
        add_bound_key(ax, bound.direction, cap_s)
    rules = [line for line in ax.get_lines() if line.get_gid() == "not_reached_rule"]
    drawn["labels"] = labels
    triangles = [line for line in drawn["bounds"] if str(line.get_gid()).startswith("bound:")]
    drawn["placer"] = [placer] if (placer := place_labels(ax, labels, [*reference_lines, *rules], triangles)) is not None else []
    ax.set_xlabel(axis.label)
    style_axes(ax)
    return drawn


def _mean_line(ax: Axes, method_rows: pd.DataFrame, method: str, axis, mean_column: str, low_column: str, high_column: str, scale: float):
    rate_on_axis = axis.scale * method_rows[axis.column].to_numpy(dtype=float)
    mean = scale * method_rows[mean_column].to_numpy(dtype=float)
    # A missing interval (one replication) collapses to the mean rather than hiding the point.
    low = np.where(np.isfinite(method_rows[low_column]), scale * method_rows[low_column].to_numpy(dtype=float), mean)
    high = np.where(np.isfinite(method_rows[high_column]), scale * method_rows[high_column].to_numpy(dtype=float), mean)
    (line,) = ax.plot(rate_on_axis, mean, **method_style(method))
    if len(rate_on_axis) > 1:
        band = ax.fill_between(rate_on_axis, low, high, color=method_color(method), alpha=band_alpha(method), linewidth=0)
    else:
        band = ax.errorbar(
            rate_on_axis, mean, yerr=[mean - low, high - mean], fmt="none", ecolor=method_color(method), capsize=3,
            alpha=method_alpha(method),
        )  # fmt: skip
    for artist in band.get_children() if isinstance(band, Container) else [band]:
        artist.set_gid(method)
    return line, band


def _bound_points(
    ax: Axes, drawn_rows: pd.DataFrame, bound_rows: pd.DataFrame, method: str, axis, mean_column: str, bound: "PartialBound", scale: float
) -> list[Artist]:
    """The hollow triangles at the bounds, and a dashed line from each neighbouring point to them."""
    rate = axis.scale * bound_rows[axis.column].to_numpy(dtype=float)
    value = scale * bound_rows[bound.column].to_numpy(dtype=float)
    (markers,) = ax.plot(
        rate, value, linestyle="none", marker=BOUND_MARKERS[bound.direction], markersize=8, markerfacecolor="white",
        markeredgecolor=method_color(method), markeredgewidth=1.6, alpha=method_alpha(method), zorder=3.5,
        gid=f"bound:{method}", label="_bound",
    )  # fmt: skip
    # Every drawn point of the method in rate order, each at the value it is drawn at.
    ordered = drawn_rows.sort_values(axis.column)
    is_bound = ordered.index.isin(bound_rows.index)
    x = axis.scale * ordered[axis.column].to_numpy(dtype=float)
    y = scale * np.where(is_bound, ordered[bound.column].astype(float), ordered[mean_column].astype(float))
    xs, ys = [], []
    for index in range(len(x) - 1):
        if is_bound[index] or is_bound[index + 1]:
            xs += [x[index], x[index + 1], np.nan]
            ys += [y[index], y[index + 1], np.nan]
    links = []
    if xs:
        (link,) = ax.plot(
            xs, ys, linestyle="--", linewidth=1.0, color=method_color(method), alpha=0.7 * method_alpha(method),
            gid=f"bound_link:{method}", label="_bound_link", zorder=1.8,
        )  # fmt: skip
        links.append(link)
    return [markers, *links]


@dataclass(frozen=True)
class PartialBound:
    """The summary column that bounds a point some replications of which missed the target
    (`calibration.tables`), which way the truth lies from it ('at_least' or 'at_most'), and how
    a label writes the bound in the figure's unit."""

    column: str
    direction: str
    text: Callable[[float], str]


def _label_bounds(
    ax: Axes, rows: pd.DataFrame, scale: float, rate_column: str, rate_scale: float, bound: PartialBound, *, widen: bool = True
) -> list[Artist]:
    """'≥ 532 h, 7/10 reached' beside each point drawn at its bound; `place_labels` keeps them
    apart at draw time. The x axis widens so that labels at the last rate stay inside it; with
    `widen=False` (a log axis) those labels go to the left of their point instead."""
    labels: list[Artist] = []
    if rows.empty:
        return labels
    last_rate = float(rows[rate_column].astype(float).max())
    longest_at_last_rate = 0
    for _, row in _without_repeated_never(rows, rate_column).iterrows():
        method = str(row["method"])
        total = float(row["num_replications"]) if "num_replications" in row.index else math.nan
        reached = f"{round(float(row['fraction_reached']) * total):.0f}/{total:.0f} reached" if math.isfinite(total) else "some missed"
        label = f"{bound.text(scale * float(row[bound.column]))}, {reached}"
        on_left = not widen and float(row[rate_column]) == last_rate
        labels.append(ax.annotate(
            label, (rate_scale * float(row[rate_column]), scale * float(row[bound.column])),
            xytext=(-LABEL_OFFSET_PT if on_left else LABEL_OFFSET_PT, 0), textcoords="offset points", fontsize=LABEL_FONT_PT,
            ha="right" if on_left else "left",
            color=method_color(method), alpha=text_alpha(method), va="center", gid=f"bound_label:{method}", bbox=LABEL_BACKGROUND,
            # A thin leader to its triangle, which shows where a label the placer moved belongs.
            arrowprops=dict(arrowstyle="-", color=method_color(method), linewidth=0.6, shrinkA=0, shrinkB=5, alpha=text_alpha(method)),
        ))  # fmt: skip
        if float(row[rate_column]) == last_rate:
            longest_at_last_rate = max(longest_at_last_rate, len(label))
    if longest_at_last_rate and widen:
        _make_room_on_the_right(ax, rate_scale * last_rate, longest_at_last_rate)
    return labels


def _without_repeated_never(rows: pd.DataFrame, rate_column: str) -> pd.DataFrame:
    """The rows to label: a point where no replication reached the target is labelled only where
    the method's previous such point was not one too (the triangles that follow at the same cap
    say the same, and the legend's key says what they are)."""
    never = rows["fraction_reached"].astype(float) <= 0.0
    keep = pd.Series(True, index=rows.index)
    for _, of_method in rows[never].groupby("method"):
        rates = sorted(of_method[rate_column].astype(float))
        for index, row in of_method.iterrows():
            rate = float(row[rate_column])
            keep[index] = rates.index(rate) == 0 or not _adjacent_never(rows, row["method"], rates[rates.index(rate) - 1], rate, rate_column)
    return rows[keep]


def _adjacent_never(rows: pd.DataFrame, method: str, previous_rate: float, rate: float, rate_column: str) -> bool:
    """Whether the method's never-reached point at `previous_rate` is its drawn point just before `rate`."""
    of_method = rows[rows["method"] == method][rate_column].astype(float)
    between = of_method[(of_method > previous_rate) & (of_method < rate)]
    return between.empty


UNIT_ABBREVIATIONS = {"hours": "h", "minutes": "min", "seconds": "s"}
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
