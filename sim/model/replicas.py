"""Data parallelism in a simulated run: the replica layer in front of the method's policy.

Both engines (`sim/model/run.py`'s `Run` and `sim/model/closed_form/engine.py`) keep one
`ReplicaGroup` when `pipeline.data_parallel_degree` D is above 1 and hand it every node loss before
the policy sees anything. It applies the contract's rule (`calibration/replica_rule.py`
`plan_node_losses`) to the lost node and the nodes still missing:

- A **stage loss** (no surviving replica, or `pipeline.replicas_fail_together`) is handed to the
  policy as the stage `FailureEvent` a D = 1 pipeline would get, so every method's recovery is
  unchanged; the stage's unfinished heals are abandoned (its replicas come back with the method's
  recovery).
- A **heal**: the replacement joins `recovery.join_delay_s` after the loss, then copies the stage's
  state from the surviving replica over the data-parallel link: `network.allreduce_bandwidth_bytes_per_s`
  and one `network.allreduce_latency_s` (the link each node uses for the gradient all-reduce; with
  the default infinite bandwidth the copy costs only that latency). Without ZeRO-1 it copies weights
  and optimizer state (`stage_checkpoint_bytes`); under ZeRO-1 (`checkpoint_sharding =
  "data_parallel"`) only the weights (`stage_weight_bytes`), and the lost optimizer shard is read
  from the method's checkpoint tier at the same time (`lost_optimizer_shard = "checkpoint"`: the
  heal takes the longer of the two) or started from zero at a setback of
  `REINITIALISED_SHARD_SETBACK_ITERATIONS` (`reinitialise`). A heal whose source replica is lost
  restarts its copy from the next survivor once its node has joined.

While nodes are missing, `training_replicas` replica pipelines train (`pipeline.while_replica_missing`):
under `continue` each iteration carries k/D of the global batch and is worth `batch_share` of a full
one by the convergence model's batch model (`ConvergenceSpec.iteration_worth`, McCandlish et al.'s
S(B) = S_min (1 + B_noise / B)); a spec that names no batch counts the share as k/D, the small-batch
limit of the same model. The trainer runs each iteration in its pipeline state's iteration time T and
credits it as `batch_share` of one, i.e. one credited iteration takes T / batch_share (a slower
effective iteration). With k = 0, or under `wait` while anything is missing, training pauses until heals end.

Approximations: the all-reduce over fewer replicas is not re-timed (the iteration time stays); a
heal's copy has the link to itself (heals from one source do not share its bandwidth, nor does the
gradient all-reduce slow it); the checkpointed shard's staleness costs nothing; a node loss that heals costs the iteration in flight
(lost work), as any failure does; the iterations counted for a method's periodic work are credited
iterations, so its interval stretches while the batch is short.

Cost: the group keeps only the missing nodes (a dict), never anything over S × D.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from churnsim.calibration.replica_rule import plan_node_losses, training_replicas

from .methods.base import checkpoint_part_bytes, stage_checkpoint_bytes, stage_weight_bytes

if TYPE_CHECKING:
    from churnsim.calibration.methods import MethodConfig
    from churnsim.calibration.scenario import Scenario

REINITIALISED_SHARD_SETBACK_ITERATIONS = 1.0
"""Uncalibrated default: iterations of progress a healed replica costs when its ZeRO-1 optimizer
shard (1/D of one stage's optimizer state) starts again from zero. No measurement backs it; it is
taken small because the weights are exact and only the moments of 1/(S·D) of the model restart."""

HEAL = "replica_heal"
"""`handled_as` of a node loss that heals from a surviving replica."""
ALREADY_DOWN = "already_down"
STAGE_LOSS = "stage_loss"

HEAL_CATEGORY = "heal"
"""Timeline category of heals, of pauses for them, and of training with fewer replicas."""
FEWER_REPLICAS_LABEL = "training with fewer replicas"
PAUSE_LABEL = "waiting for replica heals"


class Heal:
    """One missing node: when it was lost, when its replacement joins, when its copy ends."""

    __slots__ = ("lost_s", "join_s", "end_s", "source_replica", "token", "reinitialise")

    def __init__(self, lost_s: float, join_s: float, end_s: float, source_replica: int, token: int, reinitialise: bool) -> None:
        self.lost_s = lost_s
        self.join_s = join_s
        self.end_s = end_s
        self.source_replica = source_replica
        self.token = token
        self.reinitialise = reinitialise


class ReplicaGroup:
    """The S × D grid's missing nodes and what they do to training (module docstring)."""

    def __init__(self, scenario: "Scenario", method_config: "MethodConfig") -> None:
        pipeline = scenario.pipeline
        self.scenario = scenario
        self.method_config = method_config
        self.num_stages = pipeline.num_stages
        self.degree = pipeline.data_parallel_degree
        self.while_replica_missing = pipeline.while_replica_missing
        self.fail_together = pipeline.replicas_fail_together
        self.join_delay_s = scenario.recovery.join_delay_s
        self.sharded = pipeline.checkpoint_sharding == "data_parallel"
        self.missing: dict[tuple[int, int], Heal] = {}
        self.batch_share = 1.0
        """Iterations of the full global batch that one iteration with the training replicas is worth."""
        self.paused = False
        """No replica pipeline trains (k = 0, or `wait` with a node missing)."""
        self._token = 0
        self._stage_lost_s: dict[int, float] = {}
        """When each stage was last lost: its other nodes lost at that same instant are part of that loss."""
        self._copy_s: dict[int, float] = {}
        self._shares: dict[int, float] = {}

    # ----------------------------------------------------------------- sizes and times
    def copy_s(self, stage: int) -> float:
        """Seconds a replacement of `stage` takes, once joined, to get the stage's state (module docstring)."""
        seconds = self._copy_s.get(stage)
        if seconds is None:
            seconds = self._copy_s[stage] = self._compute_copy_s(stage)
        return seconds

    def _compute_copy_s(self, stage: int) -> float:
        scenario = self.scenario
        network = scenario.network
        copied_bytes = stage_weight_bytes(scenario, stage) if self.sharded else stage_checkpoint_bytes(scenario, stage)
        seconds = network.allreduce_latency_s + copied_bytes / network.allreduce_bandwidth_bytes_per_s
        if self.sharded and self._shard_from() == "checkpoint":
            tier = self._shard_tier()
            if tier is not None:
                read_s = tier.total_latency_s + checkpoint_part_bytes(scenario, stage) / tier.read_bandwidth_bytes_per_s
                seconds = max(seconds, read_s)
        return seconds

    def _shard_from(self) -> str:
        return getattr(type(self.method_config), "lost_optimizer_shard", "reinitialise")

    def _shard_tier(self):
        """The method's checkpoint tier that survives a node's loss (else its last), or None."""
        tiers = [self.scenario.tier(name) for name in self.method_config.tiers_used]
        if not tiers:
            return None
        return next((tier for tier in tiers if tier.survives_node_loss), tiers[-1])

    def share_of(self, replicas: int) -> float:
        """What one iteration with `replicas` of the D replica pipelines is worth (module docstring)."""
        share = self._shares.get(replicas)
        if share is None:
            if replicas >= self.degree:
                share = 1.0
            else:
                convergence = self.scenario.convergence
                if convergence.baseline_tokens_per_iteration is None or convergence.critical_batch_tokens is None:
                    share = replicas / self.degree
                else:
                    share = convergence.iteration_worth(self.scenario.tokens_per_iteration * replicas / self.degree)
            self._shares[replicas] = share
        return share

    # ----------------------------------------------------------------- losses and heals
    def lose(self, stage: int, replica: int, now: float) -> tuple[str, list[tuple[tuple[int, int], float, int]], list[tuple[tuple[int, int], Heal]]]:
        """The loss of node (stage, replica) at `now`: (outcome, heals to schedule as (node, delay_s,
        token), abandoned heals as (node, heal)). Outcome: `HEAL`, `STAGE_LOSS` or `ALREADY_DOWN`
        (its replacement has not joined yet). A scheduled heal ends at `now + delay_s` and counts
        only if `complete` gets its token."""
        node = (stage, replica)
        missing = self.missing
        current = missing.get(node)
        if current is not None and now < current.join_s:
            return ALREADY_DOWN, [], []
        if self._stage_lost_s.get(stage) == now:
            # Another node of a stage lost at this very instant (replicas failing together are
            # sampled as one event per replica): part of that one stage loss, even with no join delay.
            return ALREADY_DOWN, [], []
        if self.fail_together:
            return STAGE_LOSS, [], self._abandon(stage, now)
        plan = plan_node_losses(
            self.method_config, (node,), missing=missing.keys(), num_stages=self.num_stages, data_parallel_degree=self.degree, optimizer_sharded=self.sharded
        )
        if plan.lost_stages:
            return STAGE_LOSS, [], self._abandon(stage, now)
        scheduled = []
        copy_s = self.copy_s(stage)
        for heal in plan.heals:
            healed = (heal.stage, heal.replica)
            reinitialise = heal.optimizer_state_from == "reinitialise"
            if healed == node:
                self._token += 1
                delay_s = self.join_delay_s + copy_s
                lost_s = current.lost_s if current is not None else now
                missing[node] = Heal(lost_s, now + self.join_delay_s, now + delay_s, heal.source_replica, self._token, reinitialise)
                scheduled.append((node, delay_s, self._token))
                continue
            earlier = missing[healed]
            if earlier.source_replica == heal.source_replica or ((stage, earlier.source_replica) != node and (stage, earlier.source_replica) not in missing):
                continue  # its source survives: the copy goes on
            # Its source is lost: the copy starts again from the next survivor once the node has joined.
            self._token += 1
            delay_s = (earlier.join_s - now) + copy_s if earlier.join_s > now else copy_s
            earlier.end_s = now + delay_s
            earlier.source_replica = heal.source_replica
            earlier.token = self._token
            scheduled.append((healed, delay_s, self._token))
        self._refresh()
        return HEAL, scheduled, []

    def _abandon(self, stage: int, now: float) -> list[tuple[tuple[int, int], Heal]]:
        """A stage loss at `now`: its unfinished heals are abandoned."""
        self._stage_lost_s[stage] = now
        abandoned = [(node, heal) for node, heal in self.missing.items() if node[0] == stage]
        for node, _ in abandoned:
            del self.missing[node]
        if abandoned:
            self._refresh()
        return abandoned

    def complete(self, node: tuple[int, int], token: int) -> Heal | None:
        """A scheduled heal's end: the healed node's `Heal`, or None when the heal was abandoned or restarted."""
        heal = self.missing.get(node)
        if heal is None or heal.token != token:
            return None
        del self.missing[node]
        self._refresh()
        return heal

    def reinitialised_setback_iterations(self, heal: Heal) -> float:
        return REINITIALISED_SHARD_SETBACK_ITERATIONS if heal.reinitialise else 0.0

    def _refresh(self) -> None:
        replicas = training_replicas(self.missing.keys(), self.degree, self.while_replica_missing)
        self.paused = replicas == 0
        self.batch_share = 0.0 if replicas == 0 else self.share_of(replicas)

    def pause_end_s(self) -> float:
        """When training can resume: every heal done under `wait`; the first replica pipeline
        complete again under `continue`."""
        if self.while_replica_missing == "wait":
            return max(heal.end_s for heal in self.missing.values())
        last_of_replica: dict[int, float] = {}
        for (_, replica), heal in self.missing.items():
            if heal.end_s > last_of_replica.get(replica, -1.0):
                last_of_replica[replica] = heal.end_s
        return min(last_of_replica.values())


def replica_group_for(scenario: "Scenario", method_config: "MethodConfig") -> ReplicaGroup | None:
    """The run's replica layer, or None for D = 1 (every loss a stage loss: today's path, untouched)."""
    return ReplicaGroup(scenario, method_config) if scenario.pipeline.data_parallel_degree > 1 else None


def replica_heal_note(scenario: "Scenario", method_config: "MethodConfig") -> str | None:
    """The run's note on a healed replica's ZeRO-1 optimizer shard where it costs an uncalibrated setback; else None."""
    pipeline = scenario.pipeline
    if pipeline.data_parallel_degree == 1 or pipeline.checkpoint_sharding != "data_parallel" or method_config.ignores_failures:
        return None
    if getattr(type(method_config), "lost_optimizer_shard", "reinitialise") != "reinitialise":
        return None
    return (
        "a healed replica's ZeRO-1 optimizer shard restarts from zero at an uncalibrated setback of "
        f"{REINITIALISED_SHARD_SETBACK_ITERATIONS:g} iteration(s) per heal (sim/model/replicas.py)"
    )


def heal_track(stage: int, replica: int) -> str:
    return f"stage {stage} replica {replica}"
