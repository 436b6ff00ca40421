"""The bootstrap interval of a median that the validator and its benchmark report."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from churnsim.calibration.statistics import median_with_ci95


def test_the_median_is_of_every_value_pooled_and_lies_inside_its_interval():
    median, low, high = median_with_ci95([[0.01, 0.02, 0.09], [0.03, 0.05]])
    assert median == pytest.approx(0.03)
    assert low <= median <= high
    assert 0.01 <= low and high <= 0.09


def test_one_value_collapses_and_none_is_nan():
    assert median_with_ci95([[0.04]]) == (0.04, 0.04, 0.04)
    assert all(math.isnan(value) for value in median_with_ci95([[], [math.nan]]))


def test_groups_that_disagree_widen_the_interval_beyond_the_same_values_in_one_group():
    # The same 30 values: as one group they look like 30 independent runs; as three rounds that
    # each sit at their own level, the rounds are the independent units and the median is less sure.
    generator = np.random.default_rng(7)
    rounds = [level + 0.005 * generator.standard_normal(10) for level in (0.02, 0.05, 0.10)]
    _, low_pooled, high_pooled = median_with_ci95([np.concatenate(rounds)])
    _, low_rounds, high_rounds = median_with_ci95(rounds)
    assert high_rounds - low_rounds > 1.5 * (high_pooled - low_pooled)


def test_the_interval_covers_the_true_median_about_as_often_as_it_says():
    # The simulated benchmark of benchmarks/bootstrap_coverage.py (4 rounds of 8 lognormal errors,
    # each round at a level of its own, 150 repetitions): the interval holds the true median in
    # roughly 95 % of them. A coarse percentile interval with 4 clusters is known to run somewhat
    # short; 80 % is the floor here.
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bootstrap_coverage.py"
    specification = importlib.util.spec_from_file_location("bootstrap_coverage", path)
    assert specification is not None and specification.loader is not None
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)
    assert module.coverage(rounds_as_units=True) >= 0.80


def test_the_same_seed_gives_the_same_interval():
    groups = [[0.01, 0.04, 0.02], [0.07, 0.03]]
    assert median_with_ci95(groups, seed=3) == median_with_ci95(groups, seed=3)


def test_one_group_per_resample_gives_where_one_more_group_s_median_falls():
    rounds = [[0.02, 0.025, 0.03], [0.08, 0.09, 0.10]]
    _, low, high = median_with_ci95(rounds, groups_per_resample=1)
    # A new round like these has its median near one round's or the other's, not only near the pooled one.
    assert low <= 0.025 and high >= 0.09
    _, pooled_low, pooled_high = median_with_ci95(rounds)
    assert pooled_low >= low and pooled_high <= high
