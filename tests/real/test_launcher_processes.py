"""Processes and time (issue 10): the launcher's workers never outlive it, and a stalled rank is named.

- A stopped worker (SIGSTOP) ends the run within the stall limit, half the peer timeout, with an
  error that names the stopped rank rather than a healthy peer that timed out waiting for it.
- SIGTERM to `churnsim real run` ends every worker and removes the temp directories it made;
  SIGKILL of the launcher ends the workers too (they watch their parent).

Margins are generous so that a slow machine passes: the bounds are on "tens of seconds", not on
the 151 s (and the stray processes) before the fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from churnsim.real.launch import HEARTBEAT_INTERVAL_S, RunAborted, run_distributed, stall_limit_s

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)"),
]

TIMEOUT_S = 5.0
MARGIN_S = 20.0


def _stop_rank_one(communicator, stamp_path: str) -> int:
    """Rank 1 stops itself (SIGSTOP) after the start barrier; rank 0 then waits on it for a message."""
    import torch

    communicator.barrier()
    if communicator.rank == 1:
        Path(stamp_path).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return 1
    communicator.recv((1,), torch.int64, source=1, tag=7)
    return 0


def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_named(tmp_path):
    stamp = tmp_path / "stopped-at"
    with pytest.raises(RunAborted) as raised:
        run_distributed(_stop_rank_one, 2, str(stamp), timeout_s=TIMEOUT_S)
    ended = time.time()
    stopped_for_s = ended - float(stamp.read_text())
    assert raised.value.rank == 1
    message = str(raised.value)
    assert "stage/rank 1 made no progress" in message and "stopped or hung" in message and "\n" not in message
    # The last heartbeat came up to one interval before the stop: the stall is seen no earlier than that.
    assert stall_limit_s(TIMEOUT_S) - HEARTBEAT_INTERVAL_S - 0.5 <= stopped_for_s < TIMEOUT_S + MARGIN_S, stopped_for_s


def _rank_one_fails(communicator, how: str) -> int:
    """Rank 1 raises or kills itself after the start barrier; rank 0 then waits on it for a message
    and fails too ("connection closed by peer"), after it."""
    import torch

    communicator.barrier()
    if communicator.rank == 1:
        if how == "raise":
            raise ValueError("the injected fault\nof rank 1")
        os.kill(os.getpid(), signal.SIGKILL)
    communicator.recv((1,), torch.int64, source=1, tag=7)
    return 0


@pytest.mark.parametrize(
    ("how", "expected"),
    [("raise", "stage/rank 1 failed: ValueError: the injected fault of rank 1"), ("kill", "stage/rank 1 was ended by signal SIGKILL")],
)
def test_a_failed_rank_is_named_with_its_own_error_not_a_peers(how, expected):
    with pytest.raises(RunAborted) as raised:
        run_distributed(_rank_one_fails, 2, how, timeout_s=TIMEOUT_S)
    message = str(raised.value)
    assert raised.value.rank == 1 and message.startswith(expected) and "\n" not in message, message


# -- the command line --------------------------------------------------------------------------

LONG_RUN = [
    "real", "run", "--preset", "cpu-tiny", "--method", "none", "--set", "pipeline.num_stages=2",
    "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014", "--set", "target.loss=null", "--set", "target.iterations=100000", "--set", f"training.peer_timeout_s={TIMEOUT_S}",
]  # fmt: skip


def _start_cli(tmp_path: Path, temp: Path) -> tuple[subprocess.Popen, Path]:
    environment = dict(os.environ, TMPDIR=str(temp))
    process = subprocess.Popen(
        [sys.executable, "-m", "churnsim", *LONG_RUN, "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, start_new_session=True,
        # As at a terminal: a test run started in the background inherits SIGINT ignored, and so would the launcher.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    return process, temp


def _worker_pids(process: subprocess.Popen, temp: Path, deadline_s: float = 120.0) -> dict[int, int]:
    """rank -> pid, read from the heartbeat files once both workers are up."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the run ended early ({process.returncode}): {process.stderr.read()}")
        pids = {}
        for rank in (0, 1):
            for path in temp.glob(f"churnsim-real-*/heartbeat-{rank}"):
                text = path.read_text().strip()
                if text:
                    pids[rank] = int(text)
        if len(pids) == 2:
            return pids
        time.sleep(0.2)
    pytest.fail("the workers did not start")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[1]
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, of in parents.items() if of == parent]
        found += children
        frontier += children
    return found


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has ended; only its exit status is left


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _cleanup(process: subprocess.Popen, leftovers: list[int]) -> None:
    for pid in leftovers:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if process.poll() is None:
        process.kill()
    process.wait()


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_terminating_the_launcher_ends_every_worker_and_removes_its_temp_dirs(tmp_path, number, short_temp_dir):
    process, temp = _start_cli(tmp_path, short_temp_dir)
    children: list[int] = []
    try:
        pids = _worker_pids(process, temp)
        children = _descendants(process.pid)
        assert set(pids.values()) <= set(children)
        process.send_signal(number)
        process.wait(timeout=60)
        assert process.returncode != 0
        assert _wait_gone(children) == []
        assert [p.name for p in temp.iterdir() if p.name.startswith("churnsim-")] == []
    finally:
        _cleanup(process, children)


def test_killing_the_launcher_ends_its_workers(tmp_path, short_temp_dir):
    process, temp = _start_cli(tmp_path, short_temp_dir)
    children: list[int] = []
    try:
        pids = _worker_pids(process, temp)
        children = _descendants(process.pid)
        workers = [child for child in children if child in pids.values()]
        assert len(workers) == 2
        process.kill()
        process.wait(timeout=60)
        assert _wait_gone(workers) == []
    finally:
        _cleanup(process, children)


def test_a_stopped_worker_of_a_real_run_is_named_in_one_line(tmp_path, short_temp_dir):
    process, temp = _start_cli(tmp_path, short_temp_dir)
    children: list[int] = []
    try:
        pids = _worker_pids(process, temp)
        children = _descendants(process.pid)
        time.sleep(1.0)  # let training start
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = process.communicate(timeout=TIMEOUT_S + MARGIN_S + 30)
        took_s = time.monotonic() - stopped
        assert process.returncode == 1, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("churnsim: error: ")]
        assert len(errors) == 1 and "stage/rank 1 made no progress" in errors[0], stderr
        assert took_s < TIMEOUT_S + MARGIN_S, took_s
        assert _wait_gone(children) == []
        assert [p.name for p in temp.iterdir() if p.name.startswith("churnsim-")] == []
    finally:
        _cleanup(process, children)


def test_a_temporary_directory_too_long_for_the_fork_server_s_socket_is_one_line(tmp_path, assert_one_line_error):
    # Python's fork server listens on a Unix socket under TMPDIR (at most 107 bytes of path).
    temp = tmp_path / ("t" * 100)
    temp.mkdir()
    out = tmp_path / "run"
    finished = subprocess.run(
        [sys.executable, "-m", "churnsim", *LONG_RUN, "--out", str(out)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, TMPDIR=str(temp)),
    )  # fmt: skip
    assert_one_line_error(finished, "(TMPDIR) is too long", "set TMPDIR to a shorter directory")
    assert not out.exists()
