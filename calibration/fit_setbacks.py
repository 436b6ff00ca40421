"""Setbacks from the convergence lab's per-rebuild table (real/convergence_lab.py): per method and
stage position, the mean baseline progress one rebuild costs, its Student-t 95 % interval, and how it
depends on when in training the failure struck.

The table has one row per (seed, method, stage, failure iteration, window): each rebuild is paired
with the no-failure run of its seed. The calibration keeps the longest window (the setback that
remains once the transient after the rebuild has passed); shorter windows show how it develops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from .convergence import MethodSetbacks, SetbackSpec
from .errors import InputError
from .fit_convergence import setback_spec
from .statistics import mean_with_ci95, t_quantile_975

LAB_WINDOW_ITERATIONS = 30
"""Iterations the convergence lab trains a rebuilt pipeline beside its no-failure twin."""
LAB_ITERATIONS = 1000
"""The lab's default no-failure run length (`calibrate --convergence --lab-iterations`)."""
LAB_FAILURE_POINTS = 16
"""The lab's default failure iterations per seed (`--failure-points`)."""


def lab_failure_span(num_iterations: int, window_iterations: int = LAB_WINDOW_ITERATIONS) -> tuple[int, int]:
    """First and last iteration a lab failure may strike: from 10 % of the run, so that the model has
    trained, to one window before its end, so that every rebuild gets its whole window."""
    return num_iterations // 10, num_iterations - window_iterations


LAB_COLUMNS: tuple[str, ...] = (
    "seed", "method", "stage", "position", "failure_iteration", "window_iterations", "setback_iterations",
)  # fmt: skip


def _check(rows: pd.DataFrame, source: str) -> None:
    missing = [column for column in LAB_COLUMNS if column not in rows.columns]
    if missing:
        raise InputError(f"{source}: lacks column(s) {', '.join(missing)}; expected the convergence lab's table ({', '.join(LAB_COLUMNS)})")
    if rows.empty:
        raise InputError(f"{source}: has no rebuilds; run the convergence lab with at least one failure")


def kept_window(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the longest window: the setbacks a calibration keeps."""
    return rows[rows["window_iterations"] == rows["window_iterations"].max()]


def progress_setback_spec(failure_iterations: Sequence[float], setbacks: Sequence[float]) -> SetbackSpec:
    """The setback as a function of training progress p: per_progress · max(0, p − offset), fitted by
    least squares (the line's slope, with its 95 % interval, and where it crosses 0). When the slope is
    not clearly positive (its interval holds 0), a constant: the mean and its interval."""
    from scipy import stats

    x = pd.Series(failure_iterations, dtype=float).to_numpy()
    y = pd.Series(setbacks, dtype=float).to_numpy()
    if len(y) >= 3 and len(set(x.tolist())) >= 2:
        fit = stats.linregress(x, y)
        half = t_quantile_975(len(y) - 2) * fit.stderr
        if fit.slope - half > 0:
            return SetbackSpec(
                mean_iterations=0.0,
                num_samples=len(y),
                per_progress_iteration=float(fit.slope),
                per_progress_ci95_low=float(fit.slope - half),
                per_progress_ci95_high=float(fit.slope + half),
                progress_offset_iterations=max(0.0, -float(fit.intercept) / float(fit.slope)),
            )
    return setback_spec(y.tolist())


def lab_setbacks(rows: pd.DataFrame, *, source: str = "setback table") -> dict[str, MethodSetbacks]:
    """Per method, interior and edge setbacks of the kept window, as functions of training progress."""
    _check(rows, source)
    kept = kept_window(rows)
    result = {}
    for method, frame in kept.groupby("method", sort=False):
        specs = {}
        for position in ("interior", "edge"):
            mine = frame[frame["position"] == position]
            specs[position] = progress_setback_spec(mine["failure_iteration"].tolist(), mine["setback_iterations"].tolist())
        result[str(method)] = MethodSetbacks(**specs)
    return result


def setback_summary(rows: pd.DataFrame, *, source: str = "setback table") -> pd.DataFrame:
    """One row per (method, position, window): rebuilds, mean setback and its 95 % interval, and the
    least-squares slope of setback against the failure iteration with its 95 % interval (how the
    setback grows with training progress)."""
    _check(rows, source)
    from scipy import stats

    out = []
    for (method, position, window), frame in rows.groupby(["method", "position", "window_iterations"], sort=True):
        values = frame["setback_iterations"].to_numpy(dtype=float)
        mean, low, high = mean_with_ci95(values.tolist())
        slope = slope_low = slope_high = math.nan
        if len(values) >= 3 and frame["failure_iteration"].nunique() >= 2:
            fit = stats.linregress(frame["failure_iteration"].to_numpy(dtype=float), values)
            half = t_quantile_975(len(values) - 2) * fit.stderr
            slope, slope_low, slope_high = fit.slope, fit.slope - half, fit.slope + half
        out.append(
            dict(
                method=method, position=position, window_iterations=int(window), num_rebuilds=len(values),
                mean_setback_iterations=mean, ci95_low_iterations=low, ci95_high_iterations=high,
                setback_per_iteration_of_progress=slope, slope_ci95_low=slope_low, slope_ci95_high=slope_high,
            )
        )  # fmt: skip
    return pd.DataFrame(out)


def methods_told_apart(rows: pd.DataFrame, position: str) -> pd.DataFrame:
    """Paired differences between methods at one position (same seed, stage and failure iteration):
    mean difference in setback and its 95 % interval; an interval that holds 0 cannot tell them apart."""
    kept = kept_window(rows)
    kept = kept[kept["position"] == position]
    wide = kept.pivot_table(index=["seed", "stage", "failure_iteration"], columns="method", values="setback_iterations")
    out = []
    methods = list(wide.columns)
    for index, first in enumerate(methods):
        for second in methods[index + 1 :]:
            differences = (wide[first] - wide[second]).dropna().to_numpy(dtype=float)
            if len(differences) < 2:
                continue
            mean, low, high = mean_with_ci95(differences.tolist())
            out.append(dict(position=position, method=first, other=second, num_pairs=len(differences), mean_difference_iterations=mean,
                            ci95_low_iterations=low, ci95_high_iterations=high, told_apart=bool(low > 0 or high < 0)))  # fmt: skip
    return pd.DataFrame(out)



def with_lab_setbacks(calibration, rows: pd.DataFrame, *, description: str):
    """A copy of `calibration` whose convergence setbacks are the lab's (measured), keeping its other
    setbacks (methods the lab did not measure) and its baseline curve."""
    measured = lab_setbacks(rows)
    setbacks = {**calibration.convergence.setbacks, **measured}
    kept = kept_window(rows)
    counts = kept.groupby(["method", "position"]).size()
    convergence = calibration.convergence.model_copy(
        update={
            "setbacks": setbacks,
            "calibrated": True,
            "setback_source": "measured",
            "source": f"setbacks of {', '.join(sorted(measured))} measured by the convergence lab ({description}; "
            f"{int(counts.min())}–{int(counts.max())} rebuilds per method and position, window {int(kept['window_iterations'].iloc[0])} iterations)",
        }
    )
    return calibration.model_copy(update={"convergence": convergence})
