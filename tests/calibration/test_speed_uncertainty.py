"""The machine's run-to-run speed spread: fitted from a calibration's runs, carried into its scenarios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from churnsim.calibration.builtin import load_builtin_calibration
from churnsim.calibration.presets import preset
from churnsim.calibration.speed_uncertainty import (
    replication_compute_factor,
    run_speed_log_sd,
    speed_interval_factors,
    speed_spread_note,
    with_compute_scaled,
)


def test_the_spread_of_log_speeds_is_recovered_with_its_predictive_inflation():
    log_sd = 0.05
    factors = np.exp(np.random.default_rng(3).normal(0.0, log_sd, size=2000))
    # sqrt(1 + 1/n) is 1.00025 here: the fit is the sample spread.
    assert run_speed_log_sd(factors) == pytest.approx(log_sd, rel=0.05)
    few = [0.95, 1.0, 1.05]
    assert run_speed_log_sd(few) == pytest.approx(np.std(np.log(few), ddof=1) * math.sqrt(4 / 3))


def test_too_few_or_identical_speeds_give_no_spread():
    assert run_speed_log_sd([]) == 0.0
    assert run_speed_log_sd([0.9, 1.1]) == 0.0
    assert run_speed_log_sd([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert speed_interval_factors(0.0) == (1.0, 1.0)
    low, high = speed_interval_factors(0.05)
    assert low < 1.0 < high and math.log(high) == pytest.approx(-math.log(low))


def test_a_calibrated_scenario_carries_the_calibration_s_speed_spread():
    calibration, reason = load_builtin_calibration("cpu-tiny")
    assert calibration is not None, reason
    expected = run_speed_log_sd(calibration.run_speed_factors.values())
    assert expected > 0
    assert preset("cpu-tiny").compute.run_speed_log_sd == expected
    # Another setup takes its compute from the compute model, with the same machine's spread.
    assert preset("cpu-tiny", {"pipeline.num_microbatches": 6}).compute.run_speed_log_sd == expected
    assert "×" in (speed_spread_note(preset("cpu-tiny")) or "")


def test_replications_draw_one_reproducible_speed_each_and_only_with_a_spread():
    scenario = preset("cpu-tiny").model_copy(update={"seed": 5})
    factors = [replication_compute_factor(scenario, replication) for replication in range(40)]
    assert factors == [replication_compute_factor(scenario, replication) for replication in range(40)]
    assert len(set(factors)) == 40
    log_sd = scenario.compute.run_speed_log_sd
    assert np.std(np.log(factors)) == pytest.approx(log_sd, rel=0.35)
    without = scenario.model_copy(update={"compute": scenario.compute.model_copy(update={"run_speed_log_sd": 0.0})})
    assert {replication_compute_factor(without, replication) for replication in range(5)} == {1.0}
    assert speed_spread_note(without) is None
    # A paper preset computes from FLOPs: no calibrated machine, no draw.
    assert replication_compute_factor(preset("checkfree-500m-geo-10pct"), 0) == 1.0


def test_scaling_compute_scales_every_compute_time_and_nothing_else():
    scenario = preset("cpu-tiny")
    scaled = with_compute_scaled(scenario, 1.1)
    assert scaled.compute.block_forward_s == pytest.approx(tuple(1.1 * value for value in scenario.compute.block_forward_s))
    assert scaled.compute.optimizer_step_s == pytest.approx(1.1 * scenario.compute.optimizer_step_s)
    assert scaled.compute.shared_cores == scenario.compute.shared_cores
    assert scaled.network == scenario.network and scaled.storage == scenario.storage
    assert with_compute_scaled(scenario, 1.0) is scenario
