"""A killed run's record keeps every step written before the kill, and `--resume` appends (issue 45, item 3).

Each stage writes its rows to the run directory's journal as each step ends (real/journal.py); a run
whose launcher is SIGKILLed keeps them, and the record of its resumed run joins both attempts
(`results.join_attempts`): the kept steps first, then the resumed attempt's steps numbered on from
them, the iterations after the last durable checkpoint once as run before the kill and once as run
again, which the resume's row in recoveries.csv names.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from churnsim.calibration.presets import preset
from churnsim.calibration.run_record import read_run_record
from churnsim.real.results import join_attempts, kept_metrics
from churnsim.real.trainer import RankResult

NUM_ITERATIONS = 40
CHECKPOINT_INTERVAL = 2


def _stage_rows(step: int, iteration: int, end_s: float, *, head: bool) -> dict:
    return {"step": step, "iteration": iteration, "end_s": end_s, "train_loss": 5.0 - 0.1 * iteration if head else math.nan,
            "eval_loss": math.nan, "blocked_s": 0.0, "runs_head": head}  # fmt: skip


def test_join_attempts_numbers_the_resumed_steps_on_and_continues_the_clock():
    # The first attempt ran steps 0-4 (its last stage finished step 4; stage 0 had started step 5 when killed).
    first = [
        {"iteration": [_stage_rows(s, s, 1.0 + s, head=False) for s in range(6)],
         "span": [{"iteration": 5, "start_s": 6.0, "end_s": 6.5}], "failure": [], "recovery": []},
        {"iteration": [_stage_rows(s, s, 1.1 + s, head=True) for s in range(5)], "span": [], "failure": [], "recovery": []},
    ]  # fmt: skip
    # The resumed attempt went back to the checkpoint of iteration 4 and ran iterations 4-7 as its steps 4-7.
    resumed = [RankResult(rank=0, stage=0), RankResult(rank=1, stage=1)]
    resumed[0].recoveries.append({"step": 4, "iteration": 4, "resume_iteration": 4, "notes": []})
    resumed[0].spans.append({"iteration": 0, "start_s": 0.1, "end_s": 0.3})  # the resume's load, before its first step
    for s in range(4, 8):
        resumed[0].iteration_rows.append(_stage_rows(s, s, 0.5 + s, head=False))
        resumed[1].iteration_rows.append(_stage_rows(s, s, 0.6 + s, head=True))
    joined = join_attempts([first, resumed])
    head = joined[1].iteration_rows
    assert [row["step"] for row in head] == list(range(9))
    assert [row["iteration"] for row in head] == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    # stage 0's unfinished step 5 of the first attempt and its span are left out
    assert [row["step"] for row in joined[0].iteration_rows] == list(range(9)) and len(joined[0].spans) == 1
    # the clock continues from the first attempt's last step (5.1 s)
    assert head[5]["end_s"] == pytest.approx(5.1 + 4.6) and joined[0].spans[0]["start_s"] == pytest.approx(5.2)
    assert joined[0].spans[0]["iteration"] == 5
    (resume,) = joined[0].recoveries
    assert resume["step"] == 5 and resume["iteration"] == 5 and resume["resume_iteration"] == 4
    assert "iterations 4-4 ran again" in resume["notes"][-1]


def _scenario(directory: Path) -> Path:
    data = preset("cpu-tiny").model_dump(mode="json")
    data["churn"] = {"kind": "none"}  # the only interruption is the kill: iterations run once per attempt
    path = directory / "scenario.json"
    path.write_text(json.dumps(data))
    return path


def _command(scenario: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "churnsim", "real", "run", str(scenario), "--method", "checkpoint",
        "--set", "pipeline.num_stages=2", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
        "--set", "target.loss=null", "--set", f"target.iterations={NUM_ITERATIONS}",
        "--set", f"methods.checkpoint.interval_iterations={CHECKPOINT_INTERVAL}", "--out", str(out), *extra,
    ]  # fmt: skip


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(child) for child in children]
        frontier += [int(child) for child in children]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_a_killed_run_keeps_its_steps_and_resume_appends_the_rest(tmp_path):
    scenario, out = _scenario(tmp_path), tmp_path / "run"
    launcher = subprocess.Popen(
        _command(scenario, out), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    children: list[int] = []
    try:
        # Mid-training: some steps written, and every stage holds a durable checkpoint.
        deadline = time.monotonic() + 240
        seen = pd.DataFrame()
        stages = [out / "checkpoints" / f"stage-{stage}" for stage in range(2)]
        while time.monotonic() < deadline and launcher.poll() is None:
            children = _descendants(launcher.pid) or children
            if all(stage.is_dir() and any(stage.glob("*.manifest.json")) for stage in stages):
                seen = kept_metrics(out)
                if len(seen) >= 2 * CHECKPOINT_INTERVAL + 1:
                    break
            time.sleep(0.1)
        assert launcher.poll() is None, f"the run ended before it could be killed: {launcher.stderr.read()}"
        assert len(seen) < NUM_ITERATIONS
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "stage processes outlived their launcher"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    # On disk after the kill: every step seen before it, in order, once, with finite losses.
    kept = kept_metrics(out)
    assert len(kept) >= len(seen)
    assert kept["step"].tolist() == list(range(len(kept))) and kept["iteration"].tolist() == list(range(len(kept)))
    assert kept.iloc[: len(seen)]["train_loss"].tolist() == seen["train_loss"].tolist()
    assert kept["train_loss"].map(math.isfinite).all()
    assert not (out / "manifest.json").exists()  # the run did not finish

    finished = subprocess.run(_command(scenario, out, "--resume"), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    record = read_run_record(out)
    metrics = record.metrics
    steps, iterations = metrics["step"].tolist(), metrics["iteration"].tolist()
    # Every executed step once, numbered on; the kept steps first, exactly as they were.
    assert steps == list(range(len(metrics)))
    assert metrics.iloc[: len(kept)]["train_loss"].tolist() == kept["train_loss"].tolist()
    assert iterations[: len(kept)] == list(range(len(kept)))
    # Then the resumed attempt, from its durable checkpoint (a multiple of the interval, at most
    # where the kill came) to the end: every iteration 0..end is there, the re-run ones twice.
    recoveries = pd.read_csv(out / "recoveries.csv")
    (resume,) = recoveries[recoveries["failure_mode"] == "resume"].itertuples()
    resumed_at = int(resume.resume_iteration)
    assert resumed_at % CHECKPOINT_INTERVAL == 0 and 0 < resumed_at <= len(kept)
    assert iterations[len(kept) :] == list(range(resumed_at, NUM_ITERATIONS))
    assert int(resume.step) == len(kept) and int(resume.iteration) == len(kept)
    if resumed_at < len(kept):
        assert f"iterations {resumed_at}-{len(kept) - 1} ran again" in resume.notes
    assert sorted(set(iterations)) == list(range(NUM_ITERATIONS))
    assert metrics["train_loss"].map(math.isfinite).all()
    assert metrics["wall_time_s"].is_monotonic_increasing  # the resumed attempt's clock continues
    assert record.manifest.summary["num_steps"] == len(metrics)
