"""The failure schedule: which node fails when, written and read by both sim/ and real/.

File format: CSV with a first comment line naming the schema version, then the header
`time_s,iteration,stage,kind` or `time_s,iteration,stage,kind,replica`. A row gives the time of the
failure in seconds since the start of the run, the iteration before which it struck, or both; an
empty cell means unknown. A real run records both; a simulator replay uses `time_s` when present and
the iteration otherwise. A node is one (stage, replica) of the pipeline's S × D grid: the optional
`replica` column names the data-parallel replica (0-based); without the column, or with an empty
cell, the replica is 0, so a file written for a pipeline without data parallelism reads unchanged.
The writer adds the column only when some failure is on a replica other than 0.
CSV keeps schedules diffable and editable by hand.
"""

from __future__ import annotations

import os

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from .base import SCHEMA_VERSION, atomic_write_text
from .errors import InputError

FAILURE_COLUMNS: tuple[str, ...] = ("time_s", "iteration", "stage", "kind")
REPLICA_COLUMN = "replica"
"""The optional fifth column: the failed node's data-parallel replica (0-based; 0 when absent)."""
_VERSION_LINE = f"# churnsim failure schedule, schema_version {SCHEMA_VERSION}"


@dataclass(frozen=True, kw_only=True, order=True)
class ScheduledFailure:
    time_s: float | None = None
    iteration: int | None = None
    stage: int
    kind: str = "failure"
    replica: int = 0
    """The data-parallel replica of the node that failed (0-based): the node is (stage, replica)."""

    def __post_init__(self) -> None:
        if self.time_s is None and self.iteration is None:
            raise InputError(f"a failure of stage {self.stage} has neither time_s nor iteration; give one")
        if self.time_s is not None and not (math.isfinite(self.time_s) and self.time_s >= 0):
            raise InputError(f"failure time_s {self.time_s} must be a finite number >= 0")
        if self.iteration is not None and self.iteration < 0:
            raise InputError(f"failure iteration {self.iteration} must be >= 0")
        if self.stage < 0:
            raise InputError(f"failure stage {self.stage} must be >= 0")
        if isinstance(self.replica, bool) or not isinstance(self.replica, int) or self.replica < 0:
            raise InputError(f"failure replica {self.replica!r} must be a whole number >= 0 (the 0-based data-parallel replica)")


@dataclass(frozen=True, kw_only=True)
class FailureSchedule:
    failures: tuple[ScheduledFailure, ...] = ()

    def validate_for(self, num_stages: int, source: str = "failure schedule", *, data_parallel_degree: int = 1) -> "FailureSchedule":
        """Check every failure names a node of the num_stages × data_parallel_degree grid."""
        for failure in self.failures:
            if failure.stage >= num_stages:
                raise InputError(
                    f"{source}: stage {failure.stage} does not exist in a {num_stages}-stage pipeline; "
                    f"use stages 0..{num_stages - 1}"
                )
            if failure.replica >= data_parallel_degree:
                raise InputError(
                    f"{source}: replica {failure.replica} of stage {failure.stage} does not exist with "
                    f"pipeline.data_parallel_degree = {data_parallel_degree}; use replicas 0..{data_parallel_degree - 1}"
                )
        return self

    def to_csv(self) -> str:
        stream = io.StringIO()
        stream.write(_VERSION_LINE + "\n")
        writer = csv.writer(stream, lineterminator="\n")
        with_replica = any(failure.replica != 0 for failure in self.failures)
        writer.writerow(FAILURE_COLUMNS + ((REPLICA_COLUMN,) if with_replica else ()))
        for failure in self.failures:
            row = [
                "" if failure.time_s is None else repr(float(failure.time_s)),
                "" if failure.iteration is None else failure.iteration,
                failure.stage,
                failure.kind,
            ]
            writer.writerow(row + [failure.replica] if with_replica else row)
        return stream.getvalue()

    @classmethod
    def from_csv(cls, text: str, source: str = "failure schedule") -> "FailureSchedule":
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# churnsim failure schedule"):
            raise InputError(f"{source}: the first line must be '{_VERSION_LINE}'; is this a churnsim failure schedule?")
        version = lines[0].rsplit(" ", 1)[-1]
        if version != str(SCHEMA_VERSION):
            raise InputError(f"{source}: schema_version {version} is not supported; this churnsim reads version {SCHEMA_VERSION}")
        reader = csv.reader(lines[1:])
        header = next(reader, None)
        columns = None if header is None else tuple(column.strip() for column in header)
        if columns not in (FAILURE_COLUMNS, FAILURE_COLUMNS + (REPLICA_COLUMN,)):
            raise InputError(
                f"{source}: line 2 must be the header {','.join(FAILURE_COLUMNS)} "
                f"(optionally followed by ,{REPLICA_COLUMN}), got {header}"
            )
        failures = []
        for line_number, row in enumerate(reader, start=3):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(columns):
                raise InputError(f"{source}: line {line_number} has {len(row)} fields, expected {len(columns)}")
            time_text, iteration_text, stage_text, kind, *replica_text = (cell.strip() for cell in row)
            try:
                time_s = float(time_text) if time_text else None
                iteration = int(iteration_text) if iteration_text else None
                stage = int(stage_text)
            except ValueError:
                raise InputError(f"{source}: line {line_number}: time_s, iteration and stage must be numbers, got {row}") from None
            replica = _parse_replica(replica_text[0] if replica_text else "", source, line_number)
            try:
                failures.append(ScheduledFailure(time_s=time_s, iteration=iteration, stage=stage, kind=kind or "failure", replica=replica))
            except InputError as error:
                raise InputError(f"{source}: line {line_number}: {error}") from None
        return cls(failures=tuple(failures))


def _parse_replica(text: str, source: str, line_number: int) -> int:
    """A replica cell: a whole number >= 0, or empty for replica 0."""
    if not text:
        return 0
    try:
        replica = int(text)
    except ValueError:
        replica = -1
    if replica < 0:
        raise InputError(
            f"{source}: line {line_number}: replica {text!r} is not a whole number >= 0; "
            "give the failed node's 0-based data-parallel replica, or leave the cell empty for replica 0"
        )
    return replica


def write_failure_schedule(schedule: FailureSchedule, path: str | Path) -> None:
    atomic_write_text(path, schedule.to_csv())


def read_failure_schedule(path: str | Path) -> FailureSchedule:
    from .safe_files import read_input_text

    path = Path(path)
    if not os.path.lexists(path) and len(str(path)) < 4096:
        raise InputError(f"{path}: no such failure schedule; check the path")
    text = read_input_text(path, what="failure schedule")
    return FailureSchedule.from_csv(text, source=str(path))
