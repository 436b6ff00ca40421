"""Closed-form twins of `sim/model/methods/checkpointing.py`: synchronous checkpoints and restart recovery.

Each function mirrors one generator of the event model line by line, on the same objects
(`SyncCheckpointer`, `RestartRecovery`), so their state (committed progress, the stages being
restarted) is the one the policy keeps. A checkpoint write is one comparison: its end on idle links
(`TierTransfers.idle_end_s`, the event model's arithmetic) against the next failure; interrupted,
it is not committed and its flows are registered on their links (engine.py).
"""

from __future__ import annotations

from typing import Callable, Iterable

from churnsim.calibration.scenario import Scenario

from ..methods.checkpointing import CheckpointPolicy, RestartRecovery, SyncCheckpointer, stale_stage_loss_iterations
from .engine import ClosedFormPolicy, ClosedFormRun
from .transfers import TierTransfers


class SyncCheckpointerTwin:
    """`SyncCheckpointer.write`, `read` and `read_requests` on a `ClosedFormRun`."""

    def __init__(self, checkpointer: SyncCheckpointer, scenario: Scenario) -> None:
        self.checkpointer = checkpointer
        self.scenario = scenario
        tier = checkpointer.tier
        self.serialization_label = f"checkpoint serialization ({tier})"
        self.write_label = f"checkpoint write ({tier})"
        self.read_label = f"checkpoint read ({tier})"
        self.writes = TierTransfers(
            scenario, tier, "write", checkpointer.stages, [checkpointer.stage_bytes[stage] for stage in checkpointer.stages]
        )
        self._reads: dict[tuple[int, ...], TierTransfers] = {}
        self._all_stages = tuple(range(checkpointer.num_stages))

    def write(self, run: ClosedFormRun) -> None:
        checkpointer = self.checkpointer
        if checkpointer.serialization_s > 0:
            run.wait(checkpointer.serialization_s, "checkpoint_stall_s", self.serialization_label)
        run.links.wait_tier_group(self.writes, "checkpoint_stall_s", self.write_label)
        checkpointer.committed_progress = run.progress
        checkpointer.has_checkpoint = True
        checkpointer.num_written += 1
        checkpointer._origin = run.iterations_executed

    def reads(self, stages: Iterable[int]) -> TierTransfers:
        key = self._all_stages if isinstance(stages, range) and len(stages) == len(self._all_stages) else tuple(stages)
        transfers = self._reads.get(key)
        if transfers is None:
            checkpointer = self.checkpointer
            transfers = self._reads[key] = TierTransfers(
                self.scenario, checkpointer.tier, "read", key, [checkpointer.stage_bytes[stage] for stage in key]
            )
        return transfers

    def read_requests(self, run: ClosedFormRun, stages: Iterable[int]) -> list:
        if not self.checkpointer.has_checkpoint:
            return []
        return self.reads(stages).requests(run.links, run.node_generation)

    def read(self, stages: Iterable[int]) -> tuple[TierTransfers, str] | None:
        """What a restart of `stages` reads (its transfers and their label), None without a checkpoint."""
        if not self.checkpointer.has_checkpoint:
            return None
        return self.reads(stages), self.read_label


def recover(
    recovery: RestartRecovery,
    run: ClosedFormRun,
    failures,
    *,
    restore_progress: float,
    read: Callable[[Iterable[int]], tuple[TierTransfers, str] | None],
    handled_as: str | None = None,
) -> None:
    """`RestartRecovery.recover`: interrupted, it is called again with the new failures and merges them.
    `read(stages)` gives the checkpoint read of a restart of `stages` (transfers, label), or None."""
    label = handled_as or ("rollback" if recovery.rollback == "all" else "stage_reload")
    stages = recovery.stages
    if not stages:
        recovery._stale_iterations = max(run.progress - restore_progress, 0.0)
    for event in failures:
        run.record_failure(event, label)
        stages.add(event.stage)
    rollback_all = recovery.rollback == "all"
    if rollback_all:
        run.rollback_to(restore_progress)
    start_s = run.now
    ordered = tuple(sorted(stages))
    # What it reads is fixed before the waits: nothing they book moves a checkpoint or a restore point.
    reading = read(range(recovery.num_stages) if rollback_all else ordered)
    transfers, read_label = reading if reading is not None else (None, "")
    if not run.recover_unstopped(stages, recovery.restart_s, transfers, read_label):
        run.wait_for_replacements(stages)
        run.wait(recovery.restart_s, "recovery_downtime_s", "restart")
        if transfers is not None:
            run.links.wait_tier_group(transfers, "recovery_downtime_s", read_label)
    if not rollback_all:
        run.lose_iterations(stale_stage_loss_iterations(recovery._stale_iterations, len(stages), recovery.num_stages))
    span_label = _RESTART_LABELS.get(ordered)
    if span_label is None:
        span_label = _RESTART_LABELS[ordered] = f"restart of stages {list(ordered)}"
    run.span(span_label, "recovery", start_s)
    stages.clear()


_RESTART_LABELS: dict[tuple[int, ...], str] = {}


class CheckpointTwin(ClosedFormPolicy):
    """`CheckpointPolicy`: blocking checkpoints every K iterations, restart from the last one."""

    policy: CheckpointPolicy

    def __init__(self, policy: CheckpointPolicy, scenario: Scenario) -> None:
        super().__init__(policy, scenario)
        self.checkpointer = self.periodic_writer = SyncCheckpointerTwin(policy.checkpointer, scenario)

    def at_boundary(self, run: ClosedFormRun) -> None:
        self.checkpointer.write(run)

    def on_failures(self, run: ClosedFormRun, failures) -> None:
        checkpointer = self.policy.checkpointer
        checkpointer.node_lost()
        recover(self.policy.recovery, run, failures, restore_progress=checkpointer.committed_progress, read=self.checkpointer.read)
        checkpointer.restart_origin(run)  # type: ignore[arg-type]  # a run offers the RunContext API it uses
