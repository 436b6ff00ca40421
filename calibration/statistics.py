"""The one Student-t 95 % interval every table, figure and fit reports, and the numeric helpers the fits share."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
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
