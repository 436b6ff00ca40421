"""The presets with data parallelism: per-node failure rates, real all-reduce bandwidths, CheckFree's
emulator with its replicas failing together and on their own, DataStates' sharded checkpoints."""

from __future__ import annotations

import json
import math

import pytest

from churnsim.calibration.network import CHECKFREE_EMULATOR_SITES, load_site_table
from churnsim.calibration.presets import (
    CHECKFREE_EMULATOR_INDEPENDENT,
    CHECKFREE_EMULATOR_TOGETHER,
    PRESETS,
    checkfree_emulator_replica_link,
    preset,
)

HOURS_IN_54_DAYS = 54 * 24


def test_datacenter_llama3_fails_per_node_at_the_llama3_rate_whatever_its_data_parallel_degree():
    scenario = preset("datacenter-llama3")
    per_node_hour = 419 / (HOURS_IN_54_DAYS * 16_384 / 8)  # 419 interruptions, 2,048 nodes of 8 GPUs
    assert scenario.pipeline.data_parallel_degree == 128
    assert scenario.churn.failures_per_node_hour == pytest.approx(per_node_hour, rel=0.02)
    assert preset("datacenter-llama3", {"pipeline.data_parallel_degree": 8}).churn.failures_per_node_hour == scenario.churn.failures_per_node_hour
    # Its all-reduce is charged: one 400 Gb/s NIC per GPU, 8 GPUs per node.
    assert scenario.network.allreduce_bandwidth_bytes_per_s == 8 * 400e9 / 8
    assert "per node" in scenario.description


def test_checkfree_emulator_presets_differ_only_in_whether_replicas_fail_together():
    together, independent = preset(CHECKFREE_EMULATOR_TOGETHER), preset(CHECKFREE_EMULATOR_INDEPENDENT)
    assert together.pipeline.replicas_fail_together and not independent.pipeline.replicas_fail_together
    # 7 partitions × 3 replicas: 6 block stages and the never-failing embedding node.
    assert (together.pipeline.num_stages, together.pipeline.data_parallel_degree) == (6, 3)
    assert together.pipeline.embedding_placement == "separate_node"
    assert (together.pipeline.microbatch_size, together.pipeline.num_microbatches, together.model.sequence_length) == (8, 6, 1024)

    def without_names(scenario) -> dict:
        document = json.loads(scenario.model_dump_json())
        for key in ("name", "description"):
            document.pop(key)
        document["pipeline"].pop("replicas_fail_together")
        return document

    assert without_names(together) == without_names(independent)
    assert "fail together" in together.description and "on its own" in independent.description
    assert CHECKFREE_EMULATOR_TOGETHER in independent.description  # it says what to compare it with


def test_checkfree_emulator_exchanges_gradients_over_its_slowest_replica_link():
    scenario = preset(CHECKFREE_EMULATOR_TOGETHER)
    latency_s, bandwidth = checkfree_emulator_replica_link()
    assert (scenario.network.allreduce_latency_s, scenario.network.allreduce_bandwidth_bytes_per_s) == (latency_s, bandwidth)
    assert math.isfinite(bandwidth)
    # The emulator's replicas of a stage sit at three sites: the slowest such link is Australia–London.
    assert (latency_s, bandwidth) == load_site_table("checkfree_geo")[("Australia", "London")]
    replica_sites_of_stage_1 = {CHECKFREE_EMULATOR_SITES[node % 7] for node in (3, 4, 5)}
    assert replica_sites_of_stage_1 == {"Germany", "Iowa", "NL"}


def test_checkfree_paper_presets_fail_whole_stages_as_the_paper_does():
    for name in PRESETS:
        if name.startswith("checkfree-") and "-geo-" in name:
            assert preset(name).pipeline.replicas_fail_together, name


def test_datastates_data_parallel_presets_shard_checkpoints_and_charge_the_all_reduce():
    data_parallel = [name for name in PRESETS if name.startswith("datastates-") and "-dp" in name]
    assert {"datastates-13b-dp16", "datastates-30b-dp16"} <= set(data_parallel)
    for name in data_parallel:
        scenario = preset(name)
        assert scenario.pipeline.data_parallel_degree == 16
        assert scenario.pipeline.checkpoint_sharding == "data_parallel"
        assert math.isfinite(scenario.network.allreduce_bandwidth_bytes_per_s)
        assert "1/16" in scenario.description


def test_presets_json_says_whether_replicas_fail_together(capsys):
    from churnsim.cli import main

    main(["presets", "--json"])
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert listed[CHECKFREE_EMULATOR_TOGETHER]["replicas_fail_together"] is True
    assert listed[CHECKFREE_EMULATOR_INDEPENDENT]["replicas_fail_together"] is False
    assert listed[CHECKFREE_EMULATOR_INDEPENDENT]["data_parallel_degree"] == 3


def test_the_checkfree_reproduction_fails_whole_stages():
    from churnsim.sim.checks.reproduce_checkfree import LAYOUTS, SIZES, scenario_for

    for size in SIZES:
        for layout in LAYOUTS:
            assert scenario_for(size, 0.1, layout, replications=2).pipeline.replicas_fail_together, (size, layout)
