"""How fast the calibrated machine will run, carried into every answer as an uncertainty.

A calibration measures each of its runs' speed against the typical one (`Calibration.run_speed_factors`,
calibration.fit_timing.run_speed_factors). Identical runs minutes apart differ by several percent,
on shared and dedicated machines alike (the identical-runs-spread benchmark report), and no
measurement before a run tells which speed it will get. So a prediction of one run's wall-clock
has a spread of its own, however exact the model.

`run_speed_log_sd` is that spread as the standard deviation of a run's log speed factor, inflated by
sqrt(1 + 1/n) for the typical speed itself being estimated from n runs (the predictive spread of one
new run). Calibrations set it on their `ExplicitCompute` (calibration.apply.calibrated_compute):

- each replication of a scenario draws one factor exp(z · sd) and scales every compute time by it
  (`replication_compute_factor`), z from `numpy.random.SeedSequence((seed, replication, SPEED_STREAM))`:
  its own stream, so the failure path and the setback draws do not move; every method of a
  replication gets the same factor (common random numbers), so paired speed-ups keep their
  precision and only absolute times widen;
- the validator predicts each real run at the factors exp(∓1.96 · sd) as well, the 95 % interval
  of its wall-clock from the machine's speed alone (wall-clock only grows with compute, so the
  quantiles map through), and reports whether the measured run fell inside.

The spread is measured over the few minutes of a calibration. A machine that drifts further before
the predicted run (a shared host's load changing) runs outside it: the validator's coverage says
how often.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from .scenario import ExplicitCompute, Scenario
from .statistics import NORMAL_QUANTILE_975

SPEED_STREAM = 3
"""Source index of the speed draws (CHURN_STREAM = 1, SETBACK_STREAM = 2)."""
MINIMUM_RUNS_FOR_SPREAD = 3
"""Fewer speed factors than this give no spread (a standard deviation of two is a guess)."""

_COMPUTE_TIME_FIELDS = (
    "block_forward_s", "block_backward_s", "embedding_forward_s", "embedding_backward_s",
    "head_forward_s", "head_backward_s", "optimizer_step_s",
)


def _finite_logs(speed_factors: Iterable[float]) -> np.ndarray:
    return np.log([factor for factor in speed_factors if math.isfinite(factor) and factor > 0])


def _spread_of_logs(logs: np.ndarray) -> float:
    return float(np.std(logs, ddof=1)) if len(logs) >= 2 else math.nan


def log_speed_spread(speed_factors: Iterable[float]) -> float:
    """The sample standard deviation of the factors' logs, how far these runs' speeds spread (NaN
    with fewer than 2)."""
    return _spread_of_logs(_finite_logs(speed_factors))


def run_speed_log_sd(speed_factors: Iterable[float]) -> float:
    """The predictive standard deviation of one new run's log speed factor (module docstring); 0.0
    with fewer than `MINIMUM_RUNS_FOR_SPREAD` factors."""
    logs = _finite_logs(speed_factors)
    if len(logs) < MINIMUM_RUNS_FOR_SPREAD:
        return 0.0
    return _spread_of_logs(logs) * math.sqrt(1.0 + 1.0 / len(logs))


def speed_interval_factors(log_sd: float) -> tuple[float, float]:
    """The 2.5 % and 97.5 % quantiles of a run's speed factor (1.0, 1.0 without a spread)."""
    return math.exp(-NORMAL_QUANTILE_975 * log_sd), math.exp(NORMAL_QUANTILE_975 * log_sd)


def with_compute_scaled(scenario: Scenario, factor: float) -> Scenario:
    """Every compute time of an explicit-compute scenario multiplied by `factor` (a machine that ran
    slower or faster than while calibrating); other compute models are returned as they are."""
    compute = scenario.compute
    if not isinstance(compute, ExplicitCompute) or factor == 1.0:
        return scenario

    def scaled(value: float | tuple[float, ...]) -> float | tuple[float, ...]:
        return tuple(factor * item for item in value) if isinstance(value, tuple) else factor * value

    update: dict[str, object] = {name: scaled(getattr(compute, name)) for name in _COMPUTE_TIME_FIELDS}
    # The methods' extras are compute too; their ratio (the scale to another setup) stays the same.
    for name in ("method_iteration_extra_s", "method_model_extra_s"):
        update[name] = tuple((method, factor * seconds) for method, seconds in getattr(compute, name))
    return scenario.model_copy(update={"compute": compute.model_copy(update=update)})


def scenario_run_speed_log_sd(scenario: Scenario) -> float:
    """The spread of the scenario's machine speed (0.0 for compute not measured on a machine)."""
    return scenario.compute.run_speed_log_sd if isinstance(scenario.compute, ExplicitCompute) else 0.0


def replication_compute_factor(scenario: Scenario, replication: int) -> float:
    """Replication `replication`'s speed factor of `scenario`'s machine (1.0 without a spread)."""
    log_sd = scenario_run_speed_log_sd(scenario)
    if log_sd <= 0.0:
        return 1.0
    z = np.random.default_rng(np.random.SeedSequence((scenario.seed, replication, SPEED_STREAM))).standard_normal()
    return float(math.exp(z * log_sd))


def speed_spread_note(scenario: Scenario) -> str | None:
    """One line saying that replications draw the machine's speed, or None when they do not."""
    log_sd = scenario_run_speed_log_sd(scenario)
    if log_sd <= 0.0:
        return None
    low, high = speed_interval_factors(log_sd)
    return (
        f"each replication draws the calibrated machine's speed (compute ×{low:.3f}–{high:.3f} at 95 %, the spread "
        "between the calibration's runs), so the intervals of time to target include it"
    )
