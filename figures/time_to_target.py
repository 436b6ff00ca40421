"""Time to target and speed-ups against the per-stage failure rate, with 95 % confidence intervals."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.container import Container

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import speedup_baselines
from churnsim.calibration.tables import SUMMARY_COLUMNS, speedup_columns

from .selection import (
    RATE_COLUMN,
    SECONDS_PER_HOUR,
    NothingToPlot,
    require_columns,
    require_rows,
    select_methods,
    select_scenario,
)
from .style import method_color, method_label, method_style, ordered_methods, style_axes

RATE_LABEL = "failure probability per stage (%/h)"


def plot_time_to_target(
    ax: Axes, summary: pd.DataFrame, *, scenario: str | None = None, methods: Sequence[str] | None = None
) -> dict[str, list[Artist]]:
    """Draw mean wall-clock hours to the target loss against the failure rate, one line per method.

    How to read it: lower is better; the shaded band is the 95 % confidence interval over
    replications, so where two bands do not overlap the difference is not noise. A method whose
    line stops did not reach the target within the time limit at the higher rates.

    `summary` has the columns of `calibration.tables.SUMMARY_COLUMNS`. Returns {"lines": one Line2D
    per method, "bands": one 95 % band per method (a PolyCollection, or an ErrorbarContainer when the
    method has a single failure rate)}; every artist's gid (an ErrorbarContainer's children's) is the method name.
    """
    require_columns(summary, SUMMARY_COLUMNS, "summary")
    rows, _ = select_scenario(summary, scenario)
    rows = select_methods(rows, methods)
    drawn = _lines_against_rate(
        ax,
        rows,
        mean_column="time_to_target_mean_s",
        low_column="time_to_target_ci95_low_s",
        high_column="time_to_target_ci95_high_s",
        scale=1.0 / SECONDS_PER_HOUR,
        methods=ordered_methods(rows["method"]),
        what="the time-to-target figure",
    )
    ax.set_ylabel("time to target loss (hours)")
    ax.set_title("Time to target vs failure rate")
    ax.legend(loc="best")
    return drawn


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
    confidence intervals. The baseline itself is not drawn.

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
    finite = rows[np.isfinite(rows[mean_column].astype(float))]
    methods = [method for method in ordered_methods(finite["method"]) if method != baseline]
    drawn = _lines_against_rate(
        ax,
        finite,
        mean_column=mean_column,
        low_column=low_column,
        high_column=high_column,
        scale=1.0,
        methods=methods,
        what=f"the speed-up figure over {baseline} (no run of {baseline} reached the target?)",
    )
    drawn["reference"] = [ax.axhline(1.0, color="#444444", linestyle="--", linewidth=1.0)]
    ax.set_ylabel(f"speed-up over {method_label(baseline)} (×)")
    ax.set_title(f"Speed-up over {method_label(baseline)}")
    ax.legend(loc="best")
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
) -> dict[str, list[Artist]]:
    rows = rows[np.isfinite(rows[RATE_COLUMN].astype(float)) & np.isfinite(rows[mean_column].astype(float))]
    rows = rows[rows["method"].isin(methods)]
    require_rows(rows, what)
    lines: list[Artist] = []
    bands: list[Artist] = []
    for method in methods:
        method_rows = rows[rows["method"] == method].sort_values(RATE_COLUMN)
        if method_rows.empty:
            continue
        rate_percent = 100.0 * method_rows[RATE_COLUMN].to_numpy(dtype=float)
        mean = scale * method_rows[mean_column].to_numpy(dtype=float)
        # A missing interval (one replication) collapses to the mean rather than hiding the point.
        low = np.where(np.isfinite(method_rows[low_column]), scale * method_rows[low_column].to_numpy(dtype=float), mean)
        high = np.where(np.isfinite(method_rows[high_column]), scale * method_rows[high_column].to_numpy(dtype=float), mean)
        (line,) = ax.plot(rate_percent, mean, **method_style(method))
        lines.append(line)
        if len(rate_percent) > 1:
            band = ax.fill_between(rate_percent, low, high, color=method_color(method), alpha=0.2, linewidth=0)
        else:
            band = ax.errorbar(
                rate_percent, mean, yerr=[mean - low, high - mean], fmt="none", ecolor=method_color(method), capsize=3
            )
        for artist in band.get_children() if isinstance(band, Container) else [band]:
            artist.set_gid(method)
        bands.append(band)
    if not lines:
        raise NothingToPlot(f"no rows to plot for {what}")
    ax.set_xlabel(RATE_LABEL)
    style_axes(ax)
    return {"lines": lines, "bands": bands}
