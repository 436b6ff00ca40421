"""What a checkpoint recovery reads: only levels that survive the failure, never a damaged or foreign
checkpoint, and a resumed run only its own run's durable checkpoints (one rank, a stand-in communicator)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from churnsim.real.checkpoint import LazyAsyncCheckpointEngine
from churnsim.real.checkpoint.format import read_header
from churnsim.real.methods import MethodContext, StageRuntime
from churnsim.real.methods.checkpointing import CheckpointDirectories, CheckpointKeeper, synchronous_engine
from churnsim.real.methods.stage_state import capture_stage_state
from churnsim.real.model import MODEL_PRESETS, StageModule
from churnsim.real.spans import SpanRecorder

CONFIG = MODEL_PRESETS["tiny"]
STAGE, NUM_STAGES, SEED = 1, 4, 3


class OneRank:
    """The communicator of a one-rank world: gathers return this rank's value."""

    rank, world_size = STAGE, 1
    group_stages = (STAGE,)

    def all_gather_objects(self, value):
        return [value]


def make_keeper(root: Path, *, run_id: str = "run-a", resume: bool = False, engine: str = "sync"):
    module = StageModule(CONFIG, STAGE, NUM_STAGES, seed=SEED)

    def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-3 * lr_scale)

    runtime = StageRuntime(module=module, optimizer=make_optimizer(1.0))
    context = MethodContext(
        stage=STAGE, num_stages=NUM_STAGES, model_config=CONFIG, runtime=runtime, make_optimizer=make_optimizer,
        communicator=OneRank(), device=torch.device("cpu"), run_dir=root, spans=SpanRecorder(rank=STAGE, stage=STAGE),
        seed=SEED, num_iterations=10, run_id=run_id, resume=resume,
    )
    directories = CheckpointDirectories(context)
    if engine == "sync":
        built = synchronous_engine(context, directories, "remote")
    else:  # nothing ever reaches the remote level
        built = LazyAsyncCheckpointEngine(directories.local, directories.remote, 1 << 22, run_id=run_id, stage=STAGE,
                                          throttle_remote_bytes_per_s=1.0)
    return CheckpointKeeper(context, built, directories, interval_iterations=2, rollback="all"), runtime


def train(keeper: CheckpointKeeper, runtime: StageRuntime, iterations: range) -> dict[int, dict[str, torch.Tensor]]:
    """Steps with made-up gradients; the state at every checkpoint tag."""
    saved = {}
    for iteration in iterations:
        for parameter in runtime.module.parameters():
            parameter.grad = torch.full_like(parameter, 0.01 * (iteration + 1))
        keeper.before_optimizer_step()
        runtime.optimizer.step()
        keeper.after_optimizer_step(iteration)
        if (iteration + 1) % 2 == 0:
            saved[iteration + 1] = {k: v.clone() for k, v in capture_stage_state(runtime.module, runtime.optimizer).items()
                                    if isinstance(v, torch.Tensor)}
    return saved


def assert_restored(runtime: StageRuntime, expected: dict[str, torch.Tensor]) -> None:
    state = capture_stage_state(runtime.module, runtime.optimizer)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_a_damaged_newest_checkpoint_falls_back_to_the_next_one_all_stages_hold(tmp_path):
    keeper, runtime = make_keeper(tmp_path)
    saved = train(keeper, runtime, range(5))  # tags 2 and 4
    (newest,) = [info for info in keeper.engine.list_durable() if info.iteration == 4]
    header, _ = read_header(newest.data_path)
    entry = next(iter(header["tensors"].values()))
    with open(newest.data_path, "r+b") as file:  # one flipped bit in the weights
        file.seek(entry["offset"])
        byte = file.read(1)
        file.seek(entry["offset"])
        file.write(bytes([byte[0] ^ 1]))
    outcome = keeper.recover(frozenset({STAGE}), 5)
    assert outcome.resume_iteration == 2
    assert_restored(runtime, saved[2])
    assert any("iteration 4 not loadable" in note and "checksum mismatch" in note for note in outcome.notes)
    keeper.close()


def test_a_failed_stage_reads_only_levels_that_survive_node_loss(tmp_path):
    keeper, runtime = make_keeper(tmp_path, engine="async")
    train(keeper, runtime, range(4))
    deadline = time.monotonic() + 30
    while keeper.available_tags() != {0, 2, 4}:  # held at the node-local level...
        assert time.monotonic() < deadline
        time.sleep(0.01)
    outcome = keeper.recover(frozenset({STAGE}), 4)  # ...which a failed stage must not read, wiped or not
    assert outcome.resume_iteration == 0
    keeper.forget_node_state()  # stops the throttled remote copy
    keeper.close()


def test_resume_restores_its_own_runs_newest_durable_checkpoint_and_nothing_else(tmp_path):
    first, runtime = make_keeper(tmp_path)
    saved = train(first, runtime, range(6))  # tags 2, 4, 6; the process then dies
    first.close()
    other_run, _ = make_keeper(tmp_path, run_id="run-b", resume=True)
    outcome = other_run.resume()
    assert outcome.resume_iteration == 0  # run-a's checkpoints are not run-b's, and the notes say why
    assert any("checkpoint skipped: " in note and "belongs to another run or stage" in note for note in outcome.notes)
    other_run.close()
    resumed, runtime = make_keeper(tmp_path, resume=True)
    outcome = resumed.resume()
    assert outcome.resume_iteration == 6 and outcome.failed_stages == frozenset(range(NUM_STAGES))
    assert_restored(runtime, saved[6])
    train(resumed, runtime, range(6, 8))  # and it checkpoints on under the same run id
    assert max(info.iteration for info in resumed.engine.list_durable()) == 8
    resumed.close()


def test_a_fresh_run_ignores_what_an_earlier_run_of_the_same_id_left(tmp_path):
    first, runtime = make_keeper(tmp_path)
    train(first, runtime, range(4))
    first.close()
    fresh, _ = make_keeper(tmp_path)
    assert fresh.available_tags() == {0}
    fresh.close()


@pytest.mark.parametrize("rollback", ["stage"])
def test_stage_rollback_skips_a_damaged_checkpoint(tmp_path, rollback):
    keeper, runtime = make_keeper(tmp_path)
    keeper.rollback = rollback
    saved = train(keeper, runtime, range(4))
    (newest,) = [info for info in keeper.engine.list_durable() if info.iteration == 4]
    newest.data_path.write_bytes(newest.data_path.read_bytes()[:-1] + b"\0")  # the metadata's last byte
    assert keeper.restore_newest() == 2
    assert_restored(runtime, saved[2])
    keeper.close()
