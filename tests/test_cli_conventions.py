"""Conventions every command keeps: --version, Ctrl-C, --out that never mixes two runs, file modes,
a main job that runs without torch."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from churnsim import installed_version
from churnsim.calibration.base import atomic_write_text, save_model, strict_json_loads
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import load_scenario

SMALL_SIMULATE = ["simulate", "--preset", "checkfree-124m-geo-33pct", "--method", "checkfree", "--replications", "1"]

# A fresh interpreter in which `import torch` fails as it does where torch is not installed.
WITHOUT_TORCH = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoTorch())
    from churnsim.cli import main
    main(sys.argv[1:])
    """
)


def run_cli(arguments: list[str], cwd, *, without_torch: bool = False) -> subprocess.CompletedProcess:
    prefix = ["-c", WITHOUT_TORCH] if without_torch else ["-m", "churnsim"]
    return subprocess.run([sys.executable, *prefix, *arguments], capture_output=True, text=True, cwd=cwd, timeout=600)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("churnsim: error: "), result.stderr
    return lines[0]


def test_version_prints_the_installed_version(tmp_path):
    result = run_cli(["--version"], tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"churnsim {installed_version()}"


def test_ctrl_c_stops_a_run_with_exit_code_130_and_one_line(tmp_path):
    # Ctrl-C at a terminal signals the whole process group: the parent and its worker processes.
    process = subprocess.Popen(
        # 100 replications: with the compiled engine on a fast machine the default 10 finished in 3 s.
        [sys.executable, "-m", "churnsim", "whatif", "--preset", "checkfree-500m-geo-10pct", "--replications", "100", "--workers", "2",
         "--no-figures", "--out", "out"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # As at a terminal: a background job (this test run may be one) inherits SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(6.0)  # past the imports, into the sweep (the whole what-if takes far longer: about 30 s)
    assert process.poll() is None, "the what-if ended before it could be interrupted"
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "churnsim: interrupted"
    assert "Traceback" not in stderr


def test_ctrl_c_while_the_interpreter_exits_still_ends_with_130_and_one_line(tmp_path):
    # An exit handler registered before the command runs last, after the command's own (worker
    # pools joining): a Ctrl-C arriving there, as one after a long sweep can.
    program = (
        "import atexit, os, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), [None for _ in range(10**6)]))\n"
        "from churnsim.cli import main\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", program, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines() == ["churnsim: interrupted"]


def test_out_refuses_another_commands_results_unless_overwrite(tmp_path):
    assert run_cli([*SMALL_SIMULATE, "--out", "out"], tmp_path).returncode == 0
    line = one_error_line(run_cli(["sweep", "--preset", "checkfree-124m-geo-33pct", "--set", "pipeline.num_microbatches=4",
                                   "--method", "checkfree", "--replications", "1", "--out", "out"], tmp_path))
    assert "holds churnsim simulate results for 'checkfree-124m-geo-33pct'" in line and "--overwrite" in line
    line = one_error_line(run_cli(["simulate", "--preset", "checkfree-124m-geo-10pct", "--method", "checkfree", "--replications", "1", "--out", "out"], tmp_path))
    assert "holds churnsim simulate results" in line
    assert (tmp_path / "out" / "records" / "checkfree-r0").is_dir()  # refused: nothing removed
    # Even the same command on the same scenario replaces its own earlier results only with --overwrite.
    line = one_error_line(run_cli([*SMALL_SIMULATE, "--out", "out"], tmp_path))
    assert "holds the results of an earlier churnsim simulate" in line and "--overwrite" in line
    assert run_cli([*SMALL_SIMULATE, "--out", "out", "--overwrite"], tmp_path).returncode == 0
    result = run_cli(["simulate", "--preset", "checkfree-124m-geo-10pct", "--method", "checkpoint", "--replications", "1", "--out", "out", "--overwrite"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in (tmp_path / "out" / "records").iterdir()) == ["checkpoint-r0"]  # no stale records


def test_out_refuses_a_non_empty_directory_that_is_not_churnsims(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    line = one_error_line(run_cli([*SMALL_SIMULATE, "--out", "out"], tmp_path))
    assert "is not empty and holds no churnsim results" in line
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["notes.txt"]
    assert run_cli([*SMALL_SIMULATE, "--out", "out", "--overwrite"], tmp_path).returncode == 0
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (tmp_path / "out" / "summary.csv").is_file()


def test_outputs_get_ordinary_file_modes(tmp_path):
    previous = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        save_model(preset("cpu-tiny"), tmp_path / "scenario.json")
        assert run_cli([*SMALL_SIMULATE, "--out", "out"], tmp_path).returncode == 0
    finally:
        os.umask(previous)
    for path in (tmp_path / "a.txt", tmp_path / "scenario.json", tmp_path / "out" / "manifest.json",
                 tmp_path / "out" / "records" / "checkfree-r0" / "manifest.json", tmp_path / "out" / "timelines" / "checkfree-r0.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE((tmp_path / "out" / "records" / "checkfree-r0").stat().st_mode) == 0o755


def test_a_saved_scenario_with_infinite_bandwidth_is_strict_json_that_reads_back(tmp_path):
    scenario = preset("checkfree-500m-geo-10pct")
    save_model(scenario, tmp_path / "scenario.json")
    assert "Infinity" in (tmp_path / "scenario.json").read_text()  # as a string: strict parsers accept it
    strict_json_loads((tmp_path / "scenario.json").read_text())
    assert load_scenario(str(tmp_path / "scenario.json")) == scenario


def test_the_main_job_runs_without_torch(tmp_path):
    result = run_cli(
        ["whatif", "--quick", "--preset", "checkfree-124m-geo-10pct", "--method", "checkpoint", "--method", "checkfree",
         "--workers", "1", "--no-figures", "--out", "out"],
        tmp_path, without_torch=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "summary.csv").is_file()
    result = run_cli(["plot", "out"], tmp_path, without_torch=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "figures" / "time_to_target.png").is_file()


@pytest.mark.parametrize(
    "arguments",
    [["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", "--out", "run"], ["calibrate", "--quick", "--out", "c.json"]],
)
def test_commands_that_need_torch_say_how_to_install_it(arguments, tmp_path):
    line = one_error_line(run_cli(arguments, tmp_path, without_torch=True))
    assert line.endswith('install the real-run extra: pip install "churnsim[real]"')
    assert not any(tmp_path.iterdir())  # nothing half-written
