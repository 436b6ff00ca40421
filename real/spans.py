"""Timed spans of one rank (the run record's spans.csv): what ran when, relative to the run start."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class SpanRecorder:
    """Timed spans of one rank, relative to the run start (time.perf_counter).

    The `iteration` column holds the trainer's step (executed iterations, monotonic; it equals the
    training iteration unless a rollback replayed iterations). The trainer sets `step` before each
    iteration; `span(kind)` without an explicit iteration stamps it, which is what methods should use.
    On CUDA each span boundary synchronises the device so that spans time the work, not its launch.
    Each span also stamps the process's CPU clock at both ends (`cpu_start_s`, `cpu_end_s`,
    time.process_time): where stage processes share cores, a span's CPU seconds against its wall
    seconds show how long it waited for a core. The fits do not read them (calibration.cpu_sharing
    says why); they are there to check its sharing rule against.
    """

    def __init__(self, *, rank: int, stage: int, device: torch.device | None = None) -> None:
        self.rank = rank
        self.stage = stage
        self.step = 0
        self.origin_s = time.perf_counter()
        self.rows: list[dict[str, Any]] = []
        self._synchronize = device is not None and device.type == "cuda"

    def restart_clock(self) -> None:
        """Call right after the start-of-run barrier so that every rank shares the origin."""
        self.origin_s = time.perf_counter()

    def set_origin(self, origin_s: float) -> None:
        """Adopt another process's origin (a replacement process joining a running run: perf_counter
        is the machine's monotonic clock, the same in every process on it)."""
        self.origin_s = origin_s

    def now_s(self) -> float:
        if self._synchronize:
            torch.cuda.synchronize()
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
        self.rows.append(row)

    @contextmanager
    def span(self, kind: str, iteration: int | None = None, microbatch: int | None = None, nbytes: int | None = None) -> Iterator[None]:
        start_s = self.now_s()
        cpu_start_s = time.process_time()
        try:
            yield
        finally:
            end_s = self.now_s()
            self.add(kind, iteration, microbatch, start_s, end_s, cpu_start_s, time.process_time(), nbytes)
