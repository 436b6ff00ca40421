"""Hard failures (issue 10, parts 1 and 2; issue 47): stage processes that die and are replaced, levels apart.

Every local hard-failure run goes through torch.distributed.elastic's agent (real/agent_launch.py),
each worker standing in for a machine. Every method trains through at least three kills of a stage's
process in one run: kills the failure injector schedules (the stage's process SIGKILLs itself at the
boundary) and a SIGKILL this test sends to a worker the agent names (`agent_launch.worker_pids`). The
agent restarts every worker, the survivors reload their state from node memory, the killed stage's
new process starts after the join delay and the method recovers the stage over the network or from
files; the loss stays finite, and the run record shows the join, rendezvous, transfer and load spans,
what each recovery moved and what the agent's restart cost (recoveries.csv). `redundant` hands the
lost stage over from its predecessor's replica and ends bit for bit where a run without failures
ends. `async_checkpoint` keeps its remote level in another directory behind a throttled path, and a
killed stage reads only that level: its node-local level died with it.

The multi-process runs share one module fixture (one run per method) to stay within a few minutes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import save_scenario
from churnsim.real.agent_launch import worker_pids
from churnsim.real.checkpoint import SynchronousCheckpointEngine
from churnsim.real.journal import RankJournal
from churnsim.real.launch import RunAborted, launch_local, main, rendezvous_timeout_s
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.pipeline import message_flow_completes
from churnsim.real.node_memory import default_root
from churnsim.real.run_directory import RECOVERIES_FILE
from churnsim.real.run_secret import derive, read_secret_file
from churnsim.real.calibration_suite import SuiteSettings
from churnsim.real.convergence_lab import cpu_tiny_lab_settings
from churnsim.real.scenario_run import training_config
from churnsim.real.trainer import EXTERNAL_KILL_KIND, FAILURE_KIND, TrainingConfig

NUM_STAGES = 4
NUM_ITERATIONS = 22
JOIN_DELAY_S = 0.3
RUN_TIMEOUT_S = 30.0
SCHEDULED_KILLS = ((3, 2), (7, 0))  # (step, stage): an interior stage, then stage 0 (the recorder)
EXTERNAL_KILLS = ((12, 3),)  # (at or after step, stage): the last stage, which computes the loss
# Fast enough that the remote level keeps up with a checkpoint every 2 iterations of ~50 ms (1 MB
# checkpoints): at 8 MB/s it fell behind on a fast machine, and no stage held a checkpoint when one was killed.
REMOTE_BYTES_PER_S = 32e6
METHOD_PARAMETERS: dict[str, dict] = {
    "checkpoint": {"interval_iterations": 2},
    "async_checkpoint": {"interval_iterations": 2},
    "redundant": {"fallback_interval_iterations": 2},
    "checkfree": {"edge_checkpoint_interval_iterations": 2},
}
METHODS = ("none", "checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus", "copy", "uniform", "random")
NETWORK_METHODS = ("redundant", "checkfree", "checkfree_plus", "copy", "uniform")
FILE_METHODS = ("checkpoint", "async_checkpoint")
REDUNDANT_KILLS = ((3, 2), (11, 1), (17, 3))  # interior and last stages: none is fatal alone


def _config(method: str, *, failures=SCHEDULED_KILLS, join_delay_s=JOIN_DELAY_S, failure_mode="hard", **fields) -> TrainingConfig:
    return TrainingConfig(
        model=MODEL_PRESETS["tiny"],
        num_stages=NUM_STAGES,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=NUM_ITERATIONS,
        seed=13,
        method=method_from_name(method, **METHOD_PARAMETERS.get(method, {})),
        failures=failures,
        corpus_max_bytes=200_000,
        timeout_s=RUN_TIMEOUT_S,
        failure_mode=failure_mode,
        join_delay_s=join_delay_s,
        **fields,
    )


def _node_memory_left(run_dir: Path) -> list[Path]:
    """What the run keeps in node memory (real/node_memory.py): nothing once it ended."""
    label = derive(read_secret_file(run_dir / "run.secret"), "node-memory")[:16]
    return list(default_root().glob(f"churnsim-{label}-*"))


class ExternalKiller:
    """The launcher's progress callback: once a step is reached, SIGKILL that stage's current process
    as an operator would, by the pid the agent names (worker `s` runs stage `s`: a restarted worker
    takes the stage its node held, and a lost stage goes to the worker whose node lost it)."""

    def __init__(self, run_dir: Path, plan: tuple[tuple[int, int], ...]) -> None:
        self.run_dir = run_dir
        self.plan = list(plan)
        self.killed: list[tuple[int, int, int]] = []  # (step seen, stage, pid)

    def __call__(self, row: dict) -> None:
        if self.plan and row["step"] >= self.plan[0][0]:
            stage = self.plan[0][1]
            pid = worker_pids().get(stage)
            if pid is None:
                return  # the agent is restarting its workers right now: at the next report
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return  # it just ended in a restart: at the next report
            self.plan.pop(0)
            self.killed.append((row["step"], stage, pid))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One hard-failure run per method, and a run without failures to compare against."""
    results = {}
    for method in METHODS:
        run_dir = tmp_path_factory.mktemp(f"run-{method}")
        fields = {}
        if method == "none":
            # `none` ignores the failures it is told about (the no-failure reference): all three kills come from outside.
            plan, failures = ((4, 1), (10, 0), (16, 3)), ()
        else:
            plan, failures = EXTERNAL_KILLS, SCHEDULED_KILLS
        if method == "async_checkpoint":
            fields = {"remote_checkpoint_dir": str(tmp_path_factory.mktemp("remote-fs")), "remote_checkpoint_bytes_per_s": REMOTE_BYTES_PER_S}
        killer = ExternalKiller(run_dir, plan)
        # Progress is looked at often: on a fast machine an iteration takes tens of milliseconds, and
        # a kill seen a quarter second late landed after the other stages had finished.
        result = launch_local(_config(method, failures=failures, **fields), run_dir=run_dir, on_progress=killer, progress_interval_s=0.02)
        results[method] = {"result": result, "killed": killer.killed, "run_dir": run_dir}
    exact_dir = tmp_path_factory.mktemp("run-redundant-exact")
    results["redundant_exact"] = {
        "result": launch_local(_config("redundant", failures=REDUNDANT_KILLS, join_delay_s=0.5), run_dir=exact_dir),
        "run_dir": exact_dir,
    }
    results["baseline"] = {"result": launch_local(_config("none", failures=(), failure_mode="soft"))}
    return results


# -- every method, three kills ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_through_three_hard_kills_with_finite_loss(runs, method):
    run = runs[method]
    result = run["result"]
    assert len(run["killed"]) == (3 if method == "none" else len(EXTERNAL_KILLS)), run["killed"]
    kinds = result.failures["kind"].tolist()
    assert kinds.count(EXTERNAL_KILL_KIND) == len(run["killed"])
    assert len(kinds) >= 3
    if method != "none":
        assert result.failures[result.failures["kind"] == FAILURE_KIND][["iteration", "stage"]].values.tolist() == [list(k) for k in SCHEDULED_KILLS]
    # Every iteration was trained, the loss is finite throughout and came from the head process.
    metrics = result.metrics
    assert metrics["iteration"].iloc[-1] == NUM_ITERATIONS - 1
    assert metrics["train_loss"].map(math.isfinite).all(), metrics
    assert math.isfinite(metrics["eval_loss"].iloc[-1])
    # Every killed stage was handed over (two kills close together may share one recovery; a
    # redundant degraded phase adds a row before its hand-over), each replacement after a join.
    handovers = [row for row in result.recoveries if not row.get("degraded")]
    killed_stages = [int(stage) for stage in result.failures["stage"]]
    assert sorted({stage for row in handovers for stage in row["failed_stages"]}) == sorted(set(killed_stages))
    assert sorted(result.spans[result.spans["kind"] == "recovery.join"]["stage"]) == sorted(killed_stages)
    for row in handovers:
        assert row["failure_mode"] == "hard"
        assert row["join_s"] >= JOIN_DELAY_S, row
        # Bounded by the launcher's own limit (a slower rendezvous fails the run), not by a guess of the machine's speed.
        assert 0 <= row["rendezvous_s"] < rendezvous_timeout_s(RUN_TIMEOUT_S, JOIN_DELAY_S), row
    spans = set(result.spans["kind"])
    assert {"recovery.join", "recovery.rendezvous"} <= spans


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_the_run_record_shows_each_recovery_its_seconds_and_bytes(runs, method):
    run = runs[method]
    run_dir = run["run_dir"]
    assert _node_memory_left(run_dir) == []  # the run's snapshots are gone with it
    table = pd.read_csv(run_dir / RECOVERIES_FILE)
    assert len(table) == len(run["result"].recoveries)
    assert {"join_s", "rendezvous_s", "transfer_s", "load_s", "network_bytes", "file_bytes", "levels_read"} <= set(table.columns)
    spans = pd.read_csv(run_dir / "spans.csv")
    joins = spans[spans["kind"] == "recovery.join"]
    assert sorted(joins["stage"]) == sorted(int(stage) for row in run["result"].recoveries if not row.get("degraded") for stage in row["failed_stages"])
    handovers = table[~table["degraded"].fillna(False).astype(bool)]
    if method in NETWORK_METHODS:
        assert (handovers["network_bytes"] > 0).any()
        assert "recovery.transfer" in set(spans["kind"])
    if method in FILE_METHODS:
        assert (handovers["file_bytes"] > 0).any()
        assert "recovery.load" in set(spans["kind"])
    if method in ("none", "random"):
        assert (handovers["network_bytes"] == 0).all() and (handovers["file_bytes"] == 0).all()


# -- redundant: handed over exactly -------------------------------------------------------------


@pytest.mark.slow
def test_redundant_hands_the_lost_stage_over_from_its_predecessor_and_loses_nothing(runs):
    """The agent restarts every worker: the survivors reload their stages from node memory (they do
    not train degraded meanwhile), and the restarted worker of the killed stage gets its weights from
    the replica its predecessor holds."""
    result = runs["redundant_exact"]["result"]
    baseline = runs["baseline"]["result"].metrics
    # Three scheduled kills, at iteration boundaries: every iteration's loss is bit for bit the loss
    # without failures (survivors reload what they held, the lost stage comes back exactly).
    last_of_each_iteration = result.metrics.groupby("iteration")["train_loss"].last()
    assert last_of_each_iteration.tolist() == baseline["train_loss"].tolist()
    rows = result.recoveries
    assert [row["failed_stages"] for row in rows] == [[stage] for _, stage in REDUNDANT_KILLS]
    for row in rows:
        (stage,) = row["failed_stages"]
        assert not row["degraded"] and row["rebuilt_from"] == {stage: f"replica on stage {stage - 1}"}
        assert row["network_bytes"] > 0 and row["resume_iteration"] is None
        # The agent's restart, named: every survivor reloaded its snapshot from node memory.
        assert row["restart_round"] >= 1 and row["survivor_reload_bytes"] > 0 and row["survivor_restart_s"] > 0
        assert row["detection_s"] >= 0 and row["agent_restart_s"] >= 0 and row["process_start_s"] > 0
    assert _node_memory_left(runs["redundant_exact"]["run_dir"]) == []


@pytest.mark.slow
def test_redundant_falls_back_to_checkpoints_when_stage_0_is_killed(runs):
    rows = runs["redundant"]["result"].recoveries
    fatal = [row for row in rows if 0 in row["failed_stages"] and not row["degraded"]]
    assert len(fatal) == 1
    assert "stage 0 lost" in fatal[0]["notes"][0]
    # Every stage rolled back to a fallback checkpoint read from the remote level, stage 2 included,
    # whose checkpoints its host wrote while it was down.
    assert fatal[0]["resume_iteration"] > 0 and fatal[0]["file_bytes"] > 0
    assert fatal[0]["levels_read"] == {stage: ["remote"] for stage in range(NUM_STAGES)}


@pytest.mark.slow
def test_killing_every_stage_at_once_fails_the_run_and_resume_continues_it(tmp_path):
    """No survivor is left to recover from: the run fails as a soft-failure run does, keeps its
    durable checkpoints, and `resume` continues it under hard failures."""
    run_dir = tmp_path / "run"
    config = dataclasses.replace(_config("checkpoint", failures=()), num_stages=2)

    def kill_everyone(row: dict) -> None:
        if row["step"] >= 6:
            for pid in worker_pids().values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    with pytest.raises(RunAborted, match="every stage process died") as raised:
        launch_local(config, run_dir=run_dir, on_progress=kill_everyone, progress_interval_s=0.02)
    assert "\n" not in str(raised.value)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert _node_memory_left(run_dir) == []
    assert list((run_dir / "checkpoints").glob("stage-*/*.manifest.json"))
    resumed = launch_local(config, run_dir=run_dir, resume=True)
    # The record keeps the killed attempt's steps and appends the resumed one's (results.join_attempts).
    metrics = resumed.metrics
    (resume,) = [row for row in resumed.recoveries if "failure_mode" not in row]
    kept = resume["step"]
    assert metrics["step"].tolist() == list(range(len(metrics))) and kept >= 6
    assert metrics["iteration"].iloc[0] == 0 and resume["iteration"] == metrics["iteration"].iloc[kept - 1] + 1
    assert 0 < resume["resume_iteration"] <= resume["iteration"]
    assert metrics["iteration"].tolist()[kept:] == list(range(resume["resume_iteration"], NUM_ITERATIONS))
    assert metrics["train_loss"].map(math.isfinite).all()


@pytest.mark.slow
def test_a_death_before_the_run_started_ends_it_in_one_line(tmp_path):
    """A worker killed before the first group formed: no node holds any state, so the agent's
    restart finds nothing to recover from and the run ends with one line (nothing retried)."""
    run_dir = tmp_path / "run"
    killed: list[int] = []
    stop = threading.Event()

    def kill_a_starting_worker() -> None:
        while not stop.is_set() and not killed:
            pid = worker_pids().get(1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.001)

    killer = threading.Thread(target=kill_a_starting_worker, daemon=True)
    killer.start()
    try:
        with pytest.raises(RunAborted, match="one died before the run's first group formed") as raised:
            launch_local(dataclasses.replace(_config("checkpoint", failures=()), num_stages=2), run_dir=run_dir)
    finally:
        stop.set()
        killer.join()
    assert len(killed) == 1 and "\n" not in str(raised.value)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert _node_memory_left(run_dir) == []


def test_a_run_that_dies_more_often_than_its_replacement_cap_ends_in_one_line_naming_the_cap(tmp_path):
    """recovery.max_replacements (TrainingConfig.max_replacements) caps the agent's restarts: two
    scheduled kills against a cap of one end the run after the second, with one line saying so."""
    run_dir = tmp_path / "run"
    config = dataclasses.replace(_config("checkpoint", failures=((3, 1), (6, 1))), num_stages=2, max_replacements=1)
    with pytest.raises(RunAborted, match=r"restarted the workers 1 times, the most it may \(recovery.max_replacements\)") as raised:
        launch_local(config, run_dir=run_dir)
    assert "\n" not in str(raised.value)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"


# -- levels apart -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_stage_reads_only_the_remote_level_on_its_own_file_system(runs):
    run = runs["async_checkpoint"]
    result, run_dir = run["result"], run["run_dir"]
    config = result.config
    remote = Path(config.remote_checkpoint_dir)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    # The remote level lives in the other directory, not in the run directory.
    assert sorted(path.name for path in (remote / run_id).iterdir()) == [f"stage-{s}" for s in range(NUM_STAGES)]
    assert not (run_dir / "checkpoints").exists()
    for row in result.recoveries:
        for stage, levels in row["levels_read"].items():
            if stage in row["failed_stages"]:
                assert set(levels) == {"remote"}, row  # its node-local level died with its process
    # Survivors restore from their node-local level when it holds the agreed checkpoint.
    assert any("local" in levels for row in result.recoveries for levels in row["levels_read"].values())
    # Reading the remote level goes through the throttled path: at least its size over the rate.
    loads = result.spans[result.spans["kind"] == "recovery.load"]
    killed_loads = [
        span for row in result.recoveries for span in loads.itertuples()
        if span.stage in row["failed_stages"] and span.iteration == row["step"] and row["file_bytes"] > 0
    ]  # fmt: skip
    assert killed_loads
    smallest_checkpoint_bytes = 200_000
    assert all(span.end_s - span.start_s >= smallest_checkpoint_bytes / REMOTE_BYTES_PER_S for span in killed_loads)


def test_the_newest_checkpoint_is_found_when_its_latest_pointer_is_lost(tmp_path):
    import torch

    engine = SynchronousCheckpointEngine(tmp_path / "remote", level="remote", run_id="run-a", stage=1, keep_last=3)
    for iteration in (2, 4, 6):
        engine.save({"weights": torch.full((4,), float(iteration))}, iteration)
    (tmp_path / "remote" / "latest").unlink()
    newest = engine.latest_durable()
    assert newest is not None and newest.iteration == 6
    assert engine.load(newest)["weights"].tolist() == [6.0] * 4
    engine.close()


def test_a_throttled_remote_level_paces_writes_and_reads(tmp_path):
    import torch

    state = {"weights": torch.zeros(250_000)}  # 1 MB
    rate = 10e6
    engine = SynchronousCheckpointEngine(tmp_path / "remote", level="remote", throttle_bytes_per_s=rate)
    started = time.perf_counter()
    engine.save(state, 1)
    saved_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.load(engine.latest_durable())
    loaded_s = time.perf_counter() - started
    engine.close()
    assert saved_s >= 1e6 / rate and loaded_s >= 1e6 / rate
    with pytest.raises(InputError):
        SynchronousCheckpointEngine(tmp_path / "other", throttle_bytes_per_s=0)


# -- pieces ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_process_running_two_stages_cannot_deadlock_the_pipeline(schedule):
    for num_stages in range(2, 7):
        for num_microbatches in range(1, 7):
            for absent in range(1, num_stages):
                placement = tuple(absent - 1 if stage == absent else stage for stage in range(num_stages))
                assert message_flow_completes(
                    schedule, num_stages=num_stages, num_microbatches=num_microbatches, swap_odd_microbatches=False, placement=placement
                ), (num_stages, num_microbatches, placement)


def test_a_journal_outlives_its_process_and_drops_abandoned_steps(tmp_path):
    path = str(tmp_path / "journal-3.jsonl")
    rows: dict[str, list] = {"iteration": [], "span": [], "failure": [], "recovery": []}
    journal = RankJournal(path, rows)
    for step in range(5):
        rows["iteration"].append({"step": step, "iteration": step, "train_loss": float(step) if step != 2 else math.nan})
    rows["recovery"].append({"step": 3, "rebuilt_from": {2: "replica on stage 1"}})
    journal.flush()
    journal.truncate_from(4)
    with open(path, "a") as file:
        file.write('{"kind": "span", "row": {"cut sh')  # the kill cut the last line short
    later: dict[str, list] = {"iteration": [], "span": [], "failure": [], "recovery": []}
    RankJournal(path, later).replay()
    assert [row["step"] for row in later["iteration"]] == [0, 1, 2, 3]
    assert math.isnan(later["iteration"][2]["train_loss"])
    assert later["recovery"] == [{"step": 3, "rebuilt_from": {2: "replica on stage 1"}}]  # int keys survive
    assert later["span"] == []


def test_scenario_fields_reach_the_real_run(tmp_path):
    scenario = preset("cpu-tiny")
    training = scenario.training.model_copy(
        update={"failure_mode": "hard", "remote_checkpoint_dir": str(tmp_path), "remote_checkpoint_bytes_per_s": 5e6}
    )
    config = training_config(scenario.model_copy(update={"training": training}), scenario.methods[0])
    assert config.failure_mode == "hard"
    assert config.join_delay_s == scenario.recovery.join_delay_s  # by default the scenario's join delay
    assert config.remote_checkpoint_dir == str(tmp_path) and config.remote_checkpoint_bytes_per_s == 5e6
    explicit = training.model_copy(update={"join_delay_s": 2.5})
    assert training_config(scenario.model_copy(update={"training": explicit}), scenario.methods[0]).join_delay_s == 2.5
    assert scenario.training.failure_mode == "soft"  # the default stays soft
    # A run reads as much of the corpus as the calibration suite and the convergence lab did, whose
    # runs made the loss curve and setbacks that predict it; a scenario can ask for more.
    assert config.corpus_max_bytes == SuiteSettings(num_iterations=1, seeds=(0,), failure_spacing_iterations=1).corpus_max_bytes
    assert config.corpus_max_bytes == cpu_tiny_lab_settings().corpus_max_bytes
    larger = training.model_copy(update={"corpus_max_bytes": 4 * 2**20})
    assert training_config(scenario.model_copy(update={"training": larger}), scenario.methods[0]).corpus_max_bytes == 4 * 2**20
    with pytest.raises(InputError):
        _config("none", failure_mode="crash")
    with pytest.raises(InputError):
        _config("none", join_delay_s=-1.0)


def test_a_remote_checkpoint_dir_that_cannot_hold_checkpoints_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="training.remote_checkpoint_dir") as error:
        launch_local(_config("checkpoint", remote_checkpoint_dir=str(blocker / "remote")), run_dir=tmp_path / "run")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_hard_failure_rank_outside_torchrun_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Hard failures run under torchrun's agent (tests/real/test_agent_membership.py); a rank started
    without its token or its variables is refused before anything starts."""
    scenario = preset("cpu-tiny")
    scenario = scenario.model_copy(update={"training": scenario.training.model_copy(update={"failure_mode": "hard"})})
    path = tmp_path / "scenario.json"
    save_scenario(scenario, str(path))
    monkeypatch.delenv("CHURNSIM_RUN_TOKEN", raising=False)
    assert main(["--scenario", str(path), "--method", "checkpoint"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "CHURNSIM_RUN_TOKEN is not set" in error
    monkeypatch.setenv("CHURNSIM_RUN_TOKEN", "ab" * 32)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--scenario", str(path), "--method", "checkpoint"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "start the ranks with torchrun" in error
    assert [p.name for p in tmp_path.iterdir()] == ["scenario.json"]


# -- the command line ------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _stage_processes(command_pid: int) -> list[int]:
    """The agent's workers of a `churnsim real run`: the processes its fork server started."""
    servers = [child for child in _children(command_pid) if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes()]
    return [worker for server in servers for worker in _children(server)]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills worker processes by pid")
def test_churnsim_real_run_survives_a_sigkill_of_a_worker(tmp_path):
    """`churnsim real run --set training.failure_mode=hard`: an operator SIGKILLs a stage process of
    the run; the run ends with exit code 0 and the kill in its record."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "churnsim", "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint",
        "--set", "pipeline.num_stages=2", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
        "--set", "target.loss=null", "--set", "target.iterations=30", "--set", "training.failure_mode=hard",
        "--set", "training.join_delay_s=0.2", "--set", "training.peer_timeout_s=30", "--out", str(out),
        # Few scheduled kills: with two stages, one striking while the other is down would leave no
        # survivor, which ends a run (it can be resumed from its checkpoints).
        "--set", "churn.failures_per_node_hour=24",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # Training runs once a step's rows are in the run's journal.
        while not any(path.stat().st_size > 0 for path in (out / "journal").glob("*/stage-*.jsonl")):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        workers = _stage_processes(process.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        _, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    failures = pd.read_csv(out / "failures.csv", comment="#")
    assert EXTERNAL_KILL_KIND in set(failures["kind"])
    recoveries = pd.read_csv(out / RECOVERIES_FILE)
    assert (recoveries["failure_mode"] == "hard").all() and (recoveries["join_s"] >= 0.2).all()
    metrics = pd.read_csv(out / "metrics.csv")
    assert metrics["train_loss"].map(math.isfinite).all()
