"""Loss against wall-clock time, one line per method."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from churnsim.calibration.tables import TRAJECTORY_COLUMNS

from .selection import (
    SECONDS_PER_HOUR,
    require_columns,
    require_rows,
    rate_title_suffix,
    select_failure_probability,
    select_methods,
    select_scenario,
)
from .style import method_style, ordered_methods, style_axes


def plot_loss_vs_wallclock(
    ax: Axes,
    trajectories: pd.DataFrame,
    *,
    scenario: str | None = None,
    failure_probability: float | None = None,
    replication: int = 0,
    target_loss: float | None = None,
    methods: Sequence[str] | None = None,
) -> dict[str, list[Artist]]:
    """Draw training loss against wall-clock hours for each method of one replication.

    How to read it: the line that reaches the dashed target-loss line furthest to the left reaches
    the target first; flat or rising stretches are time lost to failures (rollbacks, recovery,
    setbacks). Every method in a replication saw the same failures.

    `trajectories` has the columns of `calibration.tables.TRAJECTORY_COLUMNS`. Progress is linear in
    time between rows, so each segment is drawn through intermediate points whose loss is
    interpolated from the scenario's (progress, loss) rows of every method (an approximation of the
    convergence curve, exact at the rows). Defaults: the first scenario, the highest failure rate in
    the table, every method (or only `methods`).

    Returns {"lines": one Line2D per method (gid = method name), "target": [the target Line2D] or []}.
    """
    require_columns(trajectories, TRAJECTORY_COLUMNS, "trajectories")
    rows, scenario = select_scenario(trajectories, scenario)
    curve = rows.groupby("progress_iterations")["loss"].mean().sort_index()
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = rows[rows["replication"] == replication]
    rows = select_methods(rows, methods)
    require_rows(rows, f"the loss figure (replication {replication})")

    lines = []
    for method in ordered_methods(rows["method"]):
        method_rows = rows[rows["method"] == method].sort_values("time_s", kind="stable")
        time_s, loss = _densify(
            method_rows["time_s"].to_numpy(dtype=float),
            method_rows["progress_iterations"].to_numpy(dtype=float),
            method_rows["loss"].to_numpy(dtype=float),
            curve,
        )
        (line,) = ax.plot(
            time_s / SECONDS_PER_HOUR, loss, markevery=_marker_positions(len(time_s)), **method_style(method)
        )
        lines.append(line)
    target = []
    if target_loss is not None and np.isfinite(target_loss):
        target.append(
            ax.axhline(target_loss, color="#444444", linestyle="--", linewidth=1.0, label=f"target loss {target_loss:g}")
        )
    ax.set_xlabel("wall-clock time (hours)")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"Loss vs wall-clock{rate_title_suffix(probability)}")
    style_axes(ax)
    ax.legend(loc="upper right")
    return {"lines": lines, "target": target}


def _densify(
    time_s: np.ndarray, progress: np.ndarray, loss: np.ndarray, curve: pd.Series, points_per_segment: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Points inside each segment where progress is linear in time, loss read off the (progress, loss) curve."""
    if len(time_s) < 2 or len(curve) < 3:
        return time_s, loss
    fractions = np.arange(points_per_segment) / points_per_segment  # (k,)
    dense_time = (time_s[:-1, None] + np.diff(time_s)[:, None] * fractions).ravel()  # (segments · k,)
    dense_progress = (progress[:-1, None] + np.diff(progress)[:, None] * fractions).ravel()
    dense_loss = np.interp(dense_progress, curve.index.to_numpy(dtype=float), curve.to_numpy(dtype=float))
    # The first point of every segment is a table row: keep its exact loss.
    dense_loss[::points_per_segment] = loss[:-1]
    return np.append(dense_time, time_s[-1]), np.append(dense_loss, loss[-1])


def _marker_positions(num_points: int, num_markers: int = 8) -> list[int]:
    """About `num_markers` evenly spaced markers: enough to tell lines apart without hiding them."""
    if num_points <= num_markers:
        return list(range(num_points))
    return sorted(set(np.linspace(0, num_points - 1, num_markers).round().astype(int).tolist()))
