"""Plain CheckFree's edge stages for real: the edge checkpoint keeps the embedding, a copy does not."""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.real.distributed import Communicator
from churnsim.real.launch import run_distributed
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.trainer import TrainingConfig, train_stage

NUM_STAGES = 2
NUM_ITERATIONS = 40
FAILURE_STEP = 35
EDGE_INTERVAL_ITERATIONS = 10
# A corpus the tiny model learns to near-zero loss in 30 iterations, but only through the embedding:
# the next byte is the current letter's successor. A model without a usable embedding can do no
# better than the letters' frequencies, ln 26 nats.
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
LETTERS_ONLY_LOSS = math.log(len(ALPHABET))
CHANCE_LOSS = math.log(256)  # an untrained byte-level model: 5.55


def _config(corpus: str, failures: tuple[tuple[int, int], ...], **parameters) -> TrainingConfig:
    return TrainingConfig(
        model=MODEL_PRESETS["tiny"],
        num_stages=NUM_STAGES,
        num_microbatches=2,
        microbatch_size=4,
        num_iterations=NUM_ITERATIONS,
        seed=3,
        learning_rate=3e-3,
        method=method_from_name("checkfree", **parameters),
        failures=failures,
        corpus=corpus,
        timeout_s=60,
    )


def _runs(communicator: Communicator, configs: dict[str, TrainingConfig]) -> dict:
    # One spawned group for every run: starting processes costs more than the work.
    return {name: train_stage(config, communicator) for name, config in configs.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    corpus = tmp_path_factory.mktemp("corpus") / "alphabet.txt"
    corpus.write_text(ALPHABET * 2000)
    failure = ((FAILURE_STEP, 0),)
    configs = {
        "checkpoint": _config(str(corpus), failure, edge_fallback="checkpoint", edge_checkpoint_interval_iterations=EDGE_INTERVAL_ITERATIONS),
        "copy": _config(str(corpus), failure, edge_fallback="copy"),
        "reliable": _config(str(corpus), failure, edge_stages_reliable=True),
        "no_failure": _config(str(corpus), (), edge_stages_reliable=True),
    }
    return run_distributed(_runs, NUM_STAGES, configs, timeout_s=300)


def _losses(results, name: str) -> list[float]:
    return [row["train_loss"] for row in results[-1][name].iteration_rows]


def test_edge_checkpoint_restores_the_embedding_so_the_loss_stays_far_below_chance(results):
    losses, reference = _losses(results, "checkpoint"), _losses(results, "no_failure")
    assert losses[FAILURE_STEP - 1] < 0.5  # learned: far below ln 26 and ln 256
    # Stage 0 is 5 iterations stale, the others are current: the loss barely moves.
    assert losses[FAILURE_STEP] < 0.5
    assert losses[FAILURE_STEP] == pytest.approx(reference[FAILURE_STEP], abs=0.1)
    recovery = results[0]["checkpoint"].recoveries
    assert [row["rebuilt_from"] for row in recovery] == [{0: "edge_checkpoint(iteration 30)"}]
    assert recovery[0]["lr_scale"] == 1.0  # the reloaded optimizer, not a rebuilt stage's scaled one
    assert any("5 iteration(s) stale" in note for note in recovery[0]["notes"])


def test_edge_copy_leaves_a_random_embedding_and_the_loss_returns_towards_chance(results):
    losses = _losses(results, "copy")
    assert losses[FAILURE_STEP - 1] < 0.5
    # Everything learned is gone: worse than knowing only the letters' frequencies.
    assert losses[FAILURE_STEP] > LETTERS_ONLY_LOSS and losses[FAILURE_STEP] > 0.6 * CHANCE_LOSS
    recovery = results[0]["copy"].recoveries
    assert [row["rebuilt_from"] for row in recovery] == [{0: "copy(1)"}]
    assert any(note.startswith("stage 0 embedding: random init") for note in recovery[0]["notes"])


def test_reliable_edge_stages_record_the_failure_and_train_as_if_none_happened(results):
    assert [row["stage"] for row in results[0]["reliable"].failures] == [0]
    assert results[0]["reliable"].recoveries == []
    assert _losses(results, "reliable") == _losses(results, "no_failure")


def test_edge_checkpoints_are_saved_every_interval_and_only_when_they_can_be_needed(results):
    saves = {name: [span for span in results[0][name].spans if span["kind"] == "save"] for name in ("checkpoint", "copy", "reliable")}
    assert len(saves["checkpoint"]) == NUM_ITERATIONS // EDGE_INTERVAL_ITERATIONS
    assert saves["copy"] == [] and saves["reliable"] == []
