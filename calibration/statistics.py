"""The 95 % intervals every table, figure, verdict and fit reports: the one rule for a positive
quantity (a time to target, a speed-up, any duration or ratio: `positive_mean_with_ci95`, on the log
scale, so never below zero), the Student-t interval of a quantity that may take either sign
(differences, logs: `mean_with_ci95`), the bootstrap interval of a median (validation errors), a
permutation test of whether labelled groups of errors differ, the smallest number of replications
whose intervals mean much (`MIN_REPLICATIONS_FOR_INTERVALS`), and the numeric helpers the fits share."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Iterable

import numpy as np

NORMAL_QUANTILE_975 = 1.959963984540054
"""The standard normal's 97.5 % quantile: a normal's 95 % interval is its mean ± this many standard deviations."""


MIN_REPLICATIONS_FOR_INTERVALS = 5
"""Below this many replications every output says its intervals are unreliable. Why 5: the interval's
width rests on a standard deviation estimated from the replications themselves; from n values its
relative standard error is about 1/√(2(n − 1)), 71 % at n = 2 and 50 % at n = 3, and Student's t
quantile (12.7 at n = 2, 4.3 at n = 3) makes up for that only if the values are exactly (log-)normal.
At n = 5 the error is about 35 % and t is 2.8, the first n at which the interval is a usable guide."""


def intervals_unreliable(num_replications: int | float | None) -> bool:
    """Whether intervals over `num_replications` replications are too few to rely on (at least two are
    needed for any interval; below `MIN_REPLICATIONS_FOR_INTERVALS` its width is itself a guess)."""
    return num_replications is not None and math.isfinite(num_replications) and num_replications < MIN_REPLICATIONS_FOR_INTERVALS


def small_sample_caveat(num_replications: int) -> str:
    """The caveat every output carries when its intervals come from too few replications."""
    return (
        f"the 95 % intervals come from {num_replications} replication{'s' if num_replications != 1 else ''}, fewer than "
        f"{MIN_REPLICATIONS_FOR_INTERVALS}: they are unreliable, and so is any \"cannot be told apart\" read from them; "
        f"run --replications {MIN_REPLICATIONS_FOR_INTERVALS} or more"
    )


def positive_mean_with_ci95(values: Iterable[float]) -> tuple[float, float, float]:
    """Geometric mean and 95 % interval of the finite values of a positive quantity: the Student-t
    interval of the mean of their logarithms, taken back by exp, so the interval is never below zero
    and is as skewed as such quantities are (a run cannot take less than no time, but can take many
    times longer). The one rule for times to target and speed-ups (a paired speed-up's values are the
    per-replication ratios, so this is the t interval of the mean log ratio). Collapses to the value
    for one value or a constant sample, NaN for none. Raises ValueError on a value ≤ 0, which is no
    positive quantity."""
    data = np.asarray(list(values), dtype=float)
    data = data[np.isfinite(data)]
    if data.size and not bool(np.all(data > 0)):
        raise ValueError(f"positive_mean_with_ci95 needs positive values, got {float(data.min())}")
    if data.size == 0:
        return math.nan, math.nan, math.nan
    if bool(np.all(data == data[0])):
        return float(data[0]), float(data[0]), float(data[0])  # exp(log x) need not give x back to the last bit
    log_mean, log_low, log_high = mean_with_ci95(np.log(data))
    return math.exp(log_mean), math.exp(log_low), math.exp(log_high)


def geometric_mean(values: Iterable[float]) -> float:
    """The point estimate of `positive_mean_with_ci95`, for the bounds that must be read beside it."""
    return positive_mean_with_ci95(values)[0]


def mean_with_ci95(values: Iterable[float]) -> tuple[float, float, float]:
    """Mean and Student-t 95 % interval of the finite values of a quantity that may take either sign
    (a difference, a logarithm); collapses to the mean for one value, NaN for none. A positive
    quantity takes `positive_mean_with_ci95` instead."""
    data = np.asarray(list(values), dtype=float)
    data = data[np.isfinite(data)]
    if data.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(data.mean())
    if data.size == 1:
        return mean, mean, mean
    half_width = float(t_quantile_975(data.size - 1) * data.std(ddof=1) / math.sqrt(data.size))
    return mean, mean - half_width, mean + half_width


BOOTSTRAP_RESAMPLES = 4000


def median_with_ci95(
    groups: Sequence[Iterable[float]], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, groups_per_resample: int | None = None
) -> tuple[float, float, float]:
    """Median of the finite values of all `groups` pooled, and its 95 % percentile-bootstrap interval.

    Values of one group share a cause (in validation: one calibration and one spell of the
    machine's speed), so the groups, not the values, are the independent units: each resample draws
    as many groups as there are, with replacement, and then values inside each drawn group, with
    replacement (the two-stage bootstrap; Davison & Hinkley, *Bootstrap Methods and their
    Application*, 1997, §3.8). With one group it is the plain bootstrap of its values.
    `groups_per_resample=1` draws a single group per resample: the interval is then where the median
    of one more group like these would fall (a prediction interval for a replicate). Collapses to
    the median for one value, NaN for none. Approximation: a percentile interval of a median from a
    handful of values is coarse (it moves in steps of the values themselves); `seed` makes it
    repeatable.
    """
    arrays = [np.asarray(list(group), dtype=float) for group in groups]
    arrays = [array[np.isfinite(array)] for array in arrays]
    arrays = [array for array in arrays if array.size]
    if not arrays:
        return math.nan, math.nan, math.nan
    pooled = np.concatenate(arrays)
    median = float(np.median(pooled))
    if pooled.size == 1:
        return median, median, median
    generator = np.random.default_rng(seed)
    medians = np.empty(resamples)
    for index in range(resamples):
        chosen = generator.integers(len(arrays), size=groups_per_resample or len(arrays))
        drawn = [arrays[group][generator.integers(arrays[group].size, size=arrays[group].size)] for group in chosen]
        medians[index] = np.median(np.concatenate(drawn))
    low, high = np.percentile(medians, [2.5, 97.5])
    return median, float(low), float(high)


PERMUTATIONS = 4000


@dataclasses.dataclass(frozen=True)
class LargestMedianTest:
    """Whether one label's values stand out among labels measured side by side in blocks."""

    medians: dict[str, float]
    """Per label, the median of its finite values over every block."""
    largest_label: str
    p_value: float
    """Share of within-block relabellings whose largest label median is at least the observed
    largest (with the observed labelling counted among them, so never 0)."""
    largest_if_alike: tuple[float, float, float]
    """The 2.5 %, 50 % and 97.5 % quantiles of the largest label median under those relabellings:
    what the worst label would show if every label's values came from one distribution."""


def largest_median_if_labels_alike(
    blocks: Sequence[Sequence[tuple[str, float]]], *, permutations: int = PERMUTATIONS, seed: int = 0
) -> LargestMedianTest | None:
    """A permutation test of the largest of several labels' medians: shuffle the labels inside each
    block (values of one block share a cause, in validation one calibration and one spell of the
    machine, so only labels within a block are exchangeable under "the labels do not matter") and
    see how often the largest label median is at least the observed one.

    Why: a target held per label (≤ 5 % per recovery method) is judged on the worst of several
    noisy medians; with eight labels the worst exceeds the common median by chance alone. The test
    says whether the worst label differs from the others, and `largest_if_alike` what the worst of
    them would be if none did. None without finite values of at least two labels."""
    rows = [(block_index, label, float(value)) for block_index, block in enumerate(blocks) for label, value in block if math.isfinite(value)]
    labels = sorted({label for _, label, _ in rows})
    if len(labels) < 2:
        return None
    block_ids = np.array([block for block, _, _ in rows])
    codes = np.array([labels.index(label) for _, label, _ in rows])
    values = np.array([value for _, _, value in rows])

    def label_medians(assigned: np.ndarray) -> np.ndarray:
        return np.array([np.median(values[assigned == code]) if np.any(assigned == code) else -np.inf for code in range(len(labels))])

    observed = label_medians(codes)
    generator = np.random.default_rng(seed)
    largest = np.empty(permutations)
    for index in range(permutations):
        # Sorted by block, then by a random key: a uniform shuffle of positions inside each block.
        within_block = np.lexsort((generator.random(values.size), block_ids))
        by_block = np.argsort(block_ids, kind="stable")
        relabelled = np.empty_like(codes)
        relabelled[by_block] = codes[within_block]
        largest[index] = label_medians(relabelled).max()
    low, middle, high = np.percentile(largest, [2.5, 50.0, 97.5])
    return LargestMedianTest(
        medians={label: float(median) for label, median in zip(labels, observed)},
        largest_label=labels[int(np.argmax(observed))],
        p_value=float((np.sum(largest >= observed.max()) + 1) / (permutations + 1)),
        largest_if_alike=(float(low), float(middle), float(high)),
    )


@functools.lru_cache(maxsize=256)
def t_quantile_975(degrees_of_freedom: int) -> float:
    """The 97.5 % quantile of Student's t. scipy.stats is imported here, on first use: importing it
    costs most of a second, which every command that never computes an interval would pay."""
    from scipy import stats

    return float(stats.t.ppf(0.975, degrees_of_freedom))


def solve_increasing(target: float, predict: Callable[[float], float], low: float, high: float) -> float:
    """The x in [low, high] with predict(x) = target, for a predict that grows with x (bisection):
    `low` where predict(low) already reaches the target, `high` where predict(high) does not.

    For what to charge the simulator so that its iteration lasts as measured: on cores shared by
    more processes than cores, a core-second charged to every stage lengthens the iteration by more
    than a second, so the charge is solved for, not subtracted."""
    if predict(low) >= target:
        return low
    if predict(high) < target:
        return high
    for _ in range(40):
        middle = 0.5 * (low + high)
        if predict(middle) < target:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)
