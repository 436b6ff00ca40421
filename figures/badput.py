"""Where the wall-clock time of each method goes: goodput and the badput categories, stacked."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from churnsim.calibration.statistics import mean_with_ci95
from churnsim.calibration.tables import RUN_COLUMNS, TIME_CATEGORIES

from .selection import (
    rate_title_suffix,
    require_columns,
    require_rows,
    select_failure_probability,
    select_methods,
    select_scenario,
    time_unit,
)
from .style import CATEGORY_COLORS, CATEGORY_DISPLAY_NAMES, method_label, ordered_methods, style_axes


def plot_badput_breakdown(
    ax: Axes,
    runs: pd.DataFrame,
    *,
    failure_probability: float | None = None,
    scenario: str | None = None,
    as_fraction: bool = True,
    methods: Sequence[str] | None = None,
    legend: bool = True,
) -> dict[str, list[Artist]]:
    """Draw one stacked bar per method: goodput at the bottom, then each badput category.

    How to read it: the taller the bottom (goodput) segment, the more of the wall-clock went into
    useful training; the other segments name where the rest went (bubble, checkpoint stalls, lost
    work, recovery downtime, degraded mode, convergence setback). The black error bar is the 95 %
    confidence interval of the goodput share over replications.

    Segments are means over replications of each run's share of its wall-clock (`as_fraction=True`,
    bars sum to 1) or of wall-clock time in hours, minutes or seconds (`as_fraction=False`). Defaults: first scenario, highest failure rate.
    `legend=False` leaves the legend to the caller (two panels, one legend).

    Returns {"bars": one BarContainer per category in `calibration.tables.TIME_CATEGORIES` order, each holding
    one bar per method (so methods × categories bars), "errorbars": [the goodput ErrorbarContainer]}.
    """
    require_columns(runs, RUN_COLUMNS, "runs")
    rows, _ = select_scenario(runs, scenario)
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = select_methods(rows, methods)
    rows = rows[np.isfinite(rows["wall_clock_s"].astype(float)) & (rows["wall_clock_s"].astype(float) > 0)]
    require_rows(rows, "the badput figure")

    methods = ordered_methods(rows["method"])
    seconds_per_unit, unit = time_unit(rows["wall_clock_s"])
    divisor = rows["wall_clock_s"].astype(float) if as_fraction else seconds_per_unit
    shares = {category: rows[category].astype(float) / divisor for category in TIME_CATEGORIES}
    positions = np.arange(len(methods), dtype=float)
    bottom = np.zeros(len(methods))
    bars: list[Artist] = []
    goodput_ci = np.zeros((3, len(methods)))
    for category in TIME_CATEGORIES:
        per_method = [mean_with_ci95(shares[category][rows["method"] == method]) for method in methods]
        heights = np.nan_to_num(np.array([mean for mean, _, _ in per_method]))
        container = ax.bar(
            positions,
            heights,
            bottom=bottom,
            width=0.7,
            color=CATEGORY_COLORS[category],
            edgecolor="white",
            linewidth=0.5,
            label=CATEGORY_DISPLAY_NAMES[category],
            gid=category,
        )
        bars.append(container)
        if category == "goodput_s":
            goodput_ci = np.nan_to_num(np.array(per_method).T)
        bottom = bottom + heights
    mean, low, high = goodput_ci
    errorbar = ax.errorbar(
        positions, mean, yerr=[mean - low, high - mean], fmt="none", ecolor="black", capsize=3, linewidth=1.0
    )
    ax.set_xticks(positions, [method_label(method) for method in methods], rotation=30, ha="right", rotation_mode="anchor")
    ax.set_ylabel("share of wall-clock time (fraction)" if as_fraction else f"wall-clock time ({unit})")
    if as_fraction:
        ax.set_ylim(0, 1.0)
    what = "Share of the wall-clock" if as_fraction else f"{unit.capitalize()} of wall-clock"
    ax.set_title(f"{what}{rate_title_suffix(probability, rows)}")
    style_axes(ax)
    ax.grid(False, axis="x")
    if legend:
        # Legend outside the bars, top category first, matching the visual stacking order.
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return {"bars": bars, "errorbars": [errorbar]}
