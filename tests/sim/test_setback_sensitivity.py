"""The setback-sensitivity study finds where the winner changes (sim/studies/setback_sensitivity.py)."""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.churn import ScheduleChurn
from churnsim.calibration.convergence import MethodSetbacks, SetbackSpec
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule
from churnsim.calibration.tables import CROSSOVER_COLUMNS, SENSITIVITY_COLUMNS
from churnsim.sim.model.run import simulate_run
from churnsim.sim.studies.setback_sensitivity import sensitivity_lines, setback_sensitivity

from sim_run_scenarios import method, small_scenario

SCALES = (0.5, 1.0, 2.0, 3.0, 5.0)


def two_interior_failures_scenario(tmp_path, setback_iterations: float):
    """CheckFree against synchronous checkpointing, two interior failures late enough that no setback
    reaches back to progress 0: CheckFree's time grows exactly linearly with the setback, the
    checkpointing run does not depend on it."""
    path = tmp_path / "failures.csv"
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(time_s=1000.0, stage=1), ScheduledFailure(time_s=1300.0, stage=2))), path)
    scenario = small_scenario(target_iterations=100, churn=ScheduleChurn(kind="schedule", path=str(path)), join_delay_s=10.0, restart_s=0.0)
    spec = SetbackSpec(mean_iterations=setback_iterations)
    convergence = scenario.convergence.model_copy(update={"setbacks": {"checkfree": MethodSetbacks(interior=spec, edge=spec)}})
    methods = (method("checkfree", edge_stages_reliable=True), method("checkpoint", interval_iterations=10))
    return scenario.model_copy(update={"convergence": convergence, "methods": methods, "replications": 2})


def time_to_target_s(scenario, name: str, scale: float = 1.0) -> float:
    scaled = scenario.model_copy(update={"convergence": scenario.convergence.model_copy(update={"setback_scale": scale})})
    config = next(m for m in scenario.methods if m.name == name)
    return simulate_run(scaled, config, failures_for_replication(scaled)).wall_clock_s


def test_sensitivity_finds_the_known_crossover_scale(tmp_path):
    # Calibrate the construction with direct runs: with whole setbacks (the run makes up a lost
    # iteration with a whole one), CheckFree's time is T0 + scale · k exactly; checkpointing's is fixed.
    probe = two_interior_failures_scenario(tmp_path, 1.0)
    checkpoint_s = time_to_target_s(probe, "checkpoint")
    one, two = time_to_target_s(probe, "checkfree", 1.0), time_to_target_s(probe, "checkfree", 2.0)
    per_iteration_s = two - one  # per unit of setback (two rebuilds of one iteration each)
    assert time_to_target_s(probe, "checkfree", 3.0) == pytest.approx(one + 2 * per_iteration_s, rel=1e-9)  # linear indeed
    zero_s = one - per_iteration_s
    assert zero_s < checkpoint_s  # without setbacks CheckFree wins
    # A whole setback that puts the crossover between the grid's scales 2 and 3; there it is known.
    setback = round((checkpoint_s - zero_s) / (2.5 * per_iteration_s))
    known_crossover = (checkpoint_s - zero_s) / (setback * per_iteration_s)
    assert 2.0 < known_crossover < 3.0
    scenario = two_interior_failures_scenario(tmp_path, float(setback))

    result = setback_sensitivity(scenario, scales=SCALES, failure_rates=None, workers=1)

    assert list(result.table.columns) == list(SENSITIVITY_COLUMNS)
    assert list(result.crossovers.columns) == list(CROSSOVER_COLUMNS)
    winners = result.table[result.table["winner"]].set_index("setback_scale")["method"].to_dict()
    assert winners == {0.5: "checkfree", 1.0: "checkfree", 2.0: "checkfree", 3.0: "checkpoint", 5.0: "checkpoint"}
    (crossover,) = result.crossovers.itertuples()
    assert (crossover.scale_low, crossover.scale_high) == (2.0, 3.0)
    assert (crossover.winner_below, crossover.winner_above) == ("checkfree", "checkpoint")
    assert crossover.crossover_scale == pytest.approx(known_crossover, rel=1e-9)
    # The checkpointing rows are one set of runs repeated for every scale.
    checkpoint_rows = result.table[result.table["method"] == "checkpoint"]
    assert checkpoint_rows["time_to_target_mean_s"].nunique() == 1
    assert checkpoint_rows["time_to_target_mean_s"].iloc[0] == pytest.approx(checkpoint_s)
    (line,) = sensitivity_lines(result)
    assert f"checkfree → checkpoint at ×{known_crossover:.2f}" in line


def test_without_a_change_of_winner_the_crossover_is_empty(tmp_path):
    scenario = two_interior_failures_scenario(tmp_path, 0.01)
    result = setback_sensitivity(scenario, scales=(0.5, 1.0), failure_rates=None, workers=1)
    (row,) = result.crossovers.itertuples()
    assert row.winner_below == row.winner_above == "checkfree" and math.isnan(row.crossover_scale)
    assert "does not change" in sensitivity_lines(result)[0]
