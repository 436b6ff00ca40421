"""Unequal stage splits, serialization before a write, and checkpoint shards across data-parallel
replicas, each against its closed form."""

from __future__ import annotations

import json
import math

import pytest

from churnsim.calibration.base import validate_model
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import DATASTATES_ITERATIONS, datastates, preset
from churnsim.calibration.scenario import Scenario
from churnsim.sim.model.iteration import simulate_iteration
from churnsim.sim.model.methods.base import (
    checkpoint_part_bytes,
    serialization_s,
    stage_checkpoint_bytes,
    tier_flow_bytes,
)
from churnsim.sim.model.pipeline_state import build_pipeline_state
from churnsim.sim.model.run import simulate_run

SPLIT = (5,) * 6 + (3,) * 6  # 48 layers of spot-p3-trace in 12 unequal stages


def _scenario(**changes) -> Scenario:
    """spot-p3-trace with checkpointing only, no failures and `changes` (dotted keys) applied."""
    data = json.loads(preset("spot-p3-trace").model_dump_json())
    data["methods"] = [method_from_name("none").model_dump(), method_from_name("checkpoint", interval_iterations=3).model_dump()]
    data["churn"] = {"kind": "none"}
    data["target"] = {"iterations": 10}
    data["replications"] = 1
    for path, value in changes.items():
        target = data
        *parents, last = path.split(".")
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[last] = value
    return validate_model(Scenario, data, "test scenario")


def test_flops_compute_and_checkpoint_bytes_follow_each_stages_layers():
    scenario = _scenario(**{"pipeline.layers_per_stage": list(SPLIT)})
    state = build_pipeline_state(scenario)
    model = scenario.model
    per_layer_forward = state.block_forward_s[-2] / SPLIT[-2]
    for stage, layers in enumerate(SPLIT):
        assert state.block_forward_s[stage] == pytest.approx(layers * per_layer_forward)
        assert state.block_backward_s[stage] == pytest.approx(2 * state.block_forward_s[stage])
        blocks = layers * model.parameters_per_layer
        extra = model.embedding_parameters if stage == 0 else model.head_parameters if stage == len(SPLIT) - 1 else 0
        assert stage_checkpoint_bytes(scenario, stage) == (blocks + extra) * model.checkpoint_bytes_per_parameter
        assert state.gradient_bytes_per_stage[stage] == (blocks + extra) * model.weight_bytes_per_parameter
    equal = build_pipeline_state(_scenario())
    assert sum(state.block_forward_s) == pytest.approx(sum(equal.block_forward_s))  # same model, split differently


def test_explicit_times_scale_with_layers_and_a_tuple_is_taken_as_given():
    scalar = _scenario(**{"pipeline.layers_per_stage": list(SPLIT), "compute": {"kind": "explicit", "block_forward_s": 0.4, "block_backward_s": 0.8}})
    state = build_pipeline_state(scalar)
    assert state.block_forward_s == pytest.approx(tuple(0.4 * layers / 4 for layers in SPLIT))  # 4 = mean layers per stage
    assert state.block_backward_s == pytest.approx(tuple(0.8 * layers / 4 for layers in SPLIT))
    given = tuple(0.1 * (stage + 1) for stage in range(12))
    explicit = _scenario(**{"pipeline.layers_per_stage": list(SPLIT), "compute": {"kind": "explicit", "block_forward_s": list(given), "block_backward_s": 1.0}})
    assert build_pipeline_state(explicit).block_forward_s == given
    # Equal stages keep the scalar exactly, as before the field existed.
    assert build_pipeline_state(_scenario(**{"compute": {"kind": "explicit", "block_forward_s": 0.3, "block_backward_s": 0.6}})).block_forward_s == (0.3,) * 12


def test_one_microbatch_over_free_links_takes_the_sum_of_the_stages_compute():
    scenario = _scenario(**{
        "pipeline.layers_per_stage": list(SPLIT), "pipeline.num_microbatches": 1, "pipeline.schedule": "gpipe",
        "compute": {"kind": "explicit", "block_forward_s": 1.0, "block_backward_s": 2.0, "head_forward_s": 0.5, "head_backward_s": 1.0},
        "network": {"kind": "uniform", "latency_s": 0.0, "bandwidth_bytes_per_s": "Infinity"},
    })
    expected = sum(3.0 * layers / 4 for layers in SPLIT) + 1.5
    assert simulate_iteration(build_pipeline_state(scenario)).time_s == pytest.approx(expected)


def _checkpoint_run(scenario: Scenario):
    return simulate_run(scenario, next(m for m in scenario.methods if m.name == "checkpoint"), ())


def test_sync_checkpoint_serializes_then_writes_the_largest_stage():
    scenario = _scenario(**{"pipeline.layers_per_stage": list(SPLIT), "storage.2.serialization_bytes_per_s": 0.5e9})
    remote = scenario.tier("remote")
    largest = max(stage_checkpoint_bytes(scenario, stage) for stage in range(12))
    per_checkpoint = largest / 0.5e9 + remote.latency_s + largest / remote.write_bandwidth_bytes_per_s
    result = _checkpoint_run(scenario)
    checkpoints = (10 - 1) // 3
    assert result.badput["checkpoint_stall_s"] == pytest.approx(checkpoints * per_checkpoint, rel=1e-9)
    assert result.wall_clock_s == pytest.approx(10 * result.healthy_iteration_time_s + checkpoints * per_checkpoint, rel=1e-9)
    assert any(event.name == "checkpoint serialization (remote)" for event in result.timeline)
    # Without a serialization rate nothing is added (today's behaviour).
    plain = _checkpoint_run(_scenario(**{"pipeline.layers_per_stage": list(SPLIT)}))
    assert plain.badput["checkpoint_stall_s"] == pytest.approx(checkpoints * (remote.latency_s + largest / remote.write_bandwidth_bytes_per_s))


@pytest.mark.parametrize("shared", [False, True])
def test_data_parallel_shards_split_a_per_node_write_but_not_a_shared_link(shared):
    changes = {"pipeline.data_parallel_degree": 4, "storage.2.shared": shared, "storage.2.latency_s": 0.0}
    whole = _scenario(**changes)
    sharded = _scenario(**changes, **{"pipeline.checkpoint_sharding": "data_parallel"})
    bandwidth = whole.tier("remote").write_bandwidth_bytes_per_s
    sizes = [stage_checkpoint_bytes(whole, stage) for stage in range(12)]
    for stage in range(12):
        assert checkpoint_part_bytes(sharded, stage) == pytest.approx(sizes[stage] / 4)
        assert tier_flow_bytes(sharded, "remote" and stage, "remote") == pytest.approx(sizes[stage] if shared else sizes[stage] / 4)
    if shared:
        expected_whole = expected_sharded = sum(sizes) / bandwidth  # every shard crosses the one link
    else:
        expected_whole, expected_sharded = max(sizes) / bandwidth, max(sizes) / 4 / bandwidth
    checkpoints = (10 - 1) // 3
    assert _checkpoint_run(whole).badput["checkpoint_stall_s"] == pytest.approx(checkpoints * expected_whole, rel=1e-6)
    assert _checkpoint_run(sharded).badput["checkpoint_stall_s"] == pytest.approx(checkpoints * expected_sharded, rel=1e-6)


def test_serialization_is_of_one_nodes_shard():
    sharded = _scenario(**{"pipeline.data_parallel_degree": 4, "pipeline.checkpoint_sharding": "data_parallel", "storage.2.serialization_bytes_per_s": 1e9})
    assert serialization_s(sharded, 3, "remote") == pytest.approx(stage_checkpoint_bytes(sharded, 3) / 4 / 1e9)
    assert serialization_s(sharded, 3, "local_disk") == 0.0


def _lazy(scenario: Scenario):
    return simulate_run(scenario, next(m for m in scenario.methods if m.name == "async_checkpoint"), ())


def test_lazy_checkpoint_with_one_host_slot_is_paced_by_copy_plus_flush():
    """DataStates 7B, f = 1: each node's 41.5 GB fills its 64 GB cache, so snapshot k+1 waits until
    snapshot k is copied and flushed: wall = 2 T + (checkpoints − 1)(copy + flush)."""
    scenario = datastates("7b")
    part = max(checkpoint_part_bytes(scenario, stage) for stage in range(2))  # the head's stage, by a few kB
    assert part == pytest.approx(83e9 / 2, rel=0.01)
    copy_s = part / scenario.tier("host_memory").write_bandwidth_bytes_per_s
    flush_s = part / scenario.tier("lustre").write_bandwidth_bytes_per_s
    result = _lazy(scenario)
    iteration_s = result.healthy_iteration_time_s
    assert copy_s + flush_s > iteration_s
    checkpoints = DATASTATES_ITERATIONS - 1
    assert result.wall_clock_s == pytest.approx(2 * iteration_s + (checkpoints - 1) * (copy_s + flush_s), rel=1e-9)


def test_lazy_checkpoint_shards_halve_the_copy_and_flush_and_free_the_cache():
    """With 2 replicas each node holds half: copy + flush (3.0 s) fit in one iteration (3.2 s) and
    the cache holds three shards, so training never waits."""
    scenario = datastates("7b", data_parallel_degree=2)
    part = checkpoint_part_bytes(scenario, 0)
    assert part == pytest.approx(stage_checkpoint_bytes(scenario, 0) / 2)
    result = _lazy(scenario)
    assert result.badput["checkpoint_stall_s"] == 0.0
    assert result.wall_clock_s == pytest.approx(DATASTATES_ITERATIONS * result.healthy_iteration_time_s, rel=1e-9)


def test_deepspeed_preset_is_serialize_then_write_per_node():
    scenario = datastates("13b")
    part = checkpoint_part_bytes(scenario, 0)
    tier = scenario.tier("lustre_torch_save")
    per_checkpoint = max(
        checkpoint_part_bytes(scenario, stage) for stage in range(scenario.pipeline.num_stages)
    ) * (1 / tier.serialization_bytes_per_s + 1 / tier.write_bandwidth_bytes_per_s)
    result = _checkpoint_run(scenario)
    assert result.badput["checkpoint_stall_s"] == pytest.approx((DATASTATES_ITERATIONS - 1) * per_checkpoint, rel=1e-9)
    assert part == stage_checkpoint_bytes(scenario, 0)  # DP 1: one node writes its whole stage
    assert math.isclose(sum(stage_checkpoint_bytes(scenario, s) for s in range(4)), 166e9, rel_tol=1e-9)
