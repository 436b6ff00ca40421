"""Where a real run's failures come from: a failure-schedule file, or sampled from an hourly rate.

Both return `(step, stage)` pairs for `TrainingConfig.failures`: stage fails before the first
microbatch of that executed iteration.

Sampling scales the CheckFree paper's unit, a per-stage hourly failure probability h, to the run
through a *nominal* iteration time T (default 60 s, the order of the CheckFree geo-distributed
iterations): p_iter = 1 − (1 − h)^(T / 3600 s) per stage per iteration
(`stage_hourly_to_per_iteration_probability`). A short CPU run whose iterations take milliseconds
thus sees failures at the paper's per-iteration rates, not at the rate its own wall clock implies.
Approximation: failures are drawn for the first `num_iterations` executed iterations; iterations
replayed after a rollback beyond that horizon see none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from churnsim.calibration.churn import stage_hourly_to_per_iteration_probability
from churnsim.calibration.errors import InputError
from churnsim.calibration.failures import read_failure_schedule

DEFAULT_NOMINAL_ITERATION_S = 60.0


def failures_from_schedule(path: str | Path, num_stages: int, num_iterations: int) -> tuple[tuple[int, int], ...]:
    """The (iteration, stage) rows of a failure-schedule CSV, sorted; rows past the run are dropped.

    The `iteration` column is used (it counts executed iterations, the trainer's steps); a row with
    only `time_s` is an error, since a real run's iteration times are not known in advance.
    """
    schedule = read_failure_schedule(path).validate_for(num_stages, source=str(path))
    failures = set()
    for failure in schedule.failures:
        if failure.iteration is None:
            raise InputError(
                f"{path}: the failure of stage {failure.stage} at time_s {failure.time_s} has no iteration; "
                "real runs inject failures by iteration: fill the iteration column"
            )
        if failure.iteration < num_iterations:
            failures.add((failure.iteration, failure.stage))
    return tuple(sorted(failures))


def sample_failures(
    probability_per_stage_hour: float,
    *,
    nominal_iteration_s: float = DEFAULT_NOMINAL_ITERATION_S,
    num_stages: int,
    num_iterations: int,
    seed: int,
) -> tuple[tuple[int, int], ...]:
    """Independent Bernoulli failures per stage per iteration with p_iter from the hourly rate h."""
    if num_stages < 1 or num_iterations < 1:
        raise InputError(f"num_stages {num_stages} and num_iterations {num_iterations} must be >= 1")
    probability = stage_hourly_to_per_iteration_probability(probability_per_stage_hour, nominal_iteration_s)
    generator = np.random.default_rng(seed)
    struck = generator.random((num_iterations, num_stages)) < probability  # (iteration, stage)
    return tuple((int(step), int(stage)) for step, stage in zip(*np.nonzero(struck)))
