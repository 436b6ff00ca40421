"""The held-out validation benchmark's draw (benchmarks/held_out_validation.py, `draw_setups`):
seeded, within its stated ranges, every level of every factor drawn. Nothing is run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "held_out_validation.py"


@pytest.fixture(scope="module")
def held_out():
    spec = importlib.util.spec_from_file_location("held_out_validation", _BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_draw_is_reproduced_by_its_seed_and_changed_by_another(held_out):
    assert held_out.draw_setups(48, 28) == held_out.draw_setups(48, 28)
    assert held_out.draw_setups(48, 28) != held_out.draw_setups(49, 28)


@pytest.mark.parametrize("seed", [0, 48, 1234])
@pytest.mark.parametrize("count", [3, 10, 28])
def test_every_setup_lies_in_the_stated_ranges_and_every_level_is_drawn(held_out, seed, count):
    setups = held_out.draw_setups(seed, count)
    assert len(setups) == count and len({setup.seed for setup in setups}) == count
    for factor, levels in held_out.FACTOR_LEVELS.items():
        drawn = [getattr(setup, factor) for setup in setups]
        assert set(drawn) == set(levels), factor  # within the range, and all of it
        counts = pd.Series(drawn).value_counts()
        assert counts.max() - counts.min() <= 1, factor  # spread evenly
    for setup in setups:
        assert setup.seed >= 10_000  # away from the calibration suite's seeds
        assert setup.method in held_out.METHODS and held_out.MIN_STAGES.get(setup.method, 1) <= setup.num_stages
    if count >= len(held_out.METHODS):
        assert {setup.method for setup in setups} == set(held_out.METHODS)


def test_the_ranges_hold_halved_and_doubled_width_and_hard_failures_at_high_rates(held_out):
    levels = held_out.FACTOR_LEVELS
    assert {0.5, 2.0} <= set(levels["width_factor"]) and "hard" in levels["failure_mode"] and max(levels["failures_per_node_hour"]) >= 960


def test_each_drawn_setup_is_a_scenario_real_runs_take(held_out):
    # The whole draw, as the held_out would run it: every setting accepted by the scenario contract.
    for setup in held_out.draw_setups(48, 28):
        scenario = held_out._scenario(setup, 40)
        assert (scenario.model.hidden_size, scenario.pipeline.num_stages, scenario.training.failure_mode) == (
            setup.hidden_size, setup.num_stages, setup.failure_mode,
        )  # fmt: skip
        scenario.check_real_run_layout()


def test_too_few_runs_to_draw_every_level_is_refused(held_out):
    with pytest.raises(ValueError, match="draw at least 3"):
        held_out.draw_setups(0, 2)


def test_the_figures_are_the_medians_over_every_run_and_per_level(held_out):
    setups = held_out.draw_setups(48, 6)
    errors = [0.01, -0.02, 0.05, -0.20, 0.03, 0.04]
    rows = []
    for setup, error in zip(setups, errors):
        rows.append(dict(run_id=setup.run_id, quantity="total_wall_clock_s", measured=10.0, predicted=10.0 * (1 + 2 * error),
                         relative_error=2 * error, load_normalised_relative_error=error, machine_slowdown_at_validation=1.2))
        rows.append(dict(run_id=setup.run_id, quantity="steady_iteration_s", measured=0.11, predicted=0.1,
                         relative_error=-0.1, load_normalised_relative_error=float("nan"), machine_slowdown_at_validation=1.2))
    summary = held_out.summarize(pd.DataFrame(rows), setups)
    assert summary["pooled"]["load-normalised wall-clock"]["absolute"] == pytest.approx(0.035)  # median of |errors|
    assert summary["pooled"]["wall-clock"]["absolute"] == pytest.approx(0.07) and summary["pooled"]["wall-clock"]["runs"] == 6
    assert summary["target_verdicts"]["load-normalised wall-clock"].startswith("missed")
    assert summary["machine_slowdown_at_validation"] == 1.2
    hard = [abs(error) for setup, error in zip(setups, errors) if setup.failure_mode == "hard"]
    figures = summary["by_factor"]["failure_mode"]["hard"]
    assert figures["runs"] == len(hard) and figures["median_absolute_load_normalised_error"] == pytest.approx(float(pd.Series(hard).median()))
    assert figures["median_steady_step_over_prediction"] == pytest.approx(1.1)
