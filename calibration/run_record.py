"""The run record: one directory per real or simulated run, in one format both sides write.

    manifest.json   what ran: settings, seed, git revision, package versions, hardware, notes
    metrics.csv     one row per executed iteration: step, iteration, wall_time_s, train_loss, eval_loss
    spans.csv       timed work: rank, stage, iteration, kind, microbatch, start_s, end_s
    failures.csv    the failures that struck (the failure-schedule format, so it can be replayed)
    recoveries.csv  optional, beside a real run's record: one row per recovery with the seconds of
                    each part (real/results.py); read where present (`RunRecord.recoveries`)

`step` counts executed iterations and never goes back; `iteration` is training progress and goes
back after a rollback. Times are seconds since the start of the run. A record is written into a
temporary sibling directory and renamed into place, so a crash leaves no half-written record.
"""

import datetime as _datetime
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import Field

from .base import SCHEMA_VERSION, StrictModel, load_model, output_mode, save_model
from .errors import InputError
from .failures import FAILURE_COLUMNS, FailureSchedule, ScheduledFailure, read_failure_schedule, write_failure_schedule
from .methods import MethodConfig
from .scenario import ModelSpec, PipelineSpec, Scenario

METRICS_COLUMNS: tuple[str, ...] = ("step", "iteration", "wall_time_s", "train_loss", "eval_loss")
SPANS_COLUMNS: tuple[str, ...] = ("rank", "stage", "iteration", "kind", "microbatch", "start_s", "end_s")
SPANS_CPU_COLUMNS: tuple[str, ...] = ("cpu_start_s", "cpu_end_s")
"""Optional columns of spans.csv: the stage process's CPU clock (time.process_time: CPU seconds the
process used since it started, every thread) at a span's start and end; empty for spans timed by
hand (a replacement's join). Records written before they existed have none and still load."""
SPANS_DATA_PARALLEL_COLUMNS: tuple[str, ...] = ("replica", "bytes")
"""Optional columns of spans.csv in a data-parallel run: the span's replica, and the bytes a span
moved where it moves data (`allreduce`: the gradients reduced; `recovery.heal`: a heal's copy)."""

MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.csv"
SPANS_FILE = "spans.csv"
FAILURES_FILE = "failures.csv"
RECOVERIES_FILE = "recoveries.csv"
RECOVERY_NUMBER_COLUMNS: tuple[str, ...] = (
    "join_s", "rendezvous_s", "transfer_s", "network_bytes", "detection_s", "agent_restart_s", "process_start_s",
    "survivor_reload_s", "survivor_reload_bytes", "survivor_restart_s",
)  # fmt: skip
"""Columns of recoveries.csv the calibration reads as numbers (empty cells: not measured)."""


class RealRunSettings(StrictModel):
    """What a real pipeline run was asked to do: enough to replay it in the simulator."""

    model: ModelSpec
    pipeline: PipelineSpec
    method: MethodConfig
    num_iterations: int = Field(ge=1)
    learning_rate: float = Field(gt=0)
    eval_every_iterations: int = Field(ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    corpus: str = "python-stdlib"
    deterministic: bool = True
    checkpoint_directory: str | None = None
    failure_rate_per_stage_hour: float | None = None
    """Set when failures were sampled from an hourly per-stage probability instead of a file."""
    failure_mode: Literal["soft", "hard"] | None = None
    """How its failures struck (`training.failure_mode`); None in records that do not say, whose mode
    `record_failure_mode` reads from their scenario or spans."""
    join_delay_s: float | None = Field(None, ge=0)
    """Hard failures: the configured seconds from a kill to its replacement's start; None where the
    record does not say (`configured_join_delay_s` then reads its scenario)."""


class RunManifest(StrictModel):
    schema_version: Literal[1] = SCHEMA_VERSION
    run_id: str = Field(min_length=1)
    source: Literal["real", "simulated"]
    method: str
    seed: int
    replication: int = 0
    scenario: Scenario | None = None
    """Set for simulated runs."""
    real_settings: RealRunSettings | None = None
    """Set for real runs."""
    git_revision: str = "unknown"
    package_versions: dict[str, str] = Field(default_factory=dict)
    hardware: dict[str, str] = Field(default_factory=dict)
    created_utc: str = ""
    notes: tuple[str, ...] = ()
    """Caveats a reader must see, e.g. 'convergence setbacks are uncalibrated defaults'."""
    summary: dict[str, float | int | str | bool | None] = Field(default_factory=dict)


@dataclass(frozen=True)
class RunRecord:
    manifest: RunManifest
    metrics: pd.DataFrame
    spans: pd.DataFrame
    failures: FailureSchedule
    recoveries: pd.DataFrame | None = None
    """recoveries.csv of a real run, where its directory has one (`read_recoveries`); None otherwise."""


def _columns_kept(frame: pd.DataFrame, columns: tuple[str, ...], optional: tuple[str, ...]) -> list[str]:
    """The required `columns`, then those of `optional` that `frame` has."""
    return list(columns) + [column for column in optional if column in frame.columns]


def _frame(rows: Any, columns: tuple[str, ...], what: str, optional: tuple[str, ...] = ()) -> pd.DataFrame:
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), columns=list(columns))
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise ValueError(f"{what} table lacks columns {missing}")
    return frame.loc[:, _columns_kept(frame, columns, optional)].reset_index(drop=True)


HARD_FAILURE_SPAN_KINDS: frozenset[str] = frozenset({"recovery.rendezvous", "recovery.wait"})
"""Spans only a hard failure records: a replacement process's rendezvous with the survivors, and a
survivor waiting for it."""


def record_failure_mode(record: "RunRecord") -> Literal["soft", "hard"]:
    """How a run's failures struck: its settings' `failure_mode`, else its scenario's
    `training.failure_mode`, else hard where its spans hold a rendezvous or a wait for a replacement
    (`HARD_FAILURE_SPAN_KINDS`), soft otherwise."""
    settings = record.manifest.real_settings
    if settings is not None and settings.failure_mode is not None:
        return settings.failure_mode
    if record.manifest.scenario is not None and record.manifest.source == "real":
        return record.manifest.scenario.training.failure_mode
    kinds = record.spans["kind"] if "kind" in record.spans.columns else pd.Series(dtype=object)
    return "hard" if kinds.isin(HARD_FAILURE_SPAN_KINDS).any() else "soft"


def configured_join_delay_s(record: "RunRecord") -> float | None:
    """A hard-failure run's configured delay from a kill to its replacement's start: its settings'
    `join_delay_s`, else its scenario's `training.join_delay_s` or `recovery.join_delay_s`; None
    where the record holds neither."""
    settings = record.manifest.real_settings
    if settings is not None and settings.join_delay_s is not None:
        return settings.join_delay_s
    scenario = record.manifest.scenario
    if scenario is None or record.manifest.source != "real":
        return None
    return scenario.training.join_delay_s if scenario.training.join_delay_s is not None else scenario.recovery.join_delay_s


def make_run_record(manifest: RunManifest, metrics: Any, spans: Any, failures: FailureSchedule | Any) -> RunRecord:
    """Assemble a record from frames or row iterables (dicts or tuples in column order)."""
    if not isinstance(failures, FailureSchedule):
        failures = FailureSchedule(failures=tuple(failures))
    return RunRecord(
        manifest=manifest,
        metrics=_frame(metrics, METRICS_COLUMNS, "metrics"),
        spans=_frame(spans, SPANS_COLUMNS, "spans", optional=SPANS_CPU_COLUMNS + SPANS_DATA_PARALLEL_COLUMNS),
        failures=failures,
    )


RECORD_FILES: tuple[str, ...] = (MANIFEST_FILE, METRICS_FILE, SPANS_FILE, FAILURES_FILE)


def check_record_directory(directory: str | Path, *, extra_entries: tuple[str, ...] = ()) -> None:
    """Refuse (InputError, nothing touched) an existing non-empty `directory` that is not a run record.

    A run record holds only RECORD_FILES, plus `extra_entries` its writer owns (a real run's
    checkpoints); its manifest.json, when present, names a run.
    """
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise InputError(f"{directory}: is a file, not a run record directory; choose a new or empty directory")
    foreign = sorted(set(os.listdir(directory)) - set(RECORD_FILES) - set(extra_entries))
    problem = None
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        problem = f"holds {shown}, which churnsim did not write"
    elif (directory / MANIFEST_FILE).exists():
        try:
            from .safe_files import read_json_file

            manifest = read_json_file(directory / MANIFEST_FILE)
        except (OSError, ValueError):
            manifest = None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("run_id"), str):
            problem = f"has a {MANIFEST_FILE} that is not a run record's"
    if problem is not None:
        raise InputError(
            f"{directory}: not a churnsim run record ({problem}); nothing was written or removed: choose a new or empty directory"
        )


def write_run_record(
    record: RunRecord, directory: str | Path, *, overwrite: bool = True, extra_entries: tuple[str, ...] = ()
) -> Path:
    """Write `record` to `directory`: a new one atomically (temporary sibling, then rename).

    An existing directory must be a run record (`check_record_directory`; anything else is refused
    and left untouched): its record files are replaced one by one (each renamed into place, the
    manifest last, the old manifest removed first, so a crash never pairs a manifest with other
    tables), and `extra_entries` (e.g. a real run's checkpoints) are kept.
    """
    directory = Path(directory)
    if directory.exists() and not overwrite:
        raise InputError(f"{directory} already exists; choose another --out or remove it")
    check_record_directory(directory, extra_entries=extra_entries)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name or 'record'}."))
    try:
        staging.chmod(output_mode(directory=True))  # mkdtemp's 0700 would hide the record from other users
        save_model(record.manifest, staging / MANIFEST_FILE)
        record.metrics.to_csv(staging / METRICS_FILE, index=False)
        record.spans.to_csv(staging / SPANS_FILE, index=False)
        write_failure_schedule(record.failures, staging / FAILURES_FILE)
        if not directory.exists():
            os.replace(staging, directory)
            return directory
        (directory / MANIFEST_FILE).unlink(missing_ok=True)
        for name in (METRICS_FILE, SPANS_FILE, FAILURES_FILE, MANIFEST_FILE):
            os.replace(staging / name, directory / name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _read_table(path: Path, columns: tuple[str, ...], optional: tuple[str, ...] = ()) -> pd.DataFrame:
    try:
        from .safe_files import input_stream

        frame = pd.read_csv(input_stream(path, what="run record table"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing from the run record; re-run or copy the whole record directory") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not a readable CSV table ({error.__class__.__name__})") from None
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise InputError(f"{path}: lacks column(s) {', '.join(missing)}; expected {', '.join(columns)}")
    return frame.loc[:, _columns_kept(frame, columns, optional)]


def read_run_record(directory: str | Path) -> RunRecord:
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: not a run record directory; pass a directory written by churnsim")
    manifest = load_model(RunManifest, directory / MANIFEST_FILE)
    record = RunRecord(
        manifest=manifest,
        metrics=_read_table(directory / METRICS_FILE, METRICS_COLUMNS),
        spans=_read_table(directory / SPANS_FILE, SPANS_COLUMNS, SPANS_CPU_COLUMNS + SPANS_DATA_PARALLEL_COLUMNS),
        failures=read_failure_schedule(directory / FAILURES_FILE),
    )
    from .record_checks import check_record_values

    check_record_values(record, directory)
    recoveries = read_recoveries(directory)
    if recoveries is not None:
        record = RunRecord(manifest=record.manifest, metrics=record.metrics, spans=record.spans, failures=record.failures, recoveries=recoveries)
    return record


def read_recoveries(directory: str | Path) -> pd.DataFrame | None:
    """A real run's recoveries.csv with `RECOVERY_NUMBER_COLUMNS` as numbers, or None where the
    directory has none. A cell that is neither empty nor a finite number >= 0 is refused (InputError)."""
    path = Path(directory) / RECOVERIES_FILE
    if not path.exists():
        return None
    frame = _read_table(path, (), ("step", "failure_mode", "failed_stages", "degraded", *RECOVERY_NUMBER_COLUMNS))
    for column in RECOVERY_NUMBER_COLUMNS:
        if column not in frame.columns:
            continue
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = (frame[column].notna() & values.isna()) | (values < 0) | values.isin([float("inf"), float("-inf")])
        if bad.any():
            line = int(bad.to_numpy().nonzero()[0][0]) + 2
            raise InputError(
                f"{path}: line {line}: column {column} holds {frame[column].iloc[line - 2]!r}, not a finite number >= 0; "
                "re-run the real run or fix the value"
            )
        frame[column] = values.astype(float)
    return frame


def git_revision() -> str:
    """The checkout's revision (with '+dirty' when modified), or 'unknown' outside git, or where the
    installed package merely lies inside some other repository (its own files are not tracked there)."""
    here = Path(__file__).resolve().parent
    try:
        subprocess.run(["git", "ls-files", "--error-unmatch", Path(__file__).name], cwd=here, capture_output=True, timeout=5, check=True)
        revision = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return revision + ("+dirty" if dirty else "")


def package_versions(names: tuple[str, ...] = ("churnsim", "simpy", "torch", "numpy", "pandas", "scipy", "pydantic")) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def hardware_description() -> dict[str, str]:
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "system": f"{platform.system()} {platform.release()}",
        "cpu_count": str(os.cpu_count()),
    }


def utc_now() -> str:
    return _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds")


def provenance_fields(**hardware_notes: str) -> dict[str, object]:
    """What every output records about where it was made (the field names of `RunManifest`);
    `hardware_notes` join the hardware description (a real run's stage placement)."""
    return {
        "git_revision": git_revision(),
        "package_versions": package_versions(),
        "hardware": hardware_description() | hardware_notes,
        "created_utc": utc_now(),
    }


__all__ = [
    "FAILURE_COLUMNS",
    "METRICS_COLUMNS",
    "RECORD_FILES",
    "SPANS_COLUMNS",
    "SPANS_CPU_COLUMNS",
    "RealRunSettings",
    "RunManifest",
    "RunRecord",
    "ScheduledFailure",
    "check_record_directory",
    "git_revision",
    "hardware_description",
    "make_run_record",
    "package_versions",
    "provenance_fields",
    "read_run_record",
    "utc_now",
    "write_run_record",
]
