"""Hard failures under torchrun's agent (real/agent_membership.py): two agents on this machine as two
"nodes" (separate working directories, nothing shared but the rendezvous port), each started with the
line `churnsim real run --write-config` prints.

- A stage process killed by the failure injector: its agent restarts its workers, the other agent
  restarts its own (torch's membership change), the survivor reloads its stage from node memory and
  the restarted worker takes the lost stage, which the method recovers.
- A whole agent killed (its workers with it): a new agent started with the same line in another
  directory joins and takes the lost stage.
- A process with a wrong token is refused at join, and the run goes on.

The every-method matrix of the first case takes minutes; it runs with CHURNSIM_AGENT_MATRIX=1.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from churnsim.calibration.errors import InputError
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule
from churnsim.calibration.presets import preset
from churnsim.real.agent_membership import Holding, assign_stages, check_token_proof
from churnsim.real.node_memory import NodeMemory, SnapshotRefused
from churnsim.real.run_secret import new_token

AGENT_TIMEOUT_S = 300
MATRIX = bool(os.environ.get("CHURNSIM_AGENT_MATRIX"))
STRANGER = """
import os, sys
from churnsim.real.launch import main
os.environ["MASTER_PORT"] = sys.stdin.readline().strip()
sys.exit(main(sys.argv[1:]))
"""


# -- the stage policy and node memory (no processes) ------------------------------------------------


def _holding(rank: int, node: str, local_rank: int = 0, **held: int) -> Holding:
    return Holding(rank=rank, node=node, local_rank=local_rank, held={int(stage[1:]): step for stage, step in held.items()})


def test_holders_keep_their_stages_and_newcomers_take_the_lost_ones_in_rank_order():
    # Node a holds stages 0 and 1, node b held 2 and 3 but died; its replacement c holds nothing.
    workers = [_holding(0, "c", 0), _holding(1, "a", 1, s0=5, s1=5), _holding(2, "a", 0, s0=5, s1=5), _holding(3, "c", 1)]
    assert assign_stages(4, workers) == {2: 0, 1: 1, 0: 2, 3: 3}


def test_the_newest_snapshot_of_a_stage_wins_and_a_stale_holder_becomes_a_newcomer():
    # Node b kept an old copy of stage 1 (its worker was restarted after a later loss); a is newer.
    workers = [_holding(0, "a", s0=7, s1=7), _holding(1, "b", s1=3)]
    assert assign_stages(2, workers) == {0: 0, 1: 1}  # a's one worker keeps stage 0, b's takes the rest
    workers = [_holding(0, "a", 0, s1=7), _holding(1, "b", 0, s1=3)]
    assert assign_stages(2, workers) == {0: 1, 1: 0}  # a wins stage 1; b's worker takes the lost stage 0


def test_a_fresh_run_assigns_stages_in_rank_order():
    assert assign_stages(3, [_holding(rank, f"n{rank}") for rank in (2, 0, 1)]) == {0: 0, 1: 1, 2: 2}


def test_node_memory_round_trips_a_stage_and_refuses_another_run_s_snapshot(tmp_path):
    token = new_token()
    memory = NodeMemory(token, root=tmp_path, node_id="n")
    payload = {"state": {"module.w": torch.arange(6.0).reshape(2, 3)}, "step": 4, "kills": [1]}
    nbytes = memory.save(2, 4, payload)
    assert memory.held_stages() == {2: {"step": 4}}
    loaded, loaded_bytes = memory.load(2)
    assert loaded_bytes == nbytes and torch.equal(loaded["state"]["module.w"], payload["state"]["module.w"]) and loaded["kills"] == [1]
    stranger = NodeMemory(new_token(), root=tmp_path, node_id="n")
    stranger.path.mkdir(parents=True)
    (stranger.path / "stage-2.bin").write_bytes((memory.path / "stage-2.bin").read_bytes())
    with pytest.raises(SnapshotRefused, match="HMAC"):
        stranger.load(2)
    memory.drop(2)
    assert memory.held_stages() == {}


def test_a_wrong_token_is_refused_at_join_and_the_run_s_proof_stays(tmp_path):
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    token = new_token()
    check_token_proof(server, token)  # the run's first worker fixes the proof
    check_token_proof(server, token)  # a worker with the run's token joins
    with pytest.raises(InputError, match="not the token of the run"):
        check_token_proof(server, new_token())
    check_token_proof(server, token)


# -- two agents on this machine ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _environment(pid: int) -> dict[bytes, bytes]:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in data.split(b"\0") if b"=" in item)


def _kill_tree(process: subprocess.Popen) -> None:
    """The machine dies: the agent and every process under it at once."""
    for pid in [process.pid, *_descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


class Cluster:
    """Agents started with one command line, each in a working directory of its own."""

    def __init__(self, tmp_path: Path, command: str, files: list[Path]) -> None:
        self.tmp_path, self.command, self.files = tmp_path, command, files
        shim = tmp_path / "bin" / "torchrun"  # torchrun of this interpreter (its shell entry point may be another's)
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run \"$@\"\n")
        shim.chmod(0o755)
        self.environment = os.environ | {
            "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}",
            "CHURNSIM_NODE_MEMORY_DIR": str(tmp_path / "node-memory"),
            "LOGLEVEL": "WARNING",
        }
        (tmp_path / "node-memory").mkdir(exist_ok=True)
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        directory = self.tmp_path / name
        directory.mkdir()
        for path in self.files:
            (directory / path.name).write_bytes(path.read_bytes())
        log = open(directory / "agent.log", "wb")
        agent = subprocess.Popen(["/bin/sh", "-c", self.command], cwd=directory, env=self.environment, stdout=log, stderr=subprocess.STDOUT)
        self.agents[name] = agent
        return agent

    def wait(self, *names: str) -> None:
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        for name in names:
            code = self.agents[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            assert code == 0, f"agent {name} exited with {code}:\n{self.log(name)[-3000:]}"

    def log(self, name: str) -> str:
        return (self.tmp_path / name / "agent.log").read_text(errors="replace")

    def record_directory(self) -> Path:
        (found,) = [path for path in self.tmp_path.glob("*/run") if (path / "manifest.json").exists()]
        return found

    def end(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                _kill_tree(agent)


@pytest.fixture()
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(command: str, files: list[Path]) -> Cluster:
        made.append(Cluster(tmp_path, command, files))
        return made[-1]

    yield make
    for cluster in made:
        cluster.end()


def _run_arguments(tmp_path: Path, method: str, *, iterations: int, failures: tuple[ScheduledFailure, ...], stages: int = 2, extra: tuple[str, ...] = (), failure_mode: str = "hard") -> list[str]:
    """`churnsim real run` of cpu-tiny with hard failures, its churn the failures given."""
    schedule = tmp_path / "schedule.csv"
    write_failure_schedule(FailureSchedule(failures=failures), schedule)
    data = preset("cpu-tiny").model_dump(mode="json")
    data["churn"] = {"kind": "schedule", "path": str(schedule)}
    base = tmp_path / "base.json"
    base.write_text(json.dumps(data))
    return [
        sys.executable, "-m", "churnsim", "real", "run", str(base), "--method", method,
        "--set", f"pipeline.num_stages={stages}", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
        "--set", "target.loss=null", "--set", f"target.iterations={iterations}", "--set", f"training.failure_mode={failure_mode}",
        "--set", "training.peer_timeout_s=60", *extra,
    ]  # fmt: skip


def _write_config(tmp_path: Path, method: str, *, iterations: int, failures: tuple[ScheduledFailure, ...], stages: int = 2, extra: tuple[str, ...] = (), failure_mode: str = "hard") -> tuple[str, list[Path]]:
    """The scenario, its token and the printed torchrun line (run as printed, in a node's directory)."""
    result = subprocess.run(
        [*_run_arguments(tmp_path, method, iterations=iterations, failures=failures, stages=stages, extra=extra, failure_mode=failure_mode),
         "--out", "run", "--write-config", "scenario.json", "--nodes", "2", "--rendezvous-port", str(_free_port())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (command,) = [line.strip() for line in result.stdout.splitlines() if "torchrun" in line]
    assert "--rdzv-backend=c10d" in command and "--nnodes=2:2" in command and "--max-restarts=" in command
    return command, [tmp_path / "scenario.json", tmp_path / "scenario.json.token"]


def _finished_with_finite_loss(directory: Path, iterations: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    metrics = pd.read_csv(directory / "metrics.csv")
    assert metrics["iteration"].iloc[-1] == iterations - 1
    assert all(math.isfinite(loss) for loss in metrics["train_loss"])
    return metrics, pd.read_csv(directory / "recoveries.csv")


def _both_agents_finish(cluster, iterations: int) -> tuple[Path, pd.DataFrame]:
    """Start both agents of `cluster`, wait for both, check the run finished with finite loss:
    the record's directory and its recoveries."""
    cluster.start("node-a")
    cluster.start("node-b")
    cluster.wait("node-a", "node-b")
    record = cluster.record_directory()
    _, recoveries = _finished_with_finite_loss(record, iterations)
    return record, recoveries


def _run_case_one(tmp_path: Path, cluster_factory, method: str, stages: int = 2, extra: tuple[str, ...] = ()) -> pd.DataFrame:
    iterations = 10
    killed = stages - 1
    command, files = _write_config(
        tmp_path, method, iterations=iterations, failures=(ScheduledFailure(time_s=0.5, stage=killed),), stages=stages, extra=extra
    )
    cluster = cluster_factory(command, files)
    record, recoveries = _both_agents_finish(cluster, iterations)
    failures = pd.read_csv(record / "failures.csv", comment="#")
    assert failures["kind"].tolist() == ["scheduled"] and failures["stage"].tolist() == [killed]
    if method == "none":  # the no-failure reference: the failure is recorded, nothing is killed or restarted
        assert recoveries["restart_round"].isna().all() and recoveries["survivor_reload_bytes"].isna().all()
        return {}
    (row,) = recoveries.to_dict("records")
    assert json.loads(row["failed_stages"]) == [killed] and row["failure_mode"] == "hard" and row["restart_round"] >= 1
    # The survivors came back from node memory; the costs of the agents' restart are named.
    assert row["survivor_reload_bytes"] > 0 and row["agent_restart_s"] >= 0 and row["detection_s"] >= 0
    assert row["process_start_s"] > 0 and row["survivor_restart_s"] > 0 and row["join_s"] > 0
    assert not any((tmp_path / "node-memory").iterdir()), "a finished run leaves nothing in node memory"
    return row


@pytest.mark.slow
def test_the_printed_torchrun_line_on_two_agents_survives_a_killed_worker(tmp_path, cluster_factory):
    row = _run_case_one(tmp_path, cluster_factory, "checkfree")
    assert "edge" in row["rebuilt_from"] or "neighbour" in row["rebuilt_from"] or row["rebuilt_from"]


@pytest.mark.slow
def test_the_printed_torchrun_line_on_two_agents_runs_soft_failures(tmp_path, cluster_factory):
    iterations = 8
    command, files = _write_config(
        tmp_path, "checkpoint", iterations=iterations, failures=(ScheduledFailure(time_s=0.3, stage=1),), failure_mode="soft",
        extra=("--set", "methods.checkpoint.interval_iterations=2"),
    )
    cluster = cluster_factory(command, files)
    record, recoveries = _both_agents_finish(cluster, iterations)
    (row,) = recoveries.to_dict("records")
    assert row["failure_mode"] == "soft" and json.loads(row["failed_stages"]) == [1]


@pytest.mark.slow
def test_a_replacement_agent_takes_the_stage_of_a_dead_agent_and_a_stranger_is_refused(tmp_path, cluster_factory):
    iterations = 150
    command, files = _write_config(tmp_path, "copy", iterations=iterations, failures=())
    cluster = cluster_factory(command, files)
    first = cluster.start("node-a")
    time.sleep(1.0)  # node-a serves the rendezvous store (the first agent on the endpoint's host)
    second = cluster.start("node-b")
    # A process without the run's token, ready to join as a worker of the run (imports done ahead).
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, "--scenario", str(files[0]), "--run-dir", str(tmp_path / "stranger")],
        env=os.environ | {"CHURNSIM_RUN_TOKEN": new_token(), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                          "MASTER_ADDR": "localhost", "MASTER_PORT": "0", "PYTHONSAFEPATH": "1"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        # Training has started on both nodes.
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while not any(path.stat().st_size > 0 for path in (tmp_path / "node-b" / "run" / "journal").glob("*/stage-*.jsonl")):
            assert time.monotonic() < deadline and first.poll() is None and second.poll() is None, cluster.log("node-b")[-3000:]
            time.sleep(0.05)
        # The stranger tries the workers' store (the address torchrun gave the workers) and is refused.
        (port,) = {environment[b"MASTER_PORT"] for pid in _descendants(first.pid) if b"RANK" in (environment := _environment(pid))}
        _, error = stranger.communicate(port.decode() + "\n", timeout=120)
    finally:
        if stranger.poll() is None:
            stranger.kill()
    assert stranger.returncode == 2, error
    assert error.strip().count("\n") == 0 and "CHURNSIM_RUN_TOKEN is not the token of the run" in error
    assert not (tmp_path / "stranger").exists()
    # The node-b machine dies, agent and workers; a replacement machine starts the same command.
    _kill_tree(second)
    cluster.start("node-c")
    cluster.wait("node-a", "node-c")
    record = cluster.record_directory()
    _, recoveries = _finished_with_finite_loss(record, iterations)
    failures = pd.read_csv(record / "failures.csv", comment="#")
    assert failures["kind"].tolist() == ["external_kill"]
    (row,) = recoveries.to_dict("records")
    assert json.loads(row["failed_stages"]) == failures["stage"].tolist() and row["restart_round"] >= 1
    assert row["survivor_reload_bytes"] > 0 and math.isnan(row["detection_s"])  # a kill from outside: no injector's time


@pytest.mark.slow
def test_the_printed_torchrun_line_on_two_agents_heals_a_killed_replica(tmp_path, cluster_factory):
    """Data parallelism under torchrun: 2 stages × 2 replicas on two agents of two workers each. The
    injector kills node (1, 1); the agents restart their workers, the survivors reload from node
    memory and the restarted worker of (1, 1) copies replica 0 of stage 1 over the process group."""
    iterations = 8
    command, files = _write_config(
        tmp_path, "checkfree", iterations=iterations, failures=(ScheduledFailure(time_s=0.3, stage=1, replica=1),),
        extra=("--set", "pipeline.data_parallel_degree=2"),
    )  # fmt: skip
    assert "--nproc-per-node=2" in command  # 4 stage processes on 2 machines
    cluster = cluster_factory(command, files)
    record, recoveries = _both_agents_finish(cluster, iterations)
    failures = pd.read_csv(record / "failures.csv", comment="#")
    assert failures[["stage", "replica", "kind"]].values.tolist() == [[1, 1, "scheduled"]]
    (row,) = recoveries.to_dict("records")
    assert row["handled_as"] == "replica_heal" and json.loads(row["heals"]) == [{"stage": 1, "replica": 1, "source_replica": 0}]
    assert row["heal_bytes"] > 0 and row["survivor_reload_bytes"] > 0 and row["restart_round"] >= 1


MATRIX_METHODS = {
    "none": (2, ()),
    "checkpoint": (2, ("--set", "methods.checkpoint.interval_iterations=2")),
    "async_checkpoint": (2, ("--set", "methods.async_checkpoint.interval_iterations=2")),
    "redundant": (2, ()),
    "checkfree": (2, ()),
    "checkfree_plus": (4, ()),
    "copy": (2, ()),
    "uniform": (2, ()),
    "random": (2, ()),
}


@pytest.mark.slow
@pytest.mark.skipif(not MATRIX, reason="every method on two agents takes minutes: set CHURNSIM_AGENT_MATRIX=1")
@pytest.mark.parametrize("method", sorted(MATRIX_METHODS))
def test_every_method_survives_a_killed_worker_on_two_agents(tmp_path, cluster_factory, method):
    stages, extra = MATRIX_METHODS[method]
    _run_case_one(tmp_path, cluster_factory, method, stages=stages, extra=extra)


@pytest.mark.slow
def test_real_run_with_one_agent_is_the_same_code_path_on_one_machine(tmp_path):
    """`churnsim real run --agent`: one elastic agent in the CLI's process, the injector kills stage 0
    (the recorder), the agent restarts both workers and the run finishes."""
    iterations = 10
    arguments = _run_arguments(tmp_path, "copy", iterations=iterations, failures=(ScheduledFailure(time_s=0.5, stage=0),))
    result = subprocess.run(
        [*arguments, "--agent", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=AGENT_TIMEOUT_S, cwd=tmp_path,
        env=os.environ | {"CHURNSIM_NODE_MEMORY_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _, recoveries = _finished_with_finite_loss(tmp_path / "run", iterations)
    (row,) = recoveries.to_dict("records")
    assert json.loads(row["failed_stages"]) == [0] and row["survivor_reload_bytes"] > 0 and row["detection_s"] >= 0
    assert not list(tmp_path.glob("churnsim-*")), "a finished run leaves nothing in node memory"


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc")
def test_the_one_machine_rendezvous_store_listens_on_the_named_address_only():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from churnsim.real.agent_rendezvous import create_handler

    port = _free_port()
    params = RendezvousParameters(backend="churnsim-c10d", endpoint=f"127.0.0.1:{port}", run_id="bound", min_nodes=1, max_nodes=1, is_host=True)
    handler = create_handler(params)
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, not every interface
    handler.shutdown()
