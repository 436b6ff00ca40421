"""The calibrated machine's speed spread in simulated replications: each replication one speed, every method at it."""

from __future__ import annotations

import numpy as np

from churnsim.calibration.churn import NoChurn
from churnsim.calibration.presets import preset
from churnsim.calibration.speed_uncertainty import replication_compute_factor
from churnsim.sim.studies.replicate import replication_scenario, run_replications, runs_table

NUM_REPLICATIONS = 8


def cpu_tiny_without_failures(*, log_sd: float):
    scenario = preset("cpu-tiny")
    methods = tuple(method for method in scenario.methods if method.name in ("checkpoint", "redundant"))
    return scenario.model_copy(
        update={
            "compute": scenario.compute.model_copy(update={"run_speed_log_sd": log_sd}),
            "churn": NoChurn(kind="none"),
            "methods": methods,
            "replications": NUM_REPLICATIONS,
            "seed": 11,
        }
    )


def times_by_replication(scenario):
    runs = runs_table(scenario, run_replications(scenario))
    return runs.pivot_table(index="replication", columns="method", values="time_to_target_s", aggfunc="first")


def test_each_replication_runs_every_method_at_its_drawn_speed():
    log_sd = 0.1
    spread = times_by_replication(cpu_tiny_without_failures(log_sd=log_sd))
    fixed = times_by_replication(cpu_tiny_without_failures(log_sd=0.0))
    for method in ("checkpoint", "redundant"):
        assert fixed[method].nunique() == 1
        # Without failures a run is compute plus messages and checkpoint writes: it moves with the draw.
        assert 0.5 * log_sd < np.std(np.log(spread[method])) < 1.5 * log_sd
    # Common random numbers: both methods of a replication slow down or speed up together.
    slowdown = spread / fixed
    assert np.allclose(slowdown["checkpoint"], slowdown["redundant"], rtol=0.02), slowdown
    factors = [replication_compute_factor(cpu_tiny_without_failures(log_sd=log_sd), replication) for replication in range(NUM_REPLICATIONS)]
    assert np.corrcoef(factors, slowdown["checkpoint"])[0, 1] > 0.99


def test_a_replication_s_scenario_is_scaled_by_its_own_draw():
    scenario = preset("cpu-tiny")
    for replication in (0, 3):
        factor = replication_compute_factor(scenario, replication)
        drawn = replication_scenario(scenario, replication)
        assert np.allclose(drawn.compute.block_backward_s, [factor * value for value in scenario.compute.block_backward_s])
        assert drawn.churn == scenario.churn and drawn.seed == scenario.seed
