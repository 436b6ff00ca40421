"""`churnsim real run SCENARIO|--preset NAME`: the scenario `simulate` takes, run for real.

A real run reads the scenario's model, pipeline, method, churn, seed and target; `--set` overrides
fields as `sweep --set` does; the failures it injects are the ones `simulate` samples; bad input is
one line and exit code 2 before any process starts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule
from churnsim.calibration.presets import preset
from churnsim.calibration.run_record import read_run_record
from churnsim.calibration.scenario import load_scenario, save_scenario
from churnsim.cli import main

# A short run of the cpu-tiny preset: 2 stages (the calibrated per-stage times become one time for
# every stage), 12 iterations of progress.
SMALL = [
    "--set", "pipeline.num_stages=2", "--set", "compute.block_forward_s=0.006", "--set", "compute.block_backward_s=0.014",
    "--set", "target.loss=null", "--set", "target.iterations=12",
]  # fmt: skip


@pytest.fixture()
def scenario_with_schedule(tmp_path):
    """cpu-tiny as a file whose churn replays one failure of stage 1, 1 s into training."""
    schedule = tmp_path / "schedule.csv"
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(time_s=1.0, stage=1),)), schedule)
    data = preset("cpu-tiny").model_dump(mode="json")
    data["churn"] = {"kind": "schedule", "path": str(schedule)}
    path = tmp_path / "scenario.json"
    path.write_text(__import__("json").dumps(data))
    return path


def test_a_scenario_file_runs_for_real_with_overrides_and_its_scheduled_failure(tmp_path, scenario_with_schedule, capsys):
    out = tmp_path / "run"
    main([
        "real", "run", str(scenario_with_schedule), "--method", "checkpoint", *SMALL[:8], "--set", "target.iterations=30",
        "--set", "methods.checkpoint.interval_iterations=2", "--set", "seed=3", "--out", str(out),
    ])  # fmt: skip
    record = read_run_record(out)
    manifest = record.manifest
    assert manifest.source == "real" and manifest.seed == 3 and manifest.method == "checkpoint"
    # The manifest keeps the scenario the run was made from, narrowed to its one method.
    assert manifest.scenario is not None and [m.name for m in manifest.scenario.methods] == ["checkpoint"]
    assert manifest.scenario.pipeline.num_stages == 2 and manifest.scenario.methods[0].interval_iterations == 2
    settings = manifest.real_settings
    assert settings.pipeline.num_stages == 2 and settings.num_iterations == 30 and settings.method.interval_iterations == 2
    (failure,) = record.failures.failures
    assert failure.stage == 1 and failure.kind == "scheduled" and failure.time_s >= 1.0
    # Every stage rolls back to the newest checkpoint, taken every 2 iterations: a failure before
    # iteration i resumes at the largest multiple of 2 not above i.
    iterations = record.metrics["iteration"].tolist()
    step = failure.iteration
    assert step >= 1 and iterations[step] == 2 * ((iterations[step - 1] + 1) // 2)
    assert iterations[-1] == 29
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the work directory is gone
    assert "stage 1 from checkpoint" in capsys.readouterr().out and iterations[step] >= 2


def test_a_real_run_injects_the_failures_simulate_samples(tmp_path):
    """Same scenario, same seed: the real run's failure table and simulate's agree, stage for stage.

    A real run injects a failure at its first iteration boundary at or after the sampled time, so its
    times are never earlier and lag by less than an iteration plus a recovery.
    """
    real_out, sim_out = tmp_path / "A", tmp_path / "B"
    override = ["--set", "target.loss=null", "--set", "target.iterations=40"]
    main(["real", "run", "--preset", "cpu-tiny", "--method", "checkfree", *override, "--out", str(real_out)])
    main(["simulate", "--preset", "cpu-tiny", "--method", "checkfree", *override, "--replications", "1", "--out", str(sim_out)])
    real = read_run_record(real_out).failures.failures
    simulated = read_run_record(sim_out / "records" / "checkfree-r0").failures.failures
    common = min(len(real), len(simulated))
    assert common >= 1, (real, simulated)
    for injected, sampled in zip(real[:common], simulated[:common]):
        assert (injected.stage, injected.kind) == (sampled.stage, sampled.kind)
        assert sampled.time_s <= injected.time_s < sampled.time_s + 2.0


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--preset", "cpu-tiny", "--method", "bamboo"], "--method 'bamboo' is not among scenario"),
        (["--preset", "cpu-tiny"], "a real run performs one: give --method"),
        (["--preset", "cpu-tiny", "--method", "checkfree", "--set", "pipeline.stages=2"], "has no field 'stages'"),
        (["--preset", "cpu-tiny", "--method", "checkfree", "--set", "pipeline.num_stages=8"], "exceeds model.num_layers"),
        (["--preset", "cpu-tiny", "--method", "checkfree", "--set", "training.corpus=no-such-corpus.txt"], "training.corpus"),
        (["--preset", "checkfree-1.5b-geo-10pct", "--method", "checkfree"], "GiB available: shrink"),
        (["--preset", "cpu-tiny", "--method", "checkfree", "--set", "model.num_layers=256", "--set", "model.hidden_size=4096",
          "--set", "model.num_heads=32"], "GiB available: shrink"),
        # Found by scanning extreme values: each failed mid-run with a traceback and a half-written run.
        (["--preset", "cpu-tiny", "--method", "none", "--set", "training.num_eval_batches=1000000000000"], "GiB available: shrink"),
        (["--preset", "cpu-tiny", "--method", "none", "--set", "training.learning_rate=1e300"], "training.learning_rate"),
        (["--preset", "cpu-tiny", "--method", "none", "--set", "training.peer_timeout_s=1e300"], "training.peer_timeout_s"),
        (["--preset", "cpu-tiny", "--method", "checkpoint", "--set", "training.remote_checkpoint_bytes_per_s=1e-300"],
         "training.remote_checkpoint_bytes_per_s"),
        (["--preset", "cpu-tiny", "--method", "copy", "--set", "methods.copy.lr_scale=1e300"], "methods.copy.lr_scale"),
        (["no-such-scenario.json", "--method", "checkfree"], "no-such-scenario.json"),
        (["--method", "checkfree"], "give a scenario file or --preset NAME"),
    ],
)
def test_bad_real_run_input_is_one_line_exit_2_and_starts_nothing(tmp_path, capsys, arguments, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["real", "run", *arguments, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("churnsim: error: ") and fragment in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_write_config_writes_the_resolved_scenario_for_torchrun(tmp_path):
    config_path = tmp_path / "scenario.json"
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "real", "run", "--preset", "cpu-tiny", "--method", "checkfree", *SMALL,
         "--out", str(tmp_path / "run"), "--write-config", str(config_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    scenario = load_scenario(str(config_path))
    assert [m.name for m in scenario.methods] == ["checkfree"] and scenario.pipeline.num_stages == 2
    assert "torchrun" in result.stdout and "--scenario" in result.stdout and not (tmp_path / "run").exists()


def test_the_torchrun_entry_point_refuses_a_bad_scenario_in_one_line(tmp_path):
    scenario = preset("cpu-tiny")
    path = tmp_path / "scenario.json"
    save_scenario(scenario, str(path))
    result = subprocess.run(
        [sys.executable, "-m", "churnsim.real.launch", "--scenario", str(path), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "give --method" in result.stderr


def test_calibrate_runs_the_suite_on_the_scenario_s_device(tmp_path, assert_one_line_error):
    """Without --device, the suite takes the scenario's training.device: on a machine without CUDA
    a cuda scenario is refused in one line before anything is measured or written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would run")
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "calibrate", "--quick", "--set", "training.device=cuda", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert_one_line_error(result, "device cuda", "CUDA is not available", "--device cpu")
    assert list(tmp_path.iterdir()) == []
