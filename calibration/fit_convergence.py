"""Fit the convergence half of a calibration: the baseline loss curve and per-method setbacks.

Baseline: the shifted power law of calibration/convergence.py, fitted by nonlinear least squares
(scipy.optimize.curve_fit) to the train loss of no-failure runs.

Setback of one rebuild (approximation, stated): the run with failures and the no-failure reference
run with the same seed see the same batches, so their losses differ only through the weights. Over a
window of W iterations the mean loss of each run is turned into equivalent baseline progress with
the inverse of the fitted curve; the *deficit* is reference progress minus failure-run progress. The
setback of a failure at iteration f is the deficit in [f + settle, f + settle + W) minus the deficit
in [f − W, f) (what earlier failures already cost), clipped at 0. Failures whose windows reach the
next failure or the end of the run are skipped, and so are events that rebuild several stages at
once (they are not a single-stage sample). Rollback methods are not setbacks (their `iteration`
column rewinds and the simulator subtracts the lost iterations exactly), so only the methods with
the `uses_setbacks` trait (the neighbour-rebuild family) are estimated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize

from .convergence import MethodSetbacks, PowerLawLossCurve, SetbackSpec, default_setbacks
from .errors import InputError
from .failures import FailureSchedule
from .methods import method_traits
from .run_record import RunRecord
from .stage_positions import StagePosition, stage_position
from .statistics import mean_with_ci95

DEFAULT_WINDOW_ITERATIONS = 20
MINIMUM_CURVE_POINTS = 10
MAXIMUM_CURVE_EXPONENT = 0.76
"""Upper bound of a fitted baseline's exponent: the exponent of loss against optimizer steps in
Kaplan et al.'s scaling law (arXiv 2001.08361, α_S ≈ 0.76). A short run does not identify the
exponent and the floor apart: on the two 100-iteration no-failure runs of `calibrate --quick`,
exponent 3.44 with floor 2.17 fits them as well as 0.76 with floor 1.25 (r² 0.9889 against 0.9877),
and the steep one's floor lies above the loss 320-iteration runs of the same model reach (1.71), so
no time to target under it could be predicted. Fitted without the bound, each of 8 such runs
(benchmarks/calibrate_and_validate.py's 4× longer no-failure runs; their losses are
tests/calibration/data/cpu-tiny-no-failure-losses.csv) took exponents of 0.36–0.72 over its whole
320 iterations; fitted on its first 100, its trailing-mean loss at iteration 319 came out a median
0.36 too high unbounded, 0.14 with the exponent at most 1 and 0.05 at most 0.76
(`python benchmarks/loss_curve_extrapolation.py`). Approximation: a curve whose true exponent
exceeds the bound is fitted with a shallower one and a lower floor."""


def _near_bound(maximum_exponent: float) -> float:
    """Just inside the bound: where the fit's last grid start sits (curve_fit starts strictly within
    its bounds) and from where a fitted exponent counts as at the bound."""
    return maximum_exponent * (1 - 1e-6)


def exponent_at_bound(curve: PowerLawLossCurve, maximum_exponent: float = MAXIMUM_CURVE_EXPONENT) -> bool:
    """Whether a fitted curve's exponent sits at its bound: its runs did not tell a steeper curve
    with a higher floor from it."""
    return curve.exponent >= _near_bound(maximum_exponent)


def _power_law(progress: np.ndarray, floor: float, scale: float, exponent: float, offset: float) -> np.ndarray:
    return floor + scale * (progress + offset) ** (-exponent)


def _loss_by_iteration(metrics: pd.DataFrame, where: str) -> pd.Series:
    """Train loss indexed by training iteration (the last row wins where a rollback replayed one)."""
    missing = [column for column in ("iteration", "train_loss") if column not in metrics.columns]
    if missing:
        raise InputError(f"{where} lacks column(s) {', '.join(missing)}; expected iteration, train_loss")
    frame = metrics[["iteration", "train_loss"]].dropna()
    frame = frame[np.isfinite(frame["train_loss"].astype(float))]
    return frame.drop_duplicates("iteration", keep="last").set_index("iteration")["train_loss"].astype(float).sort_index()


def fit_baseline_curve(
    metrics: pd.DataFrame | Sequence[pd.DataFrame], *, minimum_points: int = MINIMUM_CURVE_POINTS, maximum_exponent: float = MAXIMUM_CURVE_EXPONENT
) -> PowerLawLossCurve:
    """Fit floor + scale · (i + offset)^(−exponent) to the train loss of one or more no-failure runs.

    Several runs (seeds) are pooled point by point. The fit starts from a small grid of exponents
    and offsets and keeps the best; bounds keep the floor in [0, min loss), the exponent at most
    `maximum_exponent` (`MAXIMUM_CURVE_EXPONENT`; 10 was the bound before it) and the other
    parameters positive. The fitted curve's r² is recorded.
    """
    frames = [metrics] if isinstance(metrics, pd.DataFrame) else list(metrics)
    if not frames:
        raise InputError("baseline curve: no no-failure run given; run at least one reference run with method 'none' and no failures")
    series = [_loss_by_iteration(frame, f"baseline metrics #{index}") for index, frame in enumerate(frames)]
    progress = np.concatenate([s.index.to_numpy(dtype=float) for s in series])
    loss = np.concatenate([s.to_numpy() for s in series])
    num_iterations = len(np.unique(progress))
    if num_iterations < minimum_points:
        raise InputError(
            f"baseline curve: {num_iterations} distinct iterations of train_loss, at least {minimum_points} needed; "
            "run the no-failure reference for more iterations"
        )
    if np.min(progress) < 0:
        raise InputError(f"baseline metrics: iteration {np.min(progress)} is negative; iterations count from 0")
    span = float(np.max(progress)) + 1.0
    lowest, highest = float(np.min(loss)), float(np.max(loss))
    if highest - lowest <= 0:
        raise InputError("baseline curve: train_loss does not change over the run; a power law cannot be fitted")
    upper_floor = max(lowest - 1e-6 * (highest - lowest), 0.0) + 1e-12
    lower = [0.0, 1e-12, 1e-3, 1e-3]
    upper = [upper_floor, np.inf, maximum_exponent, 100.0 * span]
    best: tuple[float, np.ndarray] | None = None
    for exponent in (0.1, 0.3, 0.6, min(1.0, _near_bound(maximum_exponent))):
        for offset in (1.0, 0.05 * span, 0.3 * span):
            floor = max(0.0, lowest - 0.5 * (highest - lowest))
            floor = min(floor, upper_floor * (1 - 1e-9))
            scale = max(highest - floor, 1e-6) * offset**exponent
            try:
                parameters, _ = optimize.curve_fit(
                    _power_law, progress, loss, p0=[floor, scale, exponent, offset], bounds=(lower, upper), maxfev=20000
                )
            except (RuntimeError, ValueError, optimize.OptimizeWarning):
                continue
            error = float(np.sum((_power_law(progress, *parameters) - loss) ** 2))
            if np.isfinite(error) and (best is None or error < best[0]):
                best = (error, parameters)
    if best is None:
        raise InputError("baseline curve: the power-law fit did not converge; check that train_loss falls over the run")
    error, (floor, scale, exponent, offset) = best
    total = float(np.sum((loss - loss.mean()) ** 2))
    return PowerLawLossCurve(
        floor_loss=float(floor),
        scale=float(scale),
        exponent=float(exponent),
        offset_iterations=float(offset),
        r_squared=1.0 - error / total,
    )


def equivalent_progress(curve: PowerLawLossCurve, loss: float) -> float:
    """Baseline iterations at which the curve has `loss`; losses at or under the floor map just above it."""
    margin = 1e-9 * curve.scale
    return curve.progress_for_loss(max(float(loss), curve.floor_loss + margin))


@dataclass(frozen=True, kw_only=True)
class SetbackSample:
    """One measured rebuild: the progress a run lost when one stage was rebuilt at `iteration`."""

    run_id: str
    method: str
    stage: int
    position: StagePosition
    iteration: int
    setback_iterations: float


def _failure_iteration(failure_step: int | None, time_s: float | None, metrics: pd.DataFrame) -> int | None:
    """Training iteration before which a failure struck.

    real/trainer.py writes the *step* into a failure's `iteration` cell; it is mapped through the
    metrics' step → iteration (identical for the neighbour-rebuild runs measured here). A failure
    with only a time struck before the first step that ended after it.
    """
    if failure_step is not None:
        row = metrics.loc[metrics["step"] == failure_step, "iteration"] if "step" in metrics.columns else pd.Series(dtype=float)
        return int(row.iloc[0]) if not row.empty else int(failure_step)
    if "wall_time_s" not in metrics.columns:
        return None
    later = metrics.loc[metrics["wall_time_s"] > float(time_s), "iteration"]  # type: ignore[arg-type]
    return int(later.iloc[0]) if not later.empty else None


def setback_samples_of_run(
    *,
    run_id: str,
    method: str,
    num_stages: int,
    metrics: pd.DataFrame,
    failures: FailureSchedule,
    reference_metrics: pd.DataFrame | None,
    curve: PowerLawLossCurve,
    window_iterations: int = DEFAULT_WINDOW_ITERATIONS,
    settle_iterations: int = 0,
) -> list[SetbackSample]:
    """Setbacks of the single-stage rebuilds of one run (module docstring for the method).

    Without a same-seed reference run (`reference_metrics` None) the fitted curve itself is the
    reference, which leaves batch-to-batch noise in the estimate.
    """
    if window_iterations < 1 or settle_iterations < 0:
        raise InputError(f"window_iterations {window_iterations} must be >= 1 and settle_iterations {settle_iterations} >= 0")
    where = f"run record {run_id!r}: metrics.csv"
    loss = _loss_by_iteration(metrics, where)
    reference = _loss_by_iteration(reference_metrics, f"reference of {run_id!r}: metrics.csv") if reference_metrics is not None else None
    events: dict[int, list[int]] = {}
    for failure in failures.failures:
        iteration = _failure_iteration(failure.iteration, failure.time_s, metrics)
        if iteration is not None:
            events.setdefault(iteration, []).append(failure.stage)
    starts = sorted(events)
    last_iteration = int(loss.index.max()) if not loss.empty else -1

    def deficit(first: int, stop: int) -> float | None:
        """Reference minus failure-run progress from the mean losses over iterations [first, stop)."""
        iterations = [i for i in range(first, stop) if i in loss.index and (reference is None or i in reference.index)]
        if len(iterations) < max(1, (stop - first) // 2):
            return None
        measured = float(loss.loc[iterations].mean())
        if reference is None:
            expected = float(np.mean([curve.loss(i) for i in iterations]))
        else:
            expected = float(reference.loc[iterations].mean())
        return equivalent_progress(curve, expected) - equivalent_progress(curve, measured)

    samples = []
    for index, start in enumerate(starts):
        stages = events[start]
        window_start, window_stop = start + settle_iterations, start + settle_iterations + window_iterations
        next_start = starts[index + 1] if index + 1 < len(starts) else math.inf
        if len(stages) != 1 or window_stop > next_start or window_stop - 1 > last_iteration:
            continue
        previous_start = starts[index - 1] if index > 0 else 0
        # Before the first failure the deficit is ~0; later ones subtract what earlier rebuilds cost.
        before = deficit(max(start - window_iterations, previous_start), start)
        after = deficit(window_start, window_stop)
        if after is None:
            continue
        stage = stages[0]
        samples.append(
            SetbackSample(
                run_id=run_id,
                method=method,
                stage=stage,
                position=stage_position(stage, num_stages),
                iteration=start,
                setback_iterations=max(0.0, after - (before or 0.0)),
            )
        )
    return samples


def _num_stages(record: RunRecord) -> int:
    manifest = record.manifest
    if manifest.real_settings is not None:
        return manifest.real_settings.pipeline.num_stages
    if manifest.scenario is not None:
        return manifest.scenario.pipeline.num_stages
    raise InputError(f"run record {manifest.run_id!r}: manifest.json has neither real_settings nor scenario; cannot tell the stage count")


def is_no_failure_run(record: RunRecord) -> bool:
    """A run whose metrics follow the no-failure curve: no failures struck, or they were ignored."""
    return method_traits(record.manifest.method).ignores_failures or not record.failures.failures


def estimate_setbacks(
    failure_records: Sequence[RunRecord],
    reference_records: Sequence[RunRecord],
    curve: PowerLawLossCurve,
    *,
    window_iterations: int = DEFAULT_WINDOW_ITERATIONS,
    settle_iterations: int = 0,
) -> tuple[dict[str, MethodSetbacks], list[SetbackSample]]:
    """Per (method, position) setbacks from the runs of neighbour-rebuild methods with failures.

    Each failure run is paired with the no-failure reference of the same seed (the fitted curve
    when there is none). Returns every neighbour-rebuild method's setbacks — a position without a
    sample keeps its documented default with `num_samples=0` — and the samples behind them.
    """
    references = {record.manifest.seed: record.metrics for record in reference_records if is_no_failure_run(record)}
    samples: list[SetbackSample] = []
    for record in failure_records:
        if not method_traits(record.manifest.method).uses_setbacks or not record.failures.failures:
            continue
        samples.extend(
            setback_samples_of_run(
                run_id=record.manifest.run_id,
                method=record.manifest.method,
                num_stages=_num_stages(record),
                metrics=record.metrics,
                failures=record.failures,
                reference_metrics=references.get(record.manifest.seed),
                curve=curve,
                window_iterations=window_iterations,
                settle_iterations=settle_iterations,
            )
        )
    return summarize_setbacks(samples), samples


def setback_spec(values: Sequence[float]) -> SetbackSpec:
    """Mean and Student-t 95 % interval of the finite measured setbacks, clipped at 0 (a rebuild that
    cost nothing measurable: the raw values stay in their table); no interval from one sample."""
    values = [float(value) for value in values if math.isfinite(value)]
    if not values:
        return SetbackSpec(mean_iterations=0.0, num_samples=0)
    mean, low, high = mean_with_ci95(values)
    if len(values) < 2:
        return SetbackSpec(mean_iterations=max(mean, 0.0), num_samples=1)
    return SetbackSpec(
        mean_iterations=max(mean, 0.0), ci95_low_iterations=max(low, 0.0), ci95_high_iterations=max(high, 0.0), num_samples=len(values)
    )


def summarize_setbacks(samples: Sequence[SetbackSample]) -> dict[str, MethodSetbacks]:
    result = {}
    for method, default in default_setbacks().items():
        specs = {}
        for position in ("interior", "edge"):
            values = [s.setback_iterations for s in samples if s.method == method and s.position == position]
            specs[position] = setback_spec(values) if values else default.for_position(position)  # type: ignore[arg-type]
        result[method] = MethodSetbacks(**specs)
    return result
