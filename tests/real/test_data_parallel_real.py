"""Real runs with data parallelism: an S × D grid of processes, gradients averaged over each stage's
replicas, a lost replica healed by an exact copy from a survivor, a stage lost with every replica
recovered by the method in every replica pipeline. Tiny model, few iterations: CPU, gloo."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.calibration.replica_rule import plan_node_losses
from churnsim.real.distributed import Communicator, data_parallel_communicators
from churnsim.real.launch import launch_local, run_distributed
from churnsim.real.methods import MethodContext, StageRuntime, build_method
from churnsim.real.methods.stage_state import capture_stage_state
from churnsim.real.model import MODEL_PRESETS, StageModule
from churnsim.real.replica_heal import node_loss_actions
from churnsim.real.spans import SpanRecorder
from churnsim.real.trainer import TrainingConfig, train_stage

CONFIG = MODEL_PRESETS["tiny"]


def _config(**overrides) -> TrainingConfig:
    settings = dict(
        model=CONFIG, num_stages=2, data_parallel_degree=2, num_microbatches=2, microbatch_size=2, num_iterations=4, seed=5,
        method=method_from_name("checkfree"), corpus_max_bytes=200_000, timeout_s=60,
    )  # fmt: skip
    return TrainingConfig(**(settings | overrides))


def _copies(state: dict) -> dict:
    return {key: value.detach().clone() for key, value in state.items() if isinstance(value, torch.Tensor)}


# -- the decision: the real side's actions against the contract's rule ------------------------------


def _expected(lost: frozenset, num_stages: int, replicas: int, reliable: frozenset) -> tuple[dict, frozenset, dict]:
    """An independent statement of the rule: heals {node: source}, lost stages, handled_as."""
    heals, lost_stages, handled = {}, set(), {}
    for stage in range(num_stages):
        mine = {node for node in lost if node[0] == stage}
        if not mine:
            continue
        if stage in reliable:
            handled |= dict.fromkeys(mine, "ignored")
            continue
        survivors = [replica for replica in range(replicas) if (stage, replica) not in lost]
        if not survivors:
            lost_stages.add(stage)
            handled |= dict.fromkeys(mine, "stage_loss")
        else:
            heals |= {node: survivors[0] for node in mine}
            handled |= dict.fromkeys(mine, "replica_heal")
    return heals, frozenset(lost_stages), handled


def _loss_patterns(num_stages: int, replicas: int, rng: random.Random):
    nodes = [(stage, replica) for stage in range(num_stages) for replica in range(replicas)]
    if len(nodes) <= 10:
        for size in range(1, len(nodes) + 1):
            yield from (frozenset(chosen) for chosen in itertools.combinations(nodes, size))
        return
    for _ in range(400):
        yield frozenset(rng.sample(nodes, rng.randint(1, len(nodes))))
    for stage in range(num_stages):  # every stage lost whole, alone
        yield frozenset((stage, replica) for replica in range(replicas))


@pytest.mark.parametrize("num_stages", range(2, 7))
@pytest.mark.parametrize("replicas", range(1, 4))
@pytest.mark.parametrize(
    "method",
    [method_from_name("checkfree"), method_from_name("checkfree", edge_stages_reliable=True), method_from_name("checkpoint"),
     method_from_name("redundant")],
    ids=["checkfree", "checkfree-reliable-edges", "checkpoint", "redundant"],
)  # fmt: skip
def test_real_node_loss_actions_equal_the_simulator_rule_and_an_independent_oracle(num_stages, replicas, method):
    from churnsim.calibration.rebuild_plan import reliable_stages

    reliable = reliable_stages(method, num_stages)
    rng = random.Random(num_stages * 10 + replicas)
    for lost in _loss_patterns(num_stages, replicas, rng):
        actions = node_loss_actions(method, lost, num_stages=num_stages, data_parallel_degree=replicas)
        plan = plan_node_losses(method, lost, num_stages=num_stages, data_parallel_degree=replicas)
        heals, lost_stages, handled = _expected(lost, num_stages, replicas, reliable)
        # The simulator's plan and the real actions: the same heals and stage losses.
        assert actions.heals == plan.heals
        assert actions.lost_stages == plan.lost_stages == lost_stages
        assert {(heal.stage, heal.replica): heal.source_replica for heal in actions.heals} == heals
        assert actions.handled_as == handled
        assert actions.wiped == frozenset(node for node in lost if node[0] not in reliable)
        for heal in actions.heals:  # a source always survived
            assert (heal.stage, heal.source_replica) not in lost


def test_a_method_that_ignores_failures_only_records_them():
    actions = node_loss_actions(method_from_name("none"), {(0, 0), (0, 1)}, num_stages=2, data_parallel_degree=2, destroys_state=False)
    assert (actions.wiped, actions.heals, actions.lost_stages) == (frozenset(), (), frozenset())
    assert set(actions.handled_as.values()) == {"recorded"}


# -- the heal's copy, bit-exact --------------------------------------------------------------------


def _heal_on_rank(world: Communicator, method_name: str):
    """2 × 2: replica 0 trains two steps on its own gradients, replica 1 holds other weights and no
    optimizer state; then replica 1 of every stage heals from replica 0. Returns both states."""
    from churnsim.calibration.replica_rule import ReplicaHeal
    from churnsim.real.replica_heal import heal_replicas

    num_stages = 2
    pipeline, stage_group = data_parallel_communicators(world, num_stages, 2)
    stage, replica = pipeline.rank, stage_group.rank
    module = StageModule(CONFIG, stage, num_stages, seed=7 + 100 * replica)

    def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(module.parameters(), lr=1e-3 * lr_scale)

    runtime = StageRuntime(module=module, optimizer=make_optimizer(1.0))
    context = MethodContext(
        stage=stage, num_stages=num_stages, model_config=CONFIG, runtime=runtime, make_optimizer=make_optimizer,
        communicator=pipeline, device=torch.device("cpu"), run_dir=None, spans=SpanRecorder(rank=world.rank, stage=stage),
        seed=7, num_iterations=4, replica=replica,
    )  # fmt: skip
    method = build_method(method_from_name(method_name), context)
    if replica == 0:
        generator = torch.Generator().manual_seed(world.rank)
        for iteration in range(2):
            for parameter in module.parameters():
                parameter.grad = torch.randn(parameter.shape, generator=generator) * 0.01
            method.before_optimizer_step(iteration)
            runtime.optimizer.step()
        runtime.lr_scale = 1.1
    before = _copies(capture_stage_state(module, runtime.optimizer))
    cost = heal_replicas(stage_group, runtime, make_optimizer, method, [ReplicaHeal(stage=stage, replica=1, source_replica=0, optimizer_state_from="source")])
    after = _copies(capture_stage_state(module, runtime.optimizer))
    method.close()
    return {"stage": stage, "replica": replica, "before": before, "after": after, "lr_scale": runtime.lr_scale,
            "heal_state": method.heal_state(), "bytes_sent": cost.bytes_sent, "bytes_received": cost.bytes_received}  # fmt: skip


@pytest.mark.parametrize("method_name", ["checkfree", "redundant"])
def test_a_heal_copies_weights_optimizer_and_method_state_bit_exactly(method_name):
    results = run_distributed(_heal_on_rank, 4, method_name, timeout_s=60)
    by_node = {(each["stage"], each["replica"]): each for each in results}
    for stage in range(2):
        source, healed = by_node[(stage, 0)], by_node[(stage, 1)]
        assert set(source["before"]) == set(healed["after"])
        assert any(key.startswith("optimizer.") for key in source["before"])  # AdamW state was there to copy
        assert any(not torch.equal(healed["before"][key], source["before"][key]) for key in healed["before"])  # it differed
        for key, tensor in source["before"].items():
            assert torch.equal(healed["after"][key], tensor), key
            assert healed["after"][key].dtype == tensor.dtype
        for key, tensor in source["before"].items():  # the source is untouched
            assert torch.equal(source["after"][key], tensor), key
        assert healed["lr_scale"] == source["lr_scale"] == 1.1
        assert healed["heal_state"].keys() == source["heal_state"].keys()
        for key, value in source["heal_state"].items():
            assert torch.equal(healed["heal_state"][key], value) if isinstance(value, torch.Tensor) else healed["heal_state"][key] == value
        assert source["bytes_sent"] > 0 and healed["bytes_received"] >= source["bytes_sent"]


# -- whole runs ------------------------------------------------------------------------------------


def _train_and_keep_state(world: Communicator, config: TrainingConfig):
    kept = {}

    def keep(parts) -> None:
        kept["state"] = _copies(capture_stage_state(parts.runtime.module, parts.runtime.optimizer))
        kept["node"] = [parts.stage, parts.replica]

    result = train_stage(config, world, after_run=keep)
    return {"result": result, **kept}


def _replicas_identical(outputs, num_stages: int, replicas: int) -> None:
    states = {tuple(each["node"]): each["state"] for each in outputs}
    for stage in range(num_stages):
        reference = states[(stage, 0)]
        for replica in range(1, replicas):
            other = states[(stage, replica)]
            assert set(other) == set(reference)
            for key, tensor in reference.items():
                assert torch.equal(other[key], tensor), (stage, replica, key)


def test_two_replicas_train_as_one_pipeline_on_the_whole_global_batch():
    """Averaging each stage's gradients over D replicas, each on its shard of the global batch, is
    the one-pipeline step on the whole batch: a 2 × 2 run's losses are a 2 × 1 run's with twice the
    microbatches (equal up to float rounding; the data shards are the microbatches in order)."""
    grid = _config(method=method_from_name("none"), num_iterations=3)
    one = _config(method=method_from_name("none"), num_iterations=3, data_parallel_degree=1, num_microbatches=4)
    from churnsim.real.results import merge_rank_results

    grid_outputs = run_distributed(_train_and_keep_state, 4, grid, timeout_s=60)
    one_outputs = run_distributed(_train_and_keep_state, 2, one, timeout_s=60)
    grid_losses = merge_rank_results(grid, [each["result"] for each in grid_outputs]).metrics["train_loss"].tolist()
    one_losses = merge_rank_results(one, [each["result"] for each in one_outputs]).metrics["train_loss"].tolist()
    assert len(grid_losses) == len(one_losses) == 3
    assert grid_losses == pytest.approx(one_losses, rel=1e-5)
    assert grid_losses[0] != grid_losses[-1]  # it trained
    _replicas_identical(grid_outputs, 2, 2)


def test_a_2x2_run_heals_a_lost_replica_from_its_survivor_and_the_replicas_stay_identical():
    config = _config(failures=((2, 1, 1),), num_iterations=4)
    outputs = run_distributed(_train_and_keep_state, 4, config, timeout_s=60)
    from churnsim.real.results import merge_rank_results

    result = merge_rank_results(config, [each["result"] for each in outputs])
    assert [(row.stage, row.replica, row.iteration) for row in result.failures.itertuples()] == [(1, 1, 2)]
    (heal,) = result.recoveries
    assert heal["handled_as"] == "replica_heal" and heal["replicas_waited"] is True
    assert heal["heals"] == [{"stage": 1, "replica": 1, "source_replica": 0}]
    assert heal["heal_bytes"] > 0
    heal_spans = result.spans[result.spans["kind"] == "recovery.heal"]
    assert set(zip(heal_spans["stage"], heal_spans["replica"])) == {(1, 0), (1, 1)}
    assert (heal_spans["bytes"] > 0).all()
    reduces = result.spans[result.spans["kind"] == "allreduce"]
    assert len(reduces) == 4 * 4 and (reduces["bytes"] > 0).all()  # every node, every iteration
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    _replicas_identical(outputs, 2, 2)


@pytest.mark.parametrize(
    ("method", "rebuilt_from", "resume_iteration"),
    [(method_from_name("checkfree"), "edge_checkpoint(initial weights)", None),
     (method_from_name("checkpoint", interval_iterations=1), "checkpoint(iteration 2)", 2)],
    ids=["checkfree", "checkpoint"],
)  # fmt: skip
def test_a_stage_that_loses_every_replica_goes_to_the_method_in_every_replica_pipeline(method, rebuilt_from, resume_iteration, tmp_path):
    config = _config(method=method, failures=((2, 0, 0), (2, 0, 1)), num_iterations=4)
    result = launch_local(config, run_dir=tmp_path / "run")
    rows = [row for row in result.recoveries if row.get("handled_as") == "stage_loss"]
    assert sorted(row["replica"] for row in rows) == [0, 1]
    for row in rows:  # the same recovery in both replica pipelines, each from its own stage's files
        assert row["failed_stages"] == [0]
        assert row["rebuilt_from"] == {0: rebuilt_from}
        assert row["resume_iteration"] == resume_iteration
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    assert result.metrics["iteration"].iloc[-1] == 3
    assert (tmp_path / "run" / "recoveries.csv").read_text().count("stage_loss") == 2


def _methods_grid():
    for name in METHOD_NAMES:
        stages = max(2, getattr(type(method_from_name(name)), "minimum_stages", 1))
        yield pytest.param(name, stages, id=name)


@pytest.mark.parametrize(("method_name", "num_stages"), list(_methods_grid()))
def test_every_method_runs_a_2_replica_grid_with_a_heal_and_a_stage_loss(method_name, num_stages):
    """A replica of the last stage heals at step 1; stage 1 loses both replicas at step 2."""
    last = num_stages - 1
    config = _config(
        method=method_from_name(method_name), num_stages=num_stages, num_iterations=3,
        failures=((1, last, 1), (2, 1, 0), (2, 1, 1)),
    )  # fmt: skip
    outputs = run_distributed(_train_and_keep_state, num_stages * 2, config, timeout_s=90)
    from churnsim.real.results import merge_rank_results

    result = merge_rank_results(config, [each["result"] for each in outputs])
    assert len(result.failures) == 3
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    handled = sorted(row.get("handled_as") for row in result.recoveries)
    if method_name == "none":
        assert handled == []  # failures recorded, state kept
    else:
        assert handled == ["replica_heal", "stage_loss", "stage_loss"]
    _replicas_identical(outputs, num_stages, 2)


def test_the_failure_table_of_a_data_parallel_run_is_the_sampled_node_path(tmp_path):
    """The nodes a 2 × 2 real run injects are those `failures_for_replication` samples for its scenario."""
    from churnsim.calibration.failure_sampling import failures_for_replication
    from churnsim.calibration.run_record import read_run_record
    from churnsim.cli import main

    out = tmp_path / "real"
    main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--set", "pipeline.data_parallel_degree=2",
          "--set", "target.loss=null", "--set", "target.iterations=40", "--out", str(out)])  # fmt: skip
    record = read_run_record(out)
    scenario = record.manifest.scenario
    assert scenario is not None and scenario.pipeline.data_parallel_degree == 2
    real = record.failures.failures
    sampled = failures_for_replication(scenario, replication=record.manifest.replication, horizon_s=real[-1].time_s + 1.0 if real else 1.0)
    assert len(real) >= 1
    assert [(each.stage, each.replica) for each in real] == [(each.stage, each.replica) for each in sampled[: len(real)]]
    for injected, event in zip(real, sampled):
        assert event.time_s <= injected.time_s
    assert record.manifest.real_settings.pipeline.data_parallel_degree == 2
    assert record.manifest.real_settings.pipeline.while_replica_missing == "wait"
    assert any("every replica waits" in note for note in record.manifest.notes)
    reduces = record.spans[record.spans["kind"] == "allreduce"]  # what calibration learns the all-reduce from
    assert set(reduces["replica"]) == {0, 1} and (reduces["bytes"] > 0).all()
    if scenario.pipeline.while_replica_missing != "wait":
        assert any("a real run waits" in note for note in record.manifest.notes)


def test_the_failure_table_names_replicas_only_when_a_run_has_them_and_old_tables_still_read():
    from churnsim.calibration.failures import FAILURE_COLUMNS, FailureSchedule, ScheduledFailure

    nodes = FailureSchedule(failures=(ScheduledFailure(time_s=1.5, iteration=3, stage=1, replica=2, kind="poisson"),))
    text = nodes.to_csv()
    assert text.splitlines()[1] == "time_s,iteration,stage,kind,replica"
    assert FailureSchedule.from_csv(text) == nodes
    stages = FailureSchedule(failures=(ScheduledFailure(time_s=1.5, iteration=3, stage=1, kind="poisson"),))
    assert stages.to_csv().splitlines()[1] == ",".join(FAILURE_COLUMNS)  # a one-pipeline table is unchanged
    assert FailureSchedule.from_csv(stages.to_csv()).failures[0].replica == 0


def _agree_on_rank(world: Communicator, same: bool):
    from types import SimpleNamespace

    from churnsim.real.trainer import _check_replicas_agree

    pipeline, stage_group = data_parallel_communicators(world, 1, 2)
    module = StageModule(CONFIG, 0, 1, seed=3 if same else 3 + world.rank)
    parts = SimpleNamespace(stage_group=stage_group, runtime=SimpleNamespace(module=module), stage=0, config=SimpleNamespace(method=method_from_name("checkpoint")))
    try:
        _check_replicas_agree(parts, "in the test")
    except RuntimeError as error:
        return str(error)
    return None


def test_replicas_that_recovered_differently_fail_the_run_and_equal_ones_pass():
    assert run_distributed(_agree_on_rank, 2, True, timeout_s=60) == [None, None]
    errors = run_distributed(_agree_on_rank, 2, False, timeout_s=60)
    assert all(error is not None and "replicas hold different weights" in error for error in errors)


# -- hard failures: a node's process is killed and replaced ----------------------------------------


def _worker_keeping_state(*arguments):
    """A worker of the agent (real/agent_worker.py's `run_local_worker`) that also hands back the
    state its slot ended with."""
    from churnsim.real.agent_worker import run_local_worker

    kept = {}

    def keep(parts) -> None:
        kept["state"] = _copies(capture_stage_state(parts.runtime.module, parts.runtime.optimizer))
        kept["node"] = [parts.stage, parts.replica]

    gathered = run_local_worker(*arguments, after_run=keep)
    return {"gathered": gathered, **kept}


def _hard_run(config: TrainingConfig, run_dir):
    """A hard-failure run through torch.distributed.elastic's agent, as `launch_local` runs it (one
    agent, a worker per (stage, replica) node); checkpoints in `run_dir`. Returns each node's final
    state and the merged result."""
    import dataclasses

    from churnsim.real import launch
    from churnsim.real.results import merge_rank_results
    from churnsim.real.run_secret import checkpoint_key, new_token

    token = new_token()
    config = dataclasses.replace(config, checkpoint_key=checkpoint_key(token))
    scratch = run_dir / "scratch"
    scratch.mkdir()
    values = launch._run_hard_failures(
        config, run_dir, scratch, None, None, token=token, rendezvous_host="127.0.0.1", poll=lambda: None, poll_interval_s=0.25,
        on_warning=None, entrypoint=_worker_keeping_state,
    )  # fmt: skip
    outputs = [values[rank] for rank in sorted(values)]
    return outputs, merge_rank_results(config, outputs[0]["gathered"])


def test_a_killed_replica_s_replacement_process_heals_from_the_survivor_bit_exactly(tmp_path):
    config = _config(failure_mode="hard", join_delay_s=0.2, failures=((2, 1, 1),), num_iterations=4)
    outputs, result = _hard_run(config, tmp_path)
    assert [(row.stage, row.replica, row.iteration) for row in result.failures.itertuples()] == [(1, 1, 2)]
    (heal,) = result.recoveries
    assert (heal["handled_as"], heal["failure_mode"]) == ("replica_heal", "hard")
    assert heal["heals"] == [{"stage": 1, "replica": 1, "source_replica": 0}]
    assert heal["heal_bytes"] > 0 and heal["join_s"] >= 0.2
    joins = result.spans[result.spans["kind"] == "recovery.join"]
    assert list(zip(joins["stage"], joins["replica"])) == [(1, 1)]  # a new process joined for that node
    assert result.metrics["iteration"].tolist() == [0, 1, 2, 3]
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    _replicas_identical(outputs, 2, 2)


def test_a_stage_whose_every_replica_is_killed_is_recovered_by_the_method_in_every_replica_pipeline(tmp_path):
    config = _config(
        method=method_from_name("checkpoint", interval_iterations=1), failure_mode="hard", join_delay_s=0.2,
        failures=((2, 0, 0), (2, 0, 1)), num_iterations=4,
    )  # fmt: skip
    outputs, result = _hard_run(config, tmp_path)
    rows = [row for row in result.recoveries if row.get("handled_as") == "stage_loss"]
    assert sorted(row["replica"] for row in rows) == [0, 1]
    assert all(row["failure_mode"] == "hard" and row["resume_iteration"] == 2 for row in rows)
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    _replicas_identical(outputs, 2, 2)


def test_a_replica_process_killed_from_outside_mid_run_is_replaced_and_healed(tmp_path):
    """An operator's SIGKILL of node (1, 1)'s process at any moment: the agent restarts the grid, the
    survivors reload from node memory and the new process of (1, 1) copies replica 0 of its stage;
    training ends with finite loss."""
    import os
    import signal

    from churnsim.real.agent_launch import worker_pids
    from churnsim.real.trainer import EXTERNAL_KILL_KIND

    run_dir = tmp_path / "run"
    killed = []

    def kill_at_step_three(row: dict) -> None:
        if killed or row["step"] < 3:
            return
        pid = worker_pids().get(3)  # worker 3 runs slot 3 = stage 1 of replica 1
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return  # ended in a restart just now: at the next report
            killed.append(pid)

    config = _config(failure_mode="hard", join_delay_s=0.2, num_iterations=12)
    result = launch_local(config, run_dir=run_dir, on_progress=kill_at_step_three, progress_interval_s=0.02)
    assert len(killed) == 1
    assert [(row.stage, row.replica, row.kind) for row in result.failures.itertuples()] == [(1, 1, EXTERNAL_KILL_KIND)]
    heals = [row for row in result.recoveries if row.get("handled_as") == "replica_heal"]
    assert len(heals) == 1 and {"stage": 1, "replica": 1, "source_replica": 0} in heals[0]["heals"]
    assert result.metrics["iteration"].iloc[-1] == 11
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])


@pytest.mark.slow
@pytest.mark.parametrize(("method_name", "num_stages"), list(_methods_grid()))
def test_every_method_trains_a_2_replica_grid_through_hard_kills(method_name, num_stages, tmp_path):
    """As the soft test above with processes killed and replaced: a replica of the last stage at
    step 1 (healed), both replicas of stage 1 at step 2 (the method's recovery)."""
    last = num_stages - 1
    config = _config(
        method=method_from_name(method_name), num_stages=num_stages, num_iterations=4, failure_mode="hard", join_delay_s=0.1,
        failures=((1, last, 1), (2, 1, 0), (2, 1, 1)),
    )  # fmt: skip
    outputs, result = _hard_run(config, tmp_path)
    assert len(result.failures) == 3
    assert result.metrics["iteration"].iloc[-1] == 3
    assert all(math.isfinite(loss) for loss in result.metrics["train_loss"])
    handled = sorted(row.get("handled_as") for row in result.recoveries)
    assert handled == ([] if method_name == "none" else ["replica_heal", "stage_loss", "stage_loss"])
    _replicas_identical(outputs, num_stages, 2)


def test_replicas_of_a_lost_stage_reload_the_same_asynchronous_snapshot():
    """`async_checkpoint` with a stage-local rollback: each replica's lost stage reloads a snapshot
    that every replica holds durably (their background writers may be at different tags)."""
    config = _config(
        method=method_from_name("async_checkpoint", interval_iterations=1, rollback="stage"), failures=((3, 1, 0), (3, 1, 1)),
        num_iterations=5,
    )  # fmt: skip
    outputs = run_distributed(_train_and_keep_state, 4, config, timeout_s=60)
    rows = [row for each in outputs for row in each["result"].recoveries if row.get("handled_as") == "stage_loss"]
    assert sorted(row["replica"] for row in rows) == [0, 1]
    assert rows[0]["rebuilt_from"] == rows[1]["rebuilt_from"]
    _replicas_identical(outputs, 2, 2)
