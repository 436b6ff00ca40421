"""`redundant`: Bamboo-style redundant computation (Thorpe et al., NSDI'23), with a checkpoint fallback.

Healthy iterations run with `redundant_forward=True`: stage s holds a replica of stage s + 1 and runs
its forward in idle time (the iteration model prices that). A failure of stage s ≥ 1 loses nothing:
the node of s − 1 runs both stages (a degraded pipeline state, `node_of_stage[s] = s − 1`) while
training goes on; once the replacement has joined, restarted (`recovery.restart_s`) and received
stage s's weights from s − 1, the pipeline is healthy again. In parallel the new node receives the
weights of s + 1 (its replica); until that arrives, a failure of s + 1 has no replica.

Fatal (choices documented here) ⇒ restart from the fallback checkpoint (`rollback = "all"`):
- stage 0 fails: nobody holds its replica (the last stage holds none, as in the iteration model,
  which runs no redundant forward on the last stage);
- the predecessor s − 1 is itself down (run by s − 2), or has no current replica of s yet;
- s was running s + 1 (two coordinates on the lost node, Bamboo's fatal case).
A failure of a replacement that joined but has not taken over yet only restarts that replacement.
The fallback checkpoints are synchronous writes every `fallback_interval_iterations` to
`fallback_tier`, and their stalls are charged as checkpoint stalls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator

from .base import RecoveryPolicy, stage_weight_bytes
from .checkpointing import RestartRecovery, SyncCheckpointer

if TYPE_CHECKING:
    from ..run_context import RunContext


class RedundantPolicy(RecoveryPolicy):
    name = "redundant"
    redundant_forward = True

    def __init__(self, config, scenario) -> None:
        super().__init__(config, scenario)
        self.checkpointer = SyncCheckpointer(
            scenario, tier=config.fallback_tier, interval_iterations=config.fallback_interval_iterations
        )
        self.restart = RestartRecovery(scenario, rollback="all", method=config.name)
        self.hosted_by: dict[int, int] = {}
        """Lost stage → the stage whose node runs it meanwhile."""
        self.replica_missing: set[int] = set()
        """Stages whose predecessor has no current replica of them (its replacement is still receiving it)."""
        self._epoch = 0
        self._replacement_token = [0] * self.num_stages
        self.num_fatal = 0

    def iterations_until_boundary(self, context: "RunContext") -> int:
        return self.checkpointer.iterations_until(context)

    def at_boundary(self, context: "RunContext") -> Generator:
        yield from self.checkpointer.write(context)

    def after_fatal_restart(self, context) -> None:
        """Back to the healthy pipeline after a checkpoint restart: no stage hosted, every replica
        current, checkpoint intervals counted from here. Shared with the closed-form twin."""
        self.hosted_by.clear()
        self.replica_missing.clear()
        context.set_pipeline_state(self.healthy_state())
        self.checkpointer.restart_origin(context)

    def admit_failures(self, failures, record_failure, start_replacement) -> list:
        """Go degraded for each failure a predecessor can take over, starting its replacement; return
        the fatal ones (they need a restart). Shared by the event model and its closed-form twin."""
        fatal = []
        for event in sorted(failures, key=lambda event: event.stage):
            stage = event.stage
            if stage in self.hosted_by:
                record_failure(event, "replacement_lost")
                start_replacement(stage)
            elif self.is_fatal(stage):
                fatal.append(event)
            else:
                record_failure(event, "degraded")
                self.hosted_by[stage] = stage - 1
                if stage + 1 < self.num_stages:
                    self.replica_missing.add(stage + 1)
                start_replacement(stage)
        return fatal

    def is_fatal(self, stage: int) -> bool:
        return (
            stage == 0
            or (stage - 1) in self.hosted_by
            or stage in self.replica_missing
            or (stage + 1) in self.hosted_by
        )

    def _state(self):
        if not self.hosted_by:
            return self.healthy_state()
        stages = range(self.num_stages)
        return self.healthy_state(tuple(map(self.hosted_by.get, stages, stages)))

    def on_failures(self, context: "RunContext", failures) -> Generator:
        if self.restart.in_progress:
            yield from self._restart(context, failures)
            return
        fatal = self.admit_failures(failures, context.record_failure, lambda stage: self._start_replacement(context, stage))
        if fatal:
            self.num_fatal += 1
            yield from self._restart(context, tuple(fatal))
        else:
            context.set_pipeline_state(self._state())

    def _restart(self, context: "RunContext", failures) -> Generator:
        self._epoch += 1  # replacements in progress are taken over by the restart
        self.checkpointer.node_lost()
        self.restart.stages.update(self.hosted_by)
        yield from self.restart.recover(
            context,
            failures,
            restore_progress=self.checkpointer.committed_progress,
            read=self.checkpointer.read,
            handled_as="fatal_restart",
        )
        self.after_fatal_restart(context)

    def _start_replacement(self, context: "RunContext", stage: int) -> None:
        self._replacement_token[stage] += 1
        context.env.process(self._replace(context, stage, self._epoch, self._replacement_token[stage], context.now))

    def _replace(self, context: "RunContext", stage: int, epoch: int, token: int, failed_s: float) -> Generator:
        def stale() -> bool:
            return epoch != self._epoch or token != self._replacement_token[stage]

        ready_s = context.down_until[stage] + self.scenario.recovery.restart_s_for(self.config.name)
        if ready_s > context.now:
            yield context.env.timeout(ready_s - context.now)
        if stale():
            return
        own = context.node_link(stage - 1, stage).transfer(stage_weight_bytes(self.scenario, stage))
        successor = stage + 1
        replica = (
            context.node_link(successor, stage).transfer(stage_weight_bytes(self.scenario, successor))
            if successor < self.num_stages
            else None
        )
        yield own
        if stale():
            return
        del self.hosted_by[stage]
        context.set_pipeline_state(self._state())
        context.span(f"stage {stage} run by node {stage - 1}", "degraded", failed_s, stage=stage)
        if replica is not None:
            yield replica
            if stale():
                return
            self.replica_missing.discard(successor)
