"""The data-parallel rule (calibration/replica_rule.py): which lost nodes heal and which stages are lost."""

import itertools

import pytest

from churnsim.calibration.methods import CheckFreeConfig, CheckpointConfig
from churnsim.calibration.replica_rule import complete_replicas, plan_node_losses, training_replicas


def test_a_stage_with_a_survivor_heals_from_the_lowest_surviving_replica():
    plan = plan_node_losses(CheckpointConfig(), [(1, 0)], num_stages=3, data_parallel_degree=3)
    assert plan.lost_stages == frozenset()
    assert [(heal.stage, heal.replica, heal.source_replica) for heal in plan.heals] == [(1, 0, 1)]
    assert plan.heals[0].optimizer_state_from == "source"


def test_a_stage_is_lost_only_when_every_replica_is_gone():
    plan = plan_node_losses(CheckpointConfig(), [(2, 1)], missing=[(2, 0)], num_stages=3, data_parallel_degree=2)
    assert plan.lost_stages == frozenset({2}) and plan.heals == ()


def test_a_heal_whose_source_died_is_planned_again_from_the_next_survivor():
    # (0, 0) was healing from replica 1; replica 1 dies too: both heal from replica 2.
    plan = plan_node_losses(CheckpointConfig(), [(0, 1)], missing=[(0, 0)], num_stages=2, data_parallel_degree=3)
    assert [(heal.replica, heal.source_replica) for heal in plan.heals] == [(0, 2), (1, 2)]


def test_with_one_replica_every_loss_is_a_stage_loss():
    for num_stages in range(1, 5):
        for stage in range(num_stages):
            plan = plan_node_losses(CheckpointConfig(), [(stage, 0)], num_stages=num_stages, data_parallel_degree=1)
            assert plan.lost_stages == {stage} and plan.heals == ()


def test_zero1_shard_comes_from_where_the_method_says():
    checkpointed = plan_node_losses(CheckpointConfig(), [(0, 1)], num_stages=2, data_parallel_degree=2, optimizer_sharded=True)
    rebuilt = plan_node_losses(CheckFreeConfig(), [(0, 1)], num_stages=2, data_parallel_degree=2, optimizer_sharded=True)
    assert checkpointed.heals[0].optimizer_state_from == "checkpoint"
    assert rebuilt.heals[0].optimizer_state_from == "reinitialise"


def test_reliable_stages_ignore_their_nodes():
    config = CheckFreeConfig(edge_stages_reliable=True)
    plan = plan_node_losses(config, [(0, 0), (0, 1), (1, 0)], num_stages=3, data_parallel_degree=2)
    assert plan.ignored == {(0, 0), (0, 1)}
    assert plan.lost_stages == frozenset() and [(h.stage, h.replica) for h in plan.heals] == [(1, 0)]


@pytest.mark.parametrize("num_stages,degree", [(s, d) for s in range(2, 5) for d in range(1, 4)])
def test_every_loss_pattern_is_either_healed_or_a_stage_loss(num_stages, degree):
    nodes = [(s, r) for s in range(num_stages) for r in range(degree)]
    for size in range(1, min(len(nodes), 4) + 1):
        for lost in itertools.combinations(nodes, size):
            plan = plan_node_losses(CheckpointConfig(), lost, num_stages=num_stages, data_parallel_degree=degree)
            healed = {(heal.stage, heal.replica) for heal in plan.heals}
            in_lost_stages = {node for node in lost if node[0] in plan.lost_stages}
            assert healed | in_lost_stages == set(lost) and not healed & in_lost_stages
            for stage in plan.lost_stages:
                assert all((stage, r) in lost for r in range(degree))
            for heal in plan.heals:
                assert (heal.stage, heal.source_replica) not in lost


def test_training_replicas_follow_the_while_replica_missing_choice():
    assert complete_replicas([(0, 1), (2, 1), (1, 3)], 4) == 2
    assert training_replicas([(0, 1)], 4, "continue") == 3
    assert training_replicas([(0, 1)], 4, "wait") == 0
    assert training_replicas([], 4, "wait") == 4


def test_a_node_outside_the_grid_is_refused():
    with pytest.raises(ValueError, match="outside"):
        plan_node_losses(CheckpointConfig(), [(0, 2)], num_stages=2, data_parallel_degree=2)


def test_stage_loss_rate_falls_with_replicas_and_is_the_node_rate_when_they_fail_together():
    from churnsim.calibration.replica_rule import stage_loss_rate_per_s

    rate = 1 / 3600.0
    rates = [stage_loss_rate_per_s(rate, data_parallel_degree=d, heal_window_s=600.0) for d in (1, 2, 3)]
    assert rates[0] > rates[1] > rates[2] > 0
    # D = 2: 2λ(1 − p)p with p = λh / (1 + λh) = 1/7.
    assert rates[1] == pytest.approx(2 * rate * (6 / 7) * (1 / 7))
    assert stage_loss_rate_per_s(rate, data_parallel_degree=3, heal_window_s=600.0, replicas_fail_together=True) == rate
