"""Outputs never destroy or mix (issue 45, item 3): links, reuse, a held --out, files the user made.

Every refusal is one stderr line and exit code 2, and leaves every file outside the run, and every
file of the user inside it, as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from churnsim.calibration.presets import preset
from churnsim.cli import main
from churnsim.out_directory import LOCK_FILE


def run_main(arguments: list[str], directory: Path, capsys) -> tuple[int, str]:
    previous = Path.cwd()
    os.chdir(directory)
    try:
        with pytest.raises(SystemExit) as ended:
            main(arguments)
            raise SystemExit(0)
    finally:
        os.chdir(previous)
    return ended.value.code, capsys.readouterr().err


def one_line(code: int, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("churnsim: error: "), (code, stderr)
    return lines[0]


def tiny_scenario(directory: Path) -> None:
    data = json.loads(preset("cpu-tiny").model_dump_json())
    data["methods"] = [method for method in data["methods"] if method["name"] == "checkfree"]
    data["replications"] = 1
    data["target"] = {"loss": None, "iterations": 20, "max_wall_clock_s": 3600.0}
    (directory / "tiny.json").write_text(json.dumps(data))


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry below `directory`: a file's bytes, a link's target, a directory's marker."""
    found: dict[str, bytes | str] = {}
    for root, directories, files in os.walk(directory):
        for name in directories + files:
            path = Path(root) / name
            key = str(path.relative_to(directory))
            found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes()
    return found


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside every run, with a user's file and a *.tmp file in it."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "precious.txt").write_text("the user's")
    (directory / "draft.tmp").write_text("also the user's")
    return directory


def test_a_finished_simulation_is_not_replaced_without_overwrite(tmp_path, capsys):
    tiny_scenario(tmp_path)
    assert run_main(["simulate", "tiny.json", "--out", "out"], tmp_path, capsys)[0] == 0
    (tmp_path / "out" / "records" / "my-notes.txt").write_text("mine")
    before = snapshot(tmp_path / "out")
    line = one_line(*run_main(["simulate", "tiny.json", "--out", "out"], tmp_path, capsys))
    assert "earlier churnsim simulate" in line and "--overwrite" in line
    assert snapshot(tmp_path / "out") == before  # nothing removed, nothing written


@pytest.mark.parametrize("entry", ["records", "timelines"])
def test_a_symlinked_output_entry_is_refused_and_nothing_outside_is_touched(entry, tmp_path, outside, capsys):
    tiny_scenario(tmp_path)
    assert run_main(["simulate", "tiny.json", "--out", "out"], tmp_path, capsys)[0] == 0
    target = tmp_path / "out" / entry
    if target.exists():
        import shutil

        shutil.rmtree(target)
    target.symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    line = one_line(*run_main(["simulate", "tiny.json", "--out", "out", "--overwrite"], tmp_path, capsys))
    assert f"{entry} is a symbolic link" in line
    assert snapshot(outside) == before


def _finished_real_run(directory: Path) -> None:
    directory.mkdir()
    (directory / "run.json").write_text(json.dumps({"format": "churnsim-real-run", "format_version": 1, "run_id": "abc123", "status": "finished"}))
    (directory / "checkpoints" / "stage-0").mkdir(parents=True)


@pytest.mark.parametrize("link", ["checkpoints", "checkpoints/stage-1", "local"])
def test_a_symlinked_checkpoint_or_stage_directory_is_refused_before_anything_starts(link, tmp_path, outside, capsys):
    run = tmp_path / "run"
    _finished_real_run(run)
    if link == "checkpoints":
        import shutil

        shutil.rmtree(run / "checkpoints")
    (run / link).symlink_to(outside, target_is_directory=True)
    before_outside, before_run = snapshot(outside), snapshot(run)
    line = one_line(*run_main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--out", "run", "--overwrite"], tmp_path, capsys))
    assert f"{link} is a symbolic link" in line
    assert snapshot(outside) == before_outside and snapshot(run) == before_run


def test_a_finished_real_run_is_replaced_only_with_overwrite_and_user_files_are_never_deleted(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_real_run(run)
    (run / "checkpoints" / "my-model.pt").write_text("the user's")
    before = snapshot(run)
    line = one_line(*run_main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--out", "run"], tmp_path, capsys))
    assert "holds a finished real run" in line and "--overwrite" in line
    line = one_line(*run_main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--out", "run", "--overwrite"], tmp_path, capsys))
    assert "my-model.pt" in line and "nothing was removed" in line
    assert snapshot(run) == before


def test_write_config_and_calibrate_out_do_not_replace_a_users_file_without_overwrite(tmp_path, outside, capsys):
    (tmp_path / "mine.json").write_text("keep me")
    (tmp_path / "link.json").symlink_to(outside / "precious.txt")
    for name in ("mine.json", "link.json"):
        line = one_line(*run_main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--write-config", name, "--out", "run"], tmp_path, capsys))
        assert "--write-config" in line and "--overwrite" in line
        line = one_line(*run_main(["calibrate", "--quick", "--out", name], tmp_path, capsys))
        assert "--out" in line and "--overwrite" in line
    assert (tmp_path / "mine.json").read_text() == "keep me" and (outside / "precious.txt").read_text() == "the user's"
    assert run_main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--write-config", "mine.json", "--out", "run", "--overwrite"], tmp_path, capsys)[0] == 0
    assert json.loads((tmp_path / "mine.json").read_text())["name"]


HOLDER = """
import sys, time
from pathlib import Path
sys.argv = ["churnsim", "simulate", "tiny.json", "--out", "out"]
from churnsim.out_directory import lock_out_directory
lock_out_directory(Path("out"), command="simulate")
print("holding", flush=True)
time.sleep(600)
"""


def test_a_second_command_on_a_held_out_is_refused_naming_the_first_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    tiny_scenario(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        line = one_line(*run_main(["simulate", "tiny.json", "--out", "out"], tmp_path, capsys))
        assert f"pid {holder.pid}" in line and "churnsim simulate tiny.json --out out" in line and "is writing there" in line
        assert sorted(os.listdir(tmp_path / "out")) == [LOCK_FILE]  # the refused command wrote nothing
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, its flock goes with the process
        holder.wait()
    assert (tmp_path / "out" / LOCK_FILE).exists()
    code, stderr = run_main(["simulate", "tiny.json", "--out", "out"], tmp_path, capsys)
    assert code == 0, stderr
    assert (tmp_path / "out" / "summary.csv").is_file() and not (tmp_path / "out" / LOCK_FILE).exists()


def test_two_concurrent_simulations_on_one_out_the_second_is_refused_naming_the_first(tmp_path):
    tiny_scenario(tmp_path)
    data = json.loads((tmp_path / "tiny.json").read_text())
    data["replications"] = 4000  # long enough to be running when the second starts, on a loaded machine too
    (tmp_path / "long.json").write_text(json.dumps(data))
    first = subprocess.Popen([sys.executable, "-m", "churnsim", "simulate", "long.json", "--out", "out"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out" / LOCK_FILE).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, "the first simulation ended before it could be raced"
        second = subprocess.run([sys.executable, "-m", "churnsim", "simulate", "tiny.json", "--out", "out"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
        still_running = first.poll() is None
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have ended: the assertion above says so
            os.killpg(first.pid, signal.SIGINT)
        first.wait(timeout=60)
    assert still_running, "the first simulation ended while the second was checking; make it longer"
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"pid {first.pid}" in lines[0] and "churnsim simulate long.json" in lines[0]


@pytest.mark.parametrize("name", ["a" * 300, "x/" * 2100])
def test_output_paths_too_long_are_refused_in_one_line(name, tmp_path, capsys):
    tiny_scenario(tmp_path)
    line = one_line(*run_main(["simulate", "tiny.json", "--out", name], tmp_path, capsys))
    assert "--out" in line and "limit" in line and len(line) < 600
