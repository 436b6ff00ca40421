"""The intervals every output reports: of a positive quantity (on the log scale), of a median (the
bootstrap that the validator and its benchmark report), and when they rest on too few replications."""

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


def _blocks(levels, labels, values_of):
    return [[(label, values_of(level, label, index)) for index, label in enumerate(labels)] for level in levels]


def test_a_label_with_twice_the_error_of_the_others_stands_out():
    from churnsim.calibration.statistics import largest_median_if_labels_alike

    generator = np.random.default_rng(3)
    labels = [f"method-{index}" for index in range(6)]
    blocks = _blocks(
        range(20), labels, lambda _level, label, _index: (2.0 if label == "method-0" else 1.0) * abs(generator.normal(0.04, 0.01))
    )
    test = largest_median_if_labels_alike(blocks, permutations=999)
    assert test.largest_label == "method-0"
    assert test.p_value < 0.01
    assert test.medians["method-0"] > test.largest_if_alike[2]


def test_labels_are_shuffled_only_inside_their_blocks():
    from churnsim.calibration.statistics import largest_median_if_labels_alike

    # Every value of a block is the block's level and every label is in every block once: a shuffle
    # inside the blocks changes nothing, one across the blocks would scatter the labels' medians.
    labels = ["a", "b", "c", "d"]
    blocks = _blocks([0.01, 0.02, 0.05, 0.2, 0.3], labels, lambda level, _label, _index: level)
    test = largest_median_if_labels_alike(blocks, permutations=999)
    assert set(test.medians.values()) == {0.05}
    assert test.largest_if_alike == (0.05, 0.05, 0.05)
    assert test.p_value == 1.0


def test_the_worst_of_eight_alike_labels_exceeds_their_common_median_by_chance():
    from churnsim.calibration.statistics import largest_median_if_labels_alike

    generator = np.random.default_rng(11)
    labels = [f"method-{index}" for index in range(8)]
    blocks = _blocks(range(36), labels, lambda _level, _label, _index: abs(generator.normal(0.0, 0.06)))
    common_median = float(np.median([value for block in blocks for _, value in block]))
    test = largest_median_if_labels_alike(blocks, permutations=999)
    assert test.largest_if_alike[0] > common_median
    assert test.p_value > 0.05


def test_fewer_than_two_labels_cannot_be_compared():
    from churnsim.calibration.statistics import largest_median_if_labels_alike

    assert largest_median_if_labels_alike([[("a", 0.1), ("a", math.nan)], [("b", math.nan)]]) is None


# The one interval rule for positive quantities (times to target, speed-ups).


def test_a_positive_quantity_s_interval_stays_above_zero_at_small_n_and_skewed_values():
    from churnsim.calibration.statistics import mean_with_ci95, positive_mean_with_ci95

    for values in ([1.0, 18.0], [9.7, 0.4], [2.0, 2.1, 60.0], [0.9, 1.3, 0.2, 5.0]):
        signed_low = mean_with_ci95(values)[1]
        mean, low, high = positive_mean_with_ci95(values)
        assert 0.0 < low < mean < high, values
        assert min(values) <= mean <= max(values)  # a geometric mean lies among its values
        assert signed_low < 0.0, "these samples are chosen so that the symmetric interval goes below zero"


def test_the_positive_interval_is_the_t_interval_of_the_logs_taken_back():
    from scipy import stats

    from churnsim.calibration.statistics import positive_mean_with_ci95

    values = [10.0, 12.0, 11.0, 15.0]
    logs = np.log(values)
    half = stats.t.ppf(0.975, 3) * stats.tstd(logs) / 2.0
    mean, low, high = positive_mean_with_ci95(values)
    assert mean == pytest.approx(math.exp(logs.mean()))
    assert (low, high) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    # Skewed like a duration: further above the geometric mean than below it.
    assert high - mean > mean - low


def test_the_log_interval_of_a_constant_sample_is_a_point():
    from churnsim.calibration.statistics import positive_mean_with_ci95

    assert positive_mean_with_ci95([7.3, 7.3, 7.3]) == (7.3, 7.3, 7.3)
    assert positive_mean_with_ci95([2.5]) == (2.5, 2.5, 2.5)
    assert all(math.isnan(value) for value in positive_mean_with_ci95([math.nan]))
    assert all(math.isnan(value) for value in positive_mean_with_ci95([]))


def test_a_value_at_or_below_zero_is_no_positive_quantity():
    from churnsim.calibration.statistics import positive_mean_with_ci95

    with pytest.raises(ValueError, match="positive"):
        positive_mean_with_ci95([3.0, 0.0])


def test_intervals_below_the_minimum_number_of_replications_are_called_unreliable():
    from churnsim.calibration.statistics import MIN_REPLICATIONS_FOR_INTERVALS, intervals_unreliable, small_sample_caveat

    assert intervals_unreliable(MIN_REPLICATIONS_FOR_INTERVALS - 1) and not intervals_unreliable(MIN_REPLICATIONS_FOR_INTERVALS)
    assert not intervals_unreliable(None) and not intervals_unreliable(math.nan)
    caveat = small_sample_caveat(2)
    assert "2 replications" in caveat and "unreliable" in caveat and f"--replications {MIN_REPLICATIONS_FOR_INTERVALS}" in caveat
