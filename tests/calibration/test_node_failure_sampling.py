"""Node failures of an S × D grid: per-node counts against closed forms (fixed seeds, stated
tolerances), every node reached, replicas failing together, the prefix property, the schedule's
replica column, and D = 1 paths pinned to the values the sampler gave before it knew of replicas."""

from __future__ import annotations

import hashlib
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from churn_strategies import P3, churn_configs

from churnsim.calibration.churn import (
    BurstChurn,
    PoissonChurn,
    ScheduleChurn,
    StageHourlyChurn,
    TraceChurn,
    WeibullChurn,
    parse_churn_config,
)
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import (
    FailureEvent,
    FailurePathSpec,
    FailureSampler,
    LazyFailurePath,
    _nth_free_node,
    mean_node_failure_rate_per_s,
    mean_stage_failure_rate_per_s,
    sample_failures,
    sample_failures_with_stats,
)
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure, read_failure_schedule, write_failure_schedule

HOUR_S = 3600.0

PINNED_CHURN = {
    "poisson": {"kind": "poisson", "failures_per_node_hour": 0.6},
    "stage_hourly": {"kind": "stage_hourly", "failure_probability_per_stage_hour": 0.1},
    "weibull": {"kind": "weibull", "shape": 0.7, "mean_lifetime_s": 5000.0},
    "burst": {"kind": "burst", "bursts_per_hour": 2.0},
    "trace": P3 | {"repeat": True},
}

# (kind, seed): number of events, preemptions seen, digest of the path, first and last event (time, stage),
# for 6 stages and a 100 000 s horizon, as the sampler gave them before it sampled node failures.
PINNED_D1_PATHS = {
    ("poisson", 0): (103, 103, "84be82f0b6e7149a", (979.2835376521616, 4), (98514.90028632231, 1)),
    ("poisson", 7): (106, 106, "0aa78526763590e4", (264.54482508705354, 0), (99387.54447774627, 2)),
    ("stage_hourly", 0): (20, 20, "5031061b16911e71", (5576.758227906904, 4), (94427.0249424543, 4)),
    ("stage_hourly", 7): (17, 17, "cba1db8952b3e415", (1506.512131809614, 0), (99133.3497229547, 3)),
    ("weibull", 0): (116, 116, "95657b69e41c74b0", (296.45875583233635, 4), (98972.36260167132, 4)),
    ("weibull", 7): (136, 136, "1ea37df36a58a163", (45.70367918775246, 0), (99690.92907237432, 2)),
    ("burst", 0): (117, 117, "0b5916b615acd358", (633.0689066301769, 1), (98580.10397477975, 3)),
    ("burst", 7): (139, 139, "6005891db26d1238", (79.36344752611605, 0), (99544.4452168114, 4)),
    ("trace", 0): (85, 417, "c792fe7bc20936ed", (3060.0, 1), (98820.0, 0)),
    ("trace", 7): (99, 417, "e6fdf6afff9fdb16", (3180.0, 3), (98820.0, 3)),
}
PINNED_D1_RATES = {
    "poisson": 0.00016666666666666666,
    "stage_hourly": 2.9266809904951753e-05,
    "weibull": 0.0002,
    "burst": 0.0001925925925925926,
    "trace": 0.000169850084416509,
}


def _digest(events) -> str:
    text = "\n".join(f"{event.time_s!r},{event.stage},{event.kind}" for event in events)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize("kind, seed", sorted(PINNED_D1_PATHS))
@pytest.mark.parametrize("replicas_fail_together", [False, True])
def test_a_pipeline_without_data_parallelism_gets_the_path_pinned_before_replicas(kind, seed, replicas_fail_together):
    config = parse_churn_config(PINNED_CHURN[kind])
    sample = sample_failures_with_stats(
        config,
        num_stages=6,
        horizon_s=100000.0,
        rng=np.random.default_rng(seed),
        data_parallel_degree=1,
        replicas_fail_together=replicas_fail_together,
    )
    num_events, num_preemptions, digest, first, last = PINNED_D1_PATHS[(kind, seed)]
    assert (len(sample.events), sample.num_preemptions_seen, _digest(sample.events)) == (num_events, num_preemptions, digest)
    assert (sample.events[0].time_s, sample.events[0].stage) == first
    assert (sample.events[-1].time_s, sample.events[-1].stage) == last
    assert {event.replica for event in sample.events} == {0}
    default = sample_failures(config, num_stages=6, horizon_s=100000.0, rng=np.random.default_rng(seed))
    assert default == sample.events


@pytest.mark.parametrize("kind", sorted(PINNED_D1_RATES))
def test_the_stage_rate_of_a_pipeline_without_data_parallelism_is_unchanged_and_is_the_node_rate(kind):
    config = parse_churn_config(PINNED_CHURN[kind])
    assert mean_stage_failure_rate_per_s(config, num_stages=6) == PINNED_D1_RATES[kind]
    assert mean_node_failure_rate_per_s(config, num_stages=6, data_parallel_degree=1) == PINNED_D1_RATES[kind]


def _counts_per_node(events) -> Counter:
    return Counter((event.stage, event.replica) for event in events)


@pytest.mark.parametrize(
    "config",
    [
        PoissonChurn(kind="poisson", failures_per_node_hour=0.6),
        StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.3),
    ],
    ids=lambda config: config.kind,
)
def test_memoryless_node_failure_counts_are_the_node_rate_times_the_horizon(config):
    # 3 × 4 nodes over 2000 h: each node's count is Poisson(λT); 4 standard deviations per node.
    num_stages, num_replicas, horizon_s = 3, 4, 2000 * HOUR_S
    events = sample_failures(config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(5), data_parallel_degree=num_replicas)
    counts = _counts_per_node(events)
    expected = config.rate_per_stage_s * horizon_s
    assert set(counts) == {(stage, replica) for stage in range(num_stages) for replica in range(num_replicas)}
    for node, count in counts.items():
        assert abs(count - expected) <= 4.0 * math.sqrt(expected), node
    assert mean_node_failure_rate_per_s(config, num_stages=num_stages, data_parallel_degree=num_replicas) == config.rate_per_stage_s


def test_weibull_node_failure_counts_follow_the_renewal_theorem():
    # Renewal counts over T: mean T/μ, variance T·σ²/μ³ (asymptotically); 4 standard deviations per node.
    shape, mean_lifetime_s = 2.0, 1800.0
    config = WeibullChurn(kind="weibull", shape=shape, mean_lifetime_s=mean_lifetime_s)
    num_stages, num_replicas, horizon_s = 2, 3, 1000 * HOUR_S
    events = sample_failures(config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(2), data_parallel_degree=num_replicas)
    counts = _counts_per_node(events)
    variance_lifetime = mean_lifetime_s**2 * (math.gamma(1 + 2 / shape) / math.gamma(1 + 1 / shape) ** 2 - 1)
    expected, variance = horizon_s / mean_lifetime_s, horizon_s * variance_lifetime / mean_lifetime_s**3
    assert len(counts) == num_stages * num_replicas
    for node, count in counts.items():
        assert abs(count - expected) <= 4.0 * math.sqrt(variance), node


def test_bursts_take_distinct_nodes_at_the_per_node_rate():
    config = BurstChurn(kind="burst", bursts_per_hour=2.0)
    num_stages, num_replicas, horizon_s = 3, 2, 3000 * HOUR_S
    events = sample_failures(config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(4), data_parallel_degree=num_replicas)
    by_time: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for event in events:
        by_time[event.time_s].append((event.stage, event.replica))
    assert all(len(nodes) == len(set(nodes)) for nodes in by_time.values())
    assert max(len(nodes) for nodes in by_time.values()) == 6  # the p3 sizes reach 6 = S·D nodes
    rate = mean_node_failure_rate_per_s(config, num_stages=num_stages, data_parallel_degree=num_replicas)
    expected = rate * horizon_s
    # A node's count is a sum of one Bernoulli per burst: variance at most its mean.
    for node, count in _counts_per_node(events).items():
        assert abs(count - expected) <= 4.0 * math.sqrt(expected), node
    assert len(_counts_per_node(events)) == num_stages * num_replicas


def test_every_trace_removal_hits_the_grid_when_the_grid_outnumbers_the_trace():
    # p3 never has more than 32 nodes alive: an 8 × 5 grid occupies every one, so every removal is a node loss.
    config = TraceChurn(**P3)
    sample = sample_failures_with_stats(config, num_stages=8, horizon_s=12 * HOUR_S, rng=np.random.default_rng(3), data_parallel_degree=5)
    assert sample.num_preemptions_seen == 167 and len(sample.events) == 167
    by_time: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for event in sample.events:
        by_time[event.time_s].append((event.stage, event.replica))
    assert all(len(nodes) == len(set(nodes)) for nodes in by_time.values())
    assert {replica for _, replica in _counts_per_node(sample.events)} == set(range(5))


@pytest.mark.parametrize("kind", sorted(PINNED_CHURN))
def test_every_node_of_the_grid_fails_and_nodes_lie_in_the_grid(kind):
    config = parse_churn_config(PINNED_CHURN[kind])
    num_stages, num_replicas = 3, 4
    events = sample_failures(config, num_stages=num_stages, horizon_s=200 * HOUR_S, rng=np.random.default_rng(8), data_parallel_degree=num_replicas)
    grid = {(stage, replica) for stage in range(num_stages) for replica in range(num_replicas)}
    assert set(_counts_per_node(events)) == grid
    assert list(events) == sorted(events, key=lambda event: (event.time_s, event.stage, event.replica))


@pytest.mark.parametrize("kind", sorted(PINNED_CHURN))
def test_replicas_failing_together_lose_whole_stages_at_the_d1_instants(kind):
    config = parse_churn_config(PINNED_CHURN[kind])
    num_stages, num_replicas, horizon_s = 4, 3, 50 * HOUR_S
    together = sample_failures_with_stats(
        config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(9), data_parallel_degree=num_replicas, replicas_fail_together=True
    )
    alone = sample_failures_with_stats(config, num_stages=num_stages, horizon_s=horizon_s, rng=np.random.default_rng(9))
    replicas_of: dict[tuple[float, int, str], list[int]] = defaultdict(list)
    for event in together.events:
        replicas_of[(event.time_s, event.stage, event.kind)].append(event.replica)
    assert alone.events
    assert all(replicas == [0, 1, 2] for replicas in replicas_of.values())
    assert list(replicas_of) == [(event.time_s, event.stage, event.kind) for event in alone.events]
    expected_preemptions = alone.num_preemptions_seen if kind == "trace" else num_replicas * len(alone.events)
    assert together.num_preemptions_seen == expected_preemptions
    assert mean_node_failure_rate_per_s(
        config, num_stages=num_stages, data_parallel_degree=num_replicas, replicas_fail_together=True
    ) == mean_stage_failure_rate_per_s(config, num_stages=num_stages)


_configs = churn_configs(max_events_per_hour=20.0, min_mean_lifetime_s=60.0, min_time_scale=0.01)


@settings(max_examples=60, deadline=None)
@given(
    config=_configs,
    num_stages=st.integers(1, 6),
    num_replicas=st.integers(1, 5),
    replicas_fail_together=st.booleans(),
    horizons=st.lists(st.floats(0.0, 20 * HOUR_S), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_grid_path_read_forward_in_steps_is_the_path_sampled_in_one_go(config, num_stages, num_replicas, replicas_fail_together, horizons, seed):
    grid = dict(num_stages=num_stages, data_parallel_degree=num_replicas, replicas_fail_together=replicas_fail_together)
    sampler = FailureSampler(config, rng=np.random.default_rng(seed), **grid)
    walked = []
    for horizon_s in horizons:
        walked.extend(sampler.advance_to(horizon_s))
    whole = sample_failures_with_stats(config, horizon_s=max(horizons), rng=np.random.default_rng(seed), **grid)
    assert tuple(walked) == whole.events
    assert sampler.num_preemptions_seen == whole.num_preemptions_seen
    shorter = sample_failures(config, horizon_s=min(horizons), rng=np.random.default_rng(seed), **grid)
    assert whole.events[: len(shorter)] == shorter  # a longer horizon only appends
    assert all(0 <= event.stage < num_stages and 0 <= event.replica < num_replicas for event in whole.events)


def test_a_lazy_grid_path_is_the_spec_path():
    spec = FailurePathSpec(
        churn=WeibullChurn(kind="weibull", shape=0.6, mean_lifetime_s=3000.0),
        num_stages=4, seed=3, replication=2, max_time_s=20 * HOUR_S, data_parallel_degree=3,
    )
    path = list(LazyFailurePath(spec))
    assert path == list(spec.sample(spec.max_time_s))
    assert {event.replica for event in path} == {0, 1, 2}


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_a_bad_data_parallel_degree_is_an_input_error(bad):
    with pytest.raises(InputError, match="data_parallel_degree"):
        sample_failures(PoissonChurn(kind="poisson", failures_per_node_hour=1.0), num_stages=2, horizon_s=10.0, rng=np.random.default_rng(0), data_parallel_degree=bad)


@given(taken=st.sets(st.integers(0, 40), max_size=20), index=st.integers(0, 19))
def test_the_nth_free_node_is_the_nth_node_left_after_the_taken_ones(taken, index):
    free = [node for node in range(61) if node not in taken]
    assert _nth_free_node(index, sorted(taken)) == free[index]


VERSION_LINE = "# churnsim failure schedule, schema_version 1\n"


def test_the_schedule_replica_column_round_trips_and_is_written_only_when_needed(tmp_path):
    on_replicas = FailureSchedule(failures=(ScheduledFailure(time_s=1.5, stage=1, replica=2), ScheduledFailure(iteration=4, stage=0)))
    assert on_replicas.to_csv().splitlines()[1] == "time_s,iteration,stage,kind,replica"
    assert FailureSchedule.from_csv(on_replicas.to_csv()) == on_replicas
    on_replica_zero = FailureSchedule(failures=(ScheduledFailure(time_s=1.5, stage=1),))
    assert on_replica_zero.to_csv() == VERSION_LINE + "time_s,iteration,stage,kind\n1.5,,1,failure\n"
    old_file = tmp_path / "old.csv"
    old_file.write_text(VERSION_LINE + "time_s,iteration,stage,kind\n2.0,,1,failure\n")
    assert read_failure_schedule(old_file).failures == (ScheduledFailure(time_s=2.0, stage=1, kind="failure"),)


def test_a_schedule_replays_its_rows_on_their_replicas_and_refuses_a_replica_outside_the_grid(tmp_path):
    path = tmp_path / "schedule.csv"
    path.write_text(VERSION_LINE + "time_s,iteration,stage,kind,replica\n5.0,,1,failure,1\n2.0,,0,failure,\n")
    churn = ScheduleChurn(kind="schedule", path=str(path))
    events = sample_failures(churn, num_stages=2, horizon_s=10.0, rng=np.random.default_rng(0), data_parallel_degree=2)
    assert events == (FailureEvent(time_s=2.0, stage=0, replica=0, kind="scheduled"), FailureEvent(time_s=5.0, stage=1, replica=1, kind="scheduled"))
    together = sample_failures(churn, num_stages=2, horizon_s=10.0, rng=np.random.default_rng(0), data_parallel_degree=2, replicas_fail_together=True)
    assert [(event.time_s, event.stage, event.replica) for event in together] == [(2.0, 0, 0), (2.0, 0, 1), (5.0, 1, 0), (5.0, 1, 1)]
    with pytest.raises(InputError, match=r"replica 1 of stage 1 does not exist with pipeline.data_parallel_degree = 1; use replicas 0..0"):
        sample_failures(churn, num_stages=2, horizon_s=10.0, rng=np.random.default_rng(0))


@pytest.mark.parametrize("cell", ["1.5", "one", "-1"])
def test_a_replica_that_is_not_a_whole_number_is_one_line_naming_the_file_and_line(tmp_path, cell):
    path = tmp_path / "failures.csv"
    path.write_text(VERSION_LINE + f"time_s,iteration,stage,kind,replica\n1.0,,0,failure,0\n2.0,,1,failure,{cell}\n")
    with pytest.raises(InputError) as caught:
        read_failure_schedule(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "line 4" in message and "whole number" in message


def test_a_replica_row_of_the_wrong_width_names_its_line(tmp_path):
    path = tmp_path / "failures.csv"
    path.write_text(VERSION_LINE + "time_s,iteration,stage,kind,replica\n1.0,,0,failure\n")
    with pytest.raises(InputError, match="line 3 has 4 fields, expected 5"):
        read_failure_schedule(path)


def test_the_size_guard_counts_node_failures_of_the_grid():
    from churnsim.calibration.input_limits import expected_failures_per_run
    from churnsim.calibration.presets import preset

    scenario = preset("cpu-tiny")
    per_stage = expected_failures_per_run(scenario)
    assert per_stage > 0
    for together in (False, True):
        grid = scenario.pipeline.model_copy(update={"data_parallel_degree": 4, "replicas_fail_together": together})
        assert expected_failures_per_run(scenario.model_copy(update={"pipeline": grid})) == pytest.approx(4 * per_stage, rel=1e-12)
