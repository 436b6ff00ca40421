"""Closed-form twin of `sim/model/methods/async_checkpoint.py`: the lazy flush pipeline as a recurrence.

The event model runs one flusher process per stage for the first level and one round process per
later level. Between failures they do not interact with anything but each other, so their times
follow from the snapshots' times alone:

- first level, stage s (a FIFO on the stage's own link): snapshot n is taken from the queue at
  p = the end of the stage's previous flush, or the snapshot's append time if the flusher was idle;
  its flush starts when the host copy is ready (`ready_s`), after the tier's serialization, and ends
  one latency plus bytes / bandwidth later. Its host slot is freed then; the snapshot is durable at
  the first level when every stage's part is there (the latest of the stages' ends). When every
  flusher is idle at the append (the usual case), all stages take the snapshot at the same instant
  and the durable instant is one expression, not one per stage.
- back-pressure: with m slots per stage, snapshot k of an epoch gets stage s's slot when snapshot
  k − m has left the host buffer of s: at max(boundary, its first-level end on s).
- later levels (rounds): a level that is idle at time f starts a round at f with the newest snapshot
  durable at the level above by then, else at the next such durable instant; the round's transfers
  (all stages at once, on per-stage links or one shared link) end at the event model's instant
  (`TierTransfers.idle_end_s`: these links carry nothing else), and the snapshot is durable there.

`_advance_flushes(t)` books every durable instant up to t (spans, counters, the restore point) and
runs at each failure (whose restore point is the newest snapshot durable at a surviving level) and
at the end of the run. A failure starts a new epoch: unfinished flushes are abandoned, on links
nobody uses again (the event model keys them by epoch), so they are simply dropped.

Falls back to the event model (`NeedsEventModel`): a level named twice in `levels` (its flushes and
rounds would share links), and a first level on a `shared` tier when a snapshot arrives while the
previous one's flushes are still running (flushes of two snapshots sharing one link).

Approximation: when a round ends at the very instant (to the bit) another snapshot becomes durable
one level up, the closed form counts that snapshot as there, so the next round takes it; the event
model decides by which of the two completions SimPy processes first (when each was scheduled, how
many relay events stand between), so it may take the older one. Such exact coincidences need
commensurate flush times (round-number bandwidths and sizes); the differential test keeps them out
with generic bandwidths, as real scenarios do.
"""

from __future__ import annotations

import math
from collections import deque

from churnsim.calibration.scenario import Scenario

from ..methods.async_checkpoint import AsyncCheckpointPolicy
from .checkpointing import recover
from .engine import ClosedFormPolicy, ClosedFormRun
from .interrupts import NeedsEventModel
from .transfers import TierTransfers
from .fluid_links import FlowBatch, FluidLink


class _Snapshot:
    __slots__ = ("number", "progress", "created_s", "ready_s", "append_s", "flush_start_s", "stage_ends_s", "durable_s", "marker")

    def __init__(self, number: int, progress: float, created_s: float, ready_s: float, append_s: float, marker: int) -> None:
        self.number = number
        self.progress = progress
        self.created_s = created_s
        self.ready_s = ready_s
        self.append_s = append_s
        self.flush_start_s = math.nan
        """When every stage's first-level flush started (all flushers idle), else NaN."""
        self.stage_ends_s: list[float] | None = None
        """Per stage, the end of its first-level flush (None: follows from `flush_start_s`)."""
        self.durable_s = math.nan
        """When it is durable at the first level."""
        self.marker = marker
        """Timeline spans booked before it was handed to the flushers (its durable spans come after)."""


class _LevelWorker:
    """The round process of one later level (its state between rounds)."""

    __slots__ = ("free_s", "round", "candidates", "transfers", "serialization_s")

    def __init__(self, transfers: TierTransfers, serialization_s: float) -> None:
        self.free_s = -math.inf
        self.round: tuple[_Snapshot, float] | None = None
        self.candidates: deque[tuple[_Snapshot, float]] = deque()
        """Snapshots durable at the level above, with that instant, not yet considered."""
        self.transfers = transfers
        self.serialization_s = serialization_s


class AsyncCheckpointTwin(ClosedFormPolicy):
    policy: AsyncCheckpointPolicy

    def __init__(self, policy: AsyncCheckpointPolicy, scenario: Scenario) -> None:
        super().__init__(policy, scenario)
        num_stages = self.num_stages
        self.levels = policy.levels
        self.copy_s = max(policy.copy_s(stage) for stage in range(num_stages))
        self.optimizer_step_s = scenario.compute.optimizer_step_s
        first = scenario.tier(self.levels[0])
        self.first_bandwidth_bytes_per_s = float(first.write_bandwidth_bytes_per_s)
        self.first_latency_s = float(first.total_latency_s)
        self.first_shared = first.shared
        self.first_bytes = tuple(policy.level_bytes[0])
        self.first_serialization_s = tuple(policy.level_serialization_s[0])
        # One flow per stage link: the flush ends at admit + bytes × 1 / bandwidth (sim/model/links.py).
        self.first_flow_s = tuple(
            max(size, 0.0) * 1 / self.first_bandwidth_bytes_per_s if size > 0 and self.first_bandwidth_bytes_per_s != math.inf else None
            for size in self.first_bytes
        )
        self.uniform_first_level = not self.first_shared and all(value == 0 for value in self.first_serialization_s) and all(
            flow_s is not None for flow_s in self.first_flow_s
        )
        self.longest_first_flow_s = max((flow_s for flow_s in self.first_flow_s if flow_s is not None), default=0.0)
        self.level_transfers = tuple(
            TierTransfers(scenario, name, "write", range(num_stages), policy.level_bytes[level]) for level, name in enumerate(self.levels)
        )
        self.durable_labels = tuple((f"durable at {name}", f"storage tier {name}") for name in self.levels)
        self._read_transfers: dict[tuple[int, tuple[int, ...]], TierTransfers] = {}
        self.read_labels = tuple(f"checkpoint read ({name})" for name in self.levels)
        self.max_slots = max(policy.slots_per_stage)
        self.restore: tuple[_Snapshot, int] | None = None
        self._recent: deque[_Snapshot] = deque(maxlen=self.max_slots)
        """The epoch's latest snapshots (back-pressure looks `slots` snapshots back)."""
        self._pending_first: deque[_Snapshot] = deque()
        """Snapshots on their way to the first level (their durable instant is known, not yet booked)."""
        self._workers = {
            level: _LevelWorker(self.level_transfers[level], max(policy.level_serialization_s[level])) for level in range(1, len(self.levels))
        }
        """The round process of each level after the first."""
        self._reset_epoch()

    # ------------------------------------------------------------ epochs
    def _reset_epoch(self) -> None:
        """A new epoch: what was not durable at a level that survives is abandoned. The flushers'
        state is cleared, not rebuilt (the event model starts new processes at every failure)."""
        self._recent.clear()
        self._pending_first.clear()
        for worker in self._workers.values():
            worker.free_s = -math.inf
            worker.round = None
            worker.candidates.clear()
        self._num_epoch_snapshots = 0
        self._first_level_free_s = -math.inf
        """When the last first-level flush of the epoch ends (every stage is idle from then)."""
        self._last: _Snapshot | None = None

    def on_start(self, run: ClosedFormRun) -> None:
        if len(set(self.levels)) < len(self.levels):
            raise NeedsEventModel(f"async_checkpoint levels {list(self.levels)} name a tier twice: flushes would share its links")
        self.policy._epoch += 1

    # ------------------------------------------------------------ the first level
    def _stage_end_s(self, snapshot: _Snapshot, stage: int) -> float:
        if snapshot.stage_ends_s is not None:
            return snapshot.stage_ends_s[stage]
        return self._first_end_s(snapshot.flush_start_s, stage)

    def _first_end_s(self, start_s: float, stage: int) -> float:
        """End of stage `stage`'s first-level flush taken up at `start_s` (the host copy ready)."""
        serialization_s = self.first_serialization_s[stage]
        if serialization_s > 0:
            start_s = start_s + serialization_s
        latency_s = self.first_latency_s
        flow_s = self.first_flow_s[stage]
        if flow_s is None:  # zero bytes or an infinite bandwidth: only the latency
            return start_s + latency_s
        admit_s = start_s + latency_s if latency_s > 0 else start_s
        return admit_s + flow_s

    def _flush_first_level(self, snapshot: _Snapshot) -> None:
        append_s, ready_s = snapshot.append_s, snapshot.ready_s
        num_stages = self.num_stages
        if self._first_level_free_s <= append_s:
            # Every flusher is idle: each takes the snapshot at its append and waits for the copy.
            start_s = append_s + (ready_s - append_s) if ready_s > append_s else append_s
            if self.uniform_first_level:
                latency_s = self.first_latency_s
                snapshot.flush_start_s = start_s
                snapshot.durable_s = (start_s + latency_s if latency_s > 0 else start_s) + self.longest_first_flow_s
            elif self.first_shared:
                snapshot.stage_ends_s = self._shared_first_level_ends(start_s)
                snapshot.durable_s = max(snapshot.stage_ends_s)
            else:
                snapshot.stage_ends_s = [self._first_end_s(start_s, stage) for stage in range(num_stages)]
                snapshot.durable_s = max(snapshot.stage_ends_s)
        else:
            if self.first_shared:
                raise NeedsEventModel("async_checkpoint: first-level flushes of two snapshots would share one link")
            previous = self._last
            assert previous is not None
            ends = []
            for stage in range(num_stages):
                free_s = self._stage_end_s(previous, stage)
                taken_s = free_s if append_s <= free_s else append_s
                start_s = taken_s + (ready_s - taken_s) if ready_s > taken_s else taken_s
                ends.append(self._first_end_s(start_s, stage))
            snapshot.stage_ends_s = ends
            snapshot.durable_s = max(ends)
        self._first_level_free_s = snapshot.durable_s
        self._last = snapshot
        self._recent.append(snapshot)
        self._num_epoch_snapshots += 1
        self._pending_first.append(snapshot)

    def _shared_first_level_ends(self, start_s: float) -> list[float]:
        """All stages flush one snapshot over one shared link (started together, after their serialization)."""
        link = FluidLink(bandwidth_bytes_per_s=self.first_bandwidth_bytes_per_s, latency_s=self.first_latency_s, name=self.levels[0])
        ends: list[float] = [0.0] * self.num_stages
        batches: list[tuple[int, FlowBatch]] = []
        for stage in range(self.num_stages):
            begin_s = start_s + self.first_serialization_s[stage] if self.first_serialization_s[stage] > 0 else start_s
            size = self.first_bytes[stage]
            if size <= 0 or link.instant:
                ends[stage] = begin_s + link.latency_s
                continue
            admit_s = begin_s + link.latency_s if link.latency_s > 0 else begin_s
            batches.append((stage, FlowBatch(admit_s, (size,), None, link)))
        for stage, batch in sorted(batches, key=lambda pair: pair[1].admit_s):
            link.add(batch)
        for stage, batch in batches:
            ends[stage] = batch.end_s
        return ends

    def _slots_free_s(self, boundary_s: float) -> float:
        """When the new snapshot holds a host slot on every stage (`boundary_s` if all are free)."""
        if self._first_level_free_s <= boundary_s:
            return boundary_s
        acquired_s = boundary_s
        count = self._num_epoch_snapshots
        recent = self._recent
        for stage, slots in enumerate(self.policy.slots_per_stage):
            if count >= slots:
                end_s = self._stage_end_s(recent[-slots], stage)
                if end_s > acquired_s:
                    acquired_s = end_s
        return acquired_s

    # ------------------------------------------------------------ durable instants
    def _advance_flushes(self, run: ClosedFormRun, until_s: float, *, before_failure: bool = False) -> None:
        """Book the durable instants up to `until_s`; before a failure at `until_s`, only those before
        it: a flush ending as the failure strikes comes after it (sim/model/run.py, coinciding instants)."""
        if before_failure:
            until_s = math.nextafter(until_s, -math.inf)
        pending = self._pending_first
        while pending and pending[0].durable_s <= until_s:
            snapshot = pending.popleft()
            self._durable(run, snapshot, 0, snapshot.durable_s)
        for level in range(1, len(self.levels)):
            worker = self._workers[level]
            while True:
                if worker.round is not None:
                    snapshot, end_s = worker.round
                    if end_s > until_s:
                        break
                    worker.round = None
                    worker.free_s = end_s
                    self._durable(run, snapshot, level, end_s)
                    continue
                candidates = worker.candidates
                chosen = None
                while candidates and candidates[0][1] <= worker.free_s:
                    chosen = candidates.popleft()  # the newest durable above by now supersedes older ones
                if chosen is not None:
                    start_s = worker.free_s
                elif candidates and candidates[0][1] <= until_s:
                    chosen = candidates.popleft()
                    start_s = chosen[1]
                else:
                    break
                if worker.serialization_s > 0:
                    start_s = start_s + worker.serialization_s
                worker.round = (chosen[0], worker.transfers.idle_end_s(start_s))

    def _durable(self, run: ClosedFormRun, snapshot: _Snapshot, level: int, time_s: float) -> None:
        policy = self.policy
        policy.num_durable[level] += 1
        label, track = self.durable_labels[level]
        run.background_timeline.extend((f"checkpoint {snapshot.number} {label}", "flush", -1, snapshot.created_s, time_s, track, snapshot.marker))
        if level in policy.surviving_levels:
            if self.restore is None or snapshot.number > self.restore[0].number:
                self.restore = (snapshot, level)
        following = level + 1
        if following < len(self.levels):
            self._workers[following].candidates.append((snapshot, time_s))

    # ------------------------------------------------------------ hooks
    def at_boundary(self, run: ClosedFormRun) -> None:
        policy = self.policy
        run.wait_until(self._slots_free_s(run.now), "checkpoint_stall_s", "host buffer full")
        hidden_s = max(run.iteration_time_s - self.optimizer_step_s, 0.0)
        created_s = run.now
        run.wait(max(0.0, self.copy_s - hidden_s), "checkpoint_stall_s", "snapshot copy not hidden")
        policy.num_snapshots += 1
        snapshot = _Snapshot(policy.num_snapshots, run.progress, created_s, created_s + self.copy_s, run.now, len(run.timeline) // 6)
        self._flush_first_level(snapshot)
        policy._origin = run.iterations_executed

    def cycles(self, run: ClosedFormRun) -> None:
        """Whole cycles of (iterations up to the next snapshot, the snapshot) that nothing can stop, inline.

        `_train_loop`'s chunk and `at_boundary` in the usual case: the healthy state, every first-level
        flusher idle at the boundary (so every host slot is free), the snapshot copy hidden behind
        the iteration, a first level of per-stage links. Every step is the one the general path
        takes, booked alike; it returns, having booked nothing of it, at the first part that differs.
        """
        copy_s = self.copy_s
        if not self.uniform_first_level or run._state is not run.healthy_state:
            return
        if copy_s > max(run.iteration_time_s - self.optimizer_step_s, 0.0):
            return  # the copy is not hidden behind the iteration: a wait the general path books
        policy = self.policy
        timeline = run.timeline
        latency_s = self.first_latency_s
        longest_first_flow_s = self.longest_first_flow_s
        recent, pending_first = self._recent, self._pending_first

        def snapshot() -> bool:
            now = run.now
            if self._first_level_free_s > now:
                return False  # a flush still running: host slots and flush queues, the general path
            # `at_boundary` and `_flush_first_level` for idle flushers: every stage takes the
            # snapshot at once and waits for its host copy.
            policy.num_snapshots += 1
            ready_s = now + copy_s
            taken = _Snapshot(policy.num_snapshots, run.progress, now, ready_s, now, len(timeline) // 6)
            start_s = now + (ready_s - now) if ready_s > now else now
            taken.flush_start_s = start_s
            taken.durable_s = self._first_level_free_s = (start_s + latency_s if latency_s > 0 else start_s) + longest_first_flow_s
            self._last = taken
            recent.append(taken)
            self._num_epoch_snapshots += 1
            pending_first.append(taken)
            policy._origin = run.iterations_executed
            return True

        run.run_cycles(policy.config.interval_iterations, lambda: policy._origin, snapshot)  # type: ignore[attr-defined]  # its config's

    def _read(self, stages) -> tuple[TierTransfers, str] | None:
        """The read of a restart of `stages` from the restore point's level (None: there is none)."""
        if self.restore is None:
            return None
        level = self.restore[1]
        key = (level, tuple(stages))
        transfers = self._read_transfers.get(key)
        if transfers is None:
            sizes = [self.policy.level_bytes[level][stage] for stage in key[1]]
            transfers = self._read_transfers[key] = TierTransfers(self.scenario, self.levels[level], "read", key[1], sizes)
        return transfers, self.read_labels[level]

    def on_failures(self, run: ClosedFormRun, failures) -> None:
        self._advance_flushes(run, run.now, before_failure=True)
        self.policy._epoch += 1
        self._reset_epoch()
        restore_progress = 0.0 if self.restore is None else self.restore[0].progress
        recover(self.policy.recovery, run, failures, restore_progress=restore_progress, read=self._read)
        self.policy._origin = run.iterations_executed

    def finish(self, run: ClosedFormRun) -> None:
        self._advance_flushes(run, run.now)
