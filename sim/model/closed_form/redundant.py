"""Closed-form twin of `sim/model/methods/redundant.py`: Bamboo-style redundancy with a checkpoint fallback.

The event model runs one process per replacement (wait for the node, restart, receive the stage's
and its successor's weights); here a replacement is a small object whose steps are background
callbacks on the engine's heap: its transfers start when the node is ready, and their completions
(timed on the node links, with any transfers of earlier replacements still in flight there) make
the stage healthy again, which re-times the chunk in progress exactly as the event model's
state-change interrupt does. The successor's replica changes no state: only the next failure reads
whether it has arrived (`RedundantPolicy.is_fatal`), so its transfer is a background group without
an event, and the replicas that have arrived by then are counted when a failure comes
(`_replicas_arrived`). Staleness changes only at failures, so this is what the event model's
`yield replica` decides at the replica's arrival.
"""

from __future__ import annotations

from churnsim.calibration.scenario import Scenario

from ..methods.base import stage_weight_bytes
from ..methods.redundant import RedundantPolicy
from .checkpointing import SyncCheckpointerTwin, recover
from .engine import ClosedFormPolicy, ClosedFormRun
from .transfers import TransferGroup


class RedundantTwin(ClosedFormPolicy):
    policy: RedundantPolicy

    def __init__(self, policy: RedundantPolicy, scenario: Scenario) -> None:
        super().__init__(policy, scenario)
        self.checkpointer = self.periodic_writer = SyncCheckpointerTwin(policy.checkpointer, scenario)
        self.restart_s = scenario.recovery.restart_s_for(policy.config.name)
        self.weight_bytes = tuple(stage_weight_bytes(scenario, stage) for stage in range(self.num_stages))
        self.awaiting_replica: list[_Replacement] = []
        """Replacements holding their own weights whose successor's replica (never None here) had not arrived then."""

    def at_boundary(self, run: ClosedFormRun) -> None:
        self.checkpointer.write(run)

    def finish(self, run: ClosedFormRun) -> None:
        self.awaiting_replica = []  # nothing reads them after the run; each holds the run

    def _replicas_arrived(self, run: ClosedFormRun) -> None:
        """The successor replicas that arrived before now: no longer missing, unless their
        replacement went stale first (a failure since, which came through here before it changed that)."""
        still_awaited = []
        for replacement in self.awaiting_replica:
            replica = replacement.replica
            assert replica is not None  # only a replacement with a successor awaits its replica
            if replica.end_s < run.now:  # one arriving as the failure strikes comes after it
                if not replacement.stale():
                    self.policy.replica_missing.discard(replacement.stage + 1)
            else:
                still_awaited.append(replacement)
        self.awaiting_replica = still_awaited

    def on_failures(self, run: ClosedFormRun, failures) -> None:
        policy = self.policy
        if self.awaiting_replica:
            self._replicas_arrived(run)
        if policy.restart.in_progress:
            self._restart(run, failures)
            return
        fatal = policy.admit_failures(failures, run.record_failure, lambda stage: self._start_replacement(run, stage))
        if fatal:
            policy.num_fatal += 1
            self._restart(run, tuple(fatal))
        else:
            run.set_pipeline_state(policy._state())

    def _restart(self, run: ClosedFormRun, failures) -> None:
        policy = self.policy
        policy._epoch += 1  # replacements in progress are taken over by the restart
        policy.checkpointer.node_lost()
        policy.restart.stages.update(policy.hosted_by)
        recover(
            policy.restart,
            run,
            failures,
            restore_progress=policy.checkpointer.committed_progress,
            read=self.checkpointer.read,
            handled_as="fatal_restart",
        )
        policy.after_fatal_restart(run)

    def _start_replacement(self, run: ClosedFormRun, stage: int) -> None:
        policy = self.policy
        policy._replacement_token[stage] += 1
        replacement = _Replacement(self, run, stage, policy._epoch, policy._replacement_token[stage], run.now)
        ready_s = run.down_until[stage] + self.restart_s
        now = run.now
        run.schedule(now + (ready_s - now) if ready_s > now else now, replacement.ready)


class _Replacement:
    """`RedundantPolicy._replace` for one replacement node: ready, then the stage's weights, then its successor's."""

    __slots__ = ("twin", "run", "stage", "epoch", "token", "failed_s", "replica")

    def __init__(self, twin: RedundantTwin, run: ClosedFormRun, stage: int, epoch: int, token: int, failed_s: float) -> None:
        self.twin = twin
        self.run = run
        self.stage = stage
        self.epoch = epoch
        self.token = token
        self.failed_s = failed_s
        self.replica: TransferGroup | None = None
        """The successor's replica on its way (a background group: its end follows the link)."""

    def stale(self) -> bool:
        policy = self.twin.policy
        return self.epoch != policy._epoch or self.token != policy._replacement_token[self.stage]

    def ready(self) -> None:
        if self.stale():
            return
        run, stage, weight_bytes = self.run, self.stage, self.twin.weight_bytes
        run.links.start_transfers([(run.links.node_link(stage - 1, stage), weight_bytes[stage])], on_done=self.own_done)
        if stage + 1 < self.twin.num_stages:
            self.replica = run.links.start_transfers([(run.links.node_link(stage + 1, stage), weight_bytes[stage + 1])], background=True)

    def own_done(self) -> None:
        if self.stale():
            return
        policy, run, stage = self.twin.policy, self.run, self.stage
        del policy.hosted_by[stage]
        run.set_pipeline_state(policy._state())
        run.span(f"stage {stage} run by node {stage - 1}", "degraded", self.failed_s, stage=stage)
        if self.replica is not None:
            if self.replica.end_s <= run.now:
                policy.replica_missing.discard(stage + 1)  # it has arrived: the process goes on at once
            else:
                self.twin.awaiting_replica.append(self)
