"""The checkpoint interval: what it costs in stalls, and which interval reaches the target first."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.ticker import NullFormatter

from churnsim.calibration.tables import INTERVAL_COLUMNS

from .selection import require_columns, require_rows, setting_title_suffix, time_unit
from .style import (
    STOPPED_AT_CAP_TEXT,
    add_not_reached_key,
    cap_words,
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

INTERVAL_LABEL = "checkpoint interval K (iterations)"


def plot_checkpoint_interval(
    ax: Axes, intervals: pd.DataFrame, *, failure_probability: float = math.nan, rate_setting: str | None = None,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw the checkpoint stall fraction against the checkpoint interval, sync against lazy async.

    How to read it: the share of wall-clock spent blocked by checkpoints falls as checkpoints get
    rarer; the gap between the synchronous and the lazy asynchronous line is what hiding the copy
    behind forward/backward saves. Lines are simulated, large open markers are measured by a real
    benchmark (`source == "real"`).

    `intervals` has the columns of `calibration.tables.INTERVAL_COLUMNS`; `failure_probability` is
    the rate the simulated rows ran at (for the title; the table has no column for it), a value of
    `rate_setting` (a what-if's: None or the per-stage hourly probability, or its churn's own rate).
    Without real rows only the simulated lines are drawn (docs/gallery.md says how to add measured
    ones). A simulated interval at which no run reached the target (every run stopped at the
    wall-clock cap `cap_s`) gets a grey ring: its stall share is that of runs the cap cut short.
    Returns {"lines": one Line2D per method with
    simulated rows, "points": one PathCollection per method with real rows}; gids are method names.
    """
    require_columns(intervals, INTERVAL_COLUMNS, "checkpoint_intervals")
    rows = intervals[np.isfinite(intervals["stall_fraction"].astype(float))]
    require_rows(rows, "the checkpoint-interval figure")
    lines: list[Artist] = []
    points: list[Artist] = []
    rings: list[tuple[str, pd.DataFrame]] = []
    for method in ordered_methods(rows["method"]):
        method_rows = rows[rows["method"] == method].sort_values("interval_iterations")
        simulated = method_rows[method_rows["source"] == "simulated"]
        real = method_rows[method_rows["source"] == "real"]
        if not simulated.empty:
            (line,) = ax.plot(
                simulated["interval_iterations"].to_numpy(dtype=float),
                100.0 * simulated["stall_fraction"].to_numpy(dtype=float),
                **(method_style(method) | {"label": f"{method_label(method)}, simulated"}),
            )
            lines.append(line)
            rings.append((method, simulated[~np.isfinite(simulated["time_to_target_mean_s"].astype(float))]))
        if not real.empty:
            scatter = ax.scatter(
                real["interval_iterations"].to_numpy(dtype=float),
                100.0 * real["stall_fraction"].to_numpy(dtype=float),
                s=70,
                marker=method_marker(method),
                facecolors="none",
                edgecolors=method_color(method),
                linewidths=1.5,
                label=f"{method_label(method)}, measured",
                zorder=3,
            )
            scatter.set_gid(method)
            points.append(scatter)
    # After the lines, so that the legend lists the methods first and the rings' one entry last.
    keyed = False
    for method, capped in rings:
        if capped.empty:
            continue
        ax.plot(
            capped["interval_iterations"].to_numpy(dtype=float), 100.0 * capped["stall_fraction"].to_numpy(dtype=float),
            linestyle="none", marker="o", markersize=13, markerfacecolor="none", markeredgecolor="#333333",
            markeredgewidth=1.2, gid=f"capped:{method}",
            label="_capped" if keyed else f"{STOPPED_AT_CAP_TEXT}: no run at this interval\nreached the target within {cap_words(cap_s)}",
        )  # fmt: skip
        keyed = True
    _log_x_if_wide(ax, rows["interval_iterations"])
    ax.set_xlabel(INTERVAL_LABEL)
    ax.set_ylabel("checkpoint stall (% of wall-clock)")
    ax.set_title(f"Checkpoint stall vs interval{setting_title_suffix(rate_setting, failure_probability)}")
    style_axes(ax)
    legend_outside(ax)
    return {"lines": lines, "points": points}


def plot_optimal_interval(
    ax: Axes, intervals: pd.DataFrame, *, failure_probability: float = math.nan, rate_setting: str | None = None,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw simulated time to target against the checkpoint interval, with Young's and Daly's optima.

    How to read it: the lowest point of each line is the best interval the simulation found, with
    its 95 % confidence band; the vertical lines are the classic first-order optimum of Young,
    τ = √(2δM), and Daly's higher-order one (reference/checkpointing.md §6), converted to iterations
    from the synchronous checkpoint cost δ and the pipeline's mean time between failures M. Close
    agreement says the simple formula is enough for this setup.

    An interval at which no replication reached the target gets an × at the top: every run there
    was stopped at the wall-clock cap (`cap_s`, `target.max_wall_clock_s`, named in the legend).

    Returns {"lines": one Line2D per method, "bands": one PolyCollection per method, "reference":
    the Young and Daly Line2Ds that are finite, "not_reached": the × marks}.
    """
    require_columns(intervals, INTERVAL_COLUMNS, "checkpoint_intervals")
    simulated = intervals[intervals["source"] == "simulated"]
    reached = np.isfinite(simulated["time_to_target_mean_s"].astype(float))
    rows = simulated[reached]
    require_rows(rows, "the optimal-interval figure (no simulated interval reached the target)")
    lines: list[Artist] = []
    bands: list[Artist] = []
    not_reached: list[Artist] = []
    for method in ordered_methods(simulated["method"]):
        # An interval at which no replication reached the target (within the wall-clock limit): ×.
        missing = simulated[~reached & (simulated["method"] == method)]
        not_reached += mark_not_reached(ax, missing["interval_iterations"].to_numpy(dtype=float), method, row=len(not_reached))
    seconds_per_unit, unit = time_unit(rows["time_to_target_mean_s"])
    for method in ordered_methods(rows["method"]):
        method_rows = rows[rows["method"] == method].sort_values("interval_iterations")
        interval = method_rows["interval_iterations"].to_numpy(dtype=float)
        mean = method_rows["time_to_target_mean_s"].to_numpy(dtype=float) / seconds_per_unit
        low = method_rows["time_to_target_ci95_low_s"].to_numpy(dtype=float) / seconds_per_unit
        high = method_rows["time_to_target_ci95_high_s"].to_numpy(dtype=float) / seconds_per_unit
        low, high = np.where(np.isfinite(low), low, mean), np.where(np.isfinite(high), high, mean)
        (line,) = ax.plot(interval, mean, **method_style(method))
        band = ax.fill_between(interval, low, high, color=method_color(method), alpha=0.2, linewidth=0)
        band.set_gid(method)
        lines.append(line)
        bands.append(band)
    reference: list[Artist] = []
    for column, name, linestyle in (
        ("young_interval_iterations", "Young", "--"),
        ("daly_interval_iterations", "Daly", "-."),
    ):
        value = _first_finite(intervals[column])
        if math.isfinite(value) and value > 0:
            reference.append(
                ax.axvline(value, color="#444444", linestyle=linestyle, linewidth=1.1, label=f"{name} optimum ≈ {value:.0f} iterations", gid=name)
            )
    _log_x_if_wide(ax, simulated["interval_iterations"])
    if not_reached:
        make_room_for_not_reached(ax, len(not_reached))
        add_not_reached_key(ax, f"{STOPPED_AT_CAP_TEXT}: no run reached\nthe target within {cap_words(cap_s)}" if cap_s else None)
    ax.set_xlabel(INTERVAL_LABEL)
    ax.set_ylabel(f"time to target loss ({unit})")
    ax.set_title(f"Time to target vs checkpoint interval{setting_title_suffix(rate_setting, failure_probability)}")
    style_axes(ax)
    legend_outside(ax)
    return {"lines": lines, "bands": bands, "reference": reference, "not_reached": not_reached}


def _first_finite(column: pd.Series) -> float:
    values = column.to_numpy(dtype=float)
    values = values[np.isfinite(values)]
    return float(values[0]) if values.size else math.nan


def _log_x_if_wide(ax: Axes, intervals: pd.Series) -> None:
    """Intervals are usually swept geometrically; a log axis spaces them evenly once they span > 10×."""
    values = intervals.to_numpy(dtype=float)
    values = np.unique(values[values > 0])
    if values.size and values.max() / values.min() > 10.0:
        ax.set_xscale("log")
        if values.size <= 12:
            # Tick at the swept intervals themselves: "20" reads faster than a power of ten.
            ax.set_xticks(values, [f"{value:g}" for value in values])
            ax.xaxis.set_minor_formatter(NullFormatter())
