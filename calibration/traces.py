"""Parsers for recorded spot-instance traces, and their summary statistics.

Every format becomes a `Trace`: a time-ordered tuple of `TraceEvent(time_s, kind, count)`, one
event per run of consecutive records with the same time and kind (so 5 `remove` rows at one
timestamp are one event of count 5), starting from 0 nodes alive at trace time 0; the nodes present
at the start are an `add` at the first record's time. Times are seconds since the first record.

Formats (semantics of the shipped files: calibration/data/traces/SOURCES.md and the trace README):

- `bamboo_csv`: `time_ms,add|remove,nodeN`, no header, CRLF allowed (Bamboo's `p3-trace.csv`).
- `parcae_jsonl`: one JSON array per line, `[t_ms, "add"|"remove"|"no-op", {"nodes": [...], ...}]`;
  `nodes` lists the nodes added or removed (the first line: all nodes present at the start).
- `instance_count` / `instance_count_hours`: `x,count` step series, x in seconds / hours; two rows
  with equal x mark a step. A count change between rows with different x is taken as a step at the
  later row's x.
- `gcloud_count`: `YYYY-MM-DD, HH:MM:SS, count`; processed in file order keeping only the first line
  of each run of equal counts (the logger repeats values and its timestamps sometimes step back);
  times are relative to the first sample. A kept sample earlier than the previous kept one (does not
  happen in the shipped file) is clamped to it so the step function never runs backwards.

A count-series trace ends at its last record (for `gcloud_count`: its last kept record, as the
trace README does); a Parcae trace ends one interval (`duration`) after its last line.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Literal

from .churn import TraceFormat, resolve_trace_path
from .errors import InputError

TraceEventKind = Literal["add", "remove"]


@dataclass(frozen=True, kw_only=True)
class TraceEvent:
    """`count` nodes join (`add`) or leave (`remove`) at `time_s` seconds after the trace start."""

    time_s: float
    kind: TraceEventKind
    count: int


@dataclass(frozen=True, kw_only=True)
class Trace:
    """A parsed trace: events in time order (ties in file order) and the time its record ends."""

    source: str
    events: tuple[TraceEvent, ...]
    end_s: float

    def alive_after_each_event(self) -> tuple[int, ...]:
        """Nodes alive right after each event (0 before the first)."""
        alive, result = 0, []
        for event in self.events:
            alive += event.count if event.kind == "add" else -event.count
            result.append(alive)
        return tuple(result)

    def alive_at(self, time_s: float) -> int:
        """Nodes alive just before `time_s` (events at exactly `time_s` not yet applied)."""
        alive = 0
        for event in self.events:
            if event.time_s >= time_s:
                break
            alive += event.count if event.kind == "add" else -event.count
        return alive


@dataclass(frozen=True, kw_only=True)
class TraceSummary:
    """Statistics of a trace over [0, end_s], as the trace README states them."""

    num_removal_events: int
    """Instants at which nodes leave (a burst of simultaneous removals counts once)."""
    num_preemptions: int
    """Nodes removed in total (`remove` rows; sum of count decreases)."""
    num_additions: int
    """Nodes added in total, including those present at the start."""
    max_removals_at_once: int
    duration_h: float
    node_hours: float
    """Time-weighted integral of the nodes alive."""
    mean_nodes_alive: float
    max_nodes_alive: int
    preemptions_per_node_hour: float


def summarize_trace(trace: Trace) -> TraceSummary:
    """Counts, node-hours and mean nodes alive of `trace` (step function from 0 to `end_s`)."""
    removals_by_time: dict[float, int] = {}
    node_seconds, alive, previous_time_s, max_alive = 0.0, 0, 0.0, 0
    num_additions = 0
    for event in trace.events:
        node_seconds += alive * (event.time_s - previous_time_s)
        previous_time_s = event.time_s
        if event.kind == "add":
            alive += event.count
            num_additions += event.count
        else:
            alive -= event.count
            removals_by_time[event.time_s] = removals_by_time.get(event.time_s, 0) + event.count
        max_alive = max(max_alive, alive)
    node_seconds += alive * (trace.end_s - previous_time_s)
    node_hours = node_seconds / 3600.0
    num_preemptions = sum(removals_by_time.values())
    duration_h = trace.end_s / 3600.0
    return TraceSummary(
        num_removal_events=len(removals_by_time),
        num_preemptions=num_preemptions,
        num_additions=num_additions,
        max_removals_at_once=max(removals_by_time.values(), default=0),
        duration_h=duration_h,
        node_hours=node_hours,
        mean_nodes_alive=node_hours / duration_h if duration_h > 0 else float(alive),
        max_nodes_alive=max_alive,
        preemptions_per_node_hour=num_preemptions / node_hours if node_hours > 0 else 0.0,
    )


class _EventBuilder:
    """Collects records in file order, merges runs with the same time and kind, checks invariants."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.events: list[TraceEvent] = []
        self.alive = 0

    def fail(self, line_number: int, what: str) -> InputError:
        return InputError(f"{self.source}: line {line_number}: {what}")

    def add(self, line_number: int, time_s: float, kind: TraceEventKind, count: int) -> None:
        if count == 0:
            return
        if self.events and time_s < self.events[-1].time_s:
            raise self.fail(
                line_number,
                f"time {time_s:g} s is earlier than the previous record's {self.events[-1].time_s:g} s; "
                "sort the file by time",
            )
        if kind == "remove" and count > self.alive:
            raise self.fail(line_number, f"removes {count} node(s) but only {self.alive} are alive; fix the trace")
        self.alive += count if kind == "add" else -count
        last = self.events[-1] if self.events else None
        if last is not None and last.time_s == time_s and last.kind == kind:
            self.events[-1] = TraceEvent(time_s=time_s, kind=kind, count=last.count + count)
        else:
            self.events.append(TraceEvent(time_s=time_s, kind=kind, count=count))

    def build(self, end_s: float) -> Trace:
        return Trace(source=self.source, events=tuple(self.events), end_s=end_s)


def _numbered_lines(path: Path) -> list[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers; CRLF and LF both accepted."""
    from .safe_files import read_input_text

    text = read_input_text(path, what="trace")
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _parse_number(builder: _EventBuilder, line_number: int, text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise builder.fail(line_number, f"{what} {text!r} is not a number; expected e.g. 60000") from None
    if not math.isfinite(value) or value < 0:
        raise builder.fail(line_number, f"{what} {text!r} must be a finite number >= 0")
    return value


def _parse_count(builder: _EventBuilder, line_number: int, text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise builder.fail(line_number, f"count {text!r} is not a whole number; expected e.g. 12") from None
    if count < 0:
        raise builder.fail(line_number, f"count {count} is negative; counts are numbers of nodes")
    return count


def _check_not_empty(builder: _EventBuilder, path: Path, lines: list) -> None:
    if not lines:
        raise InputError(f"{path}: the trace has no records; use a non-empty trace file")


def parse_bamboo_csv(path: Path) -> Trace:
    """Bamboo `time_ms,add|remove,nodeN` rows; each node must be added before it is removed."""
    builder, lines = _EventBuilder(str(path)), _numbered_lines(path)
    _check_not_empty(builder, path, lines)
    alive_nodes: set[str] = set()
    last_time_s = 0.0
    for number, line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            raise builder.fail(number, f"expected 3 fields 'time_ms,add|remove,node', found {len(fields)}")
        time_s = _parse_number(builder, number, fields[0], "time_ms") / 1000.0
        kind, node = fields[1], fields[2]
        if kind == "add":
            if node in alive_nodes:
                raise builder.fail(number, f"node {node!r} is added while already alive; remove it first")
            alive_nodes.add(node)
        elif kind == "remove":
            if node not in alive_nodes:
                raise builder.fail(number, f"node {node!r} is removed but not alive; add it first")
            alive_nodes.remove(node)
        else:
            raise builder.fail(number, f"kind {kind!r} is neither 'add' nor 'remove'")
        builder.add(number, time_s, kind, 1)
        last_time_s = time_s
    return builder.build(end_s=last_time_s)


def parse_parcae_jsonl(path: Path) -> Trace:
    """Parcae `[t_ms, add|remove|no-op, {"nodes": [...], "duration": ms, ...}]` lines."""
    builder, lines = _EventBuilder(str(path)), _numbered_lines(path)
    _check_not_empty(builder, path, lines)
    alive_nodes: set[str] = set()
    end_s = 0.0
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise builder.fail(number, f"not valid JSON ({error.msg}); expected [t_ms, kind, {{\"nodes\": [...]}}]") from None
        if not (isinstance(record, list) and len(record) >= 3 and isinstance(record[2], dict)):
            raise builder.fail(number, "expected a JSON array [t_ms, kind, {\"nodes\": [...], ...}]")
        time_s = _parse_number(builder, number, str(record[0]), "t_ms") / 1000.0
        kind, details = record[1], record[2]
        nodes = details.get("nodes", [])
        if not isinstance(nodes, list):
            raise builder.fail(number, f"'nodes' = {nodes!r} is not a list; give the node names as a list")
        if kind == "add":
            duplicated = alive_nodes.intersection(map(str, nodes))
            if duplicated:
                raise builder.fail(number, f"node(s) {sorted(duplicated)} added while already alive")
            alive_nodes.update(map(str, nodes))
        elif kind == "remove":
            missing = set(map(str, nodes)) - alive_nodes
            if missing:
                raise builder.fail(number, f"node(s) {sorted(missing)} removed but not alive")
            alive_nodes.difference_update(map(str, nodes))
        elif kind != "no-op":
            raise builder.fail(number, f"kind {kind!r} is not 'add', 'remove' or 'no-op'")
        if kind != "no-op":
            builder.add(number, time_s, kind, len(nodes))
        duration_ms = details.get("duration", 0)
        duration_s = _parse_number(builder, number, str(duration_ms), "duration") / 1000.0
        end_s = max(end_s, time_s + duration_s)
    return builder.build(end_s=end_s)


def _count_steps(path: Path, x_unit_s: float) -> Trace:
    builder, lines = _EventBuilder(str(path)), _numbered_lines(path)
    _check_not_empty(builder, path, lines)
    first_x: float | None = None
    previous_count, time_s = 0, 0.0
    for number, line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 2:
            raise builder.fail(number, f"expected 2 fields 'x,count', found {len(fields)}")
        x = _parse_number(builder, number, fields[0], "x")
        count = _parse_count(builder, number, fields[1])
        first_x = x if first_x is None else first_x
        time_s = (x - first_x) * x_unit_s
        change = count - previous_count
        builder.add(number, time_s, "add" if change > 0 else "remove", abs(change))
        previous_count = count
    return builder.build(end_s=time_s)


def parse_instance_count(path: Path) -> Trace:
    """`x,count` steps with x in seconds."""
    return _count_steps(path, x_unit_s=1.0)


def parse_instance_count_hours(path: Path) -> Trace:
    """`x,count` steps with x in hours (the format of Bamboo's AWS p2.xlarge spot-instance traces)."""
    return _count_steps(path, x_unit_s=3600.0)


def parse_gcloud_count(path: Path) -> Trace:
    """`YYYY-MM-DD, HH:MM:SS, count` samples; first line of each run of equal counts kept."""
    builder, lines = _EventBuilder(str(path)), _numbered_lines(path)
    _check_not_empty(builder, path, lines)
    first_time: datetime | None = None
    previous_count: int | None = None
    kept_time_s = 0.0
    for number, line in lines:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            raise builder.fail(number, f"expected 3 fields 'YYYY-MM-DD, HH:MM:SS, count', found {len(fields)}")
        try:
            stamp = datetime.strptime(f"{fields[0]} {fields[1]}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise builder.fail(number, f"date/time {fields[0]!r}, {fields[1]!r} is not 'YYYY-MM-DD, HH:MM:SS'") from None
        count = _parse_count(builder, number, fields[2])
        first_time = stamp if first_time is None else first_time
        if count == previous_count:
            continue  # a repeated sample: only the first line of a run of equal counts is kept
        # Clamp: a kept sample must not move the step function backwards in time.
        kept_time_s = max(kept_time_s, (stamp - first_time).total_seconds())
        change = count - (previous_count or 0)
        builder.add(number, kept_time_s, "add" if change > 0 else "remove", abs(change))
        previous_count = count
    return builder.build(end_s=kept_time_s)


PARSERS: dict[str, Callable[[Path], Trace]] = {
    "bamboo_csv": parse_bamboo_csv,
    "parcae_jsonl": parse_parcae_jsonl,
    "instance_count": parse_instance_count,
    "instance_count_hours": parse_instance_count_hours,
    "gcloud_count": parse_gcloud_count,
}


def load_trace(path: str | Path, format: TraceFormat) -> Trace:
    """Parse a trace file; relative paths are looked up in the built-in trace directory first."""
    if format not in PARSERS:
        raise InputError(f"trace format = {format!r} is unknown; use one of {', '.join(PARSERS)}")
    resolved = resolve_trace_path(path)
    stat = resolved.stat()
    return _load_cached(str(resolved), format, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _load_cached(path: str, format: str, mtime_ns: int, size_bytes: int) -> Trace:
    # Keyed on modification time and size so an edited file is parsed again; `Trace` is immutable.
    return PARSERS[format](Path(path))
