"""Timed spans of one rank (the run record's spans.csv): what ran when, relative to the run start."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from churnsim.calibration.cpu_sharing import COMPUTE_SPAN_KINDS
from churnsim.calibration.tables import COMMUNICATION_SPAN_KINDS

EVENT_TIMED_SPAN_KINDS: frozenset[str] = COMPUTE_SPAN_KINDS | COMMUNICATION_SPAN_KINDS
"""On CUDA, the kinds timed with CUDA events on the current stream: the compute and the waits for
messages as the training stream sees them. Other kinds (recoveries, replica refreshes) are host work
whose cost is wall-clock time; they keep synchronising the device at their ends."""


class DeviceEvent(Protocol):
    """What the recorder uses of torch.cuda.Event (tests pass a stand-in)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end_event: Any) -> float: ...


@dataclass
class _Anchor:
    """An event whose completion was seen at `seconds` on the recorder's clock (since its origin)."""

    event: DeviceEvent
    seconds: float


@dataclass
class _PendingSpan:
    kind: str
    iteration: int
    microbatch: int | None
    start_event: DeviceEvent
    end_event: DeviceEvent
    cpu_start_s: float
    cpu_end_s: float
    anchor: _Anchor
    nbytes: int | None = None


class _CudaTimingEvent:
    """A timing torch.cuda.Event, recorded on the current stream of the recorder's device (which
    need not be the process's current device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end_event: "_CudaTimingEvent") -> float:
        return self.event.elapsed_time(end_event.event)


class SpanRecorder:
    """Timed spans of one rank, relative to the run start (time.perf_counter).

    The `iteration` column holds the trainer's step (executed iterations, monotonic; it equals the
    training iteration unless a rollback replayed iterations). The trainer sets `step` before each
    iteration; `span(kind)` without an explicit iteration stamps it, which is what methods should use.

    On CUDA, spans of EVENT_TIMED_SPAN_KINDS are timed with a pair of CUDA events on the current
    stream, so a forward span holds the forward's kernels, not the copy-stream or NCCL work queued
    before it, and nothing waits for the device when the span opens or closes. Their times are
    placed on the host clock through an anchor: an event whose completion the host waited for
    (`now_s`, the start of the run). Rows of event-timed spans are added once their end event has
    completed: at the next `now_s()` (the trainer calls it at the end of every iteration), or when
    `rows` is read. A span left by an exception keeps host times instead (its work may never
    finish on the device). Other kinds time host work and synchronise the device at both ends.

    Each span also stamps the process's CPU clock at both ends (`cpu_start_s`, `cpu_end_s`,
    time.process_time): where stage processes share cores, a span's CPU seconds against its wall
    seconds show how long it waited for a core. The fits do not read them (calibration.cpu_sharing
    says why); they are there to check its sharing rule against.
    """

    def __init__(
        self,
        *,
        rank: int,
        stage: int,
        device: torch.device | None = None,
        make_event: Callable[[], DeviceEvent] | None = None,
        synchronize_device: Callable[[], None] | None = None,
    ) -> None:
        """`make_event` and `synchronize_device` replace torch.cuda.Event and torch.cuda.synchronize
        (tests without a GPU)."""
        self.rank = rank
        self.stage = stage
        self.step = 0
        self.origin_s = time.perf_counter()
        self._rows: list[dict[str, Any]] = []
        self._on_cuda = device is not None and device.type == "cuda"
        self._make_event = make_event or (lambda: _CudaTimingEvent(device))
        self._synchronize_device = synchronize_device or (lambda: torch.cuda.synchronize(device))
        self._pending: deque[_PendingSpan] = deque()
        self._pending_lock = threading.Lock()
        self._anchor: _Anchor | None = None

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The recorded rows (a live list), after waiting for every event-timed span still open on the device."""
        self.resolve(wait=True)
        return self._rows

    def restart_clock(self) -> None:
        """Call right after the start-of-run barrier so that every rank shares the origin."""
        self.resolve(wait=True)  # spans recorded so far keep the old origin
        self.origin_s = time.perf_counter()
        self._anchor = None
        if self._on_cuda:
            self.now_s()

    def set_origin(self, origin_s: float) -> None:
        """Adopt another process's origin (a replacement process joining a running run: perf_counter
        is the machine's monotonic clock, the same in every process on it)."""
        self.resolve(wait=True)
        self.origin_s = origin_s
        self._anchor = None
        if self._on_cuda:
            self.now_s()

    def now_s(self) -> float:
        """Seconds since the origin once the work queued so far on the current stream is done (on
        CUDA the host waits for one event, not for the whole device; that event becomes the anchor)."""
        if not self._on_cuda:
            return time.perf_counter() - self.origin_s
        event = self._make_event()
        event.record()
        event.synchronize()
        seconds = time.perf_counter() - self.origin_s
        # A fresh anchor each time keeps the device timer's drift from the host clock to one
        # iteration's length.
        self._anchor = _Anchor(event, seconds)
        self.resolve(wait=False)
        return seconds

    def _host_now_s(self) -> float:
        if self._on_cuda:
            self._synchronize_device()
        return time.perf_counter() - self.origin_s

    def add(
        self,
        kind: str,
        iteration: int | None,
        microbatch: int | None,
        start_s: float,
        end_s: float,
        cpu_start_s: float = math.nan,
        cpu_end_s: float = math.nan,
        nbytes: int | None = None,
    ) -> None:
        row = {
            "rank": self.rank,
            "stage": self.stage,
            "iteration": self.step if iteration is None else iteration,
            "kind": kind,
            "microbatch": -1 if microbatch is None else microbatch,
            "start_s": start_s,
            "end_s": end_s,
            "cpu_start_s": cpu_start_s,
            "cpu_end_s": cpu_end_s,
        }
        if nbytes is not None:
            row["bytes"] = nbytes  # what the span moved (a data-parallel all-reduce, a heal's copy)
        self._rows.append(row)

    @contextmanager
    def span(self, kind: str, iteration: int | None = None, microbatch: int | None = None, nbytes: int | None = None) -> Iterator[None]:
        if self._on_cuda and kind in EVENT_TIMED_SPAN_KINDS:
            with self._event_span(kind, iteration, microbatch, nbytes):
                yield
            return
        start_s = self._host_now_s()
        cpu_start_s = time.process_time()
        try:
            yield
        finally:
            end_s = self._host_now_s()
            self.add(kind, iteration, microbatch, start_s, end_s, cpu_start_s, time.process_time(), nbytes)

    @contextmanager
    def _event_span(self, kind: str, iteration: int | None, microbatch: int | None, nbytes: int | None = None) -> Iterator[None]:
        if self._anchor is None:
            self.now_s()
        anchor = self._anchor
        assert anchor is not None
        start_event = self._make_event()
        start_event.record()
        host_start_s = time.perf_counter() - self.origin_s
        cpu_start_s = time.process_time()
        try:
            yield
        except BaseException:
            # The work may never finish on the device (a message from a peer that died): waiting for
            # its event could hang, so the span keeps the host's times.
            self.add(kind, iteration, microbatch, host_start_s, time.perf_counter() - self.origin_s, cpu_start_s, time.process_time(), nbytes)
            raise
        end_event = self._make_event()
        end_event.record()
        span = _PendingSpan(kind, self.step if iteration is None else iteration, microbatch, start_event, end_event,
                            cpu_start_s, time.process_time(), anchor, nbytes)  # fmt: skip
        with self._pending_lock:
            self._pending.append(span)

    def resolve(self, *, wait: bool) -> None:
        """Add the rows of event-timed spans whose end event completed (`wait`: of all of them,
        waiting for each end event), in the order they were opened."""
        with self._pending_lock:
            while self._pending:
                span = self._pending[0]
                if wait:
                    span.end_event.synchronize()
                elif not span.end_event.query():
                    break
                anchor = span.anchor
                start_s = anchor.seconds + anchor.event.elapsed_time(span.start_event) / 1000.0  # milliseconds
                end_s = anchor.seconds + anchor.event.elapsed_time(span.end_event) / 1000.0
                self.add(span.kind, span.iteration, span.microbatch, start_s, end_s, span.cpu_start_s, span.cpu_end_s, span.nbytes)
                self._pending.popleft()
