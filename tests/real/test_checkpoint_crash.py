"""Crash consistency: a writer process killed (SIGKILL) at random moments during saves never leaves a
checkpoint that loads wrong, and never loses one it reported durable.

A child process saves checkpoint after checkpoint (iteration i holds a state derived from i) and
appends i to a report file each time the engine says i is durable. The test kills it with SIGKILL
after a random delay, 20 times per engine, then opens a fresh engine on the same directories: every
listed checkpoint must load bit for bit, the newest must be at least the last reported one, and
the next writer continues from there.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as multiprocessing

from churnsim.real.checkpoint import LazyAsyncCheckpointEngine, SynchronousCheckpointEngine
from churnsim.real.launch import FORKSERVER_PRELOAD

NUM_KILLS = 20
RUN = "crash-run"


def crash_state(iteration: int) -> dict:
    generator = torch.Generator().manual_seed(iteration)
    return {
        "weights": torch.randn(384 * 1024, generator=generator),  # 1.5 MiB: a save takes a few ms
        "moments": torch.randn(64, 1024, generator=generator).to(torch.bfloat16),
        "step": torch.tensor(iteration),
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        "iteration": iteration,
    }


def make_engine(root: Path, kind: str):
    if kind == "sync":
        return SynchronousCheckpointEngine(root / "remote", keep_last=2, run_id=RUN, stage=3)
    return LazyAsyncCheckpointEngine(
        root / "local", root / "remote", host_buffer_bytes=1 << 20, chunk_bytes=256 * 1024, keep_last=2, run_id=RUN, stage=3
    )


def _save_until_killed(root: str, kind: str, first_iteration: int, report: str) -> None:
    """Child: save forever; report each iteration once the engine says it is durable (at every level)."""
    torch.set_num_threads(1)
    engine = make_engine(Path(root), kind)
    iteration = first_iteration
    while True:
        engine.save(crash_state(iteration), iteration)
        engine.wait_before_optimizer_step()
        if kind == "async" and iteration % 2:
            iteration += 1
            continue  # let the next save overlap this one's flushes
        engine.wait_until_durable()
        with open(report, "a") as file:
            file.write(f"{iteration}\n")
        iteration += 1


def _last_reported(report: Path) -> int:
    lines = report.read_text().split("\n") if report.exists() else []
    complete = [int(line) for line in lines[:-1] if line]  # the last line may be half written
    return max(complete, default=0)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_writer_killed_at_random_moments_never_leaves_a_wrong_or_lost_checkpoint(tmp_path, kind):
    # The fork server run_distributed uses (torch imported once), so a writer starts in milliseconds.
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # the launcher's list: whoever starts the server first sets it
    context = multiprocessing.get_context("forkserver")
    rng = random.Random(20240611)
    report = tmp_path / "durable.txt"
    next_iteration = 1
    kills_after_first_report = 0
    for _ in range(NUM_KILLS):
        before = _last_reported(report)
        writer = context.Process(target=_save_until_killed, args=(str(tmp_path), kind, next_iteration, str(report)))
        writer.start()
        # Wait until the writer is saving, then kill it at a random moment.
        deadline = time.monotonic() + 60
        while _last_reported(report) == before and time.monotonic() < deadline and writer.is_alive():
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        reported = _last_reported(report)
        kills_after_first_report += reported > before

        engine = make_engine(tmp_path, kind)
        try:
            infos = engine.list_durable()
            assert infos, "a reported checkpoint was lost"
            for info in infos:
                state = engine.load(info)  # raises if anything is damaged
                expected = crash_state(info.iteration)
                assert state.keys() == expected.keys()
                for key, value in expected.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(state[key], value), (info, key)
                    else:
                        assert state[key] == value, (info, key)
            newest_durable = engine.latest_durable(surviving_node_loss=True)
            assert newest_durable is not None and newest_durable.iteration >= reported, "a reported checkpoint was lost"
            assert engine.skipped() == [] or all("without a manifest" in line for line in engine.skipped())
            next_iteration = max(info.iteration for info in infos) + 1
        finally:
            engine.close()
    assert kills_after_first_report == NUM_KILLS  # every kill struck a writer in the middle of its saves
