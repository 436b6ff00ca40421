"""The paper fit against the simulator: its constants are the simulator's, and it recovers setbacks the
simulator charged (calibration/paper_setbacks.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from churnsim.calibration.convergence import MethodSetbacks, SetbackSpec
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.paper_setbacks import (
    PAPER_FAILURE_PROBABILITY_PER_STAGE_HOUR,
    PRESET_500M_ITERATION_TIME_S,
    PRESET_500M_RECOVERY_DOWNTIME_S,
    PaperSetting,
    ProgressModel,
    solve_setback,
)
from churnsim.calibration.presets import checkfree_500m_geo
from churnsim.sim.model.iteration import simulate_iteration
from churnsim.sim.model.pipeline_state import build_pipeline_state
from churnsim.sim.model.run import simulate_run

COPY_SETBACK_ITERATIONS = 15.0
NUM_REPLICATIONS = 6


def copy_runs_for_about_10k_iterations():
    """The 500M preset at 16 %/h, `copy` with a known setback, stopped by the clock after ≈ 10k iterations."""
    scenario = checkfree_500m_geo(PAPER_FAILURE_PROBABILITY_PER_STAGE_HOUR)
    # The paper's emulator: a stage's replicas fail together, so every failure is a stage loss.
    scenario = scenario.model_copy(update={"pipeline": scenario.pipeline.model_copy(update={"replicas_fail_together": True})})
    known = SetbackSpec(mean_iterations=COPY_SETBACK_ITERATIONS)
    convergence = scenario.convergence.model_copy(
        update={"setbacks": {**scenario.convergence.setbacks, "copy": MethodSetbacks(interior=known, edge=known)}, "sample_setbacks": False}
    )
    # Recoveries take about 3 % of the wall-clock at 16 %/h (the rate test below checks it).
    wall_clock_s = 10_000 * PRESET_500M_ITERATION_TIME_S * 1.03
    scenario = scenario.model_copy(
        update={"convergence": convergence, "target": scenario.target.model_copy(update={"loss": None, "iterations": 10**7, "max_wall_clock_s": wall_clock_s})}
    )
    copy = next(method for method in scenario.methods if method.name == "copy")
    return scenario, [
        simulate_run(scenario, copy, failures_for_replication(scenario, replication=r), replication=r) for r in range(NUM_REPLICATIONS)
    ]


def test_the_fit_uses_the_simulators_iteration_time_downtime_and_rebuild_rate():
    scenario, runs = copy_runs_for_about_10k_iterations()
    assert simulate_iteration(build_pipeline_state(scenario)).time_s == pytest.approx(PRESET_500M_ITERATION_TIME_S, rel=1e-3)
    rebuilds = sum(sum(failure.handled_as == "rebuild_copy" for failure in run.failures) for run in runs)
    executed = sum(run.iterations_executed for run in runs)
    downtime_s = sum(run.badput["recovery_downtime_s"] for run in runs) / rebuilds
    assert downtime_s == pytest.approx(PRESET_500M_RECOVERY_DOWNTIME_S, rel=0.05)
    # Poisson count of ≈ 1,600 rebuilds: 2.5 % is about one standard error.
    assert rebuilds / executed == pytest.approx(PaperSetting().rebuilds_per_iteration, rel=0.05)


def test_the_fit_recovers_the_setback_the_simulator_charged():
    scenario, runs = copy_runs_for_about_10k_iterations()
    curve = scenario.convergence.baseline
    mean_loss = float(np.mean([curve.loss(run.progress_iterations) for run in runs]))
    iterations = float(np.mean([run.iterations_executed for run in runs]))
    assert abs(iterations - 10_000) < 500
    setting = PaperSetting(iterations=round(iterations))
    model = ProgressModel(iterations=setting.iterations, rebuilds_per_iteration=setting.rebuilds_per_iteration)
    fitted = solve_setback(model, curve, mean_loss)
    assert fitted.bound is None
    # Six simulated runs against the model's 2,000 paths: their mean deficit is known to about ±6 %.
    assert fitted.setback_iterations == pytest.approx(COPY_SETBACK_ITERATIONS, rel=0.12)
    assert not math.isclose(fitted.setback_iterations, 0.0)
