"""What one simulated run returns: the numbers every table, figure and run record is built from."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from churnsim.calibration.tables import TIME_CATEGORIES

BADPUT_CATEGORIES: tuple[str, ...] = TIME_CATEGORIES[1:]
"""Where wall-clock time goes besides goodput: goodput_s + sum(badput) == wall_clock_s for every run
(definitions in calibration/tables.py and sim/model/accounting.py)."""


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """A span (end_s > start_s) or an instant (end_s == start_s) of a simulated run, for the timeline."""

    name: str
    category: str  # "train", "checkpoint", "flush", "recovery", "degraded", "failure"
    stage: int  # -1 for the whole pipeline
    start_s: float
    end_s: float
    track: str | None = None
    """The timeline track it belongs on (a storage tier, a link); None: its stage's, or the pipeline's."""


@dataclass(frozen=True, kw_only=True)
class HandledFailure:
    time_s: float
    stage: int
    kind: str  # cause from the churn model, e.g. "preemption"
    handled_as: str  # what the method did, e.g. "rebuild_interior", "rollback", "degraded", "ignored", "replica_heal"
    iteration: int  # progress (iterations) when it struck
    replica: int = 0  # the node's data-parallel replica (always 0 when D is 1)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    method: str
    replication: int
    seed: int
    reached_target: bool
    wall_clock_s: float
    """Time at which the target was reached, or the time the run gave up (target.max_wall_clock_s)."""
    target_iterations: int
    progress_iterations: float
    """Effective progress at the end (iterations of the no-failure run)."""
    iterations_executed: int
    healthy_iteration_time_s: float
    reference_iteration_time_s: float
    """Iteration time of the same pipeline without any method (the `none` method's)."""
    goodput_s: float
    badput: dict[str, float]
    failures: Sequence[HandledFailure]
    """A tuple, or a `RecordSequence` that behaves as one (built on first read)."""
    trajectory: Sequence[tuple[float, float]]
    """(time_s, progress_iterations) points; progress is linear between consecutive points. A tuple,
    or a `RecordSequence` that behaves as one (built on first read)."""
    timeline: Sequence[TimelineEvent] = ()
    """A tuple, or a `RecordSequence` that behaves as one (built on first read)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> dict[str, float | int | str | bool | None]:
        """The run's numbers as flat fields: a run record's manifest summary and a row of runs.csv."""
        summary: dict[str, float | int | str | bool | None] = {
            "reached_target": self.reached_target,
            "wall_clock_s": self.wall_clock_s,
            "time_to_target_s": self.wall_clock_s if self.reached_target else math.nan,
            "target_iterations": self.target_iterations,
            "progress_iterations": self.progress_iterations,
            "iterations_executed": self.iterations_executed,
            "healthy_iteration_time_s": self.healthy_iteration_time_s,
            "num_failures": len(self.failures),
            "goodput_s": self.goodput_s,
        }
        summary.update({category: self.badput[category] for category in BADPUT_CATEGORIES})
        return summary


def timeline_event_from_row(row) -> TimelineEvent:
    """A `TimelineEvent` from a compact row (name, category, stage, start_s, end_s, track)."""
    name, category, stage, start_s, end_s, track = row
    return TimelineEvent(name=name, category=category, stage=stage, start_s=start_s, end_s=end_s, track=track)


def handled_failure_from_row(row) -> HandledFailure:
    """A `HandledFailure` from a compact row (time_s, stage, kind, handled_as, iteration, replica)."""
    time_s, stage, kind, handled_as, iteration, replica = row
    return HandledFailure(time_s=time_s, stage=stage, kind=kind, handled_as=handled_as, iteration=iteration, replica=replica)


TIMELINE_ROW_WIDTH = 6
"""Fields of a timeline row: name, category, stage, start_s, end_s, track."""
HANDLED_ROW_WIDTH = 6
"""Fields of a handled-failure row: time_s, stage, kind, handled_as, iteration, replica."""
TRAJECTORY_ROW_WIDTH = 2
"""Fields of a trajectory point: time_s, progress_iterations."""


class RecordSequence(Sequence):
    """A read-only, tuple-like sequence of records built on first use from one flat list of fields.

    Why: a long run books tens of thousands of timeline spans, trajectory points and handled
    failures. A frozen dataclass costs about 2 µs to build, and even a small tuple per record is an
    object Python's garbage collector must track and scan, while a sweep never reads them. So a run
    appends each record's fields to one flat list of numbers and strings (`list.extend`), which the
    collector sees as a single object, and the records are built once, when something reads them.
    `width` is the number of fields per record; `factory` builds one record from its fields (default:
    the tuple of them). `background_fields`, for an engine that books some spans (lazy flushes) when
    it gets to them rather than when they end: records of `width` + 1 fields, the last a marker, the
    number of the other records booked before the work began. Each goes where the event model books
    it: after those records and after every record that ends earlier (the others are in order of
    their end, field 4), before the rest (a trainer that waited for that work resumes after it).
    `len` builds nothing; equality with any sequence compares the records; it pickles as a tuple.
    """

    __slots__ = ("_fields", "_width", "_factory", "_background_fields", "_items")

    def __init__(
        self, fields: list, width: int, factory: Callable[[tuple], object] | None = None, *, background_fields: list | None = None
    ) -> None:
        self._fields = fields
        self._width = width
        self._factory = factory
        self._background_fields = background_fields
        self._items: tuple | None = None

    def _materialize(self) -> tuple:
        items = self._items
        if items is None:
            width = self._width
            rows = _records(self._fields, width)
            if self._background_fields:
                rows = _merge_background(rows, _records(self._background_fields, width + 1))
            items = self._items = tuple(rows) if self._factory is None else tuple(map(self._factory, rows))
            self._fields = []
            self._background_fields = None
        return items

    def __len__(self) -> int:
        if self._items is not None:
            return len(self._items)
        return len(self._fields) // self._width + len(self._background_fields or ()) // (self._width + 1)

    def __getitem__(self, index):
        return self._materialize()[index]

    def __iter__(self):
        return iter(self._materialize())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RecordSequence):
            return self._materialize() == other._materialize()
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._materialize() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._materialize())

    def __repr__(self) -> str:
        return repr(self._materialize())

    def __reduce__(self):
        return (tuple, (self._materialize(),))


def _records(fields: list, width: int) -> list[tuple]:
    return list(zip(*(fields[offset::width] for offset in range(width))))


def _merge_background(rows: list[tuple], background: list[tuple]) -> list[tuple]:
    """`rows` (in order of end) with each background record (its fields, then its marker) placed at
    the first position at or after its marker whose record ends no earlier than it."""
    ends = [row[4] for row in rows]
    placed = []
    for order, record in enumerate(background):
        *fields, marker = record
        position = bisect_left(ends, fields[4])
        placed.append((max(position, marker), fields[4], order, tuple(fields)))
    placed.sort()
    merged: list[tuple] = []
    start = 0
    for position, _, _, fields in placed:
        merged.extend(rows[start:position])
        start = max(start, position)
        merged.append(fields)
    merged.extend(rows[start:])
    return merged
