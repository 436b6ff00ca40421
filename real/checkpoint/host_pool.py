"""A preallocated host buffer with a FIFO ring allocator (DataStates-LLM's host cache, [P §5.1]).

One buffer per engine, allocated and pre-faulted once (first touch of fresh pages is ~10x slower
than a warm copy, reference §6), pinned when the engine copies from CUDA so `copy_(...,
non_blocking=True)` really overlaps. Regions are handed out in order and must be released in the
same order (flushes complete FIFO), so the allocator is a ring: a new region goes after the newest
live one, or wraps to the start when the tail is too short (no region is split across the wrap).
`allocate` blocks while the ring is full: that wait is the back-pressure training feels when flushes
are slower than snapshots. Callers split tensors into chunks no larger than the capacity.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from churnsim.calibration.errors import InputError

ALIGNMENT_BYTES = 64


class PoolStopped(Exception):
    """Raised by a blocked `allocate` when its caller asked to stop (shutdown, node loss, error)."""


@dataclass(frozen=True, kw_only=True)
class Region:
    """A contiguous byte range of the pool; `view` is a uint8 tensor over it."""

    start: int
    end: int
    view: torch.Tensor


class HostPool:
    """Fixed-size host byte buffer, FIFO allocation and release, blocking when full."""

    def __init__(self, capacity_bytes: int, *, pin_memory: bool) -> None:
        if capacity_bytes < ALIGNMENT_BYTES:
            raise InputError(
                f"host_buffer_bytes = {capacity_bytes} is too small; use at least {ALIGNMENT_BYTES}"
            )
        self.capacity_bytes = capacity_bytes - capacity_bytes % ALIGNMENT_BYTES
        # pin_memory goes through the CUDA caching host allocator, which rounds to a power of two
        # (pytorch/pytorch#95823): size host_buffer_bytes with that in mind on CUDA.
        self.buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.buffer.zero_()  # pre-fault every page now, not during the first snapshot
        self._live: deque[tuple[int, int]] = deque()
        self._condition = threading.Condition()
        self.peak_used_bytes = 0

    @property
    def used_bytes(self) -> int:
        with self._condition:
            return sum(end - start for start, end in self._live)

    def _find_start(self, nbytes: int) -> int | None:
        if not self._live:
            return 0
        oldest_start = self._live[0][0]
        newest_start, newest_end = self._live[-1]
        wrapped = newest_start < oldest_start
        if wrapped:
            return newest_end if newest_end + nbytes <= oldest_start else None
        if newest_end + nbytes <= self.capacity_bytes:
            return newest_end
        return 0 if nbytes <= oldest_start else None

    def allocate(self, nbytes: int, should_stop: Callable[[], bool]) -> Region:
        """A region of `nbytes` (> 0, ≤ capacity), waiting for releases while the ring is full."""
        assert 0 < nbytes <= self.capacity_bytes, "callers chunk tensors to the pool capacity"
        reserved = -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        reserved = min(reserved, self.capacity_bytes)
        with self._condition:
            start = self._find_start(reserved)
            while start is None:
                if should_stop():
                    raise PoolStopped
                self._condition.wait(timeout=0.05)
                start = self._find_start(reserved)
            self._live.append((start, start + reserved))
            used = sum(end - begin for begin, end in self._live)
            self.peak_used_bytes = max(self.peak_used_bytes, used)
        return Region(start=start, end=start + reserved, view=self.buffer[start : start + nbytes])

    def release(self, region: Region) -> None:
        """Free the oldest live region, which must be `region` (FIFO)."""
        with self._condition:
            assert self._live and self._live[0] == (region.start, region.end), "release is FIFO"
            self._live.popleft()
            self._condition.notify_all()

    def reset(self) -> None:
        """Forget every region (the node died; its host memory is gone)."""
        with self._condition:
            self._live.clear()
            self._condition.notify_all()

    def wake(self) -> None:
        """Let blocked allocations re-check their stop condition now."""
        with self._condition:
            self._condition.notify_all()
