"""The one Student-t 95 % interval every table, figure and fit reports, the bootstrap interval of a
median (validation errors), and the numeric helpers the fits share."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Iterable

import numpy as np

NORMAL_QUANTILE_975 = 1.959963984540054
"""The standard normal's 97.5 % quantile: a normal's 95 % interval is its mean ± this many standard deviations."""


def mean_with_ci95(values: Iterable[float]) -> tuple[float, float, float]:
    """Mean and Student-t 95 % interval of the finite values; collapses to the mean for one value, NaN for none."""
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
