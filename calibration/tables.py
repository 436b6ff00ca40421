"""Column names of the tidy result tables that sim/ writes and figures/ reads.

Tables are pandas DataFrames saved as CSV (always) and Parquet (when pyarrow is installed and asked
for). One row per observation; every time in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError
from .methods import speedup_baselines

if TYPE_CHECKING:
    import pandas as pd

# Where a run's wall-clock time goes, in stacking order: goodput_s + the rest == wall_clock_s.
TIME_CATEGORIES: tuple[str, ...] = (
    "goodput_s",  # the stages' compute of the useful iterations
    "bubble_s",  # pipeline fill and drain of the useful iterations (idle stages, links free)
    "communication_s",  # waiting for activations, gradients and all-reduces of the useful iterations
    "method_overhead_s",  # steady-state cost of the method: redundant forwards, CheckFree+ swaps, replica refreshes
    "checkpoint_stall_s",  # training blocked by checkpoint writes or snapshot copies
    "lost_work_s",  # iterations rolled back, and the partial iteration a failure interrupts
    "recovery_downtime_s",  # training stopped: join delay, restart, weight transfers, checkpoint loads
    "survivor_restart_s",  # hard failures under an agent that restarts every worker: the survivors' restart
    "degraded_slowdown_s",  # extra time of iterations run with one node doing two stages
    "convergence_setback_s",  # iterations a rebuilt stage costs the model's progress
    "replica_heal_s",  # data parallelism: paused for a lost replica's heal, or trained with a smaller batch meanwhile
)

# runs.csv: one row per (scenario, method, replication).
RUN_COLUMNS: tuple[str, ...] = (
    "scenario",
    "failure_probability_per_stage_hour",  # NaN when the churn model is not stage_hourly
    "method",
    "replication",
    "seed",
    "reached_target",
    "wall_clock_s",
    "time_to_target_s",  # NaN when the target was not reached
    "target_iterations",
    "progress_iterations",
    "iterations_executed",
    "healthy_iteration_time_s",
    "num_failures",
    *TIME_CATEGORIES,
    "setbacks_calibrated",
    "setback_source",  # "measured", "paper_fitted" or "default" (calibration/convergence.py)
    "setback_interior_iterations",  # setbacks this run charged per rebuilt stage: its replication's draw
    "setback_edge_iterations",  # (calibration/setback_uncertainty.py) × setback_scale; NaN without setbacks
    # A setback that grows with training progress (the convergence lab's) adds this many iterations per
    # iteration of progress past its offset (convergence.setbacks.<method>.<position>.progress_offset_iterations
    # of the scenario) to the constant part above: the replication's draw × setback_scale; 0 for a constant one.
    "setback_interior_per_progress_iteration",
    "setback_edge_per_progress_iteration",
)


def speedup_columns(baseline: str) -> tuple[str, str, str]:
    """summary.csv's columns of the speed-up over `baseline`: the geometric mean over replications of
    T_baseline / T_method (paired: same failures) and its 95 % interval, the t interval of the log
    ratios taken back by exp (`calibration.statistics.positive_mean_with_ci95`)."""
    return (f"speedup_vs_{baseline}_mean", f"speedup_vs_{baseline}_ci95_low", f"speedup_vs_{baseline}_ci95_high")


def speedup_at_most_column(baseline: str) -> str:
    """summary.csv's upper bound on the speed-up over `baseline` of a method that did not always reach
    the target: its runs that missed count at the time they were stopped (`target.max_wall_clock_s`),
    which they would have needed more than. NaN where the baseline itself missed in some replication,
    since nothing then bounds the ratio; the paired mean where every run of both reached it."""
    return f"speedup_vs_{baseline}_at_most"


def summary_columns() -> tuple[str, ...]:
    """summary.csv's columns: one speed-up triple per registered method with the `speedup_baseline` trait."""
    return (
        "scenario",
        "failure_probability_per_stage_hour",
        "method",
        "num_replications",
        # False below calibration.statistics.MIN_REPLICATIONS_FOR_INTERVALS replications: the row's
        # intervals are then too uncertain to rely on.
        "intervals_reliable",
        "fraction_reached",
        # The geometric mean over the replications that reached the target, and its 95 % interval on
        # the log scale (calibration.statistics.positive_mean_with_ci95): never below zero.
        "time_to_target_mean_s",
        "time_to_target_ci95_low_s",
        "time_to_target_ci95_high_s",
        # A lower bound on the geometric mean over every replication: runs that missed the target count at the
        # time they were stopped; the mean itself where every run reached it.
        "time_to_target_at_least_s",
        *(column for baseline in speedup_baselines() for column in (*speedup_columns(baseline), speedup_at_most_column(baseline))),
        "setbacks_calibrated",
        "setback_source",
    )


def sensitivity_columns() -> tuple[str, ...]:
    """setback_sensitivity.csv's columns: summary.csv's with the setback factor after the rate, and
    whether the method wins at that (rate, factor) (sim/studies/setback_sensitivity.py)."""
    columns = list(summary_columns())
    columns.insert(columns.index("failure_probability_per_stage_hour") + 1, "setback_scale")
    return (*columns, "winner")


# setback_sensitivity.csv: one row per (scenario, failure rate, setback scale, method).
SENSITIVITY_COLUMNS: tuple[str, ...] = sensitivity_columns()

# setback_crossovers.csv: where the winner changes as every setback is scaled.
CROSSOVER_COLUMNS: tuple[str, ...] = (
    "scenario",
    "failure_probability_per_stage_hour",
    "scale_low",  # neighbouring setback scales whose winners differ (the whole range when none do)
    "scale_high",
    "winner_below",
    "winner_above",
    "crossover_scale",  # where the two methods' mean times to target meet, interpolated; NaN if not found
)

# summary.csv: one row per (scenario, method), over replications, with 95 % intervals on the log scale.
# The columns of the built-in methods (speed-ups over checkpoint and redundant): what readers require.
SUMMARY_COLUMNS: tuple[str, ...] = summary_columns()

# trajectories.csv: loss against wall-clock, piecewise linear between rows.
TRAJECTORY_COLUMNS: tuple[str, ...] = (
    "scenario",
    "failure_probability_per_stage_hour",
    "method",
    "replication",
    "time_s",
    "progress_iterations",
    "loss",
)

# checkpoint_intervals.csv: the cost of a checkpoint interval, simulated or measured.
INTERVAL_COLUMNS: tuple[str, ...] = (
    "source",  # "simulated" or "real"
    "method",  # a checkpoint-family method (`family == "checkpoint"` in calibration/methods.py)
    "interval_iterations",
    "stall_fraction",  # checkpoint stall / wall-clock
    "time_to_target_mean_s",  # NaN for real benchmark rows
    "time_to_target_ci95_low_s",
    "time_to_target_ci95_high_s",
    "young_interval_iterations",
    "daly_interval_iterations",
)

# tuned_intervals.csv: one row per (point, method) whose checkpoint interval, tuned at that point,
# was clearly better than the configured one (sim/studies/untuned_intervals.py); a sweep's grid columns
# follow `scenario`.
TUNED_INTERVAL_COLUMNS: tuple[str, ...] = (
    "scenario",
    "failure_probability_per_stage_hour",
    "method",
    "interval_field",
    "configured_interval_iterations",
    "tuned_interval_iterations",
    "tuned_by",  # "Daly's optimum" or "search"
    "intervals_tried",  # space-separated
    "fraction_reached",
    "time_to_target_mean_s",
    "time_to_target_ci95_low_s",
    "time_to_target_ci95_high_s",
)

# validation.csv: one row per (held-out run, quantity).
VALIDATION_COLUMNS: tuple[str, ...] = (
    "run_id",
    "method",
    "failure_probability_per_stage_hour",
    "quantity",  # e.g. "total_wall_clock_s", "time_to_target_s", "steady_iteration_s"
    "measured",
    "predicted",
    "relative_error",  # (predicted − measured) / measured
    "load_normalised_predicted",  # predicted with compute rescaled by the run's own steady step (real runs)
    "load_normalised_relative_error",  # (load_normalised_predicted − measured) / measured
    "predicted_ci95_low",  # predicted at the machine's 2.5 % speed (calibration/speed_uncertainty.py); NaN without a spread
    "predicted_ci95_high",  # ... and at its 97.5 % speed: a run of an exact model falls inside 95 % of the time
    # the run's model and pipeline in short, e.g. "4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 64", then in
    # parentheses every other field in which it differs from the calibrated setup, e.g. "(num_heads 8)"
    "setup",
    "calibrated_setup",  # whether the calibration measured this setup itself (else its compute model scaled to it)
    # the speed probe's time when validating over its time when calibrating (real/speed_probe.py), the same for every
    # real run of one validation: 1.10 = the machine computes 10 % slower now; NaN where the probe was not run
    "machine_slowdown_at_validation",
)
VALIDATION_INTERVAL_COLUMNS: tuple[str, ...] = ("predicted_ci95_low", "predicted_ci95_high")
# What a validation table must hold to be read: tables of validators before the interval (or the probe) lack it.
VALIDATION_REQUIRED_COLUMNS: tuple[str, ...] = tuple(
    column for column in VALIDATION_COLUMNS if column not in (*VALIDATION_INTERVAL_COLUMNS, "machine_slowdown_at_validation")
)

# spans.csv of a run record, or iteration_spans.csv of a simulation: drawn as a Gantt chart.
GANTT_COLUMNS: tuple[str, ...] = ("stage", "kind", "microbatch", "start_s", "end_s")
# Span kinds that move bytes between stages: they overlap the same stage's compute spans, so Gantt
# charts and timelines put them on a track (or strip) of their own.
STEP_SYNC_SPAN = "step_sync"
"""A real run's all-reduce at every step boundary (the failures due): every rank waits there for all."""
COMMUNICATION_SPAN_KINDS: frozenset[str] = frozenset({"send", "receive", "send_wait", STEP_SYNC_SPAN})


def read_table(path: str | Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """Read a CSV or Parquet result table and check it has `columns`."""
    import pandas as pd  # here, not at the top: the simulator reads this module's columns, not its tables (issue 11)

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such result table; run the command that writes it first")
    try:
        from .safe_files import input_stream

        stream = input_stream(path, what="result table")
        frame = pd.read_parquet(stream) if path.suffix == ".parquet" else pd.read_csv(stream)
    except InputError:
        raise
    except Exception as error:  # pandas raises many parser types; all mean the same to the user
        raise InputError(f"{path}: cannot be read as a table ({error.__class__.__name__})") from None
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise InputError(f"{path}: lacks column(s) {', '.join(missing)}; was it written by this churnsim version?")
    return frame


PARQUET_NEEDS_PYARROW = "Parquet output needs pyarrow: pip install 'churnsim[parquet]', or drop --parquet"


def check_parquet_writer(parquet: bool) -> None:
    """With --parquet, refuse up front where pandas has no Parquet engine, so that no command
    simulates for minutes and then stops with its CSVs half-written."""
    if not parquet:
        return
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None and importlib.util.find_spec("fastparquet") is None:
        raise InputError(PARQUET_NEEDS_PYARROW)


def write_table(frame: pd.DataFrame, path: str | Path, *, parquet: bool = False) -> list[Path]:
    """Write `frame` as CSV (and Parquet beside it when asked); returns the files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = [path.with_suffix(".csv")]
    frame.to_csv(written[0], index=False)
    if parquet:
        try:
            frame.to_parquet(path.with_suffix(".parquet"), index=False)
        except ImportError:
            raise InputError(PARQUET_NEEDS_PYARROW) from None
        written.append(path.with_suffix(".parquet"))
    return written
