"""The failure schedule: which stage fails when, written and read by both sim/ and real/.

File format: CSV with a first comment line naming the schema version, then the header
`time_s,iteration,stage,kind`. A row gives the time of the failure in seconds since the start of
the run, the iteration before which it struck, or both; an empty cell means unknown. A real run
records both; a simulator replay uses `time_s` when present and the iteration otherwise.
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
NODE_FAILURE_COLUMNS: tuple[str, ...] = ("time_s", "iteration", "stage", "replica", "kind")
"""The header of a data-parallel run's schedule: each row names a node (stage, data-parallel replica).
Written only when some failure names its replica; a schedule without the column is replica 0's."""
_VERSION_LINE = f"# churnsim failure schedule, schema_version {SCHEMA_VERSION}"


@dataclass(frozen=True, kw_only=True, order=True)
class ScheduledFailure:
    time_s: float | None = None
    iteration: int | None = None
    stage: int
    kind: str = "failure"
    replica: int | None = None
    """The data-parallel replica of the lost node; None: not named (replica 0, a one-pipeline run)."""

    def __post_init__(self) -> None:
        if self.time_s is None and self.iteration is None:
            raise InputError(f"a failure of stage {self.stage} has neither time_s nor iteration; give one")
        if self.time_s is not None and not (math.isfinite(self.time_s) and self.time_s >= 0):
            raise InputError(f"failure time_s {self.time_s} must be a finite number >= 0")
        if self.iteration is not None and self.iteration < 0:
            raise InputError(f"failure iteration {self.iteration} must be >= 0")
        if self.stage < 0:
            raise InputError(f"failure stage {self.stage} must be >= 0")
        if self.replica is not None and self.replica < 0:
            raise InputError(f"failure replica {self.replica} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class FailureSchedule:
    failures: tuple[ScheduledFailure, ...] = ()

    def validate_for(self, num_stages: int, source: str = "failure schedule") -> "FailureSchedule":
        for failure in self.failures:
            if failure.stage >= num_stages:
                raise InputError(
                    f"{source}: stage {failure.stage} does not exist in a {num_stages}-stage pipeline; "
                    f"use stages 0..{num_stages - 1}"
                )
        return self

    def to_csv(self) -> str:
        stream = io.StringIO()
        stream.write(_VERSION_LINE + "\n")
        writer = csv.writer(stream, lineterminator="\n")
        nodes = any(failure.replica is not None for failure in self.failures)
        writer.writerow(NODE_FAILURE_COLUMNS if nodes else FAILURE_COLUMNS)
        for failure in self.failures:
            writer.writerow(
                [
                    "" if failure.time_s is None else repr(float(failure.time_s)),
                    "" if failure.iteration is None else failure.iteration,
                    failure.stage,
                    *([failure.replica or 0] if nodes else []),
                    failure.kind,
                ]
            )
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
        columns = tuple(column.strip() for column in header) if header is not None else None
        if columns not in (FAILURE_COLUMNS, NODE_FAILURE_COLUMNS):
            raise InputError(
                f"{source}: line 2 must be the header {','.join(FAILURE_COLUMNS)} (or {','.join(NODE_FAILURE_COLUMNS)}), got {header}"
            )
        failures = []
        for line_number, row in enumerate(reader, start=3):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(columns):
                raise InputError(f"{source}: line {line_number} has {len(row)} fields, expected {len(columns)}")
            cells = dict(zip(columns, (cell.strip() for cell in row)))
            time_text, iteration_text, stage_text, kind = cells["time_s"], cells["iteration"], cells["stage"], cells["kind"]
            try:
                time_s = float(time_text) if time_text else None
                iteration = int(iteration_text) if iteration_text else None
                stage = int(stage_text)
                replica = int(cells["replica"]) if "replica" in cells else None
            except ValueError:
                raise InputError(f"{source}: line {line_number}: time_s, iteration, stage and replica must be numbers, got {row}") from None
            try:
                failures.append(ScheduledFailure(time_s=time_s, iteration=iteration, stage=stage, kind=kind or "failure", replica=replica))
            except InputError as error:
                raise InputError(f"{source}: line {line_number}: {error}") from None
        return cls(failures=tuple(failures))


def write_failure_schedule(schedule: FailureSchedule, path: str | Path) -> None:
    atomic_write_text(path, schedule.to_csv())


def read_failure_schedule(path: str | Path) -> FailureSchedule:
    from .safe_files import read_input_text

    path = Path(path)
    if not os.path.lexists(path) and len(str(path)) < 4096:
        raise InputError(f"{path}: no such failure schedule; check the path")
    text = read_input_text(path, what="failure schedule")
    return FailureSchedule.from_csv(text, source=str(path))
