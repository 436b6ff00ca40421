"""Real runs that strangers cannot steer (issue 45, items 1, 2 and 4), with stage processes.

- A stranger connected to a hard-failure run's rendezvous store (torch's c10d rendezvous of the
  run's agent) writes the keys churnsim's workers use, without the run's secret namespace (rounds,
  holdings, arrivals; and the generation keys of the old local protocol), over and over while a
  stage is killed and replaced: the run recovers and ends exactly as the same run without the
  stranger does. The store cannot be reached through the machine's external address.
- Modules named like standard ones planted in the working directory never run in any process of
  `churnsim real run`, under soft or hard failures, and the run succeeds.
- A run whose loss turns NaN fails with one line naming the iteration and the stage.
- A resumed run whose checkpoints were replaced by forged ones (every checksum recomputed, no HMAC
  of the run's secret) refuses each of them with a line on stderr and says it restarts from scratch.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule
from churnsim.calibration.methods import method_from_name
from churnsim.real import distributed
from churnsim.real.launch import RunAborted, launch_local
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.trainer import TrainingConfig


pytestmark = pytest.mark.slow

NUM_STAGES = 2
KILLS = ((4, 1),)  # (step, stage): the last stage's process is killed and replaced
SMALL = [
    "--set", "pipeline.num_stages=2", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
    "--set", "target.loss=null", "--set", "target.iterations=12",
]  # fmt: skip
PLANTED = ("concurrent", "json", "random", "socket")
OWN_VALUES = (b"abandoned", b"1", b"127.0.0.1:1")
"""What the stranger writes."""


def _config(**fields) -> TrainingConfig:
    return TrainingConfig(
        model=MODEL_PRESETS["tiny"], num_stages=NUM_STAGES, num_microbatches=2, microbatch_size=2, num_iterations=12, seed=5,
        method=method_from_name("checkpoint", interval_iterations=2), failures=KILLS, corpus_max_bytes=200_000,
        timeout_s=30.0, failure_mode="hard", join_delay_s=0.2, **fields,
    )  # fmt: skip


class Stranger:
    """A process without the run's token that found the store's port: writes what it can guess until stopped."""

    def __init__(self, external_address: str | None) -> None:
        self.external_address = external_address
        self.port: int | None = None
        self.stop = threading.Event()
        self.writes = 0
        self.keys_seen: list[str] = []
        self.external_connections: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def serve_store(self, host: str, timeout_s: float, **options):
        store = serve_store_of_the_agent(host, timeout_s, **options)
        self.port = int(store.port)
        self.thread.start()
        return store

    def _run(self) -> None:
        import torch.distributed as dist

        address = self.external_address
        if address is not None:
            try:
                socket.create_connection((address, self.port), timeout=2).close()
                self.external_connections.append(address)
            except OSError:
                pass
        client = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        while not self.stop.is_set():
            try:
                self._write_guesses(client)
            except RuntimeError:  # the run ended and its store with it
                return
            self.stop.wait(0.02)

    def _write_guesses(self, client) -> None:
        for generation in range(8):
            names = [f"generation-{generation}/outcome", *(f"generation-{generation}/arrived/{s}" for s in range(NUM_STAGES))]
            names += [f"round-{generation}/holding/{s}" for s in range(NUM_STAGES)] + [f"round-{generation}/ready/{s}" for s in range(NUM_STAGES)]
            # A value it did not write itself would be the run's: under these names it read them.
            self.keys_seen.extend(key for key in names if client.check([key]) and bytes(client.get(key)) not in OWN_VALUES)
            client.set(f"generation-{generation}/outcome", "abandoned")
            for stage in range(NUM_STAGES):
                client.set(f"generation-{generation}/arrived/{stage}", "1")
                client.set(f"round-{generation}/holding/{stage}", "1")
                client.set(f"round-{generation}/ready/{stage}", "1")
                client.set(f"round-{generation}/group/{stage}", "127.0.0.1:1")  # a rank's address, as the process group named it
            self.writes += 1 + 4 * NUM_STAGES


serve_store_of_the_agent = distributed.serve_store


def test_a_stranger_without_the_token_does_not_change_a_hard_failure_run(tmp_path, monkeypatch, external_address):
    control = launch_local(_config(), run_dir=tmp_path / "control")
    stranger = Stranger(external_address)
    monkeypatch.setattr(distributed, "serve_store", stranger.serve_store)  # the agent's rendezvous store (real/agent_rendezvous.py)
    try:
        attacked = launch_local(_config(), run_dir=tmp_path / "attacked")
    finally:
        stranger.stop.set()
        if stranger.thread.is_alive():
            stranger.thread.join(10)
    assert stranger.writes > 0 and stranger.keys_seen == []  # it wrote all along and read nothing of the run's
    assert stranger.external_connections == []  # not reachable through the machine's external address
    # The run recovered from the kill as the control run did, and ended in the same place.
    for result in (control, attacked):
        assert len(result.failures) == 1 and len(result.recoveries) == 1
        assert result.metrics["train_loss"].map(math.isfinite).all()
    assert attacked.recoveries[0]["resume_iteration"] == control.recoveries[0]["resume_iteration"]
    assert attacked.metrics["iteration"].tolist() == control.metrics["iteration"].tolist()
    assert attacked.metrics["train_loss"].tolist() == control.metrics["train_loss"].tolist()  # deterministic: bit for bit


def _console_script() -> str:
    script = Path(sys.executable).with_name("churnsim")
    if not script.exists():
        pytest.skip("the churnsim console script is not installed beside this interpreter")
    return str(script)


def _plant_modules(directory: Path) -> Path:
    """Modules named like standard ones that leave a marker file when anything imports them."""
    markers = directory / "markers"
    markers.mkdir()
    for name in PLANTED:
        (directory / f"{name}.py").write_text(
            f"open({str(markers)!r} + '/{name}-' + str(__import__('os').getpid()), 'w').close()\n"
        )
    return markers


@pytest.mark.parametrize("failure_mode", ["soft", "hard"])
def test_modules_planted_in_the_working_directory_never_run(tmp_path, failure_mode):
    work = tmp_path / "work"
    work.mkdir()
    markers = _plant_modules(work)
    schedule = tmp_path / "schedule.csv"
    # Early in a run long enough that the kill lands inside it however fast the machine is.
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(time_s=0.1, stage=1),)), schedule)
    command = [
        _console_script(), "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint", *SMALL[:-2],
        "--set", "target.iterations=30", "--set", "methods.checkpoint.interval_iterations=2", "--set", f"training.failure_mode={failure_mode}",
        "--set", "training.join_delay_s=0.2", "--set", f"churn={json.dumps({'kind': 'schedule', 'path': str(schedule)})}",
        "--out", "run",
    ]  # fmt: skip
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    result = subprocess.run(command, cwd=work, capture_output=True, text=True, env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(path.name for path in markers.iterdir()) == []
    assert len(pd.read_csv(work / "run" / "failures.csv", comment="#")) == 1  # the kill (hard: a new process) happened


def test_a_run_whose_loss_turns_nan_fails_naming_iteration_and_stage():
    config = dataclasses.replace(_config(), failures=(), failure_mode="soft", learning_rate=1e30, gradient_clipping="none")
    with pytest.raises(RunAborted) as raised:
        launch_local(config)
    message = str(raised.value)
    assert "\n" not in message
    assert "NonFiniteLoss: the training loss is nan at iteration" in message and f"stage {NUM_STAGES - 1} (the last" in message


def test_forged_checkpoints_are_refused_on_resume_each_with_a_line_on_stderr(tmp_path):
    """A killed run (run.json still says running) whose durable checkpoints someone replaced by
    forged ones of the same run and stage, with every checksum recomputed but no HMAC of its secret."""
    from churnsim.real.checkpoint import SynchronousCheckpointEngine

    out = tmp_path / "run"
    arguments = [
        _console_script(), "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint", *SMALL,
        "--set", "methods.checkpoint.interval_iterations=2", "--set", 'churn={"kind":"none"}', "--out", str(out),
    ]  # fmt: skip
    first = subprocess.run(arguments, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_file = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(run_file | {"status": "running"}))  # as a SIGKILLed launcher leaves it
    forged = 0
    for stage_directory in sorted((out / "checkpoints").glob("stage-*")):
        stage = int(stage_directory.name.split("-")[1])
        reader = SynchronousCheckpointEngine(stage_directory, keep_last=10, run_id=run_file["run_id"], stage=stage)
        saved = [(info.iteration, reader.load(info)) for info in reader.list_durable()]  # unkeyed: reads without checking
        reader.close()
        shutil.rmtree(stage_directory)
        forger = SynchronousCheckpointEngine(stage_directory, keep_last=10, run_id=run_file["run_id"], stage=stage)
        for iteration, state in saved:
            forger.save(state, iteration)  # the same bytes, checksums recomputed, no HMAC
            forged += 1
        forger.close()
    assert forged >= 2
    resumed = subprocess.run([*arguments, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    skipped = [line for line in resumed.stderr.splitlines() if "checkpoint skipped" in line]
    assert len(skipped) == forged and all("binding_hmac" in line for line in skipped), resumed.stderr[-3000:]
    assert any(line.startswith("churnsim: warning: restart from scratch") for line in resumed.stderr.splitlines())
    recoveries = (out / "recoveries.csv").read_text()
    assert recoveries.count("checkpoint skipped") >= 1  # in the record too


def test_the_printed_torchrun_command_runs_with_the_token_and_refuses_ranks_without_it(tmp_path):
    """`--write-config` writes the token file (0600) and prints a command that reads it; ranks
    started without the token stop in one line each (exit 2), with it the run finishes."""
    from churnsim.real.distributed import find_free_port

    config = tmp_path / "scenario.json"
    written = subprocess.run(
        [_console_script(), "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint", *SMALL[:-2], "--set", "target.iterations=4",
         "--set", 'churn={"kind":"none"}', "--out", "run", "--write-config", str(config)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    token_file = Path(f"{config}.token")
    assert (token_file.stat().st_mode & 0o777) == 0o600 and f"CHURNSIM_RUN_TOKEN=$(cat {token_file})" in written.stdout
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    ranks = ["-m", "churnsim.real.launch", "--scenario", str(config), "--run-dir", "run"]
    environment = {key: value for key, value in os.environ.items() if key != "CHURNSIM_RUN_TOKEN"}
    without = subprocess.run(
        [*torchrun, "--rdzv-endpoint", f"127.0.0.1:{find_free_port()}", *ranks], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=environment,
    )  # fmt: skip
    assert without.returncode != 0 and without.stderr.count("error: environment variable CHURNSIM_RUN_TOKEN is not set") == 2
    assert not (tmp_path / "run").exists()
    with_token = subprocess.run(
        [*torchrun, "--rdzv-endpoint", f"127.0.0.1:{find_free_port()}", *ranks], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env=environment | {"CHURNSIM_RUN_TOKEN": token_file.read_text().strip(), "PYTHONSAFEPATH": "1"},
    )  # fmt: skip
    assert with_token.returncode == 0, with_token.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
    assert (tmp_path / "run" / "run.secret").read_text().strip() == token_file.read_text().strip()
