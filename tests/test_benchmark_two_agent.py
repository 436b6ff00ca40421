"""The two-agent validation benchmark's plan and figures (benchmarks/two_agent_validation.py).
Nothing is run: the plan, the schedule, the commands and the summaries of given tables."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from churnsim.calibration.failures import read_failure_schedule

_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "two_agent_validation.py"


@pytest.fixture(scope="module")
def two_agent():
    sys.path.insert(0, str(_BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("two_agent_validation", _BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_plan_runs_every_method_under_soft_and_hard_failures(two_agent):
    plan = two_agent.plan_runs(["checkfree", "checkpoint"], 40)
    assert [(run["failure_mode"], run["method"]) for run in plan] == [
        ("soft", "checkfree"), ("soft", "checkpoint"), ("hard", "checkfree"), ("hard", "checkpoint")
    ]  # fmt: skip
    assert len({run["run_id"] for run in plan}) == 4 and {run["iterations"] for run in plan} == {40}
    with pytest.raises(ValueError, match="each once"):
        two_agent.plan_runs(["copy", "copy"], 40)


def test_the_schedule_fails_a_stage_of_each_agent_inside_the_run(two_agent, tmp_path):
    rows = two_agent.failure_rows(10.0)
    assert [stage for _, stage in rows] == [1, 0]  # 2 stages, one per agent
    assert all(0.0 < time_s < 10.0 for time_s, _ in rows) and rows == sorted(rows)
    path = tmp_path / "failures.csv"
    two_agent.write_schedule(path, rows)
    schedule = read_failure_schedule(path)
    assert [(failure.time_s, failure.stage) for failure in schedule.failures] == rows


def test_each_run_s_scenario_and_its_torchrun_line_come_from_real_run_write_config(two_agent, tmp_path):
    from churnsim.calibration.presets import preset

    run = two_agent.plan_runs(["checkfree"], 30)[-1]
    scenario = preset(two_agent.BASE_PRESET, two_agent.scenario_settings(run), methods=("checkfree",))
    assert scenario.training.failure_mode == "hard" and scenario.pipeline.num_stages == 2 and scenario.target_iterations == 30
    command = two_agent.write_config_command(tmp_path / "base.json", "checkfree", port=29999)
    assert command[1:5] == ["-m", "churnsim", "real", "run"] and "--write-config" in command
    assert command[command.index("--nodes") + 1] == "2" and command[command.index("--rendezvous-port") + 1] == "29999"
    printed = "the run, as printed:\n  torchrun --nnodes=2:2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29999 -m churnsim.real.launch\n"
    assert two_agent.torchrun_line(printed).startswith("torchrun --nnodes=2:2")
    with pytest.raises(ValueError, match="0 torchrun lines"):
        two_agent.torchrun_line("nothing here")


def test_the_figures_are_medians_of_absolute_errors_per_mode_and_method(two_agent):
    errors = {"soft-a": 0.02, "soft-b": -0.04, "hard-a": 0.10, "hard-b": -0.30}
    table = pd.DataFrame(
        [dict(run_id=run_id, quantity="total_wall_clock_s", relative_error=error, load_normalised_relative_error=error / 2) for run_id, error in errors.items()]
        + [dict(run_id="soft-a", quantity="steady_iteration_s", relative_error=9.0, load_normalised_relative_error=9.0)]
    )
    runs = [dict(run_id=run_id, failure_mode=run_id.split("-")[0], method=run_id.split("-")[1]) for run_id in errors]
    figures = two_agent.summarize(table, runs)
    assert figures["wall_clock"]["runs"] == 4 and figures["wall_clock"]["absolute"] == pytest.approx(0.07)
    assert figures["wall_clock"]["range"] == pytest.approx([0.02, 0.30])
    assert figures["by"]["failure_mode"]["hard"]["median_absolute_wall_clock_error"] == pytest.approx(0.20)
    assert figures["by"]["failure_mode"]["hard"]["median_signed_wall_clock_error"] == pytest.approx(-0.10)
    assert figures["by"]["method"]["a"]["runs"] == 2


def test_the_measured_costs_are_per_failure_mode_over_every_recovery_that_measured_them(two_agent):
    hard = pd.DataFrame({"failure_mode": ["hard"] * 3, "join_s": [3.0, 3.2, 3.4], "rendezvous_s": [0.01, 0.02, 0.03],
                         "survivor_restart_s": [3.1, None, 3.3], "failed_stages": [json.dumps([1])] * 3})  # fmt: skip
    soft = pd.DataFrame({"failure_mode": ["soft"], "join_s": [0.001], "transfer_s": [0.004]})
    costs = two_agent.measured_costs([hard, None, soft])
    assert costs["hard"]["join_s"]["median_s"] == pytest.approx(3.2) and costs["hard"]["join_s"]["recoveries"] == 3
    assert costs["hard"]["survivor_restart_s"]["recoveries"] == 2
    assert costs["soft"]["transfer_s"]["median_s"] == pytest.approx(0.004) and "survivor_restart_s" not in costs["soft"]
    assert two_agent.measured_costs([]) == {}


def test_the_benchmark_is_known_to_the_report_writer(two_agent):
    sys.path.insert(0, str(_BENCHMARK.parent))
    import report

    assert report.BENCHMARKS["two-agent-validation"].script == _BENCHMARK.name


def test_what_the_calibration_charges_is_its_survivors_restart_on_the_benchmark_s_pipeline(two_agent):
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.hard_failure_costs import FittedSeconds, FittedTransfer, HardFailureCosts

    calibration = resolve_calibration("cpu-tiny")  # built in: measured no hard failure under the agent
    assert two_agent.charged_costs(calibration)["hard_failure_costs"] is None
    seconds = FittedSeconds(median_s=0.5, num_points=3)
    costs = HardFailureCosts(
        num_recoveries=3, detection=seconds, agent_restart=seconds, process_start=seconds, rendezvous=seconds,
        survivor_reload=FittedTransfer(latency_s=0.0, bandwidth_bytes_per_s=1e8, num_points=3), snapshot_bytes_per_parameter=12.0,
    )  # fmt: skip
    charged = two_agent.charged_costs(calibration.model_copy(update={"hard_failure_costs": costs}))
    # detection + the agents' restart + a process start, 0.5 s each, then the reload: more than 1.5 s
    assert charged["survivor_restart_s_charged_on_these_runs"] > 1.5
