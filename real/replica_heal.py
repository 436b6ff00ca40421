"""Node losses in an S × D real run: what each lost node does, and the heal's copy from a survivor.

`node_loss_actions` turns the contract's rule (`calibration.replica_rule.plan_node_losses`, the one
the simulator charges) into what the ranks do at an iteration boundary: which nodes lose their
state, which heal from which surviving replica, which stages go to the method's own recovery (in
every replica pipeline, from that pipeline's own neighbours or files), which losses are ignored.

`heal_replicas` carries out the heals of one stage over its process group of replicas: the source
replica sends its weights, its optimizer state, its learning-rate scale and the method's per-node
state (`RecoveryMethod.heal_state`) to each replacement, which loads them in place: the copy is
bit-exact (no arithmetic, the bytes of every tensor as the source holds them). The source is sent
point to point to each replacement rather than broadcast to the whole group, so the replicas that
lost nothing receive nothing.

Real runs keep the full optimizer state on every replica (no ZeRO-1 sharding), so a heal always
copies the optimizer state from the source (`optimizer_sharded` is False here); the simulator
charges a sharded run's shard reload or re-initialisation by the same rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from churnsim.calibration.replica_rule import Node, ReplicaHeal, plan_node_losses

from .distributed import Communicator
from .methods import RecoveryMethod, StageRuntime
from .methods.base import METHOD_TAG_BASE
from .methods.stage_state import StateSender, capture_stage_state, receive_state, restore_stage_state

HEAL_TAG = METHOD_TAG_BASE + (1 << 21)
"""Tags of a heal's messages on a stage's group (three per message, one message per replacement)."""
METHOD_STATE_PREFIX = "method."
LR_SCALE_KEY = "runtime.lr_scale"

HandledAs = str
"""What a lost node leads to: `replica_heal`, `stage_loss` (the method's own recovery), `ignored`
(a stage the method declares reliable) or `recorded` (a method that ignores failures: `none`)."""


@dataclass(frozen=True, kw_only=True)
class NodeLossActions:
    """What the ranks do about the nodes lost at one iteration boundary; the same on every rank."""

    wiped: frozenset[Node]
    """Nodes whose state is destroyed (every lost node the method neither ignores nor declares reliable)."""
    heals: tuple[ReplicaHeal, ...]
    """Wiped nodes of stages that keep a replica: each copies from `source_replica`."""
    lost_stages: frozenset[int]
    """Stages with no surviving replica: the method's `recover` in every replica pipeline."""
    handled_as: dict[Node, HandledAs]
    """Every lost node, by what it leads to."""


def node_loss_actions(
    method_config: Any, lost: Iterable[Node], *, num_stages: int, data_parallel_degree: int, destroys_state: bool = True
) -> NodeLossActions:
    """The actions for the nodes `lost` at one boundary (soft failures: earlier heals are done, so
    nothing is missing). `destroys_state` False (`none`): every loss is only recorded."""
    lost = frozenset(lost)
    if not destroys_state:
        return NodeLossActions(wiped=frozenset(), heals=(), lost_stages=frozenset(), handled_as=dict.fromkeys(lost, "recorded"))
    plan = plan_node_losses(method_config, lost, num_stages=num_stages, data_parallel_degree=data_parallel_degree, optimizer_sharded=False)
    handled_as: dict[Node, HandledAs] = {}
    for node in lost:
        if node in plan.ignored:
            handled_as[node] = "ignored"
        elif node[0] in plan.lost_stages:
            handled_as[node] = "stage_loss"
        else:
            handled_as[node] = "replica_heal"
    return NodeLossActions(wiped=lost - plan.ignored, heals=plan.heals, lost_stages=plan.lost_stages, handled_as=handled_as)


@dataclass(frozen=True, kw_only=True)
class HealCost:
    """One rank's share of a boundary's heals."""

    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0


def heal_replicas(
    stage_group: Communicator,
    runtime: StageRuntime,
    make_optimizer: Callable[[float], torch.optim.Optimizer],
    method: RecoveryMethod,
    heals: Iterable[ReplicaHeal],
) -> HealCost:
    """Carry out the heals of this rank's stage (`heals`: those of this stage only). `stage_group`
    names peers by replica; its `rank` is this rank's replica. Only the sources and the
    replacements take part; the others return at once."""
    replica = stage_group.rank
    heals = tuple(heals)
    started = time.perf_counter()
    received_before = stage_group.bytes_received
    sent = 0
    senders = []
    for heal in heals:
        if heal.source_replica == replica:
            state = capture_stage_state(runtime.module, runtime.optimizer)
            state |= {METHOD_STATE_PREFIX + key: value for key, value in method.heal_state().items()}
            state[LR_SCALE_KEY] = runtime.lr_scale
            sender = StateSender(stage_group, state, heal.replica, HEAL_TAG)
            senders.append(sender)
            sent += sender.nbytes
    for heal in heals:
        if heal.replica == replica:
            state = receive_state(stage_group, heal.source_replica, HEAL_TAG)
            restore_stage_state(runtime, make_optimizer, state)
            runtime.lr_scale = float(state[LR_SCALE_KEY])
            method.adopt_heal_state({key[len(METHOD_STATE_PREFIX) :]: value for key, value in state.items() if key.startswith(METHOD_STATE_PREFIX)})
    for sender in senders:
        sender.wait()
    if not any(replica in (heal.replica, heal.source_replica) for heal in heals):
        return HealCost()
    return HealCost(seconds=time.perf_counter() - started, bytes_sent=sent, bytes_received=stage_group.bytes_received - received_before)
