"""Replay run records in the simulator and compare predicted with measured (DESIGN.md section 5).

For each run record:

1. **Scenario.** A real run: the record's `real_settings` (model, pipeline, method, iterations) with
   the calibration applied in mode `full` (`apply_calibration`), no churn, `restart_s` 0 (a local
   run keeps its processes: no rendezvous) except where the calibration measured a method's restart
   (`RecoveryTimes.unrecorded_s`: what its recovery steps took beyond their recorded parts). A run
   of hard failures (`record_failure_mode`) is charged the calibration's hard-failure recovery
   instead: its configured join delay plus the measured process start, and the measured rendezvous
   (`charge_own_failure_mode`). Any
   model and pipeline of the calibrated machine (same device and core count,
   `check_same_machine`): the calibrated setup takes its measured times, any other the
   calibration's compute cost model (calibration.compute_cost). A simulated run: its
   manifest's `scenario`, with the calibration applied in mode `full` when one is given.
2. **Failures.** A real run's failures strike where they struck it: before the same step
   (`calibrated.replay_failures_at_steps`), each placed at the instant the simulated run, with the
   earlier ones placed, begins that step, after the work at its boundary such as a checkpoint write
   (a real local run checks for failures between steps and loses no partial iteration). A failure
   that fell due during an earlier one's recovery (recorded at the same step, seconds later: a hard
   failure's restart under torchrun's agent) is placed after that recovery (`failure_rounds`).
   So a prediction keeps the run's failure pattern (the checkpoint a rollback returns to, the
   failures that overlap a recovery) when its speed differs from the run's; replayed at measured
   times, a failure of a run slower than predicted can land after the simulated run's end or
   before a checkpoint instead of after it, and change the prediction even with compute already
   rescaled to the run's own speed. A simulated run's failures are replayed at their
   times, which is exact for it.
3. **Stopping rule.** A real run executes exactly `num_iterations` iterations of progress (rolled
   back ones are repeated, a rebuild's setback does not lengthen it), so its wall-clock is
   predicted with every convergence setback set to 0. Time to target uses the calibrated setbacks.
   Its goal comes from the run's no-failure twin when one is validated with it (`find_twin`: same
   seed, setup and length, no failures): the twin's smoothed train loss (trailing mean over
   `SMOOTHING_ITERATIONS`) at `TARGET_FRACTION` (75 %) of its steps, a loss the run can reach; the
   simulator is asked for the twin's progress at that point plus the setbacks, so the check does
   not rest on the fitted loss curve. Without a twin the goal is the run's own smoothed loss at 75 %
   of its steps, predicted through the calibrated loss curve smoothed by the same trailing mean
   (`progress_for_smoothed_loss`). The measured time is the first step
   whose smoothed loss is at or below the goal. A simulated run is replayed under its own stopping
   rule (the scenario's target, setbacks as the scenario has them).
4. **Outside the simulator.** Held-out evaluations and the warm-up of the first steps are not
   simulated; for real runs the prediction adds the calibration's `evaluation` time per evaluation
   and its `warmup_extra_s` once. For methods with a measured steady extra cost
   (`method_iteration_extra_s`) the replay's iteration is stretched to it, on another setup to it
   scaled as the iteration model's own extra of the method (`sim/model/method_extras.py`). Process start-up (before the ranks' first barrier) is outside
   a run record's clock, on both sides.

Quantities (`calibration.tables.VALIDATION_COLUMNS`, one row each): `total_wall_clock_s`,
`time_to_target_s`, `steady_iteration_s` (median steady step of the real run, i.e. without recovery,
checkpoint I/O or evaluation, against the simulator's healthy iteration), `checkpoint_stall_s`
(measured: per step the longest rank's blocking checkpoint spans, summed), `recovery_downtime_s`
(measured: per recovery step each part's longest rank and the step's time beyond them and a steady
step, summed; `measured_recovery_downtime_s`) and `loss_curve_distance`: the
mean absolute difference of loss between the two loss-against-time curves over their common time
range (measured 0, predicted the difference in loss units; its `relative_error` is that
difference over the measured loss range). `relative_error` = (predicted − measured) / measured,
0 when both are 0 and NaN when only the measurement is 0.

Load-normalised error (real runs; `total_wall_clock_s` and `time_to_target_s`): the machine may run
slower or faster than while calibrating (other load, frequency). The run's own median steady step
over the predicted healthy iteration is that factor; the prediction is repeated with every compute
time (and evaluation and warm-up) multiplied by it. What error remains is the model's (recovery,
checkpoints, failures' timing, contention), not the machine's mood; `steady_iteration_s` is exact
after normalisation by construction and is not reported normalised.

Machine speed at validation (`machine_slowdown_at_validation`): the run's own steady step mixes the
machine's speed with the compute model's error (a setup the model carries badly also reads as a
slow machine). Where the calibration holds a speed reference and the validator runs on the
calibrated machine, the caller times the same fixed probe again (`SpeedProbeComparison`, measured
by churnsim/ with real/speed_probe.py: this module never runs torch) and every real run's rows carry
the ratio; a note says plainly when it was not measured and why. The probe times the machine now,
not during each held-out run: it tells drift since calibrating, not each run's speed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from churnsim.calibration.calibration_file import Calibration
from churnsim.calibration.compute_cost import setup_description, setup_differences, setup_fingerprint, setup_key
from churnsim.calibration.convergence import PowerLawLossCurve
from churnsim.calibration.errors import InputError
from churnsim.calibration.fit_timing import recovery_events, steady_iteration_times_s
from churnsim.calibration.apply import recovery_for_failure_mode
from churnsim.calibration.run_record import MANIFEST_FILE, METRICS_FILE, RunRecord, configured_join_delay_s, read_run_record, record_failure_mode
from churnsim.calibration.scenario import Scenario, TargetSpec
from churnsim.calibration.statistics import median_with_ci95
from churnsim.calibration.speed_uncertainty import log_speed_spread, scenario_run_speed_log_sd, speed_interval_factors, with_compute_scaled
from churnsim.calibration.tables import VALIDATION_COLUMNS

from ..model.calibrated import replay_failures, replay_failures_at_steps, replay_scenario, without_setbacks
from ..studies.outputs import simulated_run_record_rows
from ..studies.replicate import failure_probability_of
from ..model.results import RunResult
from ..model.run import simulate_run

TARGET_FRACTION = 0.75
SMOOTHING_ITERATIONS = 10
NUM_CURVE_POINTS = 200
CHECKPOINT_STALL_SPAN_KINDS: tuple[str, ...] = ("save",)
"""Span kinds during which a real run's training is blocked by checkpointing (real/checkpoint/engine.py:
a save() call, or a wait before the optimizer step that actually waited; a lazy snapshot copy runs
in the background and does not count)."""
LOAD_NORMALISED_QUANTITIES: frozenset[str] = frozenset({"total_wall_clock_s", "time_to_target_s"})
"""Quantities also reported with compute rescaled by the run's own steady step (real runs)."""
QUANTITIES: tuple[str, ...] = (
    "total_wall_clock_s",
    "time_to_target_s",
    "steady_iteration_s",
    "checkpoint_stall_s",
    "recovery_downtime_s",
    "loss_curve_distance",
)


@dataclass(frozen=True, kw_only=True)
class Observed:
    """What is compared, measured or predicted, for one run."""

    total_wall_clock_s: float
    time_to_target_s: float
    steady_iteration_s: float
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
    through_compute_model: bool = False
    """A real run of a setup other than the calibrated one, predicted through the compute model."""
    predicted_handled_as: tuple[str, ...] = ()
    """How the replay handled each of the run's failures, in order (`HandledFailure.handled_as`: e.g.
    `replica_heal`, `stage_loss` with data parallelism); () for simulated records."""


@dataclass(frozen=True, kw_only=True)
class SpeedProbeComparison:
    """The speed probe's time now over its time at calibration (`Calibration.speed_reference`), or
    why it was not measured."""

    slowdown: float | None
    """1.10: the probe ran 10 % slower than at calibration; None: the probe did not run."""
    reason_not_measured: str = ""
    """Where `slowdown` is None: why, in words a user can act on."""

    def note(self, calibration_name: str) -> str:
        if self.slowdown is None:
            return f"machine speed against calibration time: not measured ({self.reason_not_measured})"
        direction = "slower" if self.slowdown >= 1 else "faster"
        return (
            f"machine speed against calibration time: the speed probe ran {self.slowdown:.2f}× its time when {calibration_name!r} was "
            f"calibrated ({100 * abs(self.slowdown - 1):.0f} % {direction}; column machine_slowdown_at_validation): drift of the "
            "machine since then, measured now rather than during each run, which the absolute errors include and the "
            "load-normalised ones take out"
        )


NO_PROBE = SpeedProbeComparison(slowdown=None, reason_not_measured="no speed probe was run with this validation")


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
    pipeline = (manifest.real_settings or manifest.scenario).pipeline  # type: ignore[union-attr]
    record.failures.validate_for(
        pipeline.num_stages, str(directory / "failures.csv"), data_parallel_degree=pipeline.data_parallel_degree
    )


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


def measured_recovery_downtime_s(record: RunRecord, steady_step_s: float) -> float:
    """Summed over a run's recovery events, their recorded parts and the time no span records
    (`recovery_events`, against the run's median steady step): what the simulator's recovery
    downtime stands for, restart included."""
    events = recovery_events(record, steady_step_s=steady_step_s)
    return float(events.fillna(0.0).to_numpy().sum())


def smoothed_loss(metrics: pd.DataFrame) -> pd.Series:
    loss = pd.to_numeric(metrics.sort_values("step")["train_loss"], errors="coerce").reset_index(drop=True)
    return _trailing_mean(loss)


def _trailing_mean(loss: pd.Series) -> pd.Series:
    return loss.rolling(SMOOTHING_ITERATIONS, min_periods=1).mean()


def progress_for_smoothed_loss(curve: PowerLawLossCurve, target_loss: float) -> int:
    """Iterations of baseline progress after which `curve`, smoothed as a run's loss is
    (`smoothed_loss`: the trailing mean over SMOOTHING_ITERATIONS), first reaches `target_loss`
    (above the curve's floor). The measured time to target waits for the smoothed loss, which lags
    the loss itself by about half the window on a falling curve. Asking the simulator for the
    curve itself to reach the goal put the no-failure runs of the calibrate-and-validate benchmark
    short in the median, by more than with the smoothing. Runs that read another share of the corpus
    than the calibration's runs also differ (`CORPUS_MAX_BYTES` makes them the same)."""
    # The curve falls, so its trailing mean reaches the goal no earlier than the curve does and at
    # the latest a window later.
    first = max(0, math.ceil(curve.progress_for_loss(target_loss) - 1e-9))
    # The losses from a window before `first` on, so that every mean read from `first` on is whole.
    start = max(0, first - SMOOTHING_ITERATIONS + 1)
    losses = pd.Series([curve.loss(float(iteration)) for iteration in range(start, first + SMOOTHING_ITERATIONS)])
    reached = np.flatnonzero(_trailing_mean(losses).to_numpy()[first - start :] <= target_loss)
    return first + (int(reached[0]) + 1 if reached.size else SMOOTHING_ITERATIONS)


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
    steady_step_s = float(steady.median()) if not steady.empty else math.nan
    valid = np.isfinite(smoothed)
    return Observed(
        total_wall_clock_s=float(wall[-1]),
        time_to_target_s=float(wall[reached[0]]) if reached.size else math.nan,
        steady_iteration_s=steady_step_s,
        checkpoint_stall_s=_per_step_longest_rank(spans, spans["kind"].isin(CHECKPOINT_STALL_SPAN_KINDS)),
        recovery_downtime_s=measured_recovery_downtime_s(record, steady_step_s),
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
        steady_iteration_s=float(summary["healthy_iteration_time_s"]),
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


@dataclass(frozen=True, kw_only=True)
class _TargetOfTwin:
    """A time-to-target goal read off the run's no-failure twin (same seed and setup)."""

    run_id: str
    loss: float
    """The twin's smoothed loss at TARGET_FRACTION of its steps."""
    progress_iterations: int
    """Iterations of progress after which the twin's smoothed loss first reached `loss`."""


def reached_own_goal(metrics: pd.DataFrame) -> tuple[float, int]:
    """A run's own time-to-target goal (`real_target_loss`) and the iterations after which its
    smoothed loss first reached it."""
    loss = real_target_loss(metrics)
    smoothed = smoothed_loss(metrics).to_numpy(dtype=float)
    return loss, int(np.flatnonzero(smoothed <= loss)[0]) + 1


def target_of_twin(twin: RunRecord) -> _TargetOfTwin:
    loss, progress_iterations = reached_own_goal(twin.metrics)
    return _TargetOfTwin(run_id=twin.manifest.run_id, loss=loss, progress_iterations=progress_iterations)


def _predict_real(
    record: RunRecord, scenario: Scenario, calibration: Calibration, *, target_loss: float, twin_target: _TargetOfTwin | None, compute_factor: float
) -> tuple[Observed, RunResult, list[str]]:
    """The simulator's observables of a real run, its compute scaled by `compute_factor` (1: as calibrated)."""
    settings = record.manifest.real_settings
    assert settings is not None
    notes: list[str] = []
    scenario = with_compute_scaled(scenario, compute_factor)
    method = scenario.methods[0]
    wall_scenario = without_setbacks(scenario)
    failures = replay_failures_at_steps(record, lambda placed: simulate_run(wall_scenario, method, placed, seed=record.manifest.seed))
    wall_run = simulate_run(wall_scenario, method, failures, seed=record.manifest.seed)
    # Evaluations and warm-up are compute as well: they run slower on a slower machine.
    evaluation_s = compute_factor * (calibration.evaluation.median_s if calibration.evaluation is not None else 0.0)
    warmup_s = compute_factor * calibration.warmup_extra_s
    every = settings.eval_every_iterations

    def extra_s(progress: float, *, final: bool) -> float:
        evaluations = math.floor(progress / every) + (1 if final and settings.num_iterations % every else 0)
        return warmup_s + evaluation_s * evaluations

    floor = calibration.convergence.baseline.floor_loss
    time_to_target_s = math.nan
    target_result: RunResult | None = None
    limit_s = max(10.0 * compute_factor * wall_run.wall_clock_s, 60.0)
    if twin_target is not None:
        target = TargetSpec(iterations=twin_target.progress_iterations, max_wall_clock_s=limit_s)
    elif target_loss > floor:
        target = TargetSpec(iterations=progress_for_smoothed_loss(scenario.convergence.baseline, target_loss), max_wall_clock_s=limit_s)
    else:
        target = None
        notes.append(f"target loss {target_loss:.4g} is under the calibrated loss floor {floor:.4g}: time to target not predicted")
    if target is not None:
        target_result = simulate_run(scenario.model_copy(update={"target": target}), method, failures, seed=record.manifest.seed)
        if target_result.reached_target:
            time_to_target_s = target_result.wall_clock_s + extra_s(target_result.iterations_executed, final=False)
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
    predicted = dataclasses.replace(predicted, total_wall_clock_s=wall_run.wall_clock_s + extra_s(settings.num_iterations, final=True))
    notes.extend(wall_run.notes)
    return predicted, wall_run, notes


def check_same_machine(record: RunRecord, calibration: Calibration) -> None:
    """A real run is predicted from a calibration only if it ran on the calibrated kind of machine."""
    settings = record.manifest.real_settings
    assert settings is not None
    if settings.device != calibration.device:
        raise InputError(
            f"run record {record.manifest.run_id!r} ran on {settings.device}, calibration {calibration.name!r} on {calibration.device}; "
            "validate runs of the calibrated machine"
        )
    run_cores = record.manifest.hardware.get("cpu_count")
    calibrated_cores = calibration.provenance.hardware.get("cpu_count")
    if settings.device == "cpu" and run_cores and calibrated_cores and run_cores != calibrated_cores:
        raise InputError(
            f"run record {record.manifest.run_id!r} ran on {run_cores} CPU cores, calibration {calibration.name!r} was measured on "
            f"{calibrated_cores}; validate runs of the calibrated machine (or calibrate this one)"
        )


@dataclass(frozen=True, kw_only=True)
class _RealComparison:
    measured: Observed
    predicted: Observed
    load_normalised: Observed
    interval: tuple[Observed, Observed] | None
    """Predicted at the machine's 2.5 % and 97.5 % speed (None: the calibration measured no spread)."""
    target_loss: float
    notes: list[str]
    handled_as: tuple[str, ...] = ()


def charge_own_failure_mode(scenario: Scenario, record: RunRecord, calibration: Calibration) -> tuple[Scenario, list[str]]:
    """The replay with the recovery of the run's own failure mode (`record_failure_mode`): a hard
    failure's replacement process start, join and rendezvous as the calibration measured them under
    hard failures, from the run's configured join delay (calibration.apply.recovery_for_failure_mode);
    and a note where the calibration measured no hard failure to charge."""
    mode = record_failure_mode(record)
    if mode != "hard" or not record.failures.failures:
        return scenario, []
    notes = []
    if not calibration.hard_failure_recovery:
        notes.append(
            f"runs with hard failures are charged at soft-failure prices (no process start or rendezvous): calibration "
            f"{calibration.name!r} measured no hard failure; calibrate with hard-failure runs"
        )
    cap = record.manifest.scenario.recovery.max_replacements if record.manifest.scenario is not None else None
    if cap is not None and len(record.failures.failures) >= cap:
        notes.append(
            f"run {record.manifest.run_id!r} had {len(record.failures.failures)} hard failures, as many as its launcher replaces "
            f"(recovery.max_replacements {cap}): a real run ends there, the simulator's replay does not"
        )
    recovery = recovery_for_failure_mode(
        scenario.recovery, calibration, "hard", configured_join_delay_s(record),
        model=scenario.model, pipeline=scenario.pipeline, shared_cores=getattr(scenario.compute, "shared_cores", None),
    )  # fmt: skip
    training = scenario.training.model_copy(update={"failure_mode": "hard"})
    if calibration.hard_failure_recovery and calibration.hard_failure_costs is None:
        notes.append(
            f"the survivors' restart under torchrun's agent is not charged: calibration {calibration.name!r} fitted no hard-failure "
            "components (made before they existed, or without a run under the agent); re-run churnsim calibrate"
        )
    return scenario.model_copy(update={"recovery": recovery, "training": training}), notes


def _validate_real(record: RunRecord, calibration: Calibration, twin: RunRecord | None) -> _RealComparison:
    check_same_machine(record, calibration)
    scenario, mode_notes = charge_own_failure_mode(replay_scenario(record, calibration), record, calibration)
    twin_target = target_of_twin(twin) if twin is not None else None
    target_loss = twin_target.loss if twin_target is not None else real_target_loss(record.metrics)
    measured = measured_real(record, target_loss)
    predicted, wall_run, notes = _predict_real(
        record, scenario, calibration, target_loss=target_loss, twin_target=twin_target, compute_factor=1.0
    )
    notes = [*mode_notes, *notes]
    if record.manifest.real_settings.pipeline.data_parallel_degree > 1 and calibration.allreduce is None:  # type: ignore[union-attr]
        notes.append(
            f"calibration {calibration.name!r} measured no data-parallel all-reduce: the replay's all-reduce and heal copies cost "
            "nothing; re-run churnsim calibrate (its suite measures them)"
        )
    if twin_target is not None:
        notes.append(f"time to target: the loss no-failure twin {twin_target.run_id!r} reached after {twin_target.progress_iterations} iterations")
    # Load normalisation: the run's own steady step against the predicted healthy one tells how much
    # faster or slower the machine ran than while calibrating; rescaling compute by it leaves the
    # model's own error (recovery, checkpoints, failures' timing), not the machine's mood.
    factor = measured.steady_iteration_s / predicted.steady_iteration_s if predicted.steady_iteration_s > 0 else math.nan
    if math.isfinite(factor) and factor > 0:
        load_normalised, _, _ = _predict_real(
            record, scenario, calibration, target_loss=target_loss, twin_target=twin_target, compute_factor=factor
        )
    else:
        load_normalised = dataclasses.replace(predicted, total_wall_clock_s=math.nan, time_to_target_s=math.nan)
    # The machine's own run-to-run spread (calibration/speed_uncertainty.py): the run predicted at
    # the 2.5 % and 97.5 % quantiles of its speed.
    log_sd = scenario_run_speed_log_sd(scenario)
    interval: tuple[Observed, Observed] | None = None
    if log_sd > 0.0:
        fast_factor, slow_factor = speed_interval_factors(log_sd)
        at_fast, at_slow = (
            _predict_real(record, scenario, calibration, target_loss=target_loss, twin_target=twin_target, compute_factor=factor)[0]
            for factor in (fast_factor, slow_factor)
        )
        interval = (at_fast, at_slow)
    return _RealComparison(
        measured=measured, predicted=predicted, load_normalised=load_normalised, interval=interval, target_loss=target_loss, notes=notes,
        handled_as=tuple(failure.handled_as for failure in wall_run.failures),
    )


def _validate_simulated(record: RunRecord, calibration: Calibration | None) -> tuple[Observed, Observed, float | None, list[str]]:
    scenario = replay_scenario(record, calibration)
    method = next((m for m in scenario.methods if m.name == record.manifest.method), None)
    if method is None:
        raise InputError(f"run record {record.manifest.run_id!r}: method {record.manifest.method!r} is not in its scenario's methods")
    result = simulate_run(scenario, method, replay_failures(record), replication=record.manifest.replication, seed=record.manifest.seed)
    summary = dict(record.manifest.summary)
    seconds_fields = ("healthy_iteration_time_s", "checkpoint_stall_s", "recovery_downtime_s", "wall_clock_s")
    missing = [key for key in (*seconds_fields, "reached_target") if key not in summary]
    if missing:
        raise InputError(f"run record {record.manifest.run_id!r}: manifest.json field 'summary' lacks {', '.join(missing)}; re-write the record with churnsim simulate")
    wrong = [f"{key} (not a number)" for key in seconds_fields if isinstance(summary[key], (bool, str)) or summary[key] is None]
    wrong += ["reached_target (not true or false)"] if not isinstance(summary["reached_target"], bool) else []
    if wrong:
        raise InputError(f"run record {record.manifest.run_id!r}: manifest.json field 'summary' has {', '.join(wrong)}; re-write the record with churnsim simulate")
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


OWN_SETUP_CALIBRATION_ADVICE = (
    "for the closest prediction of a setup other than the calibrated one, calibrate on that setup "
    "(churnsim calibrate --quick --set ...): a calibration carried from another shape predicts less accurately "
    "than one made on the setup you predict (see the calibrate-on-the-setup benchmark report)"
)
"""Said once, after the notes, when some run was of a setup other than the calibrated one."""


def validate_record(
    record: RunRecord, calibration: Calibration | None, *, twin: RunRecord | None = None, machine_slowdown: float | None = None
) -> RunValidation:
    """Predicted against measured for one record (module docstring); `twin`: its no-failure twin, if
    given; `machine_slowdown`: the speed probe's ratio (`SpeedProbeComparison`), put in a real run's rows."""
    manifest = record.manifest
    load_normalised: Observed | None = None
    interval: tuple[Observed, Observed] | None = None
    handled_as: tuple[str, ...] = ()
    if manifest.real_settings is not None:
        if calibration is None:
            raise InputError(f"run record {manifest.run_id!r} is a real run: replaying it needs a calibration (--calibration FILE)")
        comparison = _validate_real(record, calibration, twin)
        measured, predicted, target_loss, notes = comparison.measured, comparison.predicted, comparison.target_loss, comparison.notes
        load_normalised, interval = comparison.load_normalised, comparison.interval
        handled_as = comparison.handled_as
        probability = (
            failure_probability_of(manifest.scenario) if manifest.scenario is not None else manifest.real_settings.failure_rate_per_stage_hour
        )
        settings = manifest.real_settings
        setup = setup_description(settings.model, settings.pipeline, (calibration.model, calibration.pipeline))
        calibrated_setup = setup_key(settings.model, settings.pipeline) == setup_key(calibration.model, calibration.pipeline)
        if not calibrated_setup:
            differences = setup_differences(settings.model, settings.pipeline, calibration.model, calibration.pipeline)
            notes = [
                *notes,
                f"runs of {setup} differ from the calibrated setup in "
                + ", ".join(f"{name} {value} (calibrated {calibrated})" for name, value, calibrated in differences),
            ]
            compute_model = calibration.compute_model
            if compute_model is not None and setup_fingerprint(settings.model, settings.pipeline) in compute_model.fitted_setups:
                how = f"a setup calibration {calibration.name!r} ran among its compute model's shapes but not as its calibrated setup"
            else:
                how = f"a setup calibration {calibration.name!r} did not run"
            outside = compute_model.outside_fitted_shapes(settings.model) if compute_model is not None else None
            extrapolated = f" ({outside} of its fit: extrapolated)" if outside is not None else ""
            notes = [*notes, f"runs of {setup}, {how}, are predicted through its compute model{extrapolated}"]
    else:
        measured, predicted, target_loss, notes = _validate_simulated(record, calibration)
        probability = failure_probability_of(manifest.scenario)  # type: ignore[arg-type]
        setup = setup_description(manifest.scenario.model, manifest.scenario.pipeline)  # type: ignore[union-attr]
        calibrated_setup = False
    normalised_rows = {row[0]: row[1:] for row in compare(measured, load_normalised)} if load_normalised is not None else {}
    interval_rows = {}
    if interval is not None:
        interval_rows = {quantity: (getattr(interval[0], quantity), getattr(interval[1], quantity)) for quantity in LOAD_NORMALISED_QUANTITIES}
    rows = []
    for quantity, m, p, error in compare(measured, predicted):
        normalised = normalised_rows.get(quantity) if quantity in LOAD_NORMALISED_QUANTITIES else None
        low, high = interval_rows.get(quantity, (math.nan, math.nan))
        rows.append(
            dict(
                run_id=manifest.run_id,
                method=manifest.method,
                failure_probability_per_stage_hour=math.nan if probability is None else probability,
                quantity=quantity,
                measured=m,
                predicted=p,
                relative_error=error,
                load_normalised_predicted=normalised[1] if normalised is not None else math.nan,
                load_normalised_relative_error=normalised[2] if normalised is not None else math.nan,
                predicted_ci95_low=low,
                predicted_ci95_high=high,
                setup=setup,
                calibrated_setup=calibrated_setup,
                machine_slowdown_at_validation=(
                    machine_slowdown if machine_slowdown is not None and manifest.real_settings is not None else math.nan
                ),
            )
        )
    table = pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS))
    return RunValidation(
        run_id=manifest.run_id, method=manifest.method, source=manifest.source, rows=table, target_loss=target_loss, notes=tuple(notes),
        through_compute_model=manifest.real_settings is not None and not calibrated_setup,
        predicted_handled_as=handled_as,
    )


def validate_runs(
    directories: Sequence[str | Path], calibration: Calibration | None, *, speed_probe: SpeedProbeComparison = NO_PROBE
) -> ValidationReport:
    """Validate every record; refuses runs the calibration was fitted on (held-out discipline)."""
    return validate_records(load_held_out_records(directories, calibration), calibration, speed_probe=speed_probe)


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


def validate_records(records: Sequence, calibration: Calibration | None, *, speed_probe: SpeedProbeComparison = NO_PROBE) -> ValidationReport:
    """Replay each checked record (`load_held_out_records`) in the simulator; predicted against
    measured; `speed_probe`: the machine's speed now against calibration time, noted with the real runs."""
    fitted = set(calibration.provenance.fit_run_ids) if calibration is not None else set()
    runs = tuple(
        validate_record(record, calibration, twin=find_twin(record, records), machine_slowdown=speed_probe.slowdown) for record in records
    )
    any_real = any(record.manifest.real_settings is not None for record in records)
    probe_notes = (speed_probe.note(calibration.name),) if any_real and calibration is not None else ()
    table = pd.concat([run.rows for run in runs], ignore_index=True) if runs else pd.DataFrame(columns=list(VALIDATION_COLUMNS))
    return ValidationReport(
        table=table,
        runs=runs,
        fit_run_ids=tuple(sorted(fitted)),
        validated_run_ids=tuple(run.run_id for run in runs),
        notes=tuple(dict.fromkeys(note for run in runs for note in run.notes))
        + probe_notes
        + ((OWN_SETUP_CALIBRATION_ADVICE,) if any(run.through_compute_model for run in runs) else ()),
    )


def find_twin(record: RunRecord, records: Sequence[RunRecord]) -> RunRecord | None:
    """The no-failure run of the same seed and setup (model and pipeline) of a real run with
    failures, among `records`; it gives the run's time-to-target goal."""
    settings = record.manifest.real_settings
    if settings is None or not record.failures.failures:
        return None
    for other in records:
        other_settings = other.manifest.real_settings
        if (
            other is not record
            and other_settings is not None
            and not other.failures.failures
            and other.manifest.seed == record.manifest.seed
            and setup_key(other_settings.model, other_settings.pipeline) == setup_key(settings.model, settings.pipeline)
            and other_settings.num_iterations == settings.num_iterations
        ):
            return other
    return None


def median_absolute_error(table: pd.DataFrame, quantity: str = "total_wall_clock_s") -> pd.DataFrame:
    """Per method: runs and the median of |relative_error| of `quantity`, absolute (with its 95 %
    bootstrap interval over the runs, `median_with_ci95`: a median of a few runs is only so sure) and
    load-normalised (NaN where no run of the method has a load-normalised prediction)."""
    rows = table[table["quantity"] == quantity].copy()
    rows["absolute_error"] = rows["relative_error"].abs()
    rows["load_normalised_absolute_error"] = rows["load_normalised_relative_error"].abs()
    grouped = rows.groupby("method", sort=True)
    intervals = grouped["absolute_error"].apply(lambda errors: median_with_ci95([errors.to_numpy()]))
    return pd.DataFrame(
        {
            "num_runs": grouped["absolute_error"].count(),
            "median_absolute_relative_error": grouped["absolute_error"].median(),
            "median_absolute_relative_error_ci95_low": intervals.map(lambda interval: interval[1]),
            "median_absolute_relative_error_ci95_high": intervals.map(lambda interval: interval[2]),
            "median_load_normalised_absolute_relative_error": grouped["load_normalised_absolute_error"].median(),
        }
    ).reset_index()


@dataclass(frozen=True)
class MachineSpeed:
    """How fast the machine ran during the validated real runs, against the calibration: per run,
    its measured steady step over the predicted healthy one (the load normalisation's factor)."""

    num_runs: int
    median_factor: float
    """The typical run's steady step over the prediction: 1.1 = the machine ran 10 % slower than while calibrating."""
    scatter: float
    """Median of |factor / median factor − 1|: how far single runs stray from the typical one. An
    exact model calibrated at the typical speed would still show about this median absolute error."""
    lowest_factor: float
    highest_factor: float
    log_standard_deviation: float
    """Of the factors' logs (NaN with fewer than 2 runs): the spread of speeds the machine showed
    these runs, on the scale of `compute.run_speed_log_sd` (calibration/speed_uncertainty.py)."""


def machine_speed(table: pd.DataFrame) -> MachineSpeed | None:
    """The machine's speed during the real runs of a validation table that have a load-normalised
    prediction (None if none has)."""
    normalised_runs = table.loc[table["load_normalised_relative_error"].notna(), "run_id"].unique()
    steady = table[(table["quantity"] == "steady_iteration_s") & table["run_id"].isin(normalised_runs) & (table["predicted"] > 0)]
    factors = (steady["measured"] / steady["predicted"]).dropna()
    if factors.empty:
        return None
    median_factor = float(factors.median())
    return MachineSpeed(
        num_runs=len(factors),
        median_factor=median_factor,
        scatter=float((factors / median_factor - 1).abs().median()),
        lowest_factor=float(factors.min()),
        highest_factor=float(factors.max()),
        log_standard_deviation=log_speed_spread(factors),
    )


def steady_step_carry(table: pd.DataFrame, reference: pd.Series, groups: pd.Series) -> dict[str, float]:
    """Per group of runs, how far the compute model's carry to their setup misses, with the machine's
    speed of the moment cancelled: the median of their steady steps over the predicted ones, divided
    by the same median of the `reference` runs (the calibrated setup's, run beside them). 1.10: the
    group's steps run 10 % longer than the carry predicts, where the calibrated setup's run as
    predicted. `reference` and `groups` (a label per row, None for a row of no group) align with
    `table`'s rows; a group without steady steps, or a table without reference runs, gives none."""
    steady = (table["quantity"] == "steady_iteration_s") & (table["predicted"] > 0)
    over_prediction = (table["measured"] / table["predicted"]).where(steady)
    reference_median = over_prediction[reference].median()
    if not reference_median > 0:
        return {}
    carry = {}
    for group, ratios in over_prediction[groups.notna()].groupby(groups[groups.notna()], sort=False):
        if ratios.notna().any():
            carry[str(group)] = float(ratios.median() / reference_median)
    return carry


@dataclass(frozen=True)
class IntervalCoverage:
    """How many real runs' `quantity` fell inside the prediction's 95 % interval of the machine's
    speed (`predicted_ci95_low`–`predicted_ci95_high`, calibration/speed_uncertainty.py)."""

    num_runs: int
    num_inside: int
    num_slower: int
    """Runs that took longer than the interval's upper end."""
    num_faster: int


def interval_coverage(table: pd.DataFrame, quantity: str = "total_wall_clock_s") -> IntervalCoverage | None:
    """Coverage of `quantity` over the rows with an interval (None if no row has one)."""
    rows = table[(table["quantity"] == quantity) & table["predicted_ci95_low"].notna() & table["measured"].notna()]
    if rows.empty:
        return None
    slower = int((rows["measured"] > rows["predicted_ci95_high"]).sum())
    faster = int((rows["measured"] < rows["predicted_ci95_low"]).sum())
    return IntervalCoverage(num_runs=len(rows), num_inside=len(rows) - slower - faster, num_slower=slower, num_faster=faster)
