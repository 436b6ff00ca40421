"""Time to target against a common factor on every convergence setback, at one failure rate."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

from churnsim.calibration.tables import CROSSOVER_COLUMNS, SENSITIVITY_COLUMNS

from .selection import (
    RATE_COLUMN,
    NothingToPlot,
    rate_title_suffix,
    require_columns,
    require_rows,
    select_failure_probability,
    select_methods,
    select_scenario,
    time_unit,
)
from .style import add_bound_key, band_alpha, legend_outside, method_color, method_style, ordered_methods, place_labels, style_axes
from .time_to_target import UNIT_ABBREVIATIONS, PartialBound, _bound_points, _label_bounds


class _ScaleAxis:
    """The x axis of this figure in the shape `time_to_target._bound_points` reads."""

    column = "setback_scale"
    scale = 1.0


SCALE_AXIS = _ScaleAxis()


def plot_setback_sensitivity(
    ax: Axes,
    table: pd.DataFrame,
    *,
    failure_probability: float | None = None,
    crossovers: pd.DataFrame | None = None,
    scenario: str | None = None,
    methods: Sequence[str] | None = None,
    legend: bool = True,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw the time to the target loss (hours, or minutes or seconds for runs that short) against the setback scale, one line per method, at one failure rate.

    How to read it: at scale 1 the setbacks are the scenario's own (measured, paper-fitted or
    default); at 2 every rebuild costs twice as much. Lines of methods without setbacks are flat.
    A ring marks the winner at each scale; a dashed vertical line marks where the winner changes
    (from `crossovers`, sim/setback_sensitivity.py). Bands are 95 % intervals over replications,
    which include the replications' setback draws. Where some replications were stopped at the
    wall-clock cap (`cap_s`) before the target, the point is an open upward triangle at the bound
    ("≥ 530 h, 7/10 reached"), as in `time_to_target.plot_time_to_target`.

    `table` has `calibration.tables.SENSITIVITY_COLUMNS` (setback_sensitivity.csv); the rate
    defaults to the highest in it. Returns {"lines": one Line2D per method, "bands": one band per
    method, "winners": the rings, "crossovers": the vertical lines}; lines and bands carry the method
    name as gid. `legend=False` leaves the legend to the caller (several panels, one legend).
    """
    require_columns(table, SENSITIVITY_COLUMNS, "setback sensitivity")
    rows, scenario = select_scenario(table, scenario)
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = select_methods(rows, methods)
    fraction = rows["fraction_reached"].astype(float)
    at_bound = (fraction < 1.0) & np.isfinite(rows["time_to_target_at_least_s"].astype(float))
    at_mean = np.isfinite(rows["time_to_target_mean_s"].astype(float)) & ~at_bound
    rows, at_bound, at_mean = rows[at_mean | at_bound], at_bound[at_mean | at_bound], at_mean[at_mean | at_bound]
    require_rows(rows, "the setback-sensitivity figure (no method reached the target)")
    drawn: dict[str, list[Artist]] = {"lines": [], "bands": [], "bounds": [], "winners": [], "crossovers": []}
    # Drawn at: the mean where every replication reached the target, else the bound (never the
    # optimistic mean of those that did).
    drawn_s = np.where(at_bound, rows["time_to_target_at_least_s"].astype(float), rows["time_to_target_mean_s"].astype(float))
    seconds_per_unit, unit = time_unit(drawn_s)
    bound = PartialBound("time_to_target_at_least_s", "at_least", lambda value: f"≥ {value:.3g} {UNIT_ABBREVIATIONS[unit]}")
    for method in ordered_methods(rows["method"].astype(str)):
        of_method = rows["method"] == method
        method_rows = rows[of_method & at_mean].sort_values("setback_scale")
        if not method_rows.empty:
            scale = method_rows["setback_scale"].to_numpy(dtype=float)
            mean = method_rows["time_to_target_mean_s"].to_numpy(dtype=float) / seconds_per_unit
            low = np.where(np.isfinite(method_rows["time_to_target_ci95_low_s"]), method_rows["time_to_target_ci95_low_s"] / seconds_per_unit, mean)
            high = np.where(np.isfinite(method_rows["time_to_target_ci95_high_s"]), method_rows["time_to_target_ci95_high_s"] / seconds_per_unit, mean)
            (line,) = ax.plot(scale, mean, **method_style(method))
            line.set_gid(method)
            band = ax.fill_between(scale, low, high, color=method_color(method), alpha=band_alpha(method), linewidth=0)
            band.set_gid(method)
            drawn["lines"].append(line)
            drawn["bands"].append(band)
        bound_rows = rows[of_method & at_bound]
        if not bound_rows.empty:
            drawn["bounds"] += _bound_points(ax, rows[of_method], bound_rows, method, SCALE_AXIS, "time_to_target_mean_s", bound, 1.0 / seconds_per_unit)
    labels = _label_bounds(ax, rows[at_bound], 1.0 / seconds_per_unit, "setback_scale", 1.0, bound, widen=False)
    if drawn["bounds"]:
        add_bound_key(ax, "at_least", cap_s)
    winners = rows["winner"].astype(bool).to_numpy()
    if winners.any():
        drawn["winners"].append(
            ax.scatter(rows["setback_scale"][winners], drawn_s[winners] / seconds_per_unit, s=160,
                       facecolors="none", edgecolors="#222222", linewidths=1.5, zorder=5, label="winner")
        )
    for crossover in _crossovers_at(crossovers, scenario, probability):
        drawn["crossovers"].append(ax.axvline(crossover, color="#444444", linestyle="--", linewidth=1.0))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("setback scale (× every rebuild's setback)")
    ax.set_ylabel(f"time to target loss ({unit})")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
    ax.set_title("Time to target vs setback scale\n" + rate_title_suffix(probability).strip())
    triangles = [line for line in drawn["bounds"] if str(line.get_gid()).startswith("bound:")]
    drawn["labels"] = labels
    place_labels(ax, labels, [], triangles)
    style_axes(ax)
    if legend:
        legend_outside(ax)
    return drawn


def _crossovers_at(crossovers: pd.DataFrame | None, scenario: str | None, probability: float) -> list[float]:
    if crossovers is None or crossovers.empty:
        return []
    require_columns(crossovers, CROSSOVER_COLUMNS, "setback crossovers")
    rows = crossovers if scenario is None else crossovers[crossovers["scenario"].astype(str) == scenario]
    rates = rows[RATE_COLUMN].astype(float)
    at_rate = rates.isna() if math.isnan(probability) else np.isclose(rates, probability, rtol=1e-9, atol=1e-12)
    values = rows.loc[at_rate, "crossover_scale"].astype(float)
    return [float(value) for value in values if math.isfinite(value)]


def sensitivity_rates(table: pd.DataFrame) -> list[float]:
    """The failure rates of a sensitivity table, ascending (NaN alone for non-hourly churn)."""
    if table.empty:
        raise NothingToPlot("the setback-sensitivity table is empty")
    rates = table[RATE_COLUMN].astype(float)
    finite = sorted(set(rates[np.isfinite(rates)]))
    return finite or [math.nan]
