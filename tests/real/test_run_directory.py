"""`churnsim real run --out DIR`: DIR is never emptied unless it is the run's own, and a killed run resumes.

A foreign non-empty directory is refused with one line and exit code 2 before any process starts,
its files untouched; a run keeps its durable checkpoints in DIR from the start, bound to its run id,
so a killed run continues with `--resume` from the newest checkpoint every stage holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.run_record import read_run_record, write_run_record
from churnsim.cli import main
from churnsim.real.results import kept_metrics
from churnsim.real.run_directory import RUN_FILE, check_run_directory, prepare_run_directory

# cpu-tiny on 2 stages, no churn, a checkpoint every 2 iterations.
RUN = [
    "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint",
    "--set", "pipeline.num_stages=2", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
    "--set", 'churn={"kind":"none"}', "--set", "target.loss=null", "--set", "target.iterations=24",
    "--set", "methods.checkpoint.interval_iterations=2",
]  # fmt: skip


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(path.relative_to(directory)): (path.read_bytes() if path.is_file() else b"<dir>", path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
    }


def run_cli(arguments: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(arguments)
    return exited.value.code, capsys.readouterr().err


@pytest.fixture()
def foreign(tmp_path) -> Path:
    directory = tmp_path / "my-project"
    (directory / "src").mkdir(parents=True)
    (directory / "src" / "main.py").write_text("print('precious')\n")
    (directory / "notes.txt").write_text("do not delete\n")
    (directory / ".hidden").write_text("x")
    return directory


def test_out_on_a_foreign_non_empty_directory_is_refused_and_its_files_are_untouched(foreign, capsys):
    before = snapshot(foreign)
    code, err = run_cli([*RUN, "--out", str(foreign)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "not a churnsim run record" in err and "nothing was written or removed" in err
    assert snapshot(foreign) == before
    assert sorted(p.name for p in foreign.parent.iterdir()) == ["my-project"]  # no sibling work directory either


def test_out_dot_in_a_foreign_working_directory_is_refused(foreign, capsys, monkeypatch):
    monkeypatch.chdir(foreign)
    before = snapshot(foreign)
    code, err = run_cli([*RUN, "--out", "."], capsys)
    assert code == 2 and "not a churnsim run record" in err
    assert snapshot(foreign) == before


def test_a_run_record_is_never_written_over_foreign_files(foreign):
    from churnsim.calibration.run_record import RunManifest, make_run_record

    manifest = RunManifest(run_id="r", source="simulated", method="none", seed=0)
    before = snapshot(foreign)
    with pytest.raises(InputError, match="not a churnsim run record"):
        write_run_record(make_run_record(manifest, [], [], []), foreign)
    assert snapshot(foreign) == before


def test_resume_needs_an_unfinished_run_with_the_same_settings(tmp_path, capsys):
    code, err = run_cli([*RUN, "--out", str(tmp_path / "new"), "--resume"], capsys)
    assert code == 2 and "holds no run to continue" in err
    assert not (tmp_path / "new").exists()
    lease = prepare_run_directory(tmp_path / "run", config={"seed": 1}, method="checkpoint", resume=False, resumable=True)
    lease.mark("failed")
    with pytest.raises(InputError, match="another churnsim run is using this directory"):
        prepare_run_directory(tmp_path / "run", config={"seed": 1}, method="checkpoint", resume=True, resumable=True)
    lease.release()
    with pytest.raises(InputError, match="did not finish .* --resume"):
        check_run_directory(tmp_path / "run", resume=False)
    with pytest.raises(InputError, match=r"other settings \(seed differ\)"):
        prepare_run_directory(tmp_path / "run", config={"seed": 2}, method="checkpoint", resume=True, resumable=True)
    with pytest.raises(InputError, match="keeps no checkpoints of every stage"):
        prepare_run_directory(tmp_path / "run", config={"seed": 1}, method="checkfree", resume=True, resumable=False)
    again = prepare_run_directory(tmp_path / "run", config={"seed": 1, "timeout_s": 9}, method="checkpoint", resume=True, resumable=True)
    assert again.run_id == lease.run_id
    again.mark("finished")
    again.release()
    with pytest.raises(InputError, match="already finished"):
        check_run_directory(tmp_path / "run", resume=True)
    fresh = prepare_run_directory(tmp_path / "run", config={"seed": 1}, method="checkpoint", resume=False, resumable=True)
    assert fresh.run_id != lease.run_id  # a finished run's directory takes a new run
    fresh.release()


def _stage_tags(out: Path) -> list[set[int]]:
    return [
        {int(path.name[4:14]) for path in (out / "checkpoints" / f"stage-{stage}").glob("*.manifest.json")}
        for stage in range(2)
    ]


def test_a_killed_run_keeps_its_checkpoints_and_resume_continues_from_them(tmp_path, capsys, short_temp_dir):
    out = tmp_path / "run"
    temp = short_temp_dir  # a SIGKILLed launcher cannot remove its temporary directories
    process = subprocess.Popen(
        [sys.executable, "-m", "churnsim", *RUN, "--out", str(out)],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, TMPDIR=str(temp)),
    )
    deadline = time.monotonic() + 240
    while not (out.exists() and all(tags and max(tags) >= 4 for tags in _stage_tags(out))):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher and every rank, mid-run
    process.wait()
    run_file = json.loads((out / RUN_FILE).read_text())
    assert run_file["status"] == "running" and not (out / "manifest.json").exists()
    kept = _stage_tags(out)
    resume_tag = max(set.intersection(*kept))
    assert resume_tag >= 4
    for manifest in (out / "checkpoints").rglob("*.manifest.json"):
        assert json.loads(manifest.read_text())["run_id"] == run_file["run_id"]

    steps_kept = len(kept_metrics(out))  # every step written before the kill (real/journal.py)
    assert steps_kept >= resume_tag  # a checkpoint's iterations have their rows on disk before it
    code, err = run_cli([*RUN, "--out", str(out)], capsys)  # without --resume: refused, nothing lost
    assert code == 2 and "--resume" in err and _stage_tags(out) == kept

    main([*RUN, "--out", str(out), "--resume"])
    record = read_run_record(out)
    assert record.manifest.run_id == run_file["run_id"]
    assert any(f"resumed run {run_file['run_id']} at iteration {resume_tag}" in note for note in record.manifest.notes)
    iterations = record.metrics["iteration"].tolist()
    # The killed attempt's steps, then the resumed one's: continued where every stage's checkpoint was, to the end.
    assert iterations == list(range(steps_kept)) + list(range(resume_tag, 24))
    assert record.metrics["step"].tolist() == list(range(len(iterations)))
    assert json.loads((out / RUN_FILE).read_text())["status"] == "finished"
    assert not (out / "local").exists()
