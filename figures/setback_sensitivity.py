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
from .style import legend_outside, method_color, method_style, ordered_methods, style_axes


def plot_setback_sensitivity(
    ax: Axes,
    table: pd.DataFrame,
    *,
    failure_probability: float | None = None,
    crossovers: pd.DataFrame | None = None,
    scenario: str | None = None,
    methods: Sequence[str] | None = None,
    legend: bool = True,
) -> dict[str, list[Artist]]:
    """Draw the time to the target loss (hours, or minutes or seconds for runs that short) against the setback scale, one line per method, at one failure rate.

    How to read it: at scale 1 the setbacks are the scenario's own (measured, paper-fitted or
    default); at 2 every rebuild costs twice as much. Lines of methods without setbacks are flat.
    A ring marks the winner at each scale; a dashed vertical line marks where the winner changes
    (from `crossovers`, sim/setback_sensitivity.py). Bands are 95 % intervals over replications,
    which include the replications' setback draws.

    `table` has `calibration.tables.SENSITIVITY_COLUMNS` (setback_sensitivity.csv); the rate
    defaults to the highest in it. Returns {"lines": one Line2D per method, "bands": one band per
    method, "winners": the rings, "crossovers": the vertical lines}; lines and bands carry the method
    name as gid. `legend=False` leaves the legend to the caller (several panels, one legend).
    """
    require_columns(table, SENSITIVITY_COLUMNS, "setback sensitivity")
    rows, scenario = select_scenario(table, scenario)
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = select_methods(rows, methods)
    rows = rows[np.isfinite(rows["time_to_target_mean_s"].astype(float))]
    require_rows(rows, "the setback-sensitivity figure (no method reached the target)")
    drawn: dict[str, list[Artist]] = {"lines": [], "bands": [], "winners": [], "crossovers": []}
    seconds_per_unit, unit = time_unit(rows["time_to_target_mean_s"])
    for method in ordered_methods(rows["method"].astype(str)):
        method_rows = rows[rows["method"] == method].sort_values("setback_scale")
        scale = method_rows["setback_scale"].to_numpy(dtype=float)
        mean = method_rows["time_to_target_mean_s"].to_numpy(dtype=float) / seconds_per_unit
        low = np.where(np.isfinite(method_rows["time_to_target_ci95_low_s"]), method_rows["time_to_target_ci95_low_s"] / seconds_per_unit, mean)
        high = np.where(np.isfinite(method_rows["time_to_target_ci95_high_s"]), method_rows["time_to_target_ci95_high_s"] / seconds_per_unit, mean)
        (line,) = ax.plot(scale, mean, **method_style(method))
        line.set_gid(method)
        band = ax.fill_between(scale, low, high, color=method_color(method), alpha=0.2, linewidth=0)
        band.set_gid(method)
        drawn["lines"].append(line)
        drawn["bands"].append(band)
    winners = rows[rows["winner"].astype(bool)]
    if not winners.empty:
        drawn["winners"].append(
            ax.scatter(winners["setback_scale"], winners["time_to_target_mean_s"] / seconds_per_unit, s=160,
                       facecolors="none", edgecolors="#222222", linewidths=1.5, zorder=5, label="winner")
        )
    for crossover in _crossovers_at(crossovers, scenario, probability):
        drawn["crossovers"].append(ax.axvline(crossover, color="#444444", linestyle="--", linewidth=1.0))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("setback scale (× every rebuild's setback)")
    ax.set_ylabel(f"time to target loss ({unit})")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
    ax.set_title("Time to target vs setback scale\n" + rate_title_suffix(probability).strip())
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
