"""Each recovery policy against hand-computed costs, and awkward failure patterns for every method."""

from __future__ import annotations

import pytest

from churnsim.calibration.methods import METHOD_NAMES
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.methods.base import block_weight_bytes, embedding_weight_bytes, stage_weight_bytes
from churnsim.sim.model.pipeline_state import build_pipeline_state
from churnsim.sim.model.calibrated import without_setbacks
from churnsim.sim.model.run import simulate_run

from sim_run_scenarios import CLOSED_FORM_ITERATION_S, failure, method, small_scenario, tiers

MODEL = IterationModel()
T = CLOSED_FORM_ITERATION_S
LINK_BYTES_PER_S = 1e5
FAST = dict(checkpoint={"interval_iterations": 10}, async_checkpoint={"interval_iterations": 5},
            redundant={"fallback_interval_iterations": 10}, checkfree_plus={"replica_refresh_iterations": 10})


def run(scenario, name, failures=(), **parameters):
    return simulate_run(scenario, method(name, **parameters), tuple(failures), iteration_model=MODEL)


def adds_up(result) -> bool:
    return result.goodput_s + sum(result.badput.values()) == pytest.approx(result.wall_clock_s, rel=1e-6)


# ------------------------------------------------------------------ awkward patterns, every method
PATTERNS = {
    "failure_during_recovery": (failure(500.0, 1), failure(520.0, 2), failure(531.0, 1)),
    "edge_failures": (failure(400.0, 0), failure(900.0, 3)),
    "two_adjacent_together": (failure(600.0, 1), failure(600.0, 2)),
    "burst_of_all_stages": tuple(failure(700.0, stage) for stage in range(4)),
    "failure_right_at_start": (failure(0.0, 2),),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_survives_awkward_failure_patterns(name, pattern):
    scenario = small_scenario(target_iterations=80, link_bandwidth=LINK_BYTES_PER_S)
    result = run(scenario, name, PATTERNS[pattern], **FAST.get(name, {}))
    assert result.reached_target
    assert len(result.failures) == len(PATTERNS[pattern])
    assert adds_up(result)
    clean = run(scenario, name, (), **FAST.get(name, {}))
    assert result.wall_clock_s >= clean.wall_clock_s


# ------------------------------------------------------------------ async checkpoint
def test_lazy_snapshot_stall_is_only_the_copy_not_hidden_behind_forward_and_backward():
    optimizer_s = 1.0
    scenario = small_scenario(target_iterations=50, optimizer_step_s=optimizer_s, storage=tiers(host_bandwidth=4e4))
    iteration_s = T + optimizer_s
    largest = max(scenario.stage_parameters(s) for s in range(4)) * scenario.model.checkpoint_bytes_per_parameter
    copy_s = largest / 4e4
    assert copy_s > iteration_s - optimizer_s  # the case being tested: not fully hidden
    result = run(scenario, "async_checkpoint", interval_iterations=10)
    stall_s = 4 * (copy_s - (iteration_s - optimizer_s))  # after 10, 20, 30, 40
    assert result.badput["checkpoint_stall_s"] == pytest.approx(stall_s, rel=1e-9)
    assert result.wall_clock_s == pytest.approx(50 * iteration_s + stall_s, rel=1e-9)


def test_lazy_async_checkpoint_stalls_less_than_sync_at_the_same_interval():
    scenario = small_scenario(target_iterations=100)
    sync = run(scenario, "checkpoint", interval_iterations=10)
    lazy = run(scenario, "async_checkpoint", interval_iterations=10)
    assert lazy.badput["checkpoint_stall_s"] < 0.1 * sync.badput["checkpoint_stall_s"]
    assert lazy.wall_clock_s < sync.wall_clock_s


def test_full_host_buffer_blocks_training_until_a_flush_frees_a_slot():
    slow_disk = tiers()[:1] + (tiers()[1].model_copy(update={"write_bandwidth_bytes_per_s": 1e4}),) + tiers()[2:]
    scenario = small_scenario(target_iterations=60, storage=slow_disk)
    result = run(scenario, "async_checkpoint", interval_iterations=1)
    names = {event.name for event in result.timeline}
    assert "host buffer full" in names
    assert result.badput["checkpoint_stall_s"] > 0


def test_async_checkpoint_rolls_back_to_a_checkpoint_durable_on_remote_storage():
    scenario = small_scenario(target_iterations=100)
    result = run(scenario, "async_checkpoint", [failure(55 * T + 3.0, 1)], interval_iterations=10)
    rolled_back_to = [p for (t, p) in result.trajectory if t == pytest.approx(55 * T + 3.0)][-1]
    assert rolled_back_to == 50.0  # the snapshot after 50 iterations is durable remotely within 5 iterations
    never_durable = small_scenario(target_iterations=100, storage=tiers(remote_bandwidth=1.0))
    lost_all = run(never_durable, "async_checkpoint", [failure(55 * T + 3.0, 1)], interval_iterations=10)
    assert [p for (t, p) in lost_all.trajectory if t == pytest.approx(55 * T + 3.0)][-1] == 0.0


# ------------------------------------------------------------------ redundant
def test_redundant_degraded_period_ends_after_join_restart_and_weight_transfer():
    scenario = small_scenario(target_iterations=100, link_bandwidth=LINK_BYTES_PER_S)
    failure_s = 300.0
    result = run(scenario, "redundant", [failure(failure_s, 2)])
    assert [f.handled_as for f in result.failures] == ["degraded"]
    degraded = [event for event in result.timeline if event.name == "stage 2 run by node 1"]
    assert len(degraded) == 1
    transfer_s = stage_weight_bytes(scenario, 2) / LINK_BYTES_PER_S
    assert degraded[0].start_s == failure_s
    assert degraded[0].end_s == pytest.approx(failure_s + 30.0 + 5.0 + transfer_s, rel=1e-9)
    assert result.progress_iterations == 100 and result.badput["recovery_downtime_s"] == 0.0
    assert result.badput["degraded_slowdown_s"] > 0  # node 1 computes two stages meanwhile


def test_redundant_stage_zero_and_adjacent_failures_fall_back_to_the_checkpoint():
    scenario = small_scenario(target_iterations=100, link_bandwidth=LINK_BYTES_PER_S)
    first_stage = run(scenario, "redundant", [failure(500.0, 0)], fallback_interval_iterations=10)
    assert [f.handled_as for f in first_stage.failures] == ["fatal_restart"]
    assert first_stage.badput["lost_work_s"] > 0
    adjacent = run(scenario, "redundant", [failure(500.0, 1), failure(510.0, 2)], fallback_interval_iterations=10)
    assert [f.handled_as for f in adjacent.failures] == ["degraded", "fatal_restart"]


def test_redundant_healthy_iteration_includes_the_redundant_forward():
    scenario = small_scenario(link_bandwidth=LINK_BYTES_PER_S)
    result = run(scenario, "redundant")
    assert result.healthy_iteration_time_s >= result.reference_iteration_time_s


# ------------------------------------------------------------------ rebuild family
def test_checkfree_interior_rebuild_costs_join_restart_two_concurrent_transfers_and_the_setback():
    scenario = small_scenario(target_iterations=100, link_bandwidth=LINK_BYTES_PER_S)
    T_iter = MODEL.iteration_time_s(build_pipeline_state(scenario))
    failure_s = 50 * T_iter + 0.5 * T_iter
    # No edge checkpoints (tests/sim/test_edge_checkpoints.py covers them): only the rebuild costs time.
    result = run(scenario, "checkfree", [failure(failure_s, 2)], edge_fallback="copy")
    assert [f.handled_as for f in result.failures] == ["rebuild_interior"]
    # The two neighbours send over different links, so they do not share bandwidth.
    downtime_s = 30.0 + 5.0 + block_weight_bytes(scenario) / LINK_BYTES_PER_S
    setback = scenario.convergence.setback_iterations("checkfree", "interior")
    assert result.badput["recovery_downtime_s"] == pytest.approx(downtime_s, rel=1e-9)
    assert result.badput["convergence_setback_s"] == pytest.approx(setback * T_iter, rel=1e-9)
    assert result.wall_clock_s == pytest.approx((100 + setback) * T_iter + 0.5 * T_iter + downtime_s, rel=1e-9)


def test_checkfree_edge_failure_uses_the_fallback_and_the_edge_setback():
    scenario = small_scenario(target_iterations=600, link_bandwidth=LINK_BYTES_PER_S)
    copied = run(scenario, "checkfree", [failure(500 * 22.0, 0)], edge_fallback="copy")
    assert [f.handled_as for f in copied.failures] == ["rebuild_edge_copy"]
    edge = scenario.convergence.setback_iterations("checkfree", "edge")
    assert copied.badput["convergence_setback_s"] == pytest.approx(edge * copied.healthy_iteration_time_s)
    randomised = run(scenario, "checkfree", [failure(500 * 22.0, 0)], edge_fallback="random")
    assert [f.handled_as for f in randomised.failures] == ["rebuild_random"]
    assert randomised.badput["recovery_downtime_s"] == pytest.approx(35.0)  # no transfer
    random_setback = scenario.convergence.setback_iterations("random", "edge")
    assert randomised.badput["convergence_setback_s"] == pytest.approx(random_setback * randomised.healthy_iteration_time_s)


def test_checkfree_adjacent_failures_are_not_rebuilt_from_lost_neighbours():
    scenario = small_scenario(target_iterations=200, link_bandwidth=LINK_BYTES_PER_S)
    result = run(scenario, "checkfree", [failure(3000.0, 1), failure(3000.0, 2)])
    assert [f.handled_as for f in result.failures] == ["rebuild_adjacent_copy", "rebuild_adjacent_copy"]


def test_checkfree_plus_edge_failure_copies_the_swap_partner_and_the_embedding_replica():
    scenario = small_scenario(target_iterations=200, link_bandwidth=LINK_BYTES_PER_S)
    result = run(scenario, "checkfree_plus", [failure(3000.0, 0)], replica_refresh_iterations=1000)
    assert [f.handled_as for f in result.failures] == ["rebuild_edge_swap"]
    transfer_s = (block_weight_bytes(scenario) + embedding_weight_bytes(scenario)) / LINK_BYTES_PER_S
    assert result.badput["recovery_downtime_s"] == pytest.approx(35.0 + transfer_s, rel=1e-9)
    edge = scenario.convergence.setback_iterations("checkfree_plus", "edge")
    assert result.badput["convergence_setback_s"] == pytest.approx(edge * result.healthy_iteration_time_s)


def test_checkfree_plus_replica_refresh_runs_in_the_background_and_blocks_only_when_behind():
    scenario = small_scenario(target_iterations=50, link_bandwidth=LINK_BYTES_PER_S)
    relaxed = run(scenario, "checkfree_plus", replica_refresh_iterations=10)
    assert sum(event.name == "(de)embedding replica refresh" for event in relaxed.timeline) == 4
    assert relaxed.badput["method_overhead_s"] == pytest.approx(
        50 * (relaxed.healthy_iteration_time_s - relaxed.reference_iteration_time_s), abs=1e-6
    )
    # A 100k-word vocabulary: each replica takes ~128 s to send, longer than one iteration.
    large_vocabulary = small_scenario(target_iterations=50, link_bandwidth=LINK_BYTES_PER_S, vocab_size=100_000)
    behind = run(large_vocabulary, "checkfree_plus", replica_refresh_iterations=1)
    assert behind.badput["method_overhead_s"] > 40 * 100.0
    assert any(event.name == "replica refresh backlog" for event in behind.timeline)


@pytest.mark.parametrize("name", ["copy", "uniform", "random"])
def test_a_rebuild_that_leaves_no_trained_weights_restarts_training_from_iteration_zero(name):
    # One stage: whatever rebuilds it starts from random init, so every iteration trained is gone,
    # not the few hundred a per-stage setback charges.
    scenario = small_scenario(num_stages=1, target_iterations=600)
    iteration_s = MODEL.iteration_time_s(build_pipeline_state(scenario))
    failure_s = 300.5 * iteration_s
    result = run(scenario, name, [failure(failure_s, 0)])
    assert [f.handled_as for f in result.failures] == ["rebuild_random"]
    assert result.failures[0].iteration == 300
    assert result.badput["convergence_setback_s"] == pytest.approx(300 * iteration_s, rel=1e-9)
    assert result.iterations_executed == 900
    assert any("training restarted from iteration 0" in note for note in result.notes)
    # A wall-clock replay of a real run (sim/checks/validate.py) drops it: the real run trains on from the
    # random weights for its fixed number of iterations.
    replay = run(without_setbacks(scenario), name, [failure(failure_s, 0)])
    assert replay.iterations_executed == 600 and replay.badput["convergence_setback_s"] == 0.0
    # A stage that keeps its weights keeps its progress: the same failure on 2 stages costs the setback.
    two_stages = small_scenario(num_stages=2, target_iterations=600)
    kept = run(two_stages, name, [failure(300.5 * MODEL.iteration_time_s(build_pipeline_state(two_stages)), 0)])
    assert kept.iterations_executed < 900
    assert not any("training restarted from iteration 0" in note for note in kept.notes)


@pytest.mark.parametrize(("name", "handled_as", "transfer_blocks"), [("copy", "rebuild_copy", 1), ("uniform", "rebuild_interior", 1), ("random", "rebuild_random", 0)])
def test_ablations_apply_their_setback_and_transfer(name, handled_as, transfer_blocks):
    # Late enough that even the random setback (400 iterations) is not clamped at zero progress.
    scenario = small_scenario(target_iterations=600, link_bandwidth=LINK_BYTES_PER_S)
    result = run(scenario, name, [failure(500 * 22.0, 2)])
    assert [f.handled_as for f in result.failures] == [handled_as]
    downtime_s = 35.0 + transfer_blocks * block_weight_bytes(scenario) / LINK_BYTES_PER_S
    assert result.badput["recovery_downtime_s"] == pytest.approx(downtime_s, rel=1e-9)
    setback = scenario.convergence.setback_iterations(name, "interior")
    assert result.badput["convergence_setback_s"] == pytest.approx(setback * result.healthy_iteration_time_s)
