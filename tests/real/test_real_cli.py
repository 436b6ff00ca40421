"""`churnsim real run` writes a readable run record; bad input is one line and exit code 2; failure sources."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from churnsim.calibration.churn import stage_hourly_to_per_iteration_probability
from churnsim.calibration.errors import InputError
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule
from churnsim.calibration.run_record import read_run_record
from churnsim.cli import main
from churnsim.real.failure_sources import failures_from_schedule, sample_failures


@pytest.fixture()
def schedule_file(tmp_path):
    path = tmp_path / "failures.csv"
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(iteration=3, stage=1),)), path)
    return path


def test_real_run_writes_a_readable_record_with_settings_failures_and_checkpoints(tmp_path, schedule_file, capsys):
    out = tmp_path / "run"
    main([
        "real", "run", "--method", "checkpoint", "--stages", "2", "--iterations", "5", "--failures", str(schedule_file),
        "--out", str(out), "--microbatches", "2", "--checkpoint-interval", "2", "--eval-every", "2", "--seed", "3",
    ])  # fmt: skip
    record = read_run_record(out)
    settings = record.manifest.real_settings
    assert record.manifest.source == "real" and record.manifest.seed == 3
    assert settings.method.name == "checkpoint" and settings.method.interval_iterations == 2
    assert settings.pipeline.num_stages == 2 and settings.num_iterations == 5 and settings.eval_every_iterations == 2
    assert settings.checkpoint_directory is not None and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["stage-0", "stage-1"]
    assert [(f.iteration, f.stage) for f in record.failures.failures] == [(3, 1)]
    # The failure before iteration 3 rolls back to the checkpoint after iteration 1 (tag 2).
    assert record.metrics["iteration"].tolist() == [0, 1, 2, 2, 3, 4]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the work directory is gone
    summary = capsys.readouterr().out
    assert "stage 1 from checkpoint(iteration 2), resumed at iteration 2" in summary


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--method", "bamboo", "--failure-rate", "0"], "unknown method 'bamboo'"),
        (["--method", "checkpoint", "--stages", "8", "--failure-rate", "0"], "num_stages 8 must be between 1 and num_layers 4"),
        (["--method", "checkpoint", "--corpus", "no-such-corpus.txt", "--failure-rate", "0"], "--corpus no-such-corpus.txt"),
        (["--method", "checkpoint", "--failures", "no-such-schedule.csv"], "no such failure schedule"),
        (["--method", "checkpoint"], "give --failures FILE or --failure-rate P"),
        (["--method", "checkfree", "--rollback", "stage", "--failure-rate", "0"], "--rollback does not apply"),
    ],
)
def test_bad_real_run_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, arguments, fragment):
    out = tmp_path / "run"
    full = ["real", "run", "--iterations", "3", "--out", str(out), *arguments]
    if "--stages" not in full:
        full += ["--stages", "2"]
    with pytest.raises(SystemExit) as exit_info:
        main(full)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("churnsim: error: ") and fragment in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_schedule_rows_without_iteration_are_rejected_for_real_runs(tmp_path):
    path = tmp_path / "timed.csv"
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(time_s=12.0, stage=1),)), path)
    with pytest.raises(InputError, match="real runs inject failures by iteration"):
        failures_from_schedule(path, num_stages=4, num_iterations=10)


def test_schedule_failures_are_sorted_and_cut_to_the_run(tmp_path):
    path = tmp_path / "failures.csv"
    rows = (ScheduledFailure(iteration=7, stage=0), ScheduledFailure(iteration=2, stage=3), ScheduledFailure(iteration=50, stage=1))
    write_failure_schedule(FailureSchedule(failures=rows), path)
    assert failures_from_schedule(path, num_stages=4, num_iterations=10) == ((2, 3), (7, 0))
    with pytest.raises(InputError, match="stage 3 does not exist"):
        failures_from_schedule(path, num_stages=2, num_iterations=10)


def test_sampled_failures_match_the_per_iteration_probability_and_the_seed():
    num_stages, num_iterations = 4, 5_000
    failures = sample_failures(0.2, nominal_iteration_s=600.0, num_stages=num_stages, num_iterations=num_iterations, seed=1)
    probability = stage_hourly_to_per_iteration_probability(0.2, 600.0)
    expected = probability * num_stages * num_iterations
    standard_deviation = (expected * (1 - probability)) ** 0.5
    assert abs(len(failures) - expected) < 4 * standard_deviation
    assert failures == sample_failures(0.2, nominal_iteration_s=600.0, num_stages=num_stages, num_iterations=num_iterations, seed=1)
    assert failures != sample_failures(0.2, nominal_iteration_s=600.0, num_stages=num_stages, num_iterations=num_iterations, seed=2)
    assert all(0 <= step < num_iterations and 0 <= stage < num_stages for step, stage in failures)
    assert sample_failures(0.0, num_stages=num_stages, num_iterations=100, seed=0) == ()


def test_write_config_gives_a_training_config_for_torchrun(tmp_path):
    from churnsim.real.trainer import TrainingConfig

    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "real", "run", "--method", "checkfree", "--stages", "4", "--iterations", "7",
         "--failure-rate", "0", "--out", str(tmp_path / "run"), "--write-config", str(tmp_path / "config.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    config = TrainingConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert (config.num_stages, config.num_iterations, config.method.name) == (4, 7, "checkfree")
    assert "torchrun" in result.stdout and not (tmp_path / "run").exists()
