"""The one Student-t 95 % interval every table, figure and fit reports."""

from __future__ import annotations

import functools
import math
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
