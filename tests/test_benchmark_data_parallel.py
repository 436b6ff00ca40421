"""The data-parallel validation benchmark's schedules and figures (benchmarks/data_parallel_validation.py).
Nothing is run: the replica rule decides what each schedule's failures become."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.calibration.replica_rule import plan_node_losses

_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "data_parallel_validation.py"


@pytest.fixture(scope="module")
def data_parallel():
    sys.path.insert(0, str(_BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("data_parallel_validation", _BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _outcomes(rows, num_stages: int, degree: int) -> list[str]:
    """Per failure time, what the contract's rule makes of the nodes lost then: heals or stage losses."""
    outcomes, by_time = [], {}
    for time_s, stage, replica in rows:
        by_time.setdefault(time_s, []).append((stage, replica))
    for time_s in sorted(by_time):
        plan = plan_node_losses(method_from_name("checkpoint"), by_time[time_s], num_stages=num_stages, data_parallel_degree=degree)
        outcomes += ["stage_loss"] * len(plan.lost_stages) + ["heal"] * len(plan.heals)
    return outcomes


@pytest.mark.parametrize("grid", ["2x2", "4x2"])
def test_replica_losses_only_heal_and_the_stage_loss_schedule_loses_a_stage(data_parallel, grid):
    num_stages, degree = data_parallel.GRIDS[grid]
    assert _outcomes(data_parallel.failure_rows("replica-losses", num_stages, 10.0), num_stages, degree) == ["heal", "heal"]
    assert _outcomes(data_parallel.failure_rows("stage-loss", num_stages, 10.0), num_stages, degree) == ["heal", "stage_loss"]


def test_the_figures_are_medians_of_absolute_errors_with_a_verdict_against_ten_percent(data_parallel):
    errors = {"a": 0.02, "b": -0.05, "c": 0.30}
    table = pd.DataFrame(
        [dict(run_id=run_id, quantity="total_wall_clock_s", relative_error=error, load_normalised_relative_error=error / 2) for run_id, error in errors.items()]
        + [dict(run_id="a", quantity="steady_iteration_s", relative_error=9.0, load_normalised_relative_error=9.0)]
    )
    runs = [dict(run_id="a", grid="2x2", schedule="stage-loss", method="checkpoint"), dict(run_id="b", grid="4x2", schedule="stage-loss", method="checkpoint"),
            dict(run_id="c", grid="4x2", schedule="replica-losses", method="checkfree")]  # fmt: skip
    figures = data_parallel.summarize(table, runs)
    assert figures["wall_clock"]["absolute"] == pytest.approx(0.05) and figures["wall_clock"]["runs"] == 3
    assert figures["wall_clock"]["range"] == pytest.approx([0.02, 0.30])
    assert figures["by"]["grid"]["4x2"]["median_absolute_wall_clock_error"] == pytest.approx(0.175)
    assert figures["target_verdict"] != "no runs"
