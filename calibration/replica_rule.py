"""What a lost node costs under data parallelism: one rule, read by sim/ and real/.

The pipeline is a grid of S stages × D data-parallel replicas; a node is one (stage, replica).
Data parallelism keeps every replica of a stage bit-identical after each optimizer step, so a stage
that keeps one replica has lost nothing but a machine. The rule, for the nodes lost at one instant
(`newly_lost`) with some nodes still missing from earlier losses (`missing`: lost, heal not done):

- A stage none of whose replicas survives (every one in `newly_lost` ∪ `missing`) is *lost*: its
  training state exists nowhere in the group and it goes to the method's own recovery
  (`plan_rebuild` for the rebuild methods, a rollback, a redundant take-over), as a stage of a
  D = 1 pipeline would. Its unfinished heals are abandoned: the replacements start from what the
  method's recovery gives every replica of the stage.
- Every other lost or still-missing node of a stage with a new loss *heals*: its replacement copies
  the stage's weights and optimizer state from the lowest-numbered surviving replica (a fixed
  choice, so every rank and the simulator pick the same source; a heal whose source is lost is
  planned again from the next survivor). Under ZeRO-1 (`checkpoint_sharding = "data_parallel"`) each
  replica holds only its shard of the optimizer state, so the lost shard is on no survivor: the
  method decides, by its trait `lost_optimizer_shard` (calibration/methods.py): `checkpoint`
  reloads the shard from the latest checkpoint, `reinitialise` starts it from zero and pays a
  setback.
- Nodes of the method's reliable stages (CheckFree's `edge_stages_reliable`) never fail: ignored.

While a node is missing, the replica pipeline it belongs to cannot run: the group trains with the
complete replica pipelines (`complete_replicas`) or waits, as `pipeline.while_replica_missing` says.
With D = 1 every loss is a stage loss, the rule of a pipeline without data parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .rebuild_plan import reliable_stages

Node = tuple[int, int]
"""(stage, replica), both 0-based."""

OptimizerStateFrom = Literal["source", "checkpoint", "reinitialise"]


@dataclass(frozen=True, kw_only=True)
class ReplicaHeal:
    """One node that heals by copying its stage's state from a surviving replica."""

    stage: int
    replica: int
    source_replica: int
    """The surviving replica of the same stage it copies from (the lowest-numbered survivor)."""
    optimizer_state_from: OptimizerStateFrom
    """`source`: the optimizer state comes with the weights; under ZeRO-1 the lost shard comes from
    the latest `checkpoint` or is started again (`reinitialise`)."""


@dataclass(frozen=True, kw_only=True)
class NodeLossPlan:
    """What the nodes lost at one instant lead to; the same on every rank and in the simulator."""

    heals: tuple[ReplicaHeal, ...]
    """Lost and still-missing nodes of stages that keep a survivor, by (stage, replica)."""
    lost_stages: frozenset[int]
    """Stages with no surviving replica: the method's own recovery."""
    ignored: frozenset[Node]
    """Lost nodes of stages the method declares reliable."""


def plan_node_losses(
    method_config: Any,
    newly_lost: Iterable[Node],
    *,
    missing: Iterable[Node] = (),
    num_stages: int,
    data_parallel_degree: int,
    optimizer_sharded: bool = False,
) -> NodeLossPlan:
    """The heals and stage losses that `newly_lost` causes, with `missing` nodes not yet healed."""
    if data_parallel_degree < 1 or num_stages < 1:
        raise ValueError(f"a {num_stages} × {data_parallel_degree} grid has no nodes")
    lost_now = frozenset(newly_lost)
    still_missing = frozenset(missing)
    for stage, replica in lost_now | still_missing:
        if not (0 <= stage < num_stages and 0 <= replica < data_parallel_degree):
            raise ValueError(f"node ({stage}, {replica}) is outside the {num_stages} × {data_parallel_degree} grid")
    reliable = reliable_stages(method_config, num_stages)
    ignored = frozenset(node for node in lost_now if node[0] in reliable)
    lost_now -= ignored
    gone = lost_now | still_missing
    heals: list[ReplicaHeal] = []
    lost_stages: set[int] = set()
    for stage in sorted({stage for stage, _ in lost_now}):
        survivors = [replica for replica in range(data_parallel_degree) if (stage, replica) not in gone]
        if not survivors:
            lost_stages.add(stage)
            continue
        shard_from = lost_optimizer_shard_source(method_config) if optimizer_sharded else "source"
        for replica in range(data_parallel_degree):
            if (stage, replica) in gone:
                heals.append(ReplicaHeal(stage=stage, replica=replica, source_replica=survivors[0], optimizer_state_from=shard_from))
    return NodeLossPlan(heals=tuple(heals), lost_stages=frozenset(lost_stages), ignored=ignored)


def lost_optimizer_shard_source(method_config: Any) -> OptimizerStateFrom:
    """Where a healed replica's ZeRO-1 optimizer shard comes from under this method."""
    return getattr(type(method_config), "lost_optimizer_shard", "reinitialise")


def complete_replicas(missing: Iterable[Node], data_parallel_degree: int) -> int:
    """Replica pipelines with every stage present: those that can train while `missing` heal."""
    broken = {replica for _, replica in missing}
    return data_parallel_degree - len(broken)


def training_replicas(missing: Iterable[Node], data_parallel_degree: int, while_replica_missing: str) -> int:
    """Replica pipelines that train now: the complete ones under `continue`; under `wait`, all D
    when nothing is missing and none otherwise."""
    missing = tuple(missing)
    if not missing:
        return data_parallel_degree
    if while_replica_missing == "wait":
        return 0
    return complete_replicas(missing, data_parallel_degree)


def stage_loss_rate_per_s(
    node_failure_rate_per_s: float, *, data_parallel_degree: int, heal_window_s: float, replicas_fail_together: bool = False
) -> float:
    """Long-run rate of stage losses of one stage whose D nodes each fail at `node_failure_rate_per_s`
    (memoryless) and heal `heal_window_s` after a loss (join delay plus the copy).

    A node alternates between up (mean 1/λ) and missing (h), so it is missing with probability
    p = λh / (1 + λh); a loss of one of the D nodes while it is up (rate Dλ(1 − p)) is a stage loss
    when the other D − 1 are all missing (p^(D−1)): D·λ·(1 − p)·p^(D−1). Approximation: it treats the
    replicas as independent and ignores that a stage loss replaces all of them at once, which matters
    only when stage losses are common. With D = 1 it is λ/(1 + λh), every loss of an up node; with
    replicas failing together, every failure is a stage loss: λ.
    """
    rate = node_failure_rate_per_s
    if rate < 0 or heal_window_s < 0 or data_parallel_degree < 1:
        raise ValueError("rate and heal window must be >= 0 and the data-parallel degree >= 1")
    if replicas_fail_together:
        return rate
    missing = rate * heal_window_s / (1.0 + rate * heal_window_s)
    return data_parallel_degree * rate * (1.0 - missing) * missing ** (data_parallel_degree - 1)
