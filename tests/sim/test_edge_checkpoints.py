"""Plain CheckFree's edge stages in the simulator: edge checkpoints, their reload, reliable edges."""

from __future__ import annotations

import pytest

from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.methods.base import stage_checkpoint_bytes
from churnsim.sim.model.run import simulate_run

from sim_run_scenarios import CLOSED_FORM_ITERATION_S, failure, method, small_scenario

MODEL = IterationModel()
T = CLOSED_FORM_ITERATION_S
INTERVAL = 10


def run(scenario, failures=(), **parameters):
    return simulate_run(scenario, method("checkfree", **parameters), tuple(failures), iteration_model=MODEL)


def adds_up(result) -> bool:
    return result.goodput_s + sum(result.badput.values()) == pytest.approx(result.wall_clock_s, rel=1e-6)


def edge_bytes(scenario) -> float:
    return stage_checkpoint_bytes(scenario, 0) + stage_checkpoint_bytes(scenario, scenario.pipeline.num_stages - 1)


def test_edge_checkpoints_cost_one_shared_write_of_the_two_edge_stages_per_interval_without_failures():
    scenario = small_scenario(target_iterations=100)
    # The remote tier is one shared link: latency + both edge stages' bytes / bandwidth, training blocked.
    write_s = 0.1 + edge_bytes(scenario) / 1e6
    result = run(scenario, edge_checkpoint_interval_iterations=INTERVAL)
    num_writes = 9  # after 10, 20, ..., 90 iterations; none at the target itself
    assert result.badput["checkpoint_stall_s"] == pytest.approx(num_writes * write_s, rel=1e-9)
    assert result.wall_clock_s == pytest.approx(100 * T + num_writes * write_s, rel=1e-9)
    assert adds_up(result)
    for free in (run(scenario, edge_fallback="copy"), run(scenario, edge_stages_reliable=True)):
        assert free.badput["checkpoint_stall_s"] == 0.0
        assert free.wall_clock_s == pytest.approx(100 * T, rel=1e-12)


def test_edge_failure_reloads_the_edge_checkpoint_as_a_stage_local_rollback():
    scenario = small_scenario(target_iterations=100)
    write_s = 0.1 + edge_bytes(scenario) / 1e6
    read_s = 0.1 + stage_checkpoint_bytes(scenario, 0) / 1e6
    # 25 iterations and two edge checkpoints (after 10 and 20) done, then 5 s into iteration 26.
    failure_s = 25 * T + 2 * write_s + 5.0
    result = run(scenario, [failure(failure_s, 0)], edge_checkpoint_interval_iterations=INTERVAL)
    assert [f.handled_as for f in result.failures] == ["edge_checkpoint_restore"]
    assert result.badput["recovery_downtime_s"] == pytest.approx(30.0 + 5.0 + read_s, rel=1e-9)
    # Stage 0 is 5 iterations stale and holds 1/4 of the model (as checkpoint with rollback="stage"),
    # plus the interrupted iteration; no convergence setback is charged.
    assert result.badput["lost_work_s"] == pytest.approx(5 / 4 * T + 5.0, rel=1e-9)
    assert result.badput["convergence_setback_s"] == 0.0
    assert adds_up(result)


def test_edge_failure_before_the_first_edge_checkpoint_reloads_the_initial_weights_without_a_read():
    scenario = small_scenario(target_iterations=100)
    failure_s = 8 * T + 1.0
    result = run(scenario, [failure(failure_s, 3)], edge_checkpoint_interval_iterations=INTERVAL)
    assert [f.handled_as for f in result.failures] == ["edge_checkpoint_restore"]
    assert result.badput["recovery_downtime_s"] == pytest.approx(35.0, rel=1e-9)
    assert result.badput["lost_work_s"] == pytest.approx(8 / 4 * T + 1.0, rel=1e-9)


def test_an_edge_checkpoint_on_a_tier_that_dies_with_the_node_is_lost_with_the_edge():
    scenario = small_scenario(target_iterations=100)
    # Local disks: one link per node, no latency; the two edges write in parallel.
    write_s = max(stage_checkpoint_bytes(scenario, 0), stage_checkpoint_bytes(scenario, 3)) / 1e8
    failure_s = 25 * T + 2 * write_s + 5.0
    result = run(scenario, [failure(failure_s, 0)], edge_checkpoint_interval_iterations=INTERVAL, edge_checkpoint_tier="local_disk")
    # No read: the save died with the node, the stage restarts from its initial weights, 25 iterations stale.
    assert result.badput["recovery_downtime_s"] == pytest.approx(35.0, rel=1e-9)
    assert result.badput["lost_work_s"] == pytest.approx(25 / 4 * T + 5.0, rel=1e-9)


def test_interior_stages_keep_the_weighted_average_and_adjacent_losses_copy_under_edge_checkpoints():
    scenario = small_scenario(target_iterations=200)
    result = run(scenario, [failure(900.0, 2), failure(3000.0, 1), failure(3000.0, 2), failure(4000.0, 0)])
    assert [f.handled_as for f in result.failures] == [
        "rebuild_interior",
        "rebuild_adjacent_copy",
        "rebuild_adjacent_copy",
        "edge_checkpoint_restore",
    ]
    assert adds_up(result)


def test_reliable_edge_stages_ignore_edge_failures_and_still_rebuild_interior_ones():
    scenario = small_scenario(target_iterations=100)
    edges_only = run(scenario, [failure(300.0, 0), failure(600.0, 3)], edge_stages_reliable=True)
    assert [f.handled_as for f in edges_only.failures] == ["ignored", "ignored"]
    assert edges_only.wall_clock_s == pytest.approx(100 * T, rel=1e-12)
    mixed = run(scenario, [failure(300.0, 0), failure(600.0, 2)], edge_stages_reliable=True)
    assert [f.handled_as for f in mixed.failures] == ["ignored", "rebuild_interior"]


def test_edge_copy_fallback_says_the_embedding_restarts_from_random_init():
    scenario = small_scenario(target_iterations=200)
    copied = run(scenario, [failure(3000.0, 0)], edge_fallback="copy")
    assert [f.handled_as for f in copied.failures] == ["rebuild_edge_copy"]
    assert any("random init" in note and "edge_fallback='checkpoint'" in note for note in copied.notes)
    restored = run(scenario, [failure(3000.0, 0)])
    assert not any("random init" in note for note in restored.notes)
