"""`redundant`: Bamboo-style redundancy (Thorpe et al., NSDI'23), with a checkpoint fallback.

Stage s holds a replica of stage s + 1: its weights and its optimizer state.
- Cost, as Bamboo pays it: after each forward hop stage s runs stage s + 1's blocks on its own
  output with the replica weights (`after_forward_hop`; no_grad, result discarded). This is real
  extra compute; Bamboo schedules it in pipeline bubbles, here it simply runs on the stage. The
  last stage's final norm and lm_head are not run redundantly (they need the targets).
- Keeping the replica current: Bamboo keeps it current by redundant computation (it also runs the
  redundant backward and update). We instead copy: after every optimizer step stage s + 1 sends its
  weights and optimizer state to stage s over the process group (real bytes). The copy is exact,
  simpler, and costs a transfer of the stage's state per iteration instead of the redundant
  backward. At the start no copy is needed: s builds the replica from the same seeded init.
- A failure of stage s ≥ 1 whose predecessor survived: s − 1 sends the replica (weights +
  optimizer state) to the replacement, which continues exactly where the lost node was: no
  rollback, no setback. The replacement then receives its own replica of s + 1. Under soft
  failures the degraded phase (s − 1 running both stages until the replacement joins) has zero
  length: the replacement is there at once.
- Degraded phase (hard failures, `runs_degraded`): while the replacement process of s starts, the
  survivors re-form without it and s − 1 runs stage s itself from its replica (`enter_degraded`):
  the replica's weights and optimizer state become a trained stage, forward, backward and update,
  on s − 1's process (the pipeline merges the two stages, real/pipeline.py). Replicas whose holder
  is gone are not refreshed meanwhile; s − 1 writes the fallback checkpoints of s into s's own
  directory, so that a fatal failure later still finds a recent checkpoint every stage holds. When the
  replacement has joined, s − 1 hands it the state it trained (`leave_degraded`, then `recover`):
  again no rollback, and no iteration lost while the replacement came up.
- Fatal (as in sim/methods/redundant.py): stage 0 fails (nobody holds its replica; the last stage
  holds none), or two adjacent stages fail together (the replica holder is lost with the owner).
  Then every stage falls back to the synchronous checkpoints taken every
  `fallback_interval_iterations` to `fallback_tier` with rollback `all` (the `CheckpointKeeper` of
  `checkpoint`), and every replica is refreshed from the restored state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from churnsim.calibration.pipeline_schedule import Hop

from ..model import StageModule
from .base import METHOD_TAG_BASE, MethodContext, RecoveryMethod, RecoveryOutcome, StageRuntime
from .checkpointing import CheckpointDirectories, CheckpointKeeper, synchronous_engine
from .stage_state import MODULE_PREFIX, StateSender, capture_stage_state, receive_state, restore_stage_state

_REFRESH_TAG = METHOD_TAG_BASE + (1 << 23)
_TAKEOVER_TAG = _REFRESH_TAG + 64


def is_fatal(failed_stages: frozenset[int]) -> bool:
    """Stage 0 lost, or a lost stage whose predecessor (its replica holder) is lost too."""
    return 0 in failed_stages or any(stage - 1 in failed_stages for stage in failed_stages)


class RedundantMethod(RecoveryMethod):
    name: ClassVar[str] = "redundant"
    resumable: ClassVar[bool] = True  # its fallback checkpoints hold every stage
    runs_degraded: ClassVar[bool] = True

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        directories = CheckpointDirectories(context)
        self.fallback = CheckpointKeeper(
            context,
            synchronous_engine(context, directories, config.fallback_tier),
            directories,
            interval_iterations=config.fallback_interval_iterations,
            rollback="all",
        )
        self.successor = context.stage + 1 if context.stage + 1 < context.num_stages else None
        self.replica: StageModule | None = None
        self.replica_state: dict[str, Any] | None = None
        """The successor's latest state (weights + optimizer) as received; None = no replica held."""
        if self.successor is not None:
            # Everyone starts from the seeded init, so the replica starts exact without a transfer.
            self.replica = StageModule(context.model_config, self.successor, context.num_stages, seed=context.seed)
            self.replica.to(context.device).requires_grad_(False)
            self.replica_state = {MODULE_PREFIX + k: v for k, v in self.replica.state_dict().items()}
        self.hosted: StageRuntime | None = None
        """The successor's stage, run here from the replica while its process is down (degraded)."""
        self.hosted_fallback: CheckpointKeeper | None = None
        """The fallback checkpoints of the hosted stage, written here while it is hosted."""

    # -- steady state ---------------------------------------------------------------------------

    def after_forward_hop(
        self,
        *,
        iteration: int,
        microbatch: int,
        hop_index: int,
        hop: Hop,
        hop_input: torch.Tensor | None,
        hop_output: torch.Tensor,
    ) -> None:
        if self.replica is None or hop.runs_head or hop.stage != self.context.stage or self.hosted is not None:
            return  # only after this stage's own hops; while degraded the replica runs for real
        with self.context.spans.span("redundant_forward", microbatch=microbatch), torch.no_grad():
            self.replica.run_blocks(hop_output.detach())  # Bamboo's extra forward; the result is not used

    def after_optimizer_step(self, iteration: int) -> None:
        self.fallback.after_optimizer_step(iteration)
        if self.hosted_fallback is not None:
            self.hosted_fallback.after_optimizer_step(iteration)
        present = set(self.context.communicator.group_stages)
        with self.context.spans.span("replica_refresh"):
            # Only pairs whose owner and holder are both up (all of them outside a degraded phase).
            self._refresh_replicas(stage for stage in present if stage - 1 in present)

    def forget_node_state(self) -> None:
        self.fallback.forget_node_state()
        self.replica_state = None  # the holder's memory died with it

    def heal_state(self) -> dict[str, Any]:
        # The successor's state this node holds: a healed replica of this stage holds it again.
        return {f"replica_state.{key}": value for key, value in (self.replica_state or {}).items()}

    def adopt_heal_state(self, state: dict[str, Any]) -> None:
        held = {key.split(".", 1)[1]: value for key, value in state.items() if key.startswith("replica_state.")}
        if held and self.replica is not None:
            self._hold(held)

    def replicated_metadata(self) -> Any:
        return self.fallback.replicated_metadata()


    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        self.fallback.adopt_replicated_metadata(survivors)

    # -- degraded phase (hard failures) ----------------------------------------------------------

    def hostable_stages(self) -> frozenset[int]:
        if self.successor is None or self.replica_state is None or self.hosted is not None:
            return frozenset()
        return frozenset({self.successor})

    def enter_degraded(self, hosted: frozenset[int]) -> dict[int, StageRuntime]:
        context = self.context
        assert hosted == self.hostable_stages(), f"stage {context.stage} can host only its successor"
        assert self.replica is not None and self.replica_state is not None and context.optimizer_for is not None
        replica = self.replica.requires_grad_(True)
        make_optimizer = context.optimizer_for
        runtime = StageRuntime(module=replica, optimizer=make_optimizer(replica, 1.0))
        with context.spans.span("recovery.rebuild"):
            # The replica's weights and optimizer state, as last refreshed, become a trained stage.
            restore_stage_state(runtime, lambda scale: make_optimizer(replica, scale), self.replica_state)
        self.hosted = runtime
        # The hosted stage's own fallback checkpoints, bound to its stage, in its own directory.
        hosted_context = dataclasses.replace(context, stage=self.successor, runtime=runtime)
        directories = CheckpointDirectories(hosted_context)
        self.hosted_fallback = CheckpointKeeper(
            hosted_context,
            synchronous_engine(hosted_context, directories, self.config.fallback_tier),
            directories,
            interval_iterations=self.config.fallback_interval_iterations,
            rollback="all",
        )
        return {self.successor: runtime}  # type: ignore[dict-item]

    def leave_degraded(self) -> None:
        if self.hosted is None:
            return
        # What the successor's replacement receives in `recover`: the state trained here.
        self.replica_state = capture_stage_state(self.hosted.module, self.hosted.optimizer)
        self.hosted.module.zero_grad(set_to_none=True)
        self.hosted.module.requires_grad_(False)
        self.hosted = None
        if self.hosted_fallback is not None:
            self.hosted_fallback.engine.close()  # its files stay: the stage's replacement reads them
            self.hosted_fallback = None

    def close(self) -> None:
        self.fallback.close()
        if self.hosted_fallback is not None:
            self.hosted_fallback.close()

    # -- transfers ------------------------------------------------------------------------------

    def _refresh_replicas(self, owners: Any) -> None:
        """Every stage in `owners` (≥ 1) sends its current state to its predecessor, the holder."""
        context = self.context
        owners = set(owners)
        sender = None
        if context.stage in owners and context.stage > 0:
            state = capture_stage_state(context.runtime.module, context.runtime.optimizer)
            sender = StateSender(context.communicator, state, context.stage - 1, _REFRESH_TAG)
        if self.successor is not None and self.successor in owners:
            self._hold(receive_state(context.communicator, self.successor, _REFRESH_TAG))
        if sender is not None:
            sender.wait()

    def _hold(self, state: dict[str, Any]) -> None:
        assert self.replica is not None
        weights = {key[len(MODULE_PREFIX) :]: value for key, value in state.items() if key.startswith(MODULE_PREFIX)}
        self.replica.load_state_dict(weights, strict=True)
        self.replica_state = state

    # -- recovery -------------------------------------------------------------------------------

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        if is_fatal(failed_stages):
            return self._fall_back(failed_stages, iteration)
        context = self.context
        with context.spans.span("recovery.transfer"):
            sender = None
            if self.successor in failed_stages:
                assert self.replica_state is not None, "a surviving holder keeps its replica"
                sender = StateSender(context.communicator, self.replica_state, self.successor, _TAKEOVER_TAG)
            if context.stage in failed_stages:
                state = receive_state(context.communicator, context.stage - 1, _TAKEOVER_TAG)
                restore_stage_state(context.runtime, context.make_optimizer, state)
            if sender is not None:
                sender.wait()
            # Each replacement needs its own replica of its successor.
            self._refresh_replicas(stage + 1 for stage in failed_stages)
        return RecoveryOutcome(
            failed_stages=failed_stages,
            rebuilt_from={stage: f"replica on stage {stage - 1}" for stage in failed_stages},
        )

    def resume(self) -> RecoveryOutcome:
        """A resumed run starts from the fallback checkpoints; every replica is refreshed from them."""
        outcome = self.fallback.resume()
        with self.context.spans.span("recovery.transfer"):
            self._refresh_replicas(range(self.context.num_stages))
        return outcome

    def _fall_back(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        outcome = self.fallback.recover(failed_stages, iteration)
        with self.context.spans.span("recovery.transfer"):
            self._refresh_replicas(range(self.context.num_stages))  # replicas of the restored states
        reasons = []
        if 0 in failed_stages:
            reasons.append("stage 0 lost (no stage holds its replica)")
        adjacent = sorted(stage for stage in failed_stages if stage - 1 in failed_stages)
        if adjacent:
            reasons.append(f"stages {', '.join(f'{s - 1} and {s}' for s in adjacent)} lost together (replica holder lost)")
        return RecoveryOutcome(
            failed_stages=outcome.failed_stages,
            resume_iteration=outcome.resume_iteration,
            rebuilt_from=outcome.rebuilt_from,
            notes=(f"redundant fallback to checkpoints: {'; '.join(reasons)}", *outcome.notes),
        )
