"""`async_checkpoint`: lazy asynchronous multi-level checkpointing (DataStates-LLM, HPDC'24).

At a boundary (every K executed iterations) each stage snapshots its state into a host buffer:
1. Back-pressure: each stage needs a free slot of its host buffer (`host_buffer_bytes`, default twice
   the stage checkpoint, i.e. two slots); if one is full, training blocks until a flush frees it.
2. The copy into host memory (stage checkpoint bytes over the `host_memory` tier's write bandwidth,
   instantaneous without such a tier) overlaps the next iteration's forward and backward; training
   blocks before the optimizer step only for the part not hidden:
   max(0, copy − (T_iter − optimizer_step_s)), the slowest stage's copy (checkpointing.md §6).
   Approximation: that stall is booked at the boundary, before the iteration it delays.
3. Background flushes through `levels` (default local disk, then remote). Level 1 is a per-stage
   FIFO: every snapshot is flushed, and its host slot is freed when it is on the first level. Each
   later level works in rounds: all stages send the newest snapshot complete at the level above
   (older waiting snapshots are superseded, as `keep_per_level` would drop them anyway), so a level
   that is slower than the interval skips checkpoints instead of building an unbounded backlog.
   A snapshot is durable at a level when every stage's part is there.
On failure: restart from the newest snapshot durable at a level that survives node loss (host memory
and local disk die with their node); all stages read their part from that level. Every snapshot not
yet durable there is abandoned (its in-flight transfers finish on links nobody uses any more).
`rollback = "stage"` as for `checkpoint` (see `checkpointing.py`).
Bytes and serialization come from the cost functions of `base.py`: the host buffer and the copy
hold one node's part (`checkpoint_part_bytes`, 1/DP of the stage under data-parallel sharding), each
level's links carry `tier_flow_bytes`, and a level with a serialization rate costs its flush
`serialization_s` first (a background cost; DataStates-LLM itself writes raw bytes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generator, Iterable

from simpy import AllOf

from ..links import relayed_event
from .base import RecoveryPolicy, checkpoint_part_bytes, serialization_s, tier_flow_bytes
from .checkpointing import RestartRecovery

if TYPE_CHECKING:
    from ..run_context import RunContext

HOST_MEMORY_TIER = "host_memory"


@dataclass(kw_only=True)
class _Snapshot:
    number: int
    progress: float
    epoch: int
    created_s: float
    ready_s: float
    """When the copy into host memory is complete."""
    parts_at_level: list[int] = field(default_factory=list)


MAX_HOST_BUFFER_SLOTS = 2**20
"""Snapshots a stage's host buffer holds at most, however small a snapshot: the cap binds only where
more than a million snapshots wait on flushes at once, and keeps the count a size the engines can
index (1e-300 checkpoint bytes a parameter made it 10^300, which the closed form's window could not hold)."""


class AsyncCheckpointPolicy(RecoveryPolicy):
    name = "async_checkpoint"

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self.levels = tuple(config.levels)
        # One node's part (host buffer, copy) and the bytes on each level's links (base.py: sharding).
        self.stage_bytes = tuple(checkpoint_part_bytes(scenario, stage) for stage in range(self.num_stages))
        self.level_bytes = tuple(tuple(tier_flow_bytes(scenario, stage, name) for stage in range(self.num_stages)) for name in self.levels)
        self.level_serialization_s = tuple(
            tuple(serialization_s(scenario, stage, name) for stage in range(self.num_stages)) for name in self.levels
        )
        self.slots_per_stage = tuple(
            2 if config.host_buffer_bytes is None else max(1, min(MAX_HOST_BUFFER_SLOTS, int(config.host_buffer_bytes // size)))
            for size in self.stage_bytes
        )
        names = {tier.name for tier in scenario.storage}
        self.host_tier = scenario.tier(HOST_MEMORY_TIER) if HOST_MEMORY_TIER in names else None
        self.surviving_levels = frozenset(
            index for index, name in enumerate(self.levels) if scenario.tier(name).survives_node_loss
        )
        self.recovery = RestartRecovery(scenario, rollback=config.rollback, method=config.name)
        self.restore_point: tuple[_Snapshot, int] | None = None
        """Newest snapshot durable at a level that survives node loss, and that level."""
        self.num_snapshots = 0
        self.num_durable = [0] * len(self.levels)
        self._epoch = 0
        self._origin = 0

    # ------------------------------------------------------------ per-epoch pipeline of flushes
    def on_start(self, context: "RunContext") -> None:
        self._reset(context)

    def _reset(self, context: "RunContext") -> None:
        """Forget every snapshot not yet durable at a surviving level and start fresh buffers and workers."""
        self._epoch += 1
        self._free_slots = list(self.slots_per_stage)
        self._slot_waiters: list[deque] = [deque() for _ in range(self.num_stages)]
        self._queues: list[deque] = [deque() for _ in range(self.num_stages)]
        self._queue_wakeups: list = [None] * self.num_stages
        self._level_candidate: list[_Snapshot | None] = [None] * len(self.levels)
        self._level_wakeups: list = [None] * len(self.levels)
        for stage in range(self.num_stages):
            context.env.process(self._first_level_flusher(context, stage, self._epoch))
        for level in range(1, len(self.levels)):
            context.env.process(self._level_rounds(context, level, self._epoch))

    def _acquire_slot(self, context: "RunContext", stage: int):
        event = context.env.event()
        if self._free_slots[stage] > 0:
            self._free_slots[stage] -= 1
            event.succeed()
        else:
            self._slot_waiters[stage].append(event)
        return event

    def _release_slot(self, stage: int) -> None:
        waiters = self._slot_waiters[stage]
        if waiters:
            waiters.popleft().succeed()  # the slot passes straight to the waiting snapshot
        else:
            self._free_slots[stage] += 1

    def _first_level_flusher(self, context: "RunContext", stage: int, epoch: int) -> Generator:
        env, queue = context.env, self._queues[stage]
        while True:
            while not queue:
                wakeup = env.event()
                self._queue_wakeups[stage] = wakeup
                yield wakeup
                if epoch != self._epoch:
                    return
            snapshot = queue.popleft()
            if snapshot.ready_s > env.now:
                yield env.timeout(snapshot.ready_s - env.now)
            if epoch != self._epoch:
                return
            if self.level_serialization_s[0][stage] > 0:
                yield env.timeout(self.level_serialization_s[0][stage])
                if epoch != self._epoch:
                    return
            yield context.tier_link(self.levels[0], "write", stage, generation=epoch).transfer(self.level_bytes[0][stage])
            if epoch != self._epoch:
                return
            self._release_slot(stage)
            snapshot.parts_at_level[0] += 1
            if snapshot.parts_at_level[0] == self.num_stages:
                self._durable(context, snapshot, 0)

    def _level_rounds(self, context: "RunContext", level: int, epoch: int) -> Generator:
        env, last_number = context.env, -1
        while True:
            candidate = self._level_candidate[level]
            if candidate is None or candidate.number <= last_number:
                wakeup = env.event()
                self._level_wakeups[level] = wakeup
                yield wakeup
                if epoch != self._epoch:
                    return
                continue
            last_number = candidate.number
            name = self.levels[level]
            if max(self.level_serialization_s[level]) > 0:
                yield env.timeout(max(self.level_serialization_s[level]))
                if epoch != self._epoch:
                    return
            yield context.all_transfers_done(
                (context.tier_link(name, "write", stage, generation=epoch), size) for stage, size in enumerate(self.level_bytes[level])
            )
            if epoch != self._epoch:
                return
            candidate.parts_at_level[level] = self.num_stages
            self._durable(context, candidate, level)

    def _durable(self, context: "RunContext", snapshot: _Snapshot, level: int) -> None:
        self.num_durable[level] += 1
        context.span(
            f"checkpoint {snapshot.number} durable at {self.levels[level]}",
            "flush",
            snapshot.created_s,
            track=f"storage tier {self.levels[level]}",
        )
        if level in self.surviving_levels:
            if self.restore_point is None or snapshot.number > self.restore_point[0].number:
                self.restore_point = (snapshot, level)
        following = level + 1
        if following < len(self.levels):
            self._level_candidate[following] = snapshot
            wakeup = self._level_wakeups[following]
            if wakeup is not None and not wakeup.triggered:
                wakeup.succeed()

    # ------------------------------------------------------------ hooks
    def iterations_until_boundary(self, context: "RunContext") -> int:
        return self.config.interval_iterations - (context.iterations_executed - self._origin)

    def copy_s(self, stage: int) -> float:
        if self.host_tier is None:
            return 0.0
        return self.host_tier.total_latency_s + self.stage_bytes[stage] / self.host_tier.write_bandwidth_bytes_per_s

    def at_boundary(self, context: "RunContext") -> Generator:
        if all(free > 0 for free in self._free_slots):
            # Every slot is free: the slot events would all fire at once, one after another, so a
            # relayed pair stands in for them and their AllOf (same instant, same event order).
            for stage in range(self.num_stages):
                self._free_slots[stage] -= 1
            first, slots_ready = relayed_event(context.env)
            first.succeed()
        else:
            slots_ready = AllOf(context.env, [self._acquire_slot(context, stage) for stage in range(self.num_stages)])
        yield from context.wait(slots_ready, "checkpoint_stall_s", "host buffer full")
        copy_s = max(self.copy_s(stage) for stage in range(self.num_stages))
        hidden_s = max(context.iteration_time_s - self.scenario.compute.optimizer_step_s, 0.0)
        created_s = context.now
        yield from context.wait(max(0.0, copy_s - hidden_s), "checkpoint_stall_s", "snapshot copy not hidden")
        self.num_snapshots += 1
        snapshot = _Snapshot(
            number=self.num_snapshots,
            progress=context.progress,
            epoch=self._epoch,
            created_s=created_s,
            ready_s=created_s + copy_s,
            parts_at_level=[0] * len(self.levels),
        )
        for stage in range(self.num_stages):
            self._queues[stage].append(snapshot)
            wakeup = self._queue_wakeups[stage]
            if wakeup is not None and not wakeup.triggered:
                wakeup.succeed()
        self._origin = context.iterations_executed

    def _read(self, context: "RunContext", stages: Iterable[int]) -> Generator:
        if self.restore_point is None:
            return
        level = self.restore_point[1]
        level_name = self.levels[level]
        reads = context.all_transfers_done((context.tier_link(level_name, "read", stage), self.level_bytes[level][stage]) for stage in stages)
        yield from context.wait(reads, "recovery_downtime_s", f"checkpoint read ({level_name})")

    def on_failures(self, context: "RunContext", failures) -> Generator:
        self._reset(context)
        restore_progress = 0.0 if self.restore_point is None else self.restore_point[0].progress
        yield from self.recovery.recover(context, failures, restore_progress=restore_progress, read=self._read)
        self._origin = context.iterations_executed
