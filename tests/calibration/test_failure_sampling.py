"""Failure sample paths against closed forms (fixed seeds, stated tolerances) and trace replay."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from churn_strategies import P3, churn_configs

from churnsim.calibration.churn import (
    BurstChurn,
    NoChurn,
    PoissonChurn,
    StageHourlyChurn,
    TraceChurn,
    WeibullChurn,
)
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import (
    FailureCursor,
    FailureEvent,
    FailurePathSpec,
    failures_for_replication,
    mean_stage_failure_rate_per_s,
    sample_failures,
    sample_failures_with_stats,
)
from churnsim.calibration.traces import load_trace

HOUR_S = 3600.0
NUM_REPLICATIONS = 200
P3_END_S = 40920.0
# More stages than the trace ever has nodes alive (32): every removed node hosts a stage, so the
# replayed path is the trace's removals themselves and times can be compared exactly.
ALL_NODES_HOST_STAGES = 40


def _counts(config, *, num_stages, horizon_s):
    return np.array(
        [
            len(sample_failures(config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(seed)))
            for seed in range(NUM_REPLICATIONS)
        ]
    )


def _within_three_standard_errors(samples, expected_mean, variance_per_sample):
    standard_error = math.sqrt(variance_per_sample / len(samples))
    return abs(float(np.mean(samples)) - expected_mean) <= 3.0 * standard_error


def test_no_churn_has_no_failures():
    sample = sample_failures_with_stats(NoChurn(kind="none"), num_stages=8, horizon_s=1e6, rng=np.random.default_rng(0))
    assert sample.events == () and sample.num_preemptions_seen == 0


def test_poisson_failure_counts_match_the_poisson_mean():
    # 200 replications, 6 stages, 10 h at 0.6 /node-h: mean 36 failures; tolerance 3 standard errors.
    config = PoissonChurn(kind="poisson", failures_per_node_hour=0.6)
    counts = _counts(config, num_stages=6, horizon_s=10 * HOUR_S)
    expected = 0.6 * 6 * 10
    assert _within_three_standard_errors(counts, expected, variance_per_sample=expected)
    # Index of dispersion var/mean ≈ 1 for Poisson counts; its standard error is √(2/(n−1)).
    dispersion = float(np.var(counts, ddof=1)) / expected
    assert abs(dispersion - 1.0) <= 3.0 * math.sqrt(2.0 / (NUM_REPLICATIONS - 1))


def test_stage_hourly_probability_is_the_chance_of_a_failure_in_a_stage_hour():
    # 10 %/stage-h ⇒ rate −ln(0.9); the share of (stage, hour) cells with ≥ 1 failure must be 0.1.
    hourly, num_stages, num_hours = 0.1, 8, 25
    config = StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=hourly)
    cells_hit = []
    total_failures = []
    for seed in range(NUM_REPLICATIONS):
        events = sample_failures(config, num_stages=num_stages, horizon_s=num_hours * HOUR_S, rng=np.random.default_rng(seed))
        hit = {(event.stage, int(event.time_s // HOUR_S)) for event in events}
        cells_hit.append(len(hit) / (num_stages * num_hours))
        total_failures.append(len(events))
    num_cells = num_stages * num_hours
    assert _within_three_standard_errors(cells_hit, hourly, hourly * (1 - hourly) / num_cells)
    expected = -math.log(1 - hourly) * num_stages * num_hours
    assert _within_three_standard_errors(total_failures, expected, expected)
    assert {event.kind for event in events} == {"stage_hourly"}


def test_weibull_with_shape_one_has_the_exponential_mean():
    mean_lifetime_s = 1800.0
    config = WeibullChurn(kind="weibull", shape=1.0, mean_lifetime_s=mean_lifetime_s)
    counts = _counts(config, num_stages=4, horizon_s=10 * HOUR_S)
    expected = 4 * 10 * HOUR_S / mean_lifetime_s  # renewal with exponential gaps = Poisson
    assert _within_three_standard_errors(counts, expected, expected)


@pytest.mark.parametrize("shape", [0.5, 1.0, 3.0])
def test_weibull_gaps_between_failures_of_a_stage_have_the_requested_mean(shape):
    mean_lifetime_s = 600.0
    config = WeibullChurn(kind="weibull", shape=shape, mean_lifetime_s=mean_lifetime_s)
    # One long path (400 mean lifetimes per stage), so truncation at the horizon biases nothing visible.
    events = sample_failures(config, num_stages=5, horizon_s=400 * mean_lifetime_s, rng=np.random.default_rng(7))
    gaps = []
    for stage in range(5):
        times = [0.0] + [event.time_s for event in events if event.stage == stage]
        gaps.extend(np.diff(times))
    variance = mean_lifetime_s**2 * (math.gamma(1 + 2 / shape) / math.gamma(1 + 1 / shape) ** 2 - 1)
    assert _within_three_standard_errors(gaps, mean_lifetime_s, variance)


def test_bursts_fail_distinct_stages_at_the_burst_rate():
    config = BurstChurn(kind="burst", bursts_per_hour=2.0)
    num_bursts, sizes = [], []
    for seed in range(NUM_REPLICATIONS):
        events = sample_failures(config, num_stages=8, horizon_s=5 * HOUR_S, rng=np.random.default_rng(seed))
        by_time: dict[float, list[int]] = {}
        for event in events:
            by_time.setdefault(event.time_s, []).append(event.stage)
        for stages in by_time.values():
            assert len(stages) == len(set(stages))
            sizes.append(len(stages))
        num_bursts.append(len(by_time))
    assert _within_three_standard_errors(num_bursts, 10.0, 10.0)
    expected_size = config.mean_burst_size
    size_variance = sum((i + 1) ** 2 * p for i, p in enumerate(config.burst_size_probabilities)) - expected_size**2
    assert _within_three_standard_errors(sizes, expected_size, size_variance)


def test_bursts_larger_than_the_pipeline_take_every_stage_once():
    config = BurstChurn(kind="burst", bursts_per_hour=3.0, burst_size_probabilities=[0.0, 0.0, 0.0, 1.0])
    events = sample_failures(config, num_stages=3, horizon_s=10 * HOUR_S, rng=np.random.default_rng(1))
    by_time: dict[float, list[int]] = {}
    for event in events:
        by_time.setdefault(event.time_s, []).append(event.stage)
    assert by_time and all(sorted(stages) == [0, 1, 2] for stages in by_time.values())


def test_p3_replay_sees_every_remove_row_as_a_preemption():
    config = TraceChurn(**P3)
    sample = sample_failures_with_stats(config, num_stages=12, horizon_s=12 * HOUR_S, rng=np.random.default_rng(3))
    assert sample.num_preemptions_seen == 167
    assert 0 < len(sample.events) <= 167
    everything = sample_failures_with_stats(
        config, num_stages=ALL_NODES_HOST_STAGES, horizon_s=12 * HOUR_S, rng=np.random.default_rng(3)
    )
    assert len(everything.events) == 167
    assert {event.kind for event in everything.events} == {"trace_removal"}


def test_trace_removals_hit_stages_with_the_stage_hosting_share_of_alive_nodes():
    # Each removed node hosts a stage with probability min(1, S / n), n = alive just before (p3 has
    # no instant with both adds and removes, so the expectation is the plain sum).
    num_stages = 12
    trace = load_trace("bamboo/p3-trace.csv", "bamboo_csv")
    expected, alive = 0.0, 0
    for event in trace.events:
        if event.kind == "remove":
            expected += event.count * min(1.0, num_stages / alive)
            alive -= event.count
        else:
            alive += event.count
    counts = _counts(TraceChurn(**P3), num_stages=num_stages, horizon_s=12 * HOUR_S)
    # Variance bounded by the Poisson-binomial variance of independent hits (hypergeometric is smaller).
    assert _within_three_standard_errors(counts, expected, expected)


def test_time_scale_two_doubles_event_times():
    rng_seed = 11
    once = sample_failures(
        TraceChurn(**P3), num_stages=ALL_NODES_HOST_STAGES, horizon_s=1e6, rng=np.random.default_rng(rng_seed)
    )
    twice = sample_failures(
        TraceChurn(**P3, time_scale=2.0), num_stages=ALL_NODES_HOST_STAGES, horizon_s=1e6, rng=np.random.default_rng(rng_seed)
    )
    assert [2 * event.time_s for event in once] == [event.time_s for event in twice]


def test_window_keeps_only_the_removals_inside_it_shifted_to_zero():
    trace = load_trace("bamboo/p3-trace.csv", "bamboo_csv")
    start_s, end_s = 2 * HOUR_S, 4 * HOUR_S
    inside = [e for e in trace.events if e.kind == "remove" and start_s <= e.time_s < end_s]
    config = TraceChurn(**P3, window_start_s=start_s, window_end_s=end_s)
    sample = sample_failures_with_stats(config, num_stages=ALL_NODES_HOST_STAGES, horizon_s=1e6, rng=np.random.default_rng(0))
    assert sample.num_preemptions_seen == sum(e.count for e in inside)
    expected_times = sorted(e.time_s - start_s for e in inside for _ in range(e.count))
    assert [event.time_s for event in sample.events] == expected_times


def test_repeat_loops_the_window_and_without_repeat_the_replay_stops():
    window_s = HOUR_S
    base = dict(P3, window_start_s=5.5 * HOUR_S, window_end_s=5.5 * HOUR_S + window_s)
    once = sample_failures_with_stats(
        TraceChurn(**base), num_stages=ALL_NODES_HOST_STAGES, horizon_s=3 * window_s, rng=np.random.default_rng(0)
    )
    looped = sample_failures_with_stats(
        TraceChurn(**base, repeat=True), num_stages=ALL_NODES_HOST_STAGES, horizon_s=3 * window_s, rng=np.random.default_rng(0)
    )
    assert once.num_preemptions_seen > 0
    assert all(event.time_s < window_s for event in once.events)
    assert looped.num_preemptions_seen == 3 * once.num_preemptions_seen
    first_loop_times = [event.time_s for event in once.events]
    for loop in range(3):
        in_loop = [e.time_s - loop * window_s for e in looped.events if loop * window_s <= e.time_s < (loop + 1) * window_s]
        assert in_loop == first_loop_times


@pytest.mark.parametrize(
    ("name", "start_h", "num_removed"),
    [("parcae/gpt-1.5b_trace_hh_55_65.jsonl", 5.5, 19), ("parcae/gpt-1.5b_trace_hl_15_25.jsonl", 1.5, 11)],
)
def test_parcae_window_replays_exactly_like_the_same_slice_of_the_p3_trace(name, start_h, num_removed):
    # The trace README: Parcae's windows are slices of the p3 trace; same seed ⇒ the same failure path.
    parcae = sample_failures_with_stats(
        TraceChurn(kind="trace", path=name, format="parcae_jsonl"),
        num_stages=12, horizon_s=HOUR_S, rng=np.random.default_rng(4),
    )
    p3_slice = sample_failures_with_stats(
        TraceChurn(**P3, window_start_s=start_h * HOUR_S, window_end_s=(start_h + 1) * HOUR_S),
        num_stages=12, horizon_s=HOUR_S, rng=np.random.default_rng(4),
    )
    assert parcae.num_preemptions_seen == p3_slice.num_preemptions_seen == num_removed
    assert parcae.events == p3_slice.events


_configs = churn_configs(max_events_per_hour=5.0, min_mean_lifetime_s=300.0, min_time_scale=0.1)


@settings(max_examples=60, deadline=None)
@given(
    config=_configs,
    num_stages=st.integers(1, 16),
    horizons=st.tuples(st.floats(0.0, 30 * HOUR_S), st.floats(0.0, 30 * HOUR_S)),
    seed=st.integers(0, 2**32 - 1),
)
@example(
    config=WeibullChurn(kind='weibull', shape=0.3125, mean_lifetime_s=300.0),
    num_stages=10,
    horizons=(0.0, 20628.0),
    seed=10321,
)  # zero-length Weibull lifetimes once produced a duplicate failure
def test_paths_run_forward_in_time_and_a_longer_horizon_only_adds_events(config, num_stages, horizons, seed):
    short_s, long_s = sorted(horizons)
    short = sample_failures(config, num_stages=num_stages, horizon_s=short_s, rng=np.random.default_rng(seed))
    long = sample_failures(config, num_stages=num_stages, horizon_s=long_s, rng=np.random.default_rng(seed))
    for events, horizon_s in ((short, short_s), (long, long_s)):
        assert list(events) == sorted(events)
        assert all(0.0 <= event.time_s < horizon_s and 0 <= event.stage < num_stages for event in events)
        instants = [(event.time_s, event.stage) for event in events]
        assert len(instants) == len(set(instants))  # a stage fails at most once per instant
    assert list(short) == [event for event in long if event.time_s < short_s]


def test_same_seed_gives_the_same_path_for_every_caller():
    config = BurstChurn(kind="burst", bursts_per_hour=1.0)
    first = sample_failures(config, num_stages=6, horizon_s=HOUR_S * 20, rng=np.random.default_rng(5))
    second = sample_failures(config, num_stages=6, horizon_s=HOUR_S * 20, rng=np.random.default_rng(5))
    assert first == second and all(isinstance(event, FailureEvent) for event in first)


def test_mean_stage_failure_rates_match_the_models():
    assert mean_stage_failure_rate_per_s(NoChurn(kind="none"), num_stages=4) == 0.0
    poisson = PoissonChurn(kind="poisson", failures_per_node_hour=0.6)
    assert mean_stage_failure_rate_per_s(poisson, num_stages=4) * HOUR_S == pytest.approx(0.6)
    weibull = WeibullChurn(kind="weibull", shape=2.0, mean_lifetime_s=1000.0)
    assert mean_stage_failure_rate_per_s(weibull, num_stages=4) == pytest.approx(1e-3)
    burst = BurstChurn(kind="burst", bursts_per_hour=1.0, burst_size_probabilities=[0.5, 0.5])
    assert mean_stage_failure_rate_per_s(burst, num_stages=3) * HOUR_S == pytest.approx(1.5 / 3)
    p3 = mean_stage_failure_rate_per_s(TraceChurn(**P3), num_stages=12) * HOUR_S
    assert p3 == pytest.approx(0.61, abs=0.005)  # the trace's preemptions per node-hour


@pytest.mark.parametrize(("num_stages", "horizon_s"), [(0, 10.0), (2.5, 10.0), (True, 10.0), (4, -1.0), (4, math.inf)])
def test_bad_pipeline_size_or_horizon_is_an_input_error(num_stages, horizon_s):
    with pytest.raises(InputError, match="num_stages|horizon_s"):
        sample_failures(PoissonChurn(kind="poisson", failures_per_node_hour=1.0), num_stages=num_stages,
                        horizon_s=horizon_s, rng=np.random.default_rng(0))


def test_window_starting_after_the_trace_is_an_input_error():
    with pytest.raises(InputError, match="window_start_s = 50000.*earlier start"):
        sample_failures(TraceChurn(**P3, window_start_s=50000.0), num_stages=4, horizon_s=10.0, rng=np.random.default_rng(0))


CURSOR_CHURNS = [
    StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.9),
    PoissonChurn(kind="poisson", failures_per_node_hour=30.0),
    WeibullChurn(kind="weibull", shape=0.7, mean_lifetime_s=600.0),
    BurstChurn(kind="burst", bursts_per_hour=20.0),
    TraceChurn(kind="trace", path="bamboo/p3-trace.csv", format="bamboo_csv", time_scale=0.05, repeat=True),
]


@pytest.mark.parametrize("churn", CURSOR_CHURNS, ids=lambda churn: churn.kind)
def test_a_cursor_walked_in_uneven_steps_hands_out_exactly_the_sampled_path(churn):
    # What a real run injects (walking the path by its clock) equals what `simulate` samples.
    spec = FailurePathSpec(churn=churn, num_stages=6, seed=5, replication=2, max_time_s=1e6)
    cursor = FailureCursor(spec)
    walked, now_s = [], 0.0
    steps = np.random.default_rng(0).exponential(40.0, size=400)
    for step_s in steps:
        now_s += float(step_s)
        walked.extend(cursor.take_due(now_s))
    expected = [event for event in spec.sample(now_s + 1.0) if event.time_s <= now_s]
    assert len(expected) > 10
    assert walked == expected


def test_the_scenario_path_and_the_spec_path_are_one_path():
    from churnsim.calibration.presets import preset

    scenario = preset("cpu-tiny")
    spec = FailurePathSpec.of(scenario, replication=3)
    assert failures_for_replication(scenario, replication=3, horizon_s=600.0) == spec.sample(600.0)
    assert failures_for_replication(scenario, replication=3, horizon_s=600.0) != failures_for_replication(scenario, replication=4, horizon_s=600.0)


def test_a_schedule_churn_replays_its_rows_by_time(tmp_path):
    from churnsim.calibration.churn import ScheduleChurn
    from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, write_failure_schedule

    path = tmp_path / "schedule.csv"
    rows = (ScheduledFailure(time_s=5.0, stage=2), ScheduledFailure(time_s=1.5, iteration=3, stage=0))
    write_failure_schedule(FailureSchedule(failures=rows), path)
    churn = ScheduleChurn(kind="schedule", path=str(path))
    events = sample_failures(churn, num_stages=4, horizon_s=4.0, rng=np.random.default_rng(0))
    assert events == (FailureEvent(time_s=1.5, stage=0, kind="scheduled"),)
    with pytest.raises(InputError, match="stage 2 does not exist"):
        sample_failures(churn, num_stages=2, horizon_s=10.0, rng=np.random.default_rng(0))
    write_failure_schedule(FailureSchedule(failures=(ScheduledFailure(iteration=3, stage=0),)), path)
    with pytest.raises(InputError, match="fill the time_s column"):
        sample_failures(churn, num_stages=4, horizon_s=10.0, rng=np.random.default_rng(0))
