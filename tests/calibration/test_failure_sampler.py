"""A failure path read forward one horizon at a time (`FailureSampler`, `LazyFailurePath`) is exactly
the path sampled in one go: same events in the same order, same preemptions, for every churn model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from churn_strategies import P3, churn_configs

from churnsim.calibration.churn import BurstChurn, PoissonChurn, ScheduleChurn, TraceChurn, WeibullChurn
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import (
    FailurePathSpec,
    FailureSampler,
    LazyFailurePath,
    sample_failures_with_stats,
)
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule

HOUR_S = 3600.0

_configs = churn_configs(max_events_per_hour=20.0, min_mean_lifetime_s=60.0, min_time_scale=0.01)


@settings(max_examples=80, deadline=None)
@given(
    config=_configs,
    num_stages=st.integers(1, 16),
    horizons=st.lists(st.floats(0.0, 30 * HOUR_S), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_advancing_in_steps_gives_the_path_sampled_in_one_go(config, num_stages, horizons, seed):
    sampler = FailureSampler(config, num_stages=num_stages, rng=np.random.default_rng(seed))
    walked = []
    for horizon_s in horizons:  # in any order: an earlier horizon than the last adds nothing
        walked.extend(sampler.advance_to(horizon_s))
    whole = sample_failures_with_stats(config, num_stages=num_stages, horizon_s=max(horizons), rng=np.random.default_rng(seed))
    assert tuple(walked) == whole.events
    assert sampler.num_preemptions_seen == whole.num_preemptions_seen
    assert sampler.horizon_s == max(horizons)


def test_a_schedule_is_handed_out_in_time_order_once(tmp_path):
    path = tmp_path / "schedule.csv"
    rows = (ScheduledFailure(time_s=5.0, stage=2), ScheduledFailure(time_s=1.5, stage=0), ScheduledFailure(time_s=5.0, stage=1))
    write_failure_schedule(FailureSchedule(failures=rows), path)
    sampler = FailureSampler(ScheduleChurn(kind="schedule", path=str(path)), num_stages=4, rng=np.random.default_rng(0))
    assert [(event.time_s, event.stage) for event in sampler.advance_to(2.0)] == [(1.5, 0)]
    assert sampler.advance_to(1.0) == ()
    assert [(event.time_s, event.stage) for event in sampler.advance_to(10.0)] == [(5.0, 1), (5.0, 2)]
    assert sampler.num_preemptions_seen == 3


def test_a_bad_horizon_is_an_input_error():
    sampler = FailureSampler(PoissonChurn(kind="poisson", failures_per_node_hour=1.0), num_stages=2, rng=np.random.default_rng(0))
    with pytest.raises(InputError, match="horizon_s"):
        sampler.advance_to(float("nan"))


@pytest.mark.parametrize(
    "churn",
    [
        WeibullChurn(kind="weibull", shape=0.5, mean_lifetime_s=900.0),
        BurstChurn(kind="burst", bursts_per_hour=4.0),
        TraceChurn(**P3, time_scale=0.05, repeat=True),
    ],
    ids=lambda churn: churn.kind,
)
def test_readers_of_a_lazy_path_share_one_path_that_grows_by_appending(churn):
    spec = FailurePathSpec(churn=churn, num_stages=6, seed=11, replication=1, max_time_s=20 * HOUR_S)
    lazy = LazyFailurePath(spec)
    ahead, behind = iter(lazy), iter(lazy)
    first = [next(ahead) for _ in range(5)]
    read_ahead = list(ahead)  # doubles the horizon up to the cap
    assert [next(behind) for _ in range(5)] == first and list(behind) == read_ahead
    assert first + read_ahead == list(spec.sample(spec.max_time_s))
