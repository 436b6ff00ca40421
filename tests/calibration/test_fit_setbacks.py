"""Setbacks from the convergence lab's table: known setbacks are recovered within their intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.fit_setbacks import lab_setbacks, methods_told_apart, setback_summary


def _synthetic_table(true_setbacks: dict[tuple[str, str], float], *, slope: float = 0.0, noise: float = 3.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for lab_seed in (0, 1):
        for failure in range(100, 900, 50):
            for (method, position), setback in true_setbacks.items():
                stage = 1 if position == "interior" else 0
                for window in (5, 30):
                    value = setback + slope * (failure - 500) + rng.normal(0.0, noise)
                    rows.append(dict(seed=lab_seed, method=method, stage=stage, position=position, failure_iteration=failure,
                                     window_iterations=window, setback_iterations=value if window == 30 else value * 3))  # fmt: skip
    return pd.DataFrame(rows)


def test_known_setbacks_are_recovered_within_their_intervals():
    truth = {("checkfree", "interior"): 12.0, ("checkfree", "edge"): 80.0, ("random", "interior"): 30.0, ("random", "edge"): 90.0}
    setbacks = lab_setbacks(_synthetic_table(truth))
    for (method, position), value in truth.items():
        spec = setbacks[method].for_position(position)
        assert spec.num_samples == 32  # the kept (longest) window only: 2 seeds × 16 failures
        assert spec.per_progress_iteration == 0.0  # no growth with progress in this table: a constant
        assert spec.ci95_low_iterations <= value <= spec.ci95_high_iterations


def test_a_setback_that_grows_with_progress_is_fitted_as_a_line_from_where_it_starts():
    rows = _synthetic_table({("copy", "interior"): 0.0}, slope=0.3, noise=2.0)
    # setback = 0.3 · (f − 500) here, so it starts at f = 500 (the table clips nothing: negative early)
    spec = lab_setbacks(rows)["copy"].interior
    assert spec.per_progress_ci95_low <= 0.3 <= spec.per_progress_ci95_high
    assert spec.progress_offset_iterations == pytest.approx(500.0, rel=0.05)
    assert spec.at_progress(400.0) == 0.0 and spec.at_progress(800.0) == pytest.approx(90.0, rel=0.1)


def test_paired_differences_tell_methods_apart_only_when_they_differ():
    apart = methods_told_apart(_synthetic_table({("a", "interior"): 10.0, ("b", "interior"): 20.0}), "interior")
    assert apart.iloc[0]["told_apart"] and apart.iloc[0]["mean_difference_iterations"] == pytest.approx(-10.0, abs=2.0)
    same = methods_told_apart(_synthetic_table({("a", "interior"): 10.0, ("b", "interior"): 10.0}, noise=1e-3), "interior")
    assert abs(same.iloc[0]["mean_difference_iterations"]) < 0.01


def test_the_slope_against_training_progress_is_recovered():
    summary = setback_summary(_synthetic_table({("copy", "interior"): 50.0}, slope=0.2, noise=1.0))
    kept = summary[summary["window_iterations"] == 30].iloc[0]
    assert kept["slope_ci95_low"] <= 0.2 <= kept["slope_ci95_high"]


def test_a_table_without_the_lab_columns_is_an_input_error():
    with pytest.raises(InputError, match="lacks column"):
        lab_setbacks(pd.DataFrame({"method": ["checkfree"]}), source="x.csv")
