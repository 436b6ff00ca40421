"""Loss against wall-clock time, one line per method."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from churnsim.calibration.tables import RUN_COLUMNS, TIME_CATEGORIES, TRAJECTORY_COLUMNS

from .selection import (
    rate_axis,
    require_columns,
    require_rows,
    rate_title_suffix,
    select_failure_probability,
    select_methods,
    select_scenario,
    time_unit,
)
from .style import (
    CATEGORY_DISPLAY_NAMES,
    NOT_REACHED_TEXT,
    STOPPED_AT_CAP_TEXT,
    add_not_reached_key,
    cap_words,
    legend_outside,
    method_color,
    method_label,
    method_style,
    ordered_methods,
    place_labels,
    style_axes,
)

LOSS_STEP = 0.01
"""Largest loss change (nats/token) between two drawn points inside a segment: finer than a pixel."""
MAX_POINTS_PER_SEGMENT = 400


def plot_loss_vs_wallclock(
    ax: Axes,
    trajectories: pd.DataFrame,
    *,
    scenario: str | None = None,
    failure_probability: float | None = None,
    replication: int = 0,
    target_loss: float | None = None,
    methods: Sequence[str] | None = None,
    runs: pd.DataFrame | None = None,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw training loss against wall-clock time (hours, or minutes or seconds for runs that short)
    for each method of one replication.

    How to read it: the line that reaches the dashed target-loss line furthest to the left reaches
    the target first; flat or rising stretches are time lost to failures (rollbacks, recovery,
    setbacks). Every method in a replication saw the same failures. A run that did not reach the
    target ends in an × with the reason read off the data beside it: whether the wall-clock cap
    (`cap_s`, `target.max_wall_clock_s`) stopped it, how often its progress was set back and how far
    it got, and (with `runs`, runs.csv) where most of its wall-clock went.

    `trajectories` has the columns of `calibration.tables.TRAJECTORY_COLUMNS`. Progress is linear in
    time between rows, so each segment is drawn through intermediate points whose loss is
    interpolated from the scenario's (progress, loss) rows of every method (an approximation of the
    convergence curve, exact at the rows). Defaults: the first scenario, the highest failure rate in
    the table, every method (or only `methods`).

    Returns {"lines": one Line2D per method (gid = method name), "target": [the target Line2D] or [],
    "not_reached": the × marks, "reasons": the Text beside each}.
    """
    require_columns(trajectories, TRAJECTORY_COLUMNS, "trajectories")
    rows, scenario = select_scenario(trajectories, scenario)
    curve = _loss_curve(rows)
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = rows[rows["replication"] == replication]
    rows = select_methods(rows, methods)
    require_rows(rows, f"the loss figure (replication {replication})")

    seconds_per_unit, unit = time_unit(rows["time_s"])
    lines = []
    not_reached = []
    final_progress = rows.groupby("method")["progress_iterations"].max()
    for method in ordered_methods(rows["method"]):
        method_rows = rows[rows["method"] == method].sort_values("time_s", kind="stable")
        time_s, loss = _densify(
            method_rows["time_s"].to_numpy(dtype=float),
            method_rows["progress_iterations"].to_numpy(dtype=float),
            method_rows["loss"].to_numpy(dtype=float),
            curve,
        )
        (line,) = ax.plot(time_s / seconds_per_unit, loss, markevery=_marker_positions(time_s), **method_style(method))
        lines.append(line)
        if not _reached(method_rows, target_loss, final_progress.max()):
            reason = _why_not_reached(method, method_rows, runs, rows, replication, cap_s, final_progress.max())
            # Thin, so that a run thrown back again and again does not hide the runs that progress.
            line.set_linewidth(0.8)
            not_reached.append((method, time_s[-1] / seconds_per_unit, loss[-1], float(np.min(loss)), reason))
    target = []
    if target_loss is not None and np.isfinite(target_loss):
        target.append(
            ax.axhline(target_loss, color="#444444", linestyle="--", linewidth=1.0, label=f"target loss {target_loss:g}", gid="reference:target")
        )
    # Marked once every line is drawn, so the words go to the side of the end with room.
    marks, reasons = [], []
    for method, end_time, end_loss, lowest_loss, reason in not_reached:
        mark, text = _mark_end(ax, end_time, end_loss, lowest_loss, method, reason)
        marks.append(mark)
        reasons.append(text)
    place_labels(ax, reasons, target)
    if marks:
        capped = all(f"stopped at {cap_words(cap_s)}" in text.get_text() for text in reasons)
        add_not_reached_key(ax, f"{STOPPED_AT_CAP_TEXT} ({cap_words(cap_s).removeprefix('the ')})" if capped else None)
    ax.set_xlabel(f"wall-clock time ({unit})")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Loss vs wall-clock{rate_title_suffix(probability, rows)}")
    style_axes(ax)
    legend_outside(ax)
    return {"lines": lines, "target": target, "not_reached": marks, "reasons": reasons}


def _reached(method_rows: pd.DataFrame, target_loss: float | None, most_progress: float) -> bool:
    """Whether the run got to the target: its last loss at the target loss when that is known, else
    as far as the furthest run of the replication got (the target's iterations)."""
    last = method_rows.iloc[-1]
    if target_loss is not None and np.isfinite(target_loss):
        return float(last["loss"]) <= target_loss + 1e-6 * max(abs(target_loss), 1.0)
    return float(last["progress_iterations"]) >= most_progress - 1e-9


def _why_not_reached(
    method: str, method_rows: pd.DataFrame, runs: pd.DataFrame | None, rows: pd.DataFrame, replication: int,
    cap_s: float | None, most_progress: float,
) -> str:
    """Why the run missed the target, in words drawn from its rows: stopped at the cap or not, how
    many times its progress fell back and how far it got, and its largest badput category."""
    progress = method_rows["progress_iterations"].to_numpy(dtype=float)
    end_s = float(method_rows["time_s"].iloc[-1])
    run = _run_row(runs, rows, method, replication)
    run = run if run is not None and not bool(run["reached_target"]) else None  # a row that disagrees says nothing
    capped = cap_s is not None and math.isfinite(cap_s) and end_s >= cap_s * (1.0 - 1e-6)
    failures = f" after {int(run['num_failures']):,} failures" if run is not None and np.isfinite(float(run["num_failures"])) else ""
    ended = f"stopped at {cap_words(cap_s)}" if capped else NOT_REACHED_TEXT
    parts = [f"{method_label(method)}: {ended}{failures}"]
    target_iterations = float(run["target_iterations"]) if run is not None and np.isfinite(float(run["target_iterations"])) else most_progress
    setbacks = int(np.sum(np.diff(progress) < 0))
    if setbacks:
        parts.append(f"progress set back {setbacks:,} times, never past {progress.max():,.0f} of {target_iterations:,.0f} iterations")
    if run is not None and float(run["wall_clock_s"]) > 0:
        badput = {category: float(run[category]) for category in TIME_CATEGORIES if category != "goodput_s"}
        largest = max(badput, key=badput.get)
        share = badput[largest] / float(run["wall_clock_s"])
        parts.append(f"{100 * share:.0f} % of its wall-clock went to {CATEGORY_DISPLAY_NAMES[largest]}")
    return ";\n".join(parts)


def _run_row(runs: pd.DataFrame | None, rows: pd.DataFrame, method: str, replication: int) -> pd.Series | None:
    """The runs.csv row of the run drawn (same scenario, rate, method and replication), if given."""
    if runs is None or runs.empty or not set(RUN_COLUMNS) <= set(runs.columns):
        return None
    match = (runs["method"].astype(str) == method) & (runs["replication"] == replication)
    if "scenario" in rows.columns and not rows.empty:
        match &= runs["scenario"].astype(str) == str(rows["scenario"].iloc[0])
    rate = rate_axis(rows).column
    if rate in rows.columns and rate in runs.columns and np.isfinite(rows[rate].astype(float)).any():
        match &= np.isclose(runs[rate].astype(float), float(rows[rate].astype(float).iloc[0]), rtol=1e-9, atol=1e-12)
    found = runs[match]
    return found.iloc[0] if len(found) == 1 else None


def _mark_end(ax: Axes, end_time: float, loss: float, lowest_loss: float, method: str, reason: str) -> tuple[Artist, Artist]:
    """× at the end of a run that gave up before the target, and the reason beside it (under the
    lowest point of its curve, on the side of the end with room)."""
    (mark,) = ax.plot(
        [end_time], [loss], linestyle="none", marker="x", markersize=10, markeredgewidth=2.5, color=method_color(method),
        gid=f"not_reached:{method}", label="_not_reached", zorder=4, clip_on=False,
    )  # fmt: skip
    low, high = ax.get_xlim()
    right_half = end_time > low + 0.5 * (high - low)
    text = ax.annotate(
        reason, (end_time, min(loss, lowest_loss)), xytext=(-8 if right_half else 8, -6), textcoords="offset points",
        ha="right" if right_half else "left", va="top", gid=f"reason:{method}",
        fontsize=8, color=method_color(method), bbox=dict(boxstyle="round,pad=0.25", facecolor="white", edgecolor=method_color(method), alpha=0.9),
    )  # fmt: skip
    return mark, text


def _loss_curve(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The scenario's loss against progress from every row of the table (all methods, rates and
    replications: every method follows the same curve in progress), loss made non-increasing."""
    curve = rows.groupby("progress_iterations")["loss"].mean().sort_index()
    progress = curve.index.to_numpy(dtype=float)
    loss = np.minimum.accumulate(curve.to_numpy(dtype=float))
    return progress, loss


def _densify(
    time_s: np.ndarray, progress: np.ndarray, loss: np.ndarray, curve: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Points inside each segment where progress grows linearly in time, their loss read off the
    scenario's (progress, loss) curve, spaced at most `LOSS_STEP` apart in loss, so a long segment
    (a run without failures has one) is drawn as the curve, not as chords above it. Exact at the
    table's rows; between the curve's own points the loss is interpolated linearly in progress."""
    curve_progress, curve_loss = curve
    if len(time_s) < 2 or len(curve_progress) < 3:
        return time_s, loss
    times, losses = [time_s[:1]], [loss[:1]]
    for index in range(len(time_s) - 1):
        t0, t1, p0, p1 = time_s[index], time_s[index + 1], progress[index], progress[index + 1]
        inside = (curve_progress > p0) & (curve_progress < p1)
        if p1 > p0 and t1 > t0:
            steps = int(min(max(np.ceil(abs(loss[index] - loss[index + 1]) / LOSS_STEP), 1), MAX_POINTS_PER_SEGMENT))
            # Points evenly spaced in loss where the curve is steep, plus the curve's own points.
            levels = np.linspace(loss[index], loss[index + 1], steps + 1)[1:-1]
            at_levels = np.interp(-levels, -curve_loss, curve_progress)
            points = np.unique(np.clip(np.concatenate([at_levels, curve_progress[inside]]), p0, p1))
            points = points[(points > p0) & (points < p1)]
            if len(points) > MAX_POINTS_PER_SEGMENT:
                points = points[np.linspace(0, len(points) - 1, MAX_POINTS_PER_SEGMENT).round().astype(int)]
            times.append(t0 + (points - p0) / (p1 - p0) * (t1 - t0))
            losses.append(np.interp(points, curve_progress, curve_loss))
        times.append(time_s[index + 1 : index + 2])
        losses.append(loss[index + 1 : index + 2])
    return np.concatenate(times), np.concatenate(losses)


def _marker_positions(time_s: np.ndarray, num_markers: int = 8) -> list[int]:
    """About `num_markers` markers evenly spaced in time (not in points, which crowd where the
    curve is steep): enough to tell lines apart without hiding them."""
    if len(time_s) <= num_markers:
        return list(range(len(time_s)))
    wanted = np.linspace(time_s[0], time_s[-1], num_markers)
    return sorted(set(np.searchsorted(time_s, wanted).clip(0, len(time_s) - 1).tolist()))
