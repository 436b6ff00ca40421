"""Failure sample paths: which node fails when, for one replication.

`sample_failures(config, num_stages=..., horizon_s=..., rng=..., data_parallel_degree=D)` turns a
churn model of `churnsim.calibration.churn` into a time-ordered tuple of `FailureEvent`s in
[0, horizon_s). The pipeline is a grid of S stages × D data-parallel replicas and a node is one
(stage, replica): every rate of a churn model is per node, and every event names the node lost
(`calibration/replica_rule.py` decides whether it heals from a surviving replica). The path depends
only on the churn model, the grid, the horizon and the random stream, never on the recovery method:
the run model feeds the same path to every method of a replication (common random numbers).

Prefix property: for a fixed seed, a longer horizon only appends events. Each stage's failures come
from its own random stream (memoryless models; Weibull: each node's), and bursts and trace removals
consume their stream in time order, so what happens before time t never depends on the horizon. A
`FailureSampler` reads a path forward on it: each step to a longer horizon draws only what lies
between the two horizons and appends those events, so a run whose length is not known in advance
never samples, or sorts, any part of its path twice.

Nodes, and what sampling costs (it grows with the number of failures, not with S × D, except as
stated for Weibull):
- Memoryless models (`poisson`, `stage_hourly`): a stage's D nodes fail independently at rate λ
  each, which is one Poisson process at rate D·λ whose every event hits a replica chosen uniformly
  (superposition). So each stage keeps one stream: its gaps are drawn at rate D·λ and, when D > 1,
  each failure's replica by a further draw from the same stream. With D = 1 nothing extra is drawn,
  so the path is the one of a pipeline without data parallelism.
- `weibull` is not memoryless, so every node is its own renewal process on its own stream (node
  (stage, replica) on the stream stage + replica·S, so replica 0 keeps the D = 1 streams): setting
  a path up, and each step of a `FailureSampler` to a longer horizon, costs O(S·D) besides the
  failures.
- `burst`: a burst takes `size` distinct nodes of the grid (size capped at S·D), chosen uniformly.
- `schedule`: every row names its node; the file's replicas must exist in the grid.
- `replicas_fail_together=True` (CheckFree's emulator): the model is sampled per stage exactly as
  with D = 1 (the same draws) and each stage failure becomes D events at the same instant, one per
  replica: the whole stage is lost at once.

Trace replay (an approximation: traces give timing and burstiness, not placement): a trace's
instances are nodes, and the grid's S·D nodes are taken to sit on S·D of the nodes alive in the
trace, placed uniformly at random (S nodes, one per stage, when replicas fail together). A removal
of k nodes at one instant, with n alive just before it, therefore hits a number of grid nodes drawn
from the hypergeometric law (k draws from n nodes of which min(S·D, n) host grid nodes): each
removed node hosts a grid node with probability min(1, S·D / n) and simultaneous removals hit
distinct grid nodes, chosen uniformly. Replacements are not taken from the trace's pool (the run
model adds a join delay); every removal counts as a preemption seen, whether or not it hits the grid.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Literal

import numpy as np

from .churn import (
    BurstChurn,
    ChurnConfig,
    NoChurn,
    PoissonChurn,
    ScheduleChurn,
    StageHourlyChurn,
    TraceChurn,
    WeibullChurn,
)
from .errors import InputError
from .failures import read_failure_schedule

from .traces import Trace, TraceEvent, load_trace, summarize_trace

if TYPE_CHECKING:
    from .scenario import Scenario

FailureKind = Literal["stage_hourly", "poisson", "weibull", "burst", "trace_removal", "scheduled"]

# Draws per call when extending a per-stage stream; fixed so the values drawn never depend on the horizon.
_CHUNK = 64


@dataclass(frozen=True, kw_only=True, order=True)
class FailureEvent:
    """The node of stage `stage`, data-parallel replica `replica` (both 0-based), is lost at `time_s`;
    `kind` names the churn model that caused it. A node is one (stage, replica) of the S × D grid
    (`calibration/replica_rule.py` decides whether its loss heals from a surviving replica or is a
    stage loss)."""

    time_s: float
    stage: int
    replica: int = 0
    kind: FailureKind


def sorted_events(events: Iterable[FailureEvent]) -> tuple[FailureEvent, ...]:
    """`events` in time, stage, replica, kind order. Compared as field tuples in C: on the
    per-stage runs a sampler concatenates, several times faster than the dataclass's own `__lt__`."""
    return tuple(sorted(events, key=_EVENT_ORDER))


_EVENT_ORDER = operator.attrgetter("time_s", "stage", "replica", "kind")


@dataclass(frozen=True, kw_only=True)
class FailureSample:
    """A replication's failure path and how many node preemptions produced it."""

    events: tuple[FailureEvent, ...]
    num_preemptions_seen: int
    """Node losses inside the horizon: equals len(events) for synthetic models; for trace replay,
    every removal in the replayed trace, including those that hit no stage."""


def sample_failures(
    config: ChurnConfig,
    *,
    num_stages: int,
    horizon_s: float,
    rng: np.random.Generator,
    data_parallel_degree: int = 1,
    replicas_fail_together: bool = False,
) -> tuple[FailureEvent, ...]:
    """The node failures of one replication of a num_stages × data_parallel_degree grid in
    [0, horizon_s), sorted by time, stage, then replica; `replicas_fail_together` loses whole stages
    (module docstring). With data_parallel_degree = 1 the path is the same whatever
    `replicas_fail_together` says.

    Takes exactly two draws from `rng` (to seed the per-stage streams) for every model but `none`,
    whatever the horizon; pass a stream reserved for churn so other sources stay independent of it.
    """
    return sample_failures_with_stats(
        config,
        num_stages=num_stages,
        horizon_s=horizon_s,
        rng=rng,
        data_parallel_degree=data_parallel_degree,
        replicas_fail_together=replicas_fail_together,
    ).events


def sample_failures_with_stats(
    config: ChurnConfig,
    *,
    num_stages: int,
    horizon_s: float,
    rng: np.random.Generator,
    data_parallel_degree: int = 1,
    replicas_fail_together: bool = False,
) -> FailureSample:
    """As `sample_failures`, also counting the preemptions seen (trace removals that missed every node too)."""
    num_stages = _checked_num_stages(num_stages)
    _check_horizon(horizon_s)
    sampler = FailureSampler(
        config, num_stages=num_stages, rng=rng, data_parallel_degree=data_parallel_degree, replicas_fail_together=replicas_fail_together
    )
    events = sampler.advance_to(horizon_s)
    return FailureSample(events=events, num_preemptions_seen=sampler.num_preemptions_seen)


class FailureSampler:
    """One replication's failure path, sampled forward in time one horizon at a time.

    `advance_to(h)` returns the events in [previous horizon, h), sorted, drawing from the random
    streams exactly what sampling [0, h) in one go draws (the prefix property, module docstring):
    the events of successive calls, concatenated, are `sample_failures(..., horizon_s=h)`. Takes the
    same draws from `rng` as `sample_failures`, when it is made.
    """

    def __init__(
        self,
        config: ChurnConfig,
        *,
        num_stages: int,
        rng: np.random.Generator,
        data_parallel_degree: int = 1,
        replicas_fail_together: bool = False,
    ) -> None:
        self.horizon_s = 0.0
        self.num_preemptions_seen = 0  # as `FailureSample.num_preemptions_seen`, in [0, horizon_s)
        num_stages = _checked_num_stages(num_stages)
        data_parallel_degree = _checked_data_parallel_degree(data_parallel_degree)
        if replicas_fail_together and data_parallel_degree > 1:
            # The model's draws are those of a D = 1 pipeline; each stage failure takes every replica.
            stage_source = _event_source(config, num_stages, 1, rng, schedule_replicas=data_parallel_degree)
            self._source: _EventSource = _WholeStages(stage_source, data_parallel_degree, counts_nodes=not isinstance(config, TraceChurn))
        else:
            self._source = _event_source(config, num_stages, data_parallel_degree, rng, schedule_replicas=data_parallel_degree)

    def advance_to(self, horizon_s: float) -> tuple[FailureEvent, ...]:
        """The events in [self.horizon_s, horizon_s), sorted by time, stage, then replica; none for an earlier horizon."""
        _check_horizon(horizon_s)
        if horizon_s <= self.horizon_s:
            return ()
        events, num_preemptions = self._source.advance_to(horizon_s)
        self.horizon_s = horizon_s
        self.num_preemptions_seen += num_preemptions
        # Every earlier event lies before the previous horizon: sorting the new ones keeps the path sorted.
        return sorted_events(events)


def _checked_num_stages(num_stages: int) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise InputError(f"num_stages = {num_stages!r}: must be a whole number >= 1; use the pipeline's stage count")
    return int(num_stages)


def _checked_data_parallel_degree(data_parallel_degree: int) -> int:
    if (
        isinstance(data_parallel_degree, bool)
        or not isinstance(data_parallel_degree, (int, np.integer))
        or data_parallel_degree < 1
    ):
        raise InputError(
            f"data_parallel_degree = {data_parallel_degree!r}: must be a whole number >= 1; "
            "use the pipeline's number of data-parallel replicas"
        )
    return int(data_parallel_degree)


def _check_horizon(horizon_s: float) -> None:
    if not (horizon_s >= 0.0 and math.isfinite(horizon_s)):
        raise InputError(f"horizon_s = {horizon_s!r}: must be a finite number of seconds >= 0")


def mean_node_failure_rate_per_s(
    config: ChurnConfig, *, num_stages: int, data_parallel_degree: int = 1, replicas_fail_together: bool = False
) -> float:
    """Long-run failures per second of one node of the num_stages × data_parallel_degree grid,
    averaged over the nodes, for analytic oracles (Young/Daly, ETTR, the replica rule's
    `stage_loss_rate_per_s`).

    Exact for the memoryless and burst models; the renewal-theorem limit 1 / mean lifetime for
    Weibull; for a schedule, its node failures over the span to its last row; for a trace, an
    approximation over the whole trace (not the window): preemptions per node-second
    × min(mean nodes alive, N) / N, divided by `time_scale`, with N = S·D grid nodes hosted on the
    trace (N = S when replicas fail together: one trace node per stage).
    """
    num_stages = _checked_num_stages(num_stages)
    data_parallel_degree = _checked_data_parallel_degree(data_parallel_degree)
    # Replicas failing together: every node of a stage fails when the stage's D = 1 model fails it.
    num_hosted = num_stages * (1 if replicas_fail_together else data_parallel_degree)
    if isinstance(config, NoChurn):
        return 0.0
    if isinstance(config, (StageHourlyChurn, PoissonChurn)):
        return config.rate_per_stage_s
    if isinstance(config, WeibullChurn):
        return 1.0 / config.mean_lifetime_s
    if isinstance(config, BurstChurn):
        capped_mean = math.fsum(
            min(size, num_hosted) * p for size, p in enumerate(config.burst_size_probabilities, start=1)
        )
        return config.bursts_per_hour / 3600.0 * capped_mean / num_hosted
    if isinstance(config, ScheduleChurn):
        events = _scheduled_node_events(config, num_stages, data_parallel_degree, replicas_fail_together)
        span_s = events[-1].time_s if events else 0.0
        return len(events) / span_s / (num_stages * data_parallel_degree) if span_s > 0 else 0.0
    if isinstance(config, TraceChurn):
        summary = summarize_trace(load_trace(config.path, config.format))
        if summary.node_hours <= 0:
            return 0.0
        per_node_s = summary.num_preemptions / (summary.node_hours * 3600.0)
        share = min(1.0, num_hosted / summary.mean_nodes_alive)
        return per_node_s * share * summary.mean_nodes_alive / num_hosted / config.time_scale
    raise InputError(f"churn kind = {getattr(config, 'kind', config)!r} is unknown; use one of the churn models")


def mean_stage_failure_rate_per_s(config: ChurnConfig, *, num_stages: int) -> float:
    """Long-run failures per second per stage of a pipeline without data parallelism (D = 1, where a
    node is a stage), for analytic oracles (Young/Daly, ETTR): `mean_node_failure_rate_per_s` at
    D = 1. With D > 1 a stage is lost only when all its replicas are: see
    `replica_rule.stage_loss_rate_per_s`.
    """
    return mean_node_failure_rate_per_s(config, num_stages=num_stages)


def scheduled_failures(config: ScheduleChurn, num_stages: int, data_parallel_degree: int = 1) -> tuple[FailureEvent, ...]:
    """The rows of a `schedule` churn's file as failure events of their nodes, sorted; checked
    against the num_stages × data_parallel_degree grid."""
    source = f"churn.path {config.path!r}"
    from .safe_files import check_path_text, resolve_inside

    check_path_text(config.path, what="churn.path")
    if not os.path.isabs(config.path):  # a relative path stays inside the current directory
        resolve_inside(pathlib.Path.cwd(), config.path, what="churn.path")
    schedule = read_failure_schedule(config.path).validate_for(num_stages, source=source, data_parallel_degree=data_parallel_degree)
    events = []
    for failure in schedule.failures:
        if failure.time_s is None:
            raise InputError(
                f"{source}: the failure of stage {failure.stage} at iteration {failure.iteration} has no time_s; "
                "a schedule churn replays failures by time: fill the time_s column"
            )
        events.append(FailureEvent(time_s=failure.time_s, stage=failure.stage, replica=failure.replica, kind="scheduled"))
    return sorted_events(events)


def _scheduled_node_events(
    config: ScheduleChurn, num_stages: int, data_parallel_degree: int, replicas_fail_together: bool
) -> tuple[FailureEvent, ...]:
    """The node failures a schedule churn replays, whole stages where replicas fail together."""
    events = scheduled_failures(config, num_stages, data_parallel_degree)
    if replicas_fail_together and data_parallel_degree > 1:
        return tuple(_whole_stage_events(events, data_parallel_degree))
    return events


def _event_source(
    config: ChurnConfig, num_stages: int, num_replicas: int, rng: np.random.Generator, *, schedule_replicas: int
) -> _EventSource:
    """The churn model's node failures on a num_stages × num_replicas grid, ready to be read forward;
    takes the model's draws from `rng` now. A schedule's rows are checked against `schedule_replicas`
    replicas (the pipeline's, also where the model is sampled per stage)."""
    if isinstance(config, NoChurn):
        return _NoEvents()
    if isinstance(config, (StageHourlyChurn, PoissonChurn)):
        streams = _spawn(rng, num_stages)
        rate_per_s = config.rate_per_stage_s
        if rate_per_s <= 0.0:
            return _NoEvents()
        if num_replicas == 1:
            return _RenewalEvents(
                config.kind, [(stage, 0, _renewal_times(stream, lambda stream, n: stream.exponential(1.0 / rate_per_s, n))) for stage, stream in enumerate(streams)]
            )
        # Superposition (module docstring): a stage's nodes fail at num_replicas × the node rate.
        mean_gap_s = 1.0 / (rate_per_s * num_replicas)
        return _SuperposedEvents(
            config.kind, [_superposed_times(stream, lambda stream, n: stream.exponential(mean_gap_s, n), num_replicas) for stream in streams]
        )
    if isinstance(config, WeibullChurn):
        # Not memoryless: one renewal stream per node; node (stage, replica) takes stream stage + replica·S.
        streams = _spawn(rng, num_stages * num_replicas)
        scale_s = config.scale_s
        return _RenewalEvents(
            "weibull",
            [
                (*_node_of(index, num_stages), _renewal_times(stream, lambda stream, n: scale_s * stream.weibull(config.shape, n)))
                for index, stream in enumerate(streams)
            ],
        )
    if isinstance(config, BurstChurn):
        stream = _spawn(rng, 1)[0]
        return _BurstEvents(config, num_stages, num_replicas, stream) if config.bursts_per_hour > 0.0 else _NoEvents()
    if isinstance(config, TraceChurn):
        return _TraceRemovalEvents(config, num_stages, num_replicas, _spawn(rng, 1)[0])
    if isinstance(config, ScheduleChurn):
        return _ScheduledEvents(scheduled_failures(config, num_stages, schedule_replicas))
    raise InputError(f"churn kind = {getattr(config, 'kind', config)!r} is unknown; use one of the churn models")


def _spawn(rng: np.random.Generator, num_streams: int) -> list[np.random.Generator]:
    # Two draws from the caller's stream seed independent children, whatever the horizon. Child i
    # does not depend on how many are spawned, so the first S streams are those of a D = 1 pipeline.
    root = np.random.SeedSequence([int(value) for value in rng.integers(0, 2**63, size=2)])
    return [np.random.default_rng(child) for child in root.spawn(num_streams)]


def _node_of(index: int, num_stages: int) -> tuple[int, int]:
    """(stage, replica) of grid node `index`; nodes 0..S-1 are replica 0, as the stages of D = 1."""
    return index % num_stages, index // num_stages


class _EventSource:
    """A churn model's events read forward in time: `advance_to(h)` gives those before h not given yet
    (in any order) and the node preemptions among them, consuming the random streams in time order."""

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        raise NotImplementedError


class _NoEvents(_EventSource):
    """No churn, or a churn model whose rate is zero."""

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        return [], 0


class _WholeStages(_EventSource):
    """Replicas failing together: each stage failure of a per-stage source becomes one failure of every replica."""

    def __init__(self, stage_source: _EventSource, num_replicas: int, *, counts_nodes: bool) -> None:
        self._stage_source = stage_source
        self._num_replicas = num_replicas
        self._counts_nodes = counts_nodes  # False for a trace: its preemptions are the trace's removals

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        stage_events, num_preemptions = self._stage_source.advance_to(horizon_s)
        events = _whole_stage_events(stage_events, self._num_replicas)
        return events, len(events) if self._counts_nodes else num_preemptions


def _whole_stage_events(stage_events: Iterable[FailureEvent], num_replicas: int) -> list[FailureEvent]:
    """Every replica of each (instant, stage) failed in `stage_events`, once (a schedule may name
    several replicas of one stage at one instant: the stage is lost once)."""
    kind_of_stage_hit: dict[tuple[float, int], FailureKind] = {}
    for event in stage_events:
        kind_of_stage_hit.setdefault((event.time_s, event.stage), event.kind)
    return [
        FailureEvent(time_s=time_s, stage=stage, replica=replica, kind=kind)
        for (time_s, stage), kind in kind_of_stage_hit.items()
        for replica in range(num_replicas)
    ]


class _RenewalEvents(_EventSource):
    """Renewal streams of single nodes (memoryless churn with D = 1, Weibull): each a node's
    failure times on its own stream, read forward stream by stream (O(streams) per horizon step)."""

    def __init__(self, kind: FailureKind, streams: list[tuple[int, int, Iterator[float]]]) -> None:
        self._kind = kind
        self._nodes = [(stage, replica) for stage, replica, _ in streams]
        self._node_times = [times for _, _, times in streams]
        self._next_times_s = [next(times) for times in self._node_times]  # per node, the first failure not given yet

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        events = []
        for index, times in enumerate(self._node_times):
            time_s = self._next_times_s[index]
            if time_s < horizon_s:
                stage, replica = self._nodes[index]
                while time_s < horizon_s:
                    events.append(FailureEvent(time_s=time_s, stage=stage, replica=replica, kind=self._kind))
                    time_s = next(times)
                self._next_times_s[index] = time_s
        return events, len(events)


def _renewal_times(stream: np.random.Generator, draw_gaps: Callable) -> Iterator[float]:
    """The partial sums of i.i.d. gaps, without end, drawn in fixed chunks (prefix property)."""
    now_s, last_s = 0.0, -math.inf
    while True:
        for gap_s in draw_gaps(stream, _CHUNK):
            now_s += float(gap_s)
            # A lifetime that rounds to zero (Weibull shapes well below 1) would make the node fail
            # twice at one instant; a node that is already gone cannot fail again, so it is dropped.
            if now_s > last_s:
                last_s = now_s
                yield now_s


class _SuperposedEvents(_EventSource):
    """Memoryless churn with D > 1: per stage, one stream of (time, replica) of its D nodes' failures."""

    def __init__(self, kind: FailureKind, stage_times: list[Iterator[tuple[float, int]]]) -> None:
        self._kind = kind
        self._stage_times = stage_times
        self._next = [next(times) for times in stage_times]  # per stage, the first (time_s, replica) not given yet

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        events = []
        for stage, times in enumerate(self._stage_times):
            time_s, replica = self._next[stage]
            while time_s < horizon_s:
                events.append(FailureEvent(time_s=time_s, stage=stage, replica=replica, kind=self._kind))
                time_s, replica = next(times)
            self._next[stage] = (time_s, replica)
        return events, len(events)


def _superposed_times(stream: np.random.Generator, draw_gaps: Callable, num_replicas: int) -> Iterator[tuple[float, int]]:
    """(time_s, replica) of a stage's superposed node failures, without end: each chunk of gaps (at
    the stage's total rate) is followed by a chunk of uniform replicas from the same stream, in
    fixed sizes (prefix property)."""
    now_s, last_s, failed_at_last = 0.0, -math.inf, ()
    while True:
        gaps = draw_gaps(stream, _CHUNK)
        replicas = stream.integers(0, num_replicas, size=_CHUNK).tolist()
        for gap_s, replica in zip(gaps, replicas):
            now_s += float(gap_s)
            # Two failures at one instant (a gap that rounds to zero) are kept only on distinct nodes.
            if now_s > last_s:
                last_s, failed_at_last = now_s, (replica,)
            elif replica in failed_at_last:
                continue
            else:
                failed_at_last += (replica,)
            yield now_s, replica


class _BurstEvents(_EventSource):
    """Bursts: one stream, consumed per burst always in this order: gap, size, victims (distinct grid nodes)."""

    def __init__(self, config: BurstChurn, num_stages: int, num_replicas: int, stream: np.random.Generator) -> None:
        self._num_stages = num_stages
        self._num_nodes = num_stages * num_replicas
        self._stream = stream
        self._mean_gap_s = 3600.0 / config.bursts_per_hour
        probabilities = np.asarray(config.burst_size_probabilities, dtype=float)
        self._size_probabilities = probabilities / probabilities.sum()  # exact normalisation of the validated ±1e-6
        self._next_burst_s = float(stream.exponential(self._mean_gap_s))

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        events = []
        while self._next_burst_s < horizon_s:
            size = min(self._num_nodes, 1 + int(self._stream.choice(len(self._size_probabilities), p=self._size_probabilities)))
            for node in self._stream.choice(self._num_nodes, size=size, replace=False):
                stage, replica = _node_of(int(node), self._num_stages)
                events.append(FailureEvent(time_s=self._next_burst_s, stage=stage, replica=replica, kind="burst"))
            self._next_burst_s += float(self._stream.exponential(self._mean_gap_s))
        return events, len(events)


def _window_events(config: TraceChurn, trace: Trace) -> tuple[list[TraceEvent], int, float]:
    """Events of the window shifted to start at 0 (unscaled), nodes alive at its start, its length."""
    start_s = config.window_start_s
    end_s = trace.end_s if config.window_end_s is None else config.window_end_s
    if start_s >= trace.end_s and start_s > 0.0:
        raise InputError(
            f"churn.window_start_s = {start_s:g}: at or after the end of trace {config.path!r} "
            f"({trace.end_s:g} s); use an earlier start"
        )
    # The default window includes events at the trace's last record; an explicit end is exclusive.
    inside = [
        event
        for event in trace.events
        if start_s <= event.time_s and (event.time_s < end_s or (config.window_end_s is None and event.time_s <= end_s))
    ]
    shifted = [TraceEvent(time_s=e.time_s - start_s, kind=e.kind, count=e.count) for e in inside]
    return shifted, trace.alive_at(start_s), end_s - start_s


class _TraceRemovalEvents(_EventSource):
    """Trace replay (module docstring): the window's events walked in replay order, each removal
    hitting grid nodes drawn from one stream."""

    def __init__(self, config: TraceChurn, num_stages: int, num_replicas: int, stream: np.random.Generator) -> None:
        trace = load_trace(config.path, config.format)
        window, self._alive_at_start, window_length_s = _window_events(config, trace)
        period_s = window_length_s * config.time_scale
        repeats = config.repeat and period_s > 0 and any(event.kind == "remove" for event in window)
        self._replayed = _replayed(window, period_s=period_s, time_scale=config.time_scale, repeats=repeats)
        self._next = next(self._replayed, None)  # (loop, time_s, event) of the first event not walked yet
        self._num_stages = num_stages
        self._num_nodes = num_stages * num_replicas
        self._stream = stream
        self._loop = 0
        self._alive = self._alive_at_start
        self._hit_time_s: float | None = None
        self._hit_nodes: set[int] = set()  # grid nodes already hit at `_hit_time_s`

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        events: list[FailureEvent] = []
        preemptions = 0
        while self._next is not None and self._next[1] < horizon_s:
            loop, time_s, event = self._next
            if loop != self._loop:  # every loop replays the window from its initial state
                self._loop, self._alive, self._hit_time_s = loop, self._alive_at_start, None
            if event.kind == "add":
                self._alive += event.count
            else:
                if time_s != self._hit_time_s:
                    self._hit_time_s, self._hit_nodes = time_s, set()
                preemptions += event.count
                for node in _nodes_hit(event.count, self._alive, self._num_nodes, self._hit_nodes, self._stream):
                    self._hit_nodes.add(node)
                    stage, replica = _node_of(node, self._num_stages)
                    events.append(FailureEvent(time_s=time_s, stage=stage, replica=replica, kind="trace_removal"))
                self._alive -= event.count
            self._next = next(self._replayed, None)
        return events, preemptions


def _replayed(window: list[TraceEvent], *, period_s: float, time_scale: float, repeats: bool) -> Iterator[tuple[int, float, TraceEvent]]:
    """(loop, time_s, event) of the window's events in replay order; without end when the window repeats."""
    for loop in itertools.count() if repeats else (0,):
        loop_start_s = loop * period_s
        for event in window:
            yield loop, loop_start_s + event.time_s * time_scale, event


def _nodes_hit(
    num_removed: int, num_alive: int, num_nodes: int, already_hit: set[int], stream: np.random.Generator
) -> list[int]:
    """Grid nodes lost when `num_removed` of `num_alive` uniformly placed trace nodes leave
    (hypergeometric), among the `num_nodes` grid nodes not in `already_hit`. The free nodes are
    numbered in order without being listed, so the cost follows the nodes hit, not the grid."""
    num_free = num_nodes - len(already_hit)
    num_hosting = min(num_free, num_alive)
    if num_hosting == 0 or num_removed <= 0:
        return []
    num_hit = int(stream.hypergeometric(num_hosting, num_alive - num_hosting, min(num_removed, num_alive)))
    if num_hit == 0:
        return []
    chosen = stream.choice(num_free, size=num_hit, replace=False)
    taken = sorted(already_hit)
    return [_nth_free_node(int(index), taken) for index in chosen]


def _nth_free_node(index: int, taken: list[int]) -> int:
    """The `index`-th (0-based) node number not in the ascending list `taken`."""
    node = index
    for taken_node in taken:
        if taken_node > node:
            break
        node += 1
    return node


class _ScheduledEvents(_EventSource):
    """A schedule churn: its rows, already sorted, handed out in time order."""

    def __init__(self, events: tuple[FailureEvent, ...]) -> None:
        self._events = events
        self._num_given = 0

    def advance_to(self, horizon_s: float) -> tuple[list[FailureEvent], int]:
        start = self._num_given
        while self._num_given < len(self._events) and self._events[self._num_given].time_s < horizon_s:
            self._num_given += 1
        return list(self._events[start : self._num_given]), self._num_given - start


CHURN_STREAM = 1
"""Source index of the failure stream in `numpy.random.SeedSequence((seed, replication, source))`."""


@dataclass(frozen=True, kw_only=True)
class FailurePathSpec:
    """What fixes one replication's failure path: the churn model, the S × D grid (and whether its
    replicas fail together) and the seeds.

    Small and picklable, so a real run's ranks get it instead of a whole scenario.
    """

    churn: ChurnConfig
    num_stages: int
    seed: int
    replication: int = 0
    max_time_s: float
    """Nothing is sampled beyond this time (the scenario's `target.max_wall_clock_s`)."""
    data_parallel_degree: int = 1
    """D: the grid has num_stages × D nodes, each failing on its own unless `replicas_fail_together`."""
    replicas_fail_together: bool = False

    @classmethod
    def of(cls, scenario: "Scenario", *, replication: int = 0) -> "FailurePathSpec":
        return cls(
            churn=scenario.churn,
            num_stages=scenario.pipeline.num_stages,
            seed=scenario.seed,
            replication=replication,
            max_time_s=scenario.target.max_wall_clock_s,
            data_parallel_degree=scenario.pipeline.data_parallel_degree,
            replicas_fail_together=scenario.pipeline.replicas_fail_together,
        )

    def sample(self, horizon_s: float) -> tuple[FailureEvent, ...]:
        """The path's events in [0, min(horizon_s, max_time_s))."""
        return sample_failures(
            self.churn,
            num_stages=self.num_stages,
            horizon_s=min(horizon_s, self.max_time_s),
            rng=self._churn_rng(),
            data_parallel_degree=self.data_parallel_degree,
            replicas_fail_together=self.replicas_fail_together,
        )

    def sampler(self) -> FailureSampler:
        """A sampler of the path, to read it forward in time; it does not stop at `max_time_s`, its caller does."""
        return FailureSampler(
            self.churn,
            num_stages=self.num_stages,
            rng=self._churn_rng(),
            data_parallel_degree=self.data_parallel_degree,
            replicas_fail_together=self.replicas_fail_together,
        )

    def _churn_rng(self) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence((self.seed, self.replication, CHURN_STREAM)))


def failures_for_replication(
    scenario: "Scenario", *, replication: int = 0, horizon_s: float | None = None
) -> tuple[FailureEvent, ...]:
    """The failure path of one replication of `scenario`: the same for every method (common random
    numbers) and for both wings, so a real run injects exactly what `simulate` samples."""
    spec = FailurePathSpec.of(scenario, replication=replication)
    return spec.sample(spec.max_time_s if horizon_s is None else horizon_s)


class LazyFailurePath:
    """A replication's failure path, sampled only as far as it is read.

    Iterating yields the events of `spec`'s path in time order; the path is sampled up to a horizon
    that doubles whenever a reader gets past it (from `FIRST_HORIZON_S`, never beyond
    `spec.max_time_s`), each doubling appending only the events between the two horizons
    (`FailureSampler`). By the prefix property (module docstring) every reader sees exactly the
    events `failures_for_replication` gives, and a run that ends early never pays for sampling up to
    the 30-day cap. Several readers (the methods of one replication) share the samples already drawn.
    """

    FIRST_HORIZON_S = 60.0

    def __init__(self, spec: FailurePathSpec) -> None:
        self.spec = spec
        self._horizon_s = 0.0
        self._events: list[FailureEvent] = []
        # Made on the first extension: the churn inputs (a trace, a schedule) are read when first sampled.
        self._sampler: FailureSampler | None = None

    def __iter__(self):
        index = 0
        while True:
            while index >= len(self._events):
                if self._horizon_s >= self.spec.max_time_s:
                    return
                self.extend_to(max(self.FIRST_HORIZON_S, 2.0 * self._horizon_s))
            yield self._events[index]
            index += 1

    def extend_to(self, horizon_s: float) -> None:
        """Sample at least up to `horizon_s` (capped at the spec's end)."""
        horizon_s = min(horizon_s, self.spec.max_time_s)
        if horizon_s > self._horizon_s:
            if self._sampler is None:
                self._sampler = self.spec.sampler()
            self._events.extend(self._sampler.advance_to(horizon_s))
            self._horizon_s = horizon_s


class FailureCursor:
    """Walks a failure path in time order for a run whose length is not known in advance (a real run)."""

    def __init__(self, spec: FailurePathSpec) -> None:
        self.spec = spec
        self._events = iter(LazyFailurePath(spec))
        self._next: FailureEvent | None = next(self._events, None)

    def take_due(self, now_s: float) -> tuple[FailureEvent, ...]:
        """Events with time_s <= now_s not handed out before, in time order."""
        due = []
        while self._next is not None and self._next.time_s <= now_s:
            due.append(self._next)
            self._next = next(self._events, None)
        return tuple(due)
