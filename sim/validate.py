"""Replay run records in the simulator and compare predicted with measured (DESIGN.md section 5).

For each run record:

1. **Scenario.** A real run: the record's `real_settings` (model, pipeline, method, iterations) with
   the calibration applied in mode `full` (`apply_calibration`), no churn, `restart_s` 0 (a local
   run keeps its processes: no rendezvous). A simulated run: its manifest's `scenario`, with the
   calibration applied in mode `full` when one is given.
2. **Failures.** The record's failures are replayed at their measured `time_s`. Consequence: when
   the prediction drifts, a failure lands at a different point of the simulated run than of the
   real one (another iteration, or inside an iteration instead of between two); the simulator then
   charges the interrupted part of the iteration in flight as lost work, which a real local run,
   whose failures strike between steps, does not lose. Failures with only an iteration are placed
   at the measured end of the step before.
3. **Stopping rule.** A real run executes exactly `num_iterations` iterations of progress (rolled
   back ones are repeated, a rebuild's setback does not lengthen it), so its wall-clock is
   predicted with every convergence setback set to 0. Time to target uses the calibrated setbacks
   and a target loss the run reached: its smoothed train loss (trailing mean over
   `SMOOTHING_ITERATIONS`) at `TARGET_FRACTION` (75 %) of its iterations; the measured time is
   the first step whose smoothed loss is at or below it. A simulated run is replayed under its own
   stopping rule (the scenario's target, setbacks as the scenario has them).
4. **Outside the simulator.** Held-out evaluations and the warm-up of the first steps are not
   simulated; for real runs the prediction adds the calibration's `evaluation` time per evaluation
   and its `warmup_extra_s` once. For methods with a measured steady extra cost
   (`method_iteration_extra_s`) the replay's iteration is stretched to it
   (`with_method_iteration_extra`). Process start-up (before the ranks' first barrier) is outside
   a run record's clock, on both sides.

Quantities (`calibration.tables.VALIDATION_COLUMNS`, one row each): `total_wall_clock_s`,
`time_to_target_s`, `mean_iteration_s` (mean steady step of the real run, i.e. without recovery,
checkpoint I/O or evaluation, against the simulator's healthy iteration), `checkpoint_stall_s`
(measured: per step the longest rank's blocking checkpoint spans, summed), `recovery_downtime_s`
(measured: per step the longest rank's `recovery.*` spans, summed) and `loss_curve_distance`: the
mean absolute difference of loss between the two loss-against-time curves over their common time
range (measured 0, predicted the difference in loss units; its `relative_error` is that
difference over the measured loss range). `relative_error` = (predicted − measured) / measured,
0 when both are 0 and NaN when only the measurement is 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from churnsim.calibration.calibration_file import Calibration
from churnsim.calibration.errors import InputError
from churnsim.calibration.fit_timing import steady_iteration_times_s
from churnsim.calibration.run_record import MANIFEST_FILE, METRICS_FILE, RunRecord, read_run_record
from churnsim.calibration.scenario import Scenario, TargetSpec
from churnsim.calibration.tables import VALIDATION_COLUMNS

from .calibrated import replay_failures, replay_scenario, without_setbacks
from .outputs import simulated_run_record_rows
from .replicate import failure_probability_of
from .results import RunResult
from .run import simulate_run

TARGET_FRACTION = 0.75
SMOOTHING_ITERATIONS = 10
NUM_CURVE_POINTS = 200
CHECKPOINT_STALL_SPAN_KINDS: tuple[str, ...] = ("save",)
"""Span kinds during which a real run's training is blocked by checkpointing (real/checkpoint/engine.py:
a save() call, or a wait before the optimizer step that actually waited; a lazy snapshot copy runs
in the background and does not count)."""
RECOVERY_SPAN_PREFIX = "recovery."
QUANTITIES: tuple[str, ...] = (
    "total_wall_clock_s",
    "time_to_target_s",
    "mean_iteration_s",
    "checkpoint_stall_s",
    "recovery_downtime_s",
    "loss_curve_distance",
)


@dataclass(frozen=True, kw_only=True)
class Observed:
    """What is compared, measured or predicted, for one run."""

    total_wall_clock_s: float
    time_to_target_s: float
    mean_iteration_s: float
    checkpoint_stall_s: float
    recovery_downtime_s: float
    loss_at: Callable[[np.ndarray], np.ndarray]
    """Loss against wall-clock seconds (vectorised)."""
    time_range_s: tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class RunValidation:
    run_id: str
    method: str
    source: str
    rows: pd.DataFrame
    target_loss: float | None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ValidationReport:
    table: pd.DataFrame
    """One row per (run, quantity), columns VALIDATION_COLUMNS."""
    runs: tuple[RunValidation, ...]
    fit_run_ids: tuple[str, ...]
    validated_run_ids: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)


# -- reading and checking records ---------------------------------------------------------------


def run_record_directories(paths: Sequence[str | Path]) -> list[Path]:
    """Each path is a run record, or a directory whose subdirectories are run records."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / MANIFEST_FILE).is_file():
            found.append(path)
            continue
        children = sorted(child for child in path.iterdir() if (child / MANIFEST_FILE).is_file()) if path.is_dir() else []
        if not children:
            raise InputError(f"{path}: neither a run record (no {MANIFEST_FILE}) nor a directory of run records; pass run record directories")
        found.extend(children)
    return found


def check_record(record: RunRecord, directory: str | Path) -> None:
    """Raise InputError naming the file and field when a record cannot be replayed."""
    directory = Path(directory)
    metrics_path = directory / METRICS_FILE
    metrics = record.metrics
    if metrics.empty:
        raise InputError(f"{metrics_path}: has no rows; a run record needs one row per executed iteration")
    for column in ("step", "iteration", "wall_time_s", "train_loss"):
        values = pd.to_numeric(metrics[column], errors="coerce")
        if column != "train_loss" and values.isna().any():
            row = int(values.isna().to_numpy().argmax())
            raise InputError(f"{metrics_path}: column '{column}' row {row} = {metrics[column].iloc[row]!r} is not a number; fix or re-record the run")
    wall = metrics["wall_time_s"].to_numpy(dtype=float)
    if np.any(wall < 0) or np.any(np.diff(wall) < 0):
        raise InputError(f"{metrics_path}: column 'wall_time_s' must be >= 0 and never decrease (seconds since the run started)")
    if not np.isfinite(pd.to_numeric(metrics["train_loss"], errors="coerce")).any():
        raise InputError(f"{metrics_path}: column 'train_loss' has no finite value; the loss curve cannot be compared")
    manifest = record.manifest
    if manifest.real_settings is None and manifest.scenario is None:
        raise InputError(f"{directory / MANIFEST_FILE}: field 'real_settings' (real runs) or 'scenario' (simulated runs) is required to replay the run")
    num_stages = (manifest.real_settings or manifest.scenario).pipeline.num_stages  # type: ignore[union-attr]
    record.failures.validate_for(num_stages, str(directory / "failures.csv"))


def load_record(directory: str | Path) -> RunRecord:
    record = read_run_record(directory)
    check_record(record, directory)
    return record


# -- measured and predicted observables ---------------------------------------------------------


def _per_step_longest_rank(spans: pd.DataFrame, chosen: pd.Series) -> float:
    rows = spans[chosen]
    if rows.empty:
        return 0.0
    durations = (rows["end_s"] - rows["start_s"]).groupby([rows["iteration"], rows["rank"]]).sum()
    return float(durations.groupby(level=0).max().sum())


def smoothed_loss(metrics: pd.DataFrame) -> pd.Series:
    loss = pd.to_numeric(metrics.sort_values("step")["train_loss"], errors="coerce").reset_index(drop=True)
    return loss.rolling(SMOOTHING_ITERATIONS, min_periods=1).mean()


def real_target_loss(metrics: pd.DataFrame) -> float:
    """The smoothed train loss the run reached at TARGET_FRACTION of its steps."""
    smoothed = smoothed_loss(metrics)
    index = min(len(smoothed) - 1, max(0, math.ceil(TARGET_FRACTION * len(smoothed)) - 1))
    return float(smoothed.iloc[index])


def measured_real(record: RunRecord, target_loss: float) -> Observed:
    metrics = record.metrics.sort_values("step").reset_index(drop=True)
    wall = metrics["wall_time_s"].to_numpy(dtype=float)
    smoothed = smoothed_loss(metrics).to_numpy(dtype=float)
    reached = np.flatnonzero(smoothed <= target_loss)
    spans = record.spans
    steady = steady_iteration_times_s(record)
    valid = np.isfinite(smoothed)
    return Observed(
        total_wall_clock_s=float(wall[-1]),
        time_to_target_s=float(wall[reached[0]]) if reached.size else math.nan,
        mean_iteration_s=float(steady.mean()) if not steady.empty else math.nan,
        checkpoint_stall_s=_per_step_longest_rank(spans, spans["kind"].isin(CHECKPOINT_STALL_SPAN_KINDS)),
        recovery_downtime_s=_per_step_longest_rank(spans, spans["kind"].astype(str).str.startswith(RECOVERY_SPAN_PREFIX)),
        loss_at=lambda times: np.interp(times, wall[valid], smoothed[valid]),
        time_range_s=(float(wall[0]), float(wall[-1])),
    )


def _observed_from_simulation(
    scenario: Scenario, summary: dict, metrics: pd.DataFrame, *, time_to_target_s: float, shift_s: Callable[[np.ndarray], np.ndarray] | None = None
) -> Observed:
    """Observables of a simulated run from its summary and its metrics rows (trajectory points).

    Used for both sides of a simulated record, so replaying a record in its own scenario gives
    exactly the recorded values.
    """
    curve = scenario.convergence.baseline
    times = metrics["wall_time_s"].to_numpy(dtype=float)
    progress = metrics["iteration"].to_numpy(dtype=float)
    shown = shift_s(times) if shift_s is not None else times

    def loss_at(query: np.ndarray) -> np.ndarray:
        return np.array([curve.loss(value) for value in np.interp(query, shown, progress)])

    return Observed(
        total_wall_clock_s=float(shown[-1]),
        time_to_target_s=time_to_target_s,
        mean_iteration_s=float(summary["healthy_iteration_time_s"]),
        checkpoint_stall_s=float(summary["checkpoint_stall_s"]),
        recovery_downtime_s=float(summary["recovery_downtime_s"]),
        loss_at=loss_at,
        time_range_s=(float(shown[0]), float(shown[-1])),
    )


def _metrics_of(scenario: Scenario, result: RunResult) -> pd.DataFrame:
    rows, _ = simulated_run_record_rows(scenario, result)
    return pd.DataFrame(rows)


def _relative_error(measured: float, predicted: float) -> float:
    if not (math.isfinite(measured) and math.isfinite(predicted)):
        return math.nan
    if measured == 0:
        return 0.0 if predicted == 0 else math.nan
    return (predicted - measured) / measured


def compare(measured: Observed, predicted: Observed) -> list[tuple[str, float, float, float]]:
    """(quantity, measured, predicted, relative_error) rows."""
    rows = [
        (quantity, getattr(measured, quantity), getattr(predicted, quantity))
        for quantity in QUANTITIES
        if quantity != "loss_curve_distance"
    ]
    result = [(quantity, m, p, _relative_error(m, p)) for quantity, m, p in rows]
    start = max(measured.time_range_s[0], predicted.time_range_s[0])
    stop = min(measured.time_range_s[1], predicted.time_range_s[1])
    if stop > start:
        grid = np.linspace(start, stop, NUM_CURVE_POINTS)
        measured_loss, predicted_loss = measured.loss_at(grid), predicted.loss_at(grid)
        distance = float(np.mean(np.abs(predicted_loss - measured_loss)))
        loss_range = float(np.max(measured_loss) - np.min(measured_loss))
        result.append(("loss_curve_distance", 0.0, distance, distance / loss_range if loss_range > 0 else math.nan))
    else:
        result.append(("loss_curve_distance", 0.0, math.nan, math.nan))
    return result


# -- one record ---------------------------------------------------------------------------------


def _validate_real(record: RunRecord, calibration: Calibration) -> tuple[Observed, Observed, float | None, list[str]]:
    settings = record.manifest.real_settings
    assert settings is not None
    notes: list[str] = []
    scenario = replay_scenario(record, calibration)
    failures = replay_failures(record)
    method = scenario.methods[0]
    wall_run = simulate_run(without_setbacks(scenario), method, failures, seed=record.manifest.seed)
    target_loss = real_target_loss(record.metrics)
    measured = measured_real(record, target_loss)
    evaluation_s = calibration.evaluation.median_s if calibration.evaluation is not None else 0.0
    every = settings.eval_every_iterations

    def extra_s(progress: float, *, final: bool) -> float:
        evaluations = math.floor(progress / every) + (1 if final and settings.num_iterations % every else 0)
        return calibration.warmup_extra_s + evaluation_s * evaluations

    floor = calibration.convergence.baseline.floor_loss
    time_to_target_s = math.nan
    target_result: RunResult | None = None
    if target_loss > floor:
        target_scenario = scenario.model_copy(
            update={"target": TargetSpec(loss=target_loss, max_wall_clock_s=max(10.0 * measured.total_wall_clock_s, 60.0))}
        )
        target_result = simulate_run(target_scenario, method, failures, seed=record.manifest.seed)
        if target_result.reached_target:
            time_to_target_s = target_result.wall_clock_s + extra_s(target_result.iterations_executed, final=False)
    else:
        notes.append(f"target loss {target_loss:.4g} is under the calibrated loss floor {floor:.4g}: time to target not predicted")
    curve_run = target_result if target_result is not None else wall_run
    curve_metrics = _metrics_of(scenario, curve_run)
    progress = curve_metrics["iteration"].to_numpy(dtype=float)
    predicted = _observed_from_simulation(
        scenario,
        wall_run.summary(),
        curve_metrics,
        time_to_target_s=time_to_target_s,
        # Evaluations already done never come undone, even when a setback lowers progress.
        shift_s=lambda times: times + np.maximum.accumulate(np.array([extra_s(value, final=False) for value in progress])),
    )
    predicted = Observed(
        total_wall_clock_s=wall_run.wall_clock_s + extra_s(settings.num_iterations, final=True),
        time_to_target_s=predicted.time_to_target_s,
        mean_iteration_s=predicted.mean_iteration_s,
        checkpoint_stall_s=predicted.checkpoint_stall_s,
        recovery_downtime_s=predicted.recovery_downtime_s,
        loss_at=predicted.loss_at,
        time_range_s=predicted.time_range_s,
    )
    notes.extend(wall_run.notes)
    return measured, predicted, target_loss, notes


def _validate_simulated(record: RunRecord, calibration: Calibration | None) -> tuple[Observed, Observed, float | None, list[str]]:
    scenario = replay_scenario(record, calibration)
    method = next((m for m in scenario.methods if m.name == record.manifest.method), None)
    if method is None:
        raise InputError(f"run record {record.manifest.run_id!r}: method {record.manifest.method!r} is not in its scenario's methods")
    result = simulate_run(scenario, method, replay_failures(record), replication=record.manifest.replication, seed=record.manifest.seed)
    summary = dict(record.manifest.summary)
    missing = [key for key in ("healthy_iteration_time_s", "checkpoint_stall_s", "recovery_downtime_s", "reached_target", "wall_clock_s") if key not in summary]
    if missing:
        raise InputError(f"run record {record.manifest.run_id!r}: manifest.json field 'summary' lacks {', '.join(missing)}; re-write the record with churnsim simulate")
    measured = _observed_from_simulation(
        scenario, summary, record.metrics, time_to_target_s=float(summary["wall_clock_s"]) if summary["reached_target"] else math.nan
    )
    predicted_summary = result.summary()
    predicted = _observed_from_simulation(
        scenario,
        predicted_summary,
        _metrics_of(scenario, result),
        time_to_target_s=result.wall_clock_s if result.reached_target else math.nan,
    )
    return measured, predicted, scenario.target.loss, list(result.notes)


def validate_record(record: RunRecord, calibration: Calibration | None) -> RunValidation:
    """Predicted against measured for one record (module docstring)."""
    manifest = record.manifest
    if manifest.real_settings is not None:
        if calibration is None:
            raise InputError(f"run record {manifest.run_id!r} is a real run: replaying it needs a calibration (--calibration FILE)")
        measured, predicted, target_loss, notes = _validate_real(record, calibration)
        probability = (
            failure_probability_of(manifest.scenario) if manifest.scenario is not None else manifest.real_settings.failure_rate_per_stage_hour
        )
    else:
        measured, predicted, target_loss, notes = _validate_simulated(record, calibration)
        probability = failure_probability_of(manifest.scenario)  # type: ignore[arg-type]
    rows = pd.DataFrame(
        [
            dict(
                run_id=manifest.run_id,
                method=manifest.method,
                failure_probability_per_stage_hour=math.nan if probability is None else probability,
                quantity=quantity,
                measured=m,
                predicted=p,
                relative_error=error,
            )
            for quantity, m, p, error in compare(measured, predicted)
        ],
        columns=list(VALIDATION_COLUMNS),
    )
    return RunValidation(run_id=manifest.run_id, method=manifest.method, source=manifest.source, rows=rows, target_loss=target_loss, notes=tuple(notes))


def validate_runs(directories: Sequence[str | Path], calibration: Calibration | None) -> ValidationReport:
    """Validate every record; refuses runs the calibration was fitted on (held-out discipline)."""
    return validate_records(load_held_out_records(directories, calibration), calibration)


def load_held_out_records(directories: Sequence[str | Path], calibration: Calibration | None) -> list:
    """Read and check every run record (InputError naming the first bad one), before any work.

    Refuses a run the calibration was fitted on, and a run given twice."""
    fitted = set(calibration.provenance.fit_run_ids) if calibration is not None else set()
    records = []
    for directory in run_record_directories(directories):
        record = load_record(directory)
        if record.manifest.run_id in fitted:
            raise InputError(
                f"{directory}: run {record.manifest.run_id!r} was used to fit calibration {calibration.name!r}; "  # type: ignore[union-attr]
                "validate only held-out runs (see provenance.fit_run_ids)"
            )
        records.append(record)
    seen: set[str] = set()
    for record in records:
        if record.manifest.run_id in seen:
            raise InputError(f"run {record.manifest.run_id!r} is given twice; pass each run record once")
        seen.add(record.manifest.run_id)
    return records


def validate_records(records: Sequence, calibration: Calibration | None) -> ValidationReport:
    """Replay each checked record (`load_held_out_records`) in the simulator; predicted against measured."""
    fitted = set(calibration.provenance.fit_run_ids) if calibration is not None else set()
    runs = tuple(validate_record(record, calibration) for record in records)
    table = pd.concat([run.rows for run in runs], ignore_index=True) if runs else pd.DataFrame(columns=list(VALIDATION_COLUMNS))
    return ValidationReport(
        table=table,
        runs=runs,
        fit_run_ids=tuple(sorted(fitted)),
        validated_run_ids=tuple(run.run_id for run in runs),
        notes=tuple(dict.fromkeys(note for run in runs for note in run.notes)),
    )


def median_absolute_error(table: pd.DataFrame, quantity: str = "total_wall_clock_s") -> pd.DataFrame:
    """Per method: runs and the median of |relative_error| of `quantity`."""
    rows = table[table["quantity"] == quantity].copy()
    rows["absolute_error"] = rows["relative_error"].abs()
    grouped = rows.groupby("method", sort=True)["absolute_error"]
    return pd.DataFrame({"num_runs": grouped.count(), "median_absolute_relative_error": grouped.median()}).reset_index()
