"""CheckFree, CheckFree+ and the ablations rebuild lost stages from the right neighbours, for real."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import pytest
import torch

from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.real.distributed import Communicator
from churnsim.real.launch import run_distributed
from churnsim.real.methods import (
    METHODS,
    MethodContext,
    RecoveryMethod,
    RecoveryOutcome,
    StageRuntime,
    build_method,
    register_method,
)
from churnsim.calibration.rebuild_plan import plan_rebuild
from churnsim.real.methods.rebuild import CheckFreeMethod, CheckFreePlusMethod, gradient_weight
from churnsim.real.model import MODEL_PRESETS, StageModule
from churnsim.real.spans import SpanRecorder
from churnsim.real.trainer import TrainingConfig, train_stage

CONFIG = MODEL_PRESETS["tiny"]
NUM_STAGES = 4
SEED = 9
BASE_LR = 1e-3
LR_SCALE = 1.25
REBUILD_METHODS = ("checkfree", "checkfree_plus", "copy", "uniform", "random")


def _gradient_value(stage: int) -> float:
    return 0.01 * (stage + 1)  # different gradient norms per stage, so ω differ


def _blocks(module: StageModule) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.part_parameters("blocks").values()]).clone()


def _method_on_rank(communicator: Communicator, made: contextlib.ExitStack, name: str, **parameters):
    """A method of stage `communicator.rank`, closed when `made` closes."""
    stage = communicator.rank
    module = StageModule(CONFIG, stage, NUM_STAGES, seed=SEED)

    def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=BASE_LR * lr_scale)

    runtime = StageRuntime(module=module, optimizer=make_optimizer(1.0))
    context = MethodContext(
        stage=stage,
        num_stages=NUM_STAGES,
        model_config=CONFIG,
        runtime=runtime,
        make_optimizer=make_optimizer,
        communicator=communicator,
        device=torch.device("cpu"),
        run_dir=None,
        spans=SpanRecorder(rank=stage, stage=stage),
        seed=SEED,
        num_iterations=10,
    )
    method = build_method(method_from_name(name, lr_scale=LR_SCALE, **parameters), context)
    made.callback(method.close)
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, _gradient_value(stage))
    method.before_optimizer_step(0)
    return method, runtime


def _fail(method, runtime: StageRuntime, failed: frozenset[int], iteration: int):
    """What the trainer does at a failure: reset the lost stage, then recover collectively."""
    stage = runtime.module.stage
    if stage in failed:
        runtime.module.reset_parameters(SEED + 1000 + iteration)
        runtime.optimizer = method.context.make_optimizer(1.0)
        method.forget_node_state()
    return method.recover(failed, iteration)


def _rebuild_scenarios(communicator: Communicator) -> dict:
    torch.set_num_threads(1)
    results: dict = {}
    with contextlib.ExitStack() as made:  # closes every method made: edge checkpoints live in temporary directories
        method, runtime = _method_on_rank(communicator, made, "checkfree", weighting="squared_l2")
        outcome = _fail(method, runtime, frozenset({2}), 0)
        results["interior"] = {
            "blocks": _blocks(runtime.module),
            "lr": runtime.optimizer.param_groups[0]["lr"],
            "outcome": outcome,
        }
        _fail(method, runtime, frozenset({2}), 1)  # the same stage fails again
        results["interior"]["lr_after_second_failure"] = runtime.optimizer.param_groups[0]["lr"]

        method, runtime = _method_on_rank(communicator, made, "checkfree", edge_fallback="copy")
        outcome = _fail(method, runtime, frozenset({1, 2}), 0)
        results["adjacent"] = {"blocks": _blocks(runtime.module), "outcome": outcome}

        # CheckFree+: the replica taken at the refresh is restored, not the weights trained after it.
        method, runtime = _method_on_rank(communicator, made, "checkfree_plus", replica_refresh_iterations=5)
        method.after_optimizer_step(0)  # refresh: stage 1 holds the embedding, stage 2 the head
        embedding_at_refresh = runtime.module.embedding.weight.detach().clone() if runtime.module.embedding is not None else None
        head_at_refresh = runtime.module.lm_head.weight.detach().clone() if runtime.module.lm_head is not None else None
        with torch.no_grad():
            for parameter in runtime.module.parameters():
                parameter.add_(1.0)  # training after the refresh
        outcome = _fail(method, runtime, frozenset({0, 3}), 1)
        results["plus_edges"] = {
            "blocks": _blocks(runtime.module),
            "embedding": runtime.module.embedding.weight.detach().clone() if runtime.module.embedding is not None else None,
            "embedding_at_refresh": embedding_at_refresh,
            "head": runtime.module.lm_head.weight.detach().clone() if runtime.module.lm_head is not None else None,
            "head_at_refresh": head_at_refresh,
            "outcome": outcome,
        }
        # The holder of the embedding replica dies together with its owner: random init, reported.
        outcome = _fail(method, runtime, frozenset({0, 1}), 2)
        results["plus_lost_replica"] = {"outcome": outcome}
    return results


def _all_scenarios(communicator: Communicator) -> dict:
    # One spawned group for the whole file: starting processes costs more than the work.
    return {"rebuilt": _rebuild_scenarios(communicator), "short_runs": _short_runs(communicator)}


@pytest.fixture(scope="module")
def worker_results() -> list[dict]:
    return run_distributed(_all_scenarios, NUM_STAGES, timeout_s=120)


@pytest.fixture(scope="module")
def rebuilt(worker_results) -> list[dict]:
    return [rank_result["rebuilt"] for rank_result in worker_results]


@functools.lru_cache(maxsize=None)
def _expected_stage_blocks(stage: int) -> torch.Tensor:
    return _blocks(StageModule(CONFIG, stage, NUM_STAGES, seed=SEED))


def _expected_gradient_norm(stage: int) -> float:
    num_block_parameters = _expected_stage_blocks(stage).numel()
    return math.sqrt(num_block_parameters) * _gradient_value(stage)


def test_checkfree_rebuilds_interior_stage_as_squared_gradient_norm_weighted_average(rebuilt):
    omega_previous = _expected_gradient_norm(1) ** 2
    omega_next = _expected_gradient_norm(3) ** 2
    expected = (omega_previous * _expected_stage_blocks(1).double() + omega_next * _expected_stage_blocks(3).double()) / (
        omega_previous + omega_next
    )
    torch.testing.assert_close(rebuilt[2]["interior"]["blocks"], expected.float())
    # Not the uniform average: the weights matter.
    uniform = (_expected_stage_blocks(1) + _expected_stage_blocks(3)) / 2
    assert not torch.allclose(rebuilt[2]["interior"]["blocks"], uniform)


def test_checkfree_gives_rebuilt_stage_scaled_lr_and_leaves_neighbours_untouched(rebuilt):
    assert rebuilt[2]["interior"]["lr"] == pytest.approx(BASE_LR * LR_SCALE)
    assert rebuilt[2]["interior"]["lr_after_second_failure"] == pytest.approx(BASE_LR * LR_SCALE)  # no compounding
    assert rebuilt[1]["interior"]["lr"] == pytest.approx(BASE_LR)
    for stage in (0, 1, 3):
        torch.testing.assert_close(rebuilt[stage]["interior"]["blocks"], _expected_stage_blocks(stage), rtol=0, atol=0)
    outcome = rebuilt[0]["interior"]["outcome"]
    assert outcome.rebuilt_from == {2: "weighted_average(1,3)"} and outcome.lr_scale == LR_SCALE


def test_checkfree_adjacent_lost_stages_copy_their_surviving_neighbours_not_each_other(rebuilt):
    torch.testing.assert_close(rebuilt[1]["adjacent"]["blocks"], _expected_stage_blocks(0), rtol=0, atol=0)
    torch.testing.assert_close(rebuilt[2]["adjacent"]["blocks"], _expected_stage_blocks(3), rtol=0, atol=0)
    assert rebuilt[0]["adjacent"]["outcome"].rebuilt_from == {1: "copy(0)", 2: "copy(3)"}


def test_checkfree_plus_edges_copy_swap_partner_and_restore_replicated_embedding_and_head(rebuilt):
    scenario_0, scenario_3 = rebuilt[0]["plus_edges"], rebuilt[3]["plus_edges"]
    # Partners had trained (+1) after the refresh; the edge copies their current blocks.
    torch.testing.assert_close(scenario_0["blocks"], _expected_stage_blocks(1) + 1.0)
    torch.testing.assert_close(scenario_3["blocks"], _expected_stage_blocks(2) + 1.0)
    torch.testing.assert_close(scenario_0["embedding"], scenario_0["embedding_at_refresh"], rtol=0, atol=0)
    torch.testing.assert_close(scenario_3["head"], scenario_3["head_at_refresh"], rtol=0, atol=0)
    assert scenario_0["outcome"].rebuilt_from == {0: "copy(1)", 3: "copy(2)"}
    assert scenario_0["outcome"].notes == ()


def test_checkfree_plus_reports_random_embedding_when_replica_holder_is_lost_too(rebuilt):
    outcome = rebuilt[0]["plus_lost_replica"]["outcome"]
    assert outcome.rebuilt_from == {0: "random", 1: "copy(2)"}
    assert any("stage 0 embedding" in note and "holder stage 1 also lost" in note for note in outcome.notes)
    assert all(rank_result["plus_lost_replica"]["outcome"] == outcome for rank_result in rebuilt)


FAILURES = ((1, 2), (2, 0), (3, 1), (3, 2), (4, 3))  # interior, first, two adjacent, last


def _run_config(name: str) -> TrainingConfig:
    return TrainingConfig(
        model=CONFIG,
        num_stages=NUM_STAGES,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=6,
        seed=SEED,
        schedule="1f1b",
        method=method_from_name(name),
        failures=FAILURES,
        corpus_max_bytes=200_000,
        timeout_s=60,
    )


class _RollbackTwoIterations(RecoveryMethod):
    """Test double of a rollback method: every failure resumes two iterations earlier."""

    name = "checkpoint"

    def recover(self, failed_stages, iteration):
        return RecoveryOutcome(failed_stages=failed_stages, resume_iteration=max(iteration - 2, 0))


def _short_runs(communicator: Communicator) -> dict:
    """Worker: a short training run per method in one process group (spawning is the slow part)."""
    results = {name: train_stage(_run_config(name), communicator) for name in REBUILD_METHODS}
    results["checkfree_again"] = train_stage(_run_config("checkfree"), communicator)
    global_clip = dataclasses.replace(_run_config("checkfree"), gradient_clipping="global", max_gradient_norm=0.5)
    results["global_clip"] = train_stage(global_clip, communicator)
    register_method(_RollbackTwoIterations)  # only in this spawned process
    rollback = dataclasses.replace(_run_config("checkpoint"), failures=((4, 1),))
    results["rollback"] = train_stage(rollback, communicator)
    return results


@pytest.fixture(scope="module")
def short_runs(worker_results) -> list[dict]:
    return [rank_result["short_runs"] for rank_result in worker_results]


@pytest.mark.parametrize("name", REBUILD_METHODS)
def test_every_neighbour_rebuild_method_survives_edge_and_adjacent_failures(short_runs, name):
    head = short_runs[-1][name]
    losses = [row["train_loss"] for row in head.iteration_rows]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert math.isfinite(head.iteration_rows[-1]["eval_loss"])
    recorded = sorted((row["iteration"], row["stage"]) for r in short_runs for row in r[name].failures)
    assert recorded == sorted(FAILURES)
    recoveries = short_runs[0][name].recoveries
    assert [row["failed_stages"] for row in recoveries] == [[2], [0], [1, 2], [3]]
    assert {"recovery.join", "recovery.transfer", "recovery.rebuild"} <= {s["kind"] for s in short_runs[2][name].spans}


def test_deterministic_mode_reproduces_a_run_with_failures_exactly(short_runs):
    first = [row["train_loss"] for row in short_runs[-1]["checkfree"].iteration_rows]
    again = [row["train_loss"] for row in short_runs[-1]["checkfree_again"].iteration_rows]
    assert first == again


def test_global_gradient_clipping_trains_with_finite_loss_and_differs_from_per_stage(short_runs):
    global_losses = [row["train_loss"] for row in short_runs[-1]["global_clip"].iteration_rows]
    per_stage_losses = [row["train_loss"] for row in short_runs[-1]["checkfree"].iteration_rows]
    assert all(math.isfinite(loss) for loss in global_losses)
    assert global_losses[0] == per_stage_losses[0] and global_losses[-1] != per_stage_losses[-1]


def test_a_rollback_outcome_replays_iterations_while_steps_keep_counting(short_runs):
    rows = short_runs[-1]["rollback"].iteration_rows
    assert [row["step"] for row in rows] == list(range(8))
    assert [row["iteration"] for row in rows] == [0, 1, 2, 3, 2, 3, 4, 5]


def test_registry_names_are_calibration_method_names():
    assert set(REBUILD_METHODS) | {"none"} <= set(METHODS) <= set(METHOD_NAMES)
    assert METHODS["checkfree"] is CheckFreeMethod and METHODS["checkfree_plus"] is CheckFreePlusMethod


@pytest.mark.parametrize(
    ("weighting", "norm", "expected"), [("squared_l2", 3.0, 9.0), ("l2", 3.0, 3.0), ("uniform", 3.0, 1.0)]
)
def test_gradient_weight_options(weighting, norm, expected):
    assert gradient_weight(norm, weighting) == expected


def test_rebuild_plan_descriptions_name_their_sources():
    assert plan_rebuild(method_from_name("checkfree"), {2}, 4)[2].description == "weighted_average(1,3)"
    assert plan_rebuild(method_from_name("uniform"), {2}, 4)[2].description == "uniform_average(1,3)"
    assert plan_rebuild(method_from_name("copy"), {1, 2}, 4)[2].description == "copy(3)"
    assert plan_rebuild(method_from_name("random"), {0}, 4)[0].description == "random"
    assert plan_rebuild(method_from_name("checkfree"), {0}, 4)[0].description == "edge_checkpoint"
