"""Simulated against measured: how far the simulator's predictions of held-out real runs are off."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from churnsim.calibration.tables import VALIDATION_INTERVAL_COLUMNS, VALIDATION_REQUIRED_COLUMNS

from .selection import require_columns, require_rows
from .style import legend_outside, method_color, method_label, method_marker, ordered_methods, style_axes

TOLERANCE = 0.05  # the ±5 % band


def quantity_label(quantity: str) -> str:
    """'time_to_target_s' → 'time to target (s)'; quantities without a unit suffix are unitless."""
    units = {"_s": "s", "_bytes": "bytes", "_bytes_per_s": "bytes/s", "_iterations": "iterations"}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return f"{quantity[: -len(suffix)].replace('_', ' ')} ({units[suffix]})"
    return f"{quantity.replace('_', ' ')} (unitless)"


def plot_validation(
    ax: Axes, validation: pd.DataFrame, *, quantity: str | None = None, legend: bool = True
) -> dict[str, list[Artist]]:
    """Draw each held-out run's predicted value against its measured value, coloured by method.

    How to read it: points on the diagonal are perfect predictions; points inside the shaded band
    are within ±5 % of the measurement; a vertical bar through a point is the prediction's 95 %
    interval of the calibrated machine's speed (where the table has one), which an exact model's
    run crosses the diagonal within; the title gives the mean of |simulated − measured| / measured.

    `validation` has the columns of `calibration.tables.VALIDATION_REQUIRED_COLUMNS` (and, drawn when
    present, `VALIDATION_INTERVAL_COLUMNS`). With `quantity` given,
    only its rows are drawn (the axes carry its unit); otherwise every quantity shares log–log axes.
    `legend=False` leaves the legend to the caller (several panels, one legend).

    Returns {"points": one PathCollection per method (gid = method), "identity": [the y = x
    Line2D], "band": [the ±5 % PolyCollection], "intervals": one bar collection per method with
    intervals}.
    """
    require_columns(validation, VALIDATION_REQUIRED_COLUMNS, "validation")
    rows = validation if quantity is None else validation[validation["quantity"] == quantity]
    measured_all = rows["measured"].to_numpy(dtype=float)
    predicted_all = rows["predicted"].to_numpy(dtype=float)
    rows = rows[np.isfinite(measured_all) & np.isfinite(predicted_all)]
    require_rows(rows, f"the validation figure ({quantity or 'all quantities'})")

    points: list[Artist] = []
    intervals: list[Artist] = []
    for method in ordered_methods(rows["method"]):
        method_rows = rows[rows["method"] == method]
        scatter = ax.scatter(
            method_rows["measured"].to_numpy(dtype=float),
            method_rows["predicted"].to_numpy(dtype=float),
            color=method_color(method),
            marker=method_marker(method),
            s=36,
            label=method_label(method),
            zorder=3,
        )
        scatter.set_gid(method)
        points.append(scatter)
        if all(column in method_rows for column in VALIDATION_INTERVAL_COLUMNS):
            # An interval that does not hold its prediction is not the validator's: it is not drawn.
            with_interval = method_rows[
                (method_rows["predicted_ci95_low"] <= method_rows["predicted"]) & (method_rows["predicted"] <= method_rows["predicted_ci95_high"])
            ]
            if not with_interval.empty:
                predicted = with_interval["predicted"].to_numpy(dtype=float)
                below = predicted - with_interval["predicted_ci95_low"].to_numpy(dtype=float)
                above = with_interval["predicted_ci95_high"].to_numpy(dtype=float) - predicted
                bars = ax.errorbar(
                    with_interval["measured"].to_numpy(dtype=float), predicted, yerr=np.vstack([below, above]),
                    fmt="none", ecolor=method_color(method), elinewidth=1.0, alpha=0.6, zorder=2,
                )
                intervals.append(bars)

    values = np.concatenate([rows["measured"].to_numpy(dtype=float), rows["predicted"].to_numpy(dtype=float)])
    quantities = list(dict.fromkeys(rows["quantity"].astype(str)))
    spread = values.max() / values.min() if values.min() > 0 else 1.0
    log_axes = (quantity is None and len(quantities) > 1) or spread > 20.0
    low, high = values.min(), values.max()
    margin = 0.08 * (high - low) if high > low else 0.1 * abs(high) + 1e-9
    if log_axes and low > 0:
        reference_x = np.geomspace(low / 1.3, high * 1.3, 100)
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        reference_x = np.linspace(low - margin, high + margin, 100)
    band = ax.fill_between(
        reference_x, (1 - TOLERANCE) * reference_x, (1 + TOLERANCE) * reference_x, color="#999999", alpha=0.25, linewidth=0, label="±5 %"
    )
    (identity,) = ax.plot(reference_x, reference_x, color="#444444", linestyle="--", linewidth=1.0, label="y = x")
    ax.set_xlim(reference_x[0], reference_x[-1])
    ax.set_ylim(reference_x[0], reference_x[-1])
    if not log_axes:
        ax.set_aspect("equal", adjustable="box")

    if quantity is not None or len(quantities) == 1:
        label = quantity_label(quantities[0])
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"simulated {label}")
    else:
        ax.set_xlabel("measured value (unit of each quantity, log scale)")
        ax.set_ylabel("simulated value (same unit, log scale)")
    measured, predicted = rows["measured"].to_numpy(dtype=float), rows["predicted"].to_numpy(dtype=float)
    nonzero = measured != 0
    subject = quantity_label(quantities[0]).split(" (")[0] if len(quantities) == 1 else "all quantities"
    if nonzero.any():
        error = float(np.mean(np.abs(predicted[nonzero] - measured[nonzero]) / np.abs(measured[nonzero])))
        summary = f"mean |error| {100 * error:.1f} %"
    else:
        # A relative error of a measured 0 is undefined: say so instead of printing "nan %".
        summary = f"measured all 0; mean simulated {np.mean(predicted):.3g}"
    ax.set_title(f"{subject}\n{summary}")
    style_axes(ax)
    if legend:
        legend_outside(ax)
    return {"points": points, "identity": [identity], "band": [band], "intervals": intervals}
