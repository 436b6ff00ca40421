"""`checkpoint` and `async_checkpoint` save real files and roll back exactly; every method survives failures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.real.distributed import Communicator
from churnsim.real.launch import run_distributed
from churnsim.real.methods import METHODS, MethodContext, StageRuntime, build_method
from churnsim.real.methods.stage_state import capture_stage_state
from churnsim.real.model import MODEL_PRESETS, StageModule
from churnsim.real.spans import SpanRecorder
from churnsim.real.trainer import TrainingConfig, train_stage

CONFIG = MODEL_PRESETS["tiny"]
NUM_STAGES = 4
SEED = 5
NUM_ITERATIONS = 8
# Every kind of failure: interior, first, two adjacent, last.
MIXED_FAILURES = ((1, 2), (2, 0), (3, 1), (3, 2), (4, 3))
SHORT_RUN_PARAMETERS = {
    "checkpoint": {"interval_iterations": 2},
    "async_checkpoint": {"interval_iterations": 2},
    "redundant": {"fallback_interval_iterations": 2},
}


def _run_config(name: str, failures: tuple, num_iterations: int = NUM_ITERATIONS, **parameters) -> TrainingConfig:
    return TrainingConfig(
        model=CONFIG,
        num_stages=NUM_STAGES,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=num_iterations,
        seed=SEED,
        method=method_from_name(name, **parameters),
        failures=failures,
        corpus_max_bytes=200_000,
        timeout_s=60,
    )


def _snapshot(runtime: StageRuntime) -> dict[str, torch.Tensor]:
    state = capture_stage_state(runtime.module, runtime.optimizer)
    return {key: value.detach().clone() for key, value in state.items() if isinstance(value, torch.Tensor)}


def _context(communicator: Communicator, runtime: StageRuntime, make_optimizer, run_dir: Path) -> MethodContext:
    return MethodContext(
        stage=communicator.rank,
        num_stages=NUM_STAGES,
        model_config=CONFIG,
        runtime=runtime,
        make_optimizer=make_optimizer,
        communicator=communicator,
        device=torch.device("cpu"),
        run_dir=run_dir,
        spans=SpanRecorder(rank=communicator.rank, stage=communicator.rank),
        seed=SEED,
        num_iterations=NUM_ITERATIONS,
    )


def _new_runtime(stage: int):
    module = StageModule(CONFIG, stage, NUM_STAGES, seed=SEED)

    def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-3 * lr_scale)

    return StageRuntime(module=module, optimizer=make_optimizer(1.0)), make_optimizer


def _fake_step(runtime: StageRuntime, stage: int, iteration: int, methods) -> None:
    """One optimizer step with made-up gradients, with the method hooks around it as the trainer calls them."""
    for parameter in runtime.module.parameters():
        parameter.grad = torch.full_like(parameter, 0.01 * (stage + 1) * (iteration + 1))
    for method in methods:
        method.before_optimizer_step(iteration)
    runtime.optimizer.step()
    runtime.optimizer.zero_grad(set_to_none=True)
    for method in methods:
        method.after_optimizer_step(iteration)


def _fail(runtime: StageRuntime, make_optimizer, methods, failed: frozenset[int], iteration: int):
    """What the trainer does to a lost stage: the node dies, a replacement starts from random weights."""
    if runtime.module.stage in failed:
        for method in methods:
            method.forget_node_state()
        runtime.module.reset_parameters(SEED + 1000 + iteration)
        runtime.optimizer = make_optimizer(1.0)


def _sync_and_async(communicator: Communicator, root: Path) -> dict:
    """Both methods checkpoint the same state every 3 iterations; then stage 2 fails before iteration 8."""
    stage = communicator.rank
    runtime, make_optimizer = _new_runtime(stage)
    sync = build_method(method_from_name("checkpoint", interval_iterations=3), _context(communicator, runtime, make_optimizer, root / "sync"))
    lazy = build_method(
        method_from_name("async_checkpoint", interval_iterations=3), _context(communicator, runtime, make_optimizer, root / "async")
    )
    expected = None
    for iteration in range(8):
        _fake_step(runtime, stage, iteration, (lazy, sync))
        if iteration == 5:
            expected = _snapshot(runtime)  # tag 6 = state after iteration 5
    lazy.keeper.engine.wait_until_durable()  # "when all checkpoints are durable"...
    lazy.keeper.engine.mark_boundary()  # ...and a boundary later the node dies: nothing is in flight there
    sync_info = sync.keeper.engine.latest_durable()
    lazy_info = lazy.keeper.engine.latest_durable("remote")
    files = {
        "sync_iteration": sync_info.iteration,
        "async_iteration": lazy_info.iteration,
        "sync_state": sync.keeper.engine.load(sync_info),
        "async_state": lazy.keeper.engine.load(lazy_info),
    }
    failed = frozenset({2})
    _fail(runtime, make_optimizer, (sync, lazy), failed, 8)
    sync_outcome = sync.recover(failed, 8)
    after_sync = _snapshot(runtime)
    with torch.no_grad():
        for parameter in runtime.module.parameters():
            parameter.add_(1.0)  # disturb every stage: the async rollback must restore them all again
    lazy_outcome = lazy.recover(failed, 8)
    after_async = _snapshot(runtime)
    sync.close()
    lazy.close()
    return {
        "files": files,
        "expected": expected,
        "sync_outcome": sync_outcome,
        "async_outcome": lazy_outcome,
        "after_sync": after_sync,
        "after_async": after_async,
    }


def _rollback_stage(communicator: Communicator, root: Path) -> dict:
    """rollback = "stage": checkpoints at tags 2 and 4, stage 1 fails before iteration 5."""
    stage = communicator.rank
    runtime, make_optimizer = _new_runtime(stage)
    method = build_method(
        method_from_name("checkpoint", interval_iterations=2, rollback="stage"), _context(communicator, runtime, make_optimizer, root / "stage")
    )
    at_tag_4 = None
    for iteration in range(5):
        _fake_step(runtime, stage, iteration, (method,))
        if iteration == 3:
            at_tag_4 = _snapshot(runtime)
    before_failure = _snapshot(runtime)
    failed = frozenset({1})
    _fail(runtime, make_optimizer, (method,), failed, 5)
    outcome = method.recover(failed, 5)
    method.close()
    return {"at_tag_4": at_tag_4, "before_failure": before_failure, "after": _snapshot(runtime), "outcome": outcome}


def _worker(communicator: Communicator, root: Path) -> dict:
    torch.set_num_threads(1)
    results = {"sync_and_async": _sync_and_async(communicator, root), "rollback_stage": _rollback_stage(communicator, root)}
    results["baseline"] = train_stage(_run_config("none", ()), communicator)
    results["rollback_all"] = train_stage(
        _run_config("checkpoint", ((5, 2),), interval_iterations=3), communicator, run_dir=root / "run-all"
    )
    results["before_first_checkpoint"] = train_stage(
        _run_config("checkpoint", ((1, 1),), interval_iterations=3), communicator, run_dir=root / "run-early"
    )
    results["short_runs"] = {
        name: train_stage(_run_config(name, MIXED_FAILURES, 6, **SHORT_RUN_PARAMETERS.get(name, {})), communicator)
        for name in METHOD_NAMES
    }
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, NUM_STAGES, tmp_path_factory.mktemp("checkpoint-methods"), timeout_s=120)


def _losses(rank_result) -> list[tuple[int, float]]:
    return [(row["iteration"], row["train_loss"]) for row in rank_result.iteration_rows]


def test_checkpoint_rollback_all_replays_from_last_checkpoint_bit_for_bit(ranks):
    baseline = dict(_losses(ranks[-1]["baseline"]))
    replayed = _losses(ranks[-1]["rollback_all"])
    assert [iteration for iteration, _ in replayed] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    assert all(loss == baseline[iteration] for iteration, loss in replayed)  # exact, deterministic mode
    outcome = ranks[0]["rollback_all"].recoveries[0]
    assert outcome["resume_iteration"] == 3 and outcome["rebuilt_from"] == {2: "checkpoint(iteration 3)"}
    assert {"save", "recovery.load"} <= {span["kind"] for span in ranks[2]["rollback_all"].spans}


def test_checkpoint_failure_before_first_checkpoint_restarts_from_initial_weights(ranks):
    baseline = dict(_losses(ranks[-1]["baseline"]))
    replayed = _losses(ranks[-1]["before_first_checkpoint"])
    assert [iteration for iteration, _ in replayed][:3] == [0, 0, 1]
    assert all(loss == baseline[iteration] for iteration, loss in replayed)
    outcome = ranks[0]["before_first_checkpoint"].recoveries[0]
    assert outcome["resume_iteration"] == 0
    assert any("initial weights" in note for note in outcome["notes"])


def test_async_checkpoint_files_hold_what_a_sync_save_of_the_same_state_holds(ranks):
    for rank in ranks:
        files = rank["sync_and_async"]["files"]
        assert files["sync_iteration"] == files["async_iteration"] == 6
        sync_state, async_state = files["sync_state"], files["async_state"]
        assert sync_state.keys() == async_state.keys()
        for key, value in sync_state.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == async_state[key].dtype and torch.equal(value, async_state[key]), key
            else:
                assert value == async_state[key], key


def test_async_and_sync_rollbacks_agree_on_resume_iteration_and_restored_state(ranks):
    for rank in ranks:
        scenario = rank["sync_and_async"]
        assert scenario["sync_outcome"].resume_iteration == scenario["async_outcome"].resume_iteration == 6
        for restored in (scenario["after_sync"], scenario["after_async"]):
            assert restored.keys() == scenario["expected"].keys()
            assert all(torch.equal(restored[key], value) for key, value in scenario["expected"].items())


def test_rollback_stage_reloads_only_the_failed_stage_without_rewinding(ranks):
    for stage, rank in enumerate(ranks):
        scenario = rank["rollback_stage"]
        target = scenario["at_tag_4"] if stage == 1 else scenario["before_failure"]
        assert scenario["after"].keys() == target.keys()
        assert all(torch.equal(scenario["after"][key], value) for key, value in target.items()), stage
        assert scenario["outcome"].resume_iteration is None
        assert scenario["outcome"].rebuilt_from == {1: "checkpoint(iteration 4)"}
    assert not torch.equal(ranks[1]["rollback_stage"]["at_tag_4"]["module.blocks.0.attention.wq.weight"],
                           ranks[1]["rollback_stage"]["before_failure"]["module.blocks.0.attention.wq.weight"])


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_method_finishes_a_run_with_edge_interior_and_adjacent_failures(ranks, name):
    assert name in METHODS
    head = ranks[-1]["short_runs"][name]
    assert head.iteration_rows[-1]["iteration"] == 5
    assert all(math.isfinite(row["train_loss"]) for row in head.iteration_rows)
    assert math.isfinite(head.iteration_rows[-1]["eval_loss"])
    recorded = sorted((row["iteration"], row["stage"]) for rank in ranks for row in rank["short_runs"][name].failures)
    assert recorded == sorted(MIXED_FAILURES)
    assert [row["failed_stages"] for row in ranks[0]["short_runs"][name].recoveries] == [[2], [0], [1, 2], [3]]
