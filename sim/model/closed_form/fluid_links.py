"""The processor-sharing link of `sim/model/links.py` without SimPy: transfer completion times as numbers.

`ProcessorSharingLink` advances its flows on every arrival and departure and arms one wake-up at the
earliest completion. Here:

- a batch of transfers that starts on an idle link ends at `processor_sharing_end_s`: the event
  model's wake-up chain replayed with the same floating-point operations in the same order, so the
  very instant the event model computes (the closed-form engine runs the chain once per set of
  transfers and adds its length to each admission: `transfers.IdleDuration`);
- a batch that joins a busy link (flows of an abandoned transfer still in flight, a background
  refresh) is timed by `FluidLink`, which replays the event model's steps (to the bit) unless
  abandoned transfers pile up, and reports the earlier batches whose completion moved, so the
  closed-form engine (`sim/model/closed_form/engine.py`) can re-time what waits for them.

Approximation: none beyond the event model's (flows count as finished within a relative
`COMPLETION_TOLERANCE` of their size), except in virtual service time (rounding, see `FluidLink`);
an admission and a departure at the very same instant are taken admission first, where the event
model orders them by when each was scheduled.
"""

from __future__ import annotations

import math
from bisect import insort
from functools import lru_cache

from ..links import COMPLETION_TOLERANCE, _check_link_parameters


def processor_sharing_end_s(admit_s: float, sizes, bandwidth_bytes_per_s: float) -> float:
    """When the last of `sizes` (bytes, each > 0), admitted together at `admit_s` on an idle link, arrives.

    The event model's wake-up chain, step by step: each step ends the smallest remaining flow(s),
    with the same arithmetic (`ProcessorSharingLink._arm_wakeup`, `_advance`, `_on_wakeup`).
    """
    if len(sizes) == 1:
        return admit_s + max(sizes[0], 0.0) * 1 / bandwidth_bytes_per_s
    return size_classes_end_s(admit_s, size_classes(tuple(sizes)), bandwidth_bytes_per_s)


@lru_cache(maxsize=1024)
def size_classes(sizes: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[int, ...], tuple[float, ...]]:
    """Distinct sizes (ascending), how many flows have each, and their completion tolerances: flows
    of one size stay equal through every step of the chain (the same subtraction), and subtracting
    the same amount keeps the sizes in order, so the chain can run over classes."""
    counts: dict[float, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    distinct = tuple(sorted(counts))
    return distinct, tuple(counts[size] for size in distinct), tuple(COMPLETION_TOLERANCE * size for size in distinct)


def size_classes_end_s(admit_s: float, classes, bandwidth_bytes_per_s: float) -> float:
    """`processor_sharing_end_s` for flows given as `size_classes` (the smallest is always first)."""
    sizes, counts, tolerances = classes
    count = sum(counts)
    classes_left = len(sizes)
    if classes_left == 1:
        smallest = sizes[0]
        return admit_s + (smallest if smallest > 0.0 else 0.0) * count / bandwidth_bytes_per_s
    remaining = list(sizes)
    first = 0  # the classes before it have arrived; the rest are in order, smallest first
    last_s = admit_s
    while True:
        smallest = remaining[first]
        wake_s = last_s + (smallest if smallest > 0.0 else 0.0) * count / bandwidth_bytes_per_s
        elapsed_s = wake_s - last_s
        last_s = wake_s
        if elapsed_s > 0:
            sent = elapsed_s * bandwidth_bytes_per_s / count
            for index in range(first, classes_left):
                remaining[index] -= sent
            smallest = remaining[first]
        count -= counts[first]
        first += 1
        while first < classes_left and remaining[first] <= smallest:
            count -= counts[first]
            first += 1
        if first == classes_left:
            return wake_s
        for index in range(first + 1, classes_left):
            if remaining[index] <= tolerances[index]:  # within tolerance, out of order: rare
                return _classes_with_tolerance_end_s(last_s, remaining[first:], counts[first:], tolerances[first:], bandwidth_bytes_per_s)
        if remaining[first] <= tolerances[first]:
            count -= counts[first]
            first += 1
            while first < classes_left and (remaining[first] <= tolerances[first]):
                count -= counts[first]
                first += 1
            if first == classes_left:
                return wake_s
            for index in range(first + 1, classes_left):
                if remaining[index] <= tolerances[index]:
                    return _classes_with_tolerance_end_s(last_s, remaining[first:], counts[first:], tolerances[first:], bandwidth_bytes_per_s)


def _classes_with_tolerance_end_s(last_s, remaining, counts, tolerances, bandwidth_bytes_per_s) -> float:
    """The general step loop (any class may finish within its tolerance), from a wake-up at `last_s`
    whose finished classes are already removed."""
    remaining, counts, tolerances = list(remaining), list(counts), list(tolerances)
    smallest = min(remaining)
    index = 0
    while index < len(remaining):  # the rest of the wake-up at last_s
        if remaining[index] <= tolerances[index]:
            del remaining[index], counts[index], tolerances[index]
        else:
            index += 1
    count = sum(counts)
    wake_s = last_s
    while remaining:
        smallest = min(remaining)
        wake_s = last_s + (smallest if smallest > 0.0 else 0.0) * count / bandwidth_bytes_per_s
        elapsed_s = wake_s - last_s
        last_s = wake_s
        if elapsed_s > 0:
            sent = elapsed_s * bandwidth_bytes_per_s / count
            remaining = [value - sent for value in remaining]
        smallest = min(remaining)
        index = 0
        while index < len(remaining):
            if remaining[index] <= smallest or remaining[index] <= tolerances[index]:
                count -= counts[index]
                del remaining[index], counts[index], tolerances[index]
            else:
                index += 1
    return wake_s


class FlowBatch:
    """Flows started together on one link (one latency timer in the event model), part of a group."""

    __slots__ = ("admit_s", "sizes", "end_s", "group", "link")

    def __init__(self, admit_s: float, sizes: tuple, group, link: "FluidLink") -> None:
        self.admit_s = admit_s
        self.sizes = sizes
        self.end_s = math.inf
        """When its last flow arrives (as far as the flows known now decide)."""
        self.group = group
        self.link = link


EXACT_CLASS_LIMIT = 24
"""A busy link is replayed with the event model's own arithmetic while its active flows form at most
this many classes; beyond, in virtual service time (the replay would cost O(classes²) per admission)."""


class FluidLink:
    """One direction of a link or one storage tier: flows share the bandwidth equally.

    An idle link's first batch ends at `processor_sharing_end_s` (the event model's arithmetic, to
    the bit). When a later batch joins while flows are active, the link keeps the event model's
    state, the remaining bytes of every active class of flows (flows of one batch with one size leave
    together), and replays its steps: every departure before the admission is made final, then the
    admission, then the departures after it are projected on a copy (to the bit again). Only when
    abandoned transfers pile up beyond `EXACT_CLASS_LIMIT` classes (a shared read link that a failure
    rate above its capacity keeps busy for the whole run) does it switch, for the rest of that busy
    period, to processor sharing in virtual service time: every active flow has received the same
    bytes V since the switch, V grows at bandwidth / (active flows), a class leaves when V reaches
    its finish level, and a batch that something waits for ends once the link has done the work of
    every flow up to that batch's largest finish level (one sum): O(classes) per admission, equal to
    the event model to rounding (flows within tolerance of each other leave in turn, not together).
    Only `batch` and the `watched` batches of `add` get their end re-timed: an abandoned transfer's
    end concerns nobody.
    """

    __slots__ = ("bandwidth_bytes_per_s", "latency_s", "name", "instant", "batches", "busy_until_s", "family",
                 "_mode", "_remaining", "_tolerances", "_counts", "_owners", "_levels", "_virtual", "_top",
                 "_last_s", "_count", "_left")

    def __init__(self, *, bandwidth_bytes_per_s: float, latency_s: float = 0.0, name: str = "", family: object = None) -> None:
        _check_link_parameters(name, bandwidth_bytes_per_s, latency_s)
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self.latency_s = float(latency_s)
        self.name = name
        self.instant = self.bandwidth_bytes_per_s == math.inf
        """Only latency: transfers never occupy the link (the event model's plain timeouts)."""
        self.batches: list[FlowBatch] = []
        """The batches with flows still active after the latest admission."""
        self.busy_until_s = -math.inf
        """When the last flow known to this link arrives."""
        self.family = family
        """Links that are idle together or not (a storage tier in one direction): the engine keeps
        the latest `busy_until_s` per family, so a group can tell without resolving its links."""
        self._mode: str | None = None
        """None: one batch alone (its closed form); "exact": the event model's replay; "virtual"."""
        # "exact": per active class, its remaining bytes, tolerance, flows and batch.
        self._remaining: list[float] = []
        self._tolerances: list[float] = []
        self._counts: list[int] = []
        self._owners: list[FlowBatch] = []
        # "virtual": [finish level, tolerance, flows, batch] in order of finish level; the service
        # level; each batch's largest finish level.
        self._levels: list[list] = []
        self._virtual = 0.0
        self._top: dict[int, float] = {}
        self._last_s = -math.inf
        """The instant the state above describes."""
        self._count = 0
        """Active flows."""
        self._left: dict[int, int] = {}
        """Batch → its flows still active."""

    def add(self, batch: FlowBatch, *, watched=()) -> list[FlowBatch]:
        """Admit `batch` (flows > 0 bytes, admitted no earlier than the previous batch); return those of
        the earlier batches in `watched` (whose end something waits for) whose completion moved."""
        if batch.admit_s >= self.busy_until_s:
            for finished in self.batches:
                finished.group = None  # complete: its end can no longer move (and no cycle outlives it)
            self.batches = [batch]
            self._mode = None
            batch.end_s = processor_sharing_end_s(batch.admit_s, batch.sizes, self.bandwidth_bytes_per_s)
            self.busy_until_s = batch.end_s
            return []
        if self._mode is None:
            first = self.batches[0]
            self._mode = "exact"
            self._remaining, self._tolerances, self._counts, self._owners = [], [], [], []
            self._count, self._left, self._last_s = 0, {}, first.admit_s
            self._append_exact(first)
        if batch.admit_s < self._last_s:
            raise ValueError(f"link {self.name!r}: a batch admitted at {batch.admit_s} after one at {self._last_s}")
        earlier_ends = [(earlier, earlier.end_s) for earlier in watched]
        if self._mode == "exact":
            self._depart_exact_until(batch.admit_s)
            self._admit_exact(batch)
            if len(self._remaining) > EXACT_CLASS_LIMIT:
                self._to_virtual()
        else:
            self._advance_virtual_to(batch.admit_s)
            self._append_virtual(batch)
        left = self._left
        self.batches = [earlier for earlier in self.batches if left.get(id(earlier), 0) > 0] + [batch]
        if self._mode == "exact":
            self._project_exact()
        else:
            retimed = [earlier for earlier, _ in earlier_ends if left.get(id(earlier), 0) > 0] + [batch]
            for retimed_batch, end_s in zip(retimed, self._virtual_ends_s(retimed)):
                retimed_batch.end_s = end_s
            work = 0.0
            for level, _, count, _ in self._levels:
                work += count * (level - self._virtual)
            self.busy_until_s = self._last_s + max(work, 0.0) / self.bandwidth_bytes_per_s
        return [earlier for earlier, end_s in earlier_ends if earlier.end_s != end_s]

    # ------------------------------------------------------------ the event model's replay
    def _append_exact(self, batch: FlowBatch) -> None:
        sizes, counts, tolerances = size_classes(batch.sizes)
        self._remaining.extend(sizes)
        self._tolerances.extend(tolerances)
        self._counts.extend(counts)
        self._owners.extend([batch] * len(sizes))
        self._count += len(batch.sizes)
        self._left[id(batch)] = len(batch.sizes)

    def _admit_exact(self, batch: FlowBatch) -> None:
        """`ProcessorSharingLink._admit`: advance every flow to the admission, then add the batch's."""
        elapsed_s = batch.admit_s - self._last_s
        self._last_s = batch.admit_s
        if elapsed_s > 0 and self._count:
            sent = elapsed_s * self.bandwidth_bytes_per_s / self._count
            self._remaining = [value - sent for value in self._remaining]
        self._append_exact(batch)

    def _depart_exact_until(self, until_s: float) -> None:
        """Make final the departures before `until_s` (the event model's wake-ups in between)."""
        bandwidth = self.bandwidth_bytes_per_s
        while self._count:
            wake_s = self._last_s + max(min(self._remaining), 0.0) * self._count / bandwidth
            if wake_s >= until_s:  # an admission at the same instant comes first (module docstring)
                return
            self._step_exact(wake_s, final=True)

    def _step_exact(self, wake_s: float, *, final: bool) -> None:
        """`ProcessorSharingLink._on_wakeup`: advance every flow, end the smallest and those within tolerance."""
        elapsed_s = wake_s - self._last_s
        self._last_s = wake_s
        remaining = self._remaining
        if elapsed_s > 0:
            sent = elapsed_s * self.bandwidth_bytes_per_s / self._count
            remaining = [value - sent for value in remaining]
        smallest = min(remaining)
        kept_remaining, kept_tolerances, kept_counts, kept_owners = [], [], [], []
        left = self._left
        for value, tolerance, count, owner in zip(remaining, self._tolerances, self._counts, self._owners):
            if value <= smallest or value <= tolerance:
                self._count -= count
                key = id(owner)
                left[key] -= count
                if left[key] == 0:
                    owner.end_s = wake_s
                    if final:
                        del left[key]
            else:
                kept_remaining.append(value)
                kept_tolerances.append(tolerance)
                kept_counts.append(count)
                kept_owners.append(owner)
        self._remaining, self._tolerances, self._counts, self._owners = kept_remaining, kept_tolerances, kept_counts, kept_owners

    def _project_exact(self) -> None:
        """The departures after the latest admission, were nothing else to come (on a copy of the state)."""
        saved = (self._remaining, self._tolerances, self._counts, self._owners, self._count, dict(self._left), self._last_s)
        bandwidth = self.bandwidth_bytes_per_s
        while self._count:
            self._step_exact(self._last_s + max(min(self._remaining), 0.0) * self._count / bandwidth, final=False)
        self.busy_until_s = self._last_s
        self._remaining, self._tolerances, self._counts, self._owners, self._count, self._left, self._last_s = saved

    # ------------------------------------------------------------ virtual service time
    def _to_virtual(self) -> None:
        self._mode = "virtual"
        self._virtual = 0.0
        self._levels = sorted(
            ([value, tolerance, count, owner] for value, tolerance, count, owner in zip(self._remaining, self._tolerances, self._counts, self._owners)),
            key=_finish_level,
        )
        self._top = {}
        for level, _, _, owner in self._levels:
            self._top[id(owner)] = max(level, self._top.get(id(owner), -math.inf))
        self._remaining, self._tolerances, self._counts, self._owners = [], [], [], []

    def _append_virtual(self, batch: FlowBatch) -> None:
        sizes, counts, tolerances = size_classes(batch.sizes)
        virtual = self._virtual
        levels = self._levels
        for size, count, tolerance in zip(sizes, counts, tolerances):
            insort(levels, [virtual + size, tolerance, count, batch], key=_finish_level)
        self._count += len(batch.sizes)
        self._left[id(batch)] = len(batch.sizes)
        self._top[id(batch)] = virtual + sizes[-1]

    def _virtual_ends_s(self, batches: list) -> list:
        """When each batch's last flow leaves, were nothing else to come: every active flow is served
        until it leaves or the service level reaches the batch's largest finish level, whichever
        first. One pass over the classes serves every batch (by their top finish levels in order):
        transfers piling up across thousands of failures once made each admission cost batches ×
        classes with a pass per batch."""
        virtual, levels = self._virtual, self._levels
        total_count = 0
        for entry in levels:
            total_count += entry[2]
        ends = [0.0] * len(batches)
        below_work, below_count, index = 0.0, 0, 0
        for top, position in sorted((self._top[id(batch)], position) for position, batch in enumerate(batches)):
            while index < len(levels) and levels[index][0] < top:
                below_work += levels[index][2] * (levels[index][0] - virtual)
                below_count += levels[index][2]
                index += 1
            work = below_work + (total_count - below_count) * (top - virtual)
            ends[position] = self._last_s + max(work, 0.0) / self.bandwidth_bytes_per_s
        return ends

    def _advance_virtual_to(self, time_s: float) -> None:
        """Make final the departures before `time_s`, then bring the service level to `time_s`."""
        bandwidth = self.bandwidth_bytes_per_s
        levels, left = self._levels, self._left
        while levels:
            first = levels[0][0]
            departure_s = self._last_s + max(first - self._virtual, 0.0) * self._count / bandwidth
            if departure_s >= time_s:  # an admission at the same instant comes first (module docstring)
                break
            self._last_s, self._virtual = departure_s, max(first, self._virtual)
            while levels and (levels[0][0] <= self._virtual or levels[0][0] - self._virtual <= levels[0][1]):
                _, _, count, owner = levels.pop(0)
                self._count -= count
                key = id(owner)
                left[key] -= count
                if left[key] == 0:
                    owner.end_s = departure_s
                    del left[key], self._top[key]
        if self._count and time_s > self._last_s:
            self._virtual += (time_s - self._last_s) * bandwidth / self._count
        self._last_s = time_s


def _finish_level(entry: list) -> float:
    return entry[0]
