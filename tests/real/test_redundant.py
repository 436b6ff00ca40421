"""`redundant` recovers single failures exactly from the predecessor's replica and falls back to checkpoints."""

from __future__ import annotations

import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.real.distributed import Communicator
from churnsim.real.launch import run_distributed
from churnsim.real.methods.redundant import is_fatal
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.trainer import TrainingConfig, train_stage

NUM_STAGES = 4
SINGLE_FAILURES = ((3, 2), (5, 1), (6, 3))  # interior, interior, last: one at a time
FATAL_FAILURES = ((4, 0), (7, 1), (7, 2))  # stage 0, then two adjacent stages


def _run_config(name: str, failures: tuple, **parameters) -> TrainingConfig:
    return TrainingConfig(
        model=MODEL_PRESETS["tiny"],
        num_stages=NUM_STAGES,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=9,
        seed=13,
        method=method_from_name(name, **parameters),
        failures=failures,
        corpus_max_bytes=200_000,
        timeout_s=60,
    )


def _worker(communicator: Communicator) -> dict:
    return {
        "baseline": train_stage(_run_config("none", ()), communicator),
        "single": train_stage(_run_config("redundant", SINGLE_FAILURES), communicator),
        "random": train_stage(_run_config("random", SINGLE_FAILURES), communicator),
        "fatal": train_stage(_run_config("redundant", FATAL_FAILURES, fallback_interval_iterations=3), communicator),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, NUM_STAGES, timeout_s=120)


def _losses(rank_result) -> list[tuple[int, float]]:
    return [(row["iteration"], row["train_loss"]) for row in rank_result.iteration_rows]


def test_redundant_recovers_interior_and_last_stage_failures_exactly_without_rollback(ranks):
    baseline = _losses(ranks[-1]["baseline"])
    assert _losses(ranks[-1]["single"]) == baseline  # bit for bit, no iteration replayed
    recoveries = ranks[0]["single"].recoveries
    assert [row["rebuilt_from"] for row in recoveries] == [{2: "replica on stage 1"}, {1: "replica on stage 0"}, {3: "replica on stage 2"}]
    assert all(row["resume_iteration"] is None for row in recoveries)


def test_the_same_failures_without_a_replica_change_the_loss(ranks):
    # The failures really destroy state: a method that keeps the fresh init diverges from the baseline.
    baseline = dict(_losses(ranks[-1]["baseline"]))
    assert any(loss != baseline[iteration] for iteration, loss in _losses(ranks[-1]["random"])[4:])


def test_redundant_falls_back_to_checkpoints_when_stage_0_or_adjacent_stages_fail(ranks):
    baseline = dict(_losses(ranks[-1]["baseline"]))
    replayed = _losses(ranks[-1]["fatal"])
    assert all(loss == baseline[iteration] for iteration, loss in replayed)  # rollback is exact too
    first, second = ranks[0]["fatal"].recoveries
    assert first["resume_iteration"] == 3 and first["rebuilt_from"] == {0: "checkpoint(iteration 3)"}
    assert "stage 0 lost" in first["notes"][0]
    assert second["failed_stages"] == [1, 2] and second["resume_iteration"] == 6
    assert "stages 1 and 2 lost together" in second["notes"][0]


def test_every_stage_but_the_last_runs_the_redundant_forward_and_receives_replicas(ranks):
    for stage, rank in enumerate(ranks):
        kinds = {span["kind"] for span in rank["single"].spans}
        assert ("redundant_forward" in kinds) == (stage < NUM_STAGES - 1)
        assert "replica_refresh" in kinds


@pytest.mark.parametrize(
    ("failed", "fatal"),
    [({2}, False), ({1, 3}, False), ({3}, False), ({0}, True), ({1, 2}, True), ({2, 3}, True)],
)
def test_fatal_failures_are_stage_0_or_adjacent_pairs(failed, fatal):
    assert is_fatal(frozenset(failed)) is fatal
