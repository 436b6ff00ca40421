"""Checkpoint intervals far from their best at a point, run again there, and what that changes.

An answer compares the methods as the scenario configures them: a preset's checkpoint interval is
its paper's (the CheckFree replay's 20 iterations), which at a high failure rate is far longer than
the optimum, so the speed-up over checkpointing would overstate what a user with a tuned interval
gains, and the lazy asynchronous checkpoint's 10 can decide which method comes first. So at every
point with failures of a what-if or a sweep (and in the one scenario of `simulate`), each method
with a checkpoint interval is tried at a better one, with the same failures (common random
numbers):

- a method that blocks training to checkpoint, at Daly's optimum where its interval is
  `UNTUNED_INTERVAL_RATIO` or more away from it (δ read off the point's own runs, M the whole
  pipeline's at the point's churn: `analytic.interval_optimum_from_runs`);
- one that blocks nothing (the lazy asynchronous checkpoint, redundant computation's fallback,
  which is read only after two adjacent losses), which has no Daly point, by a search: half and
  twice its interval, then on in the better direction while that improves, up to
  `MAX_SEARCH_STEPS` halvings or doublings.

Where the tuned interval is clearly better (the 95 % interval of its mean log paired speed-up over
the configured one above 0, or reaching the target in more replications) it replaces the configured one in a second answer for the
point (`PointVerdict.with_tuned_intervals`: winner, paired speed-ups, ties, all with the tuned
intervals; the commands print it under the point's answer), and a caveat lists the intervals. A
tuned time is the best of the few tried on the same failures, so it is somewhat optimistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import pandas as pd

from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from ..model.analytic import interval_optimum_from_runs
from .replicate import replication_tasks, summary_table
from .sweep import SweepTask, run_sweep
from .verdict import Estimate, IntervalRerun, PointVerdict, Verdict, point_verdict

UNTUNED_INTERVAL_RATIO = 1.5
"""A blocking checkpoint's interval this many times Daly's, or less than 1/1.5 of it, is run again at Daly's."""
MAX_SEARCH_STEPS = 4
"""Halvings or doublings a search goes past the first ones: from the configured interval, at most 32× either way."""
TUNED_INTERVAL_SETTING = "tuned_interval_iterations"
TUNING_SETTING = "tuning_index"
"""Columns of the tuning sweeps' runs: the interval tried, and which (point, method) it was for."""
DALY_RULE = "Daly's optimum"
SEARCH_RULE = "search"
"""How an interval was tuned (`IntervalRerun.tuned_by`)."""


@dataclass(frozen=True, kw_only=True)
class DalyRerun:
    """One method at one point of an answer, its configured interval far from Daly's optimum there."""

    point: Scenario
    """The point's scenario with only this method, at Daly's interval."""
    method: str
    interval_field: str
    scenario_interval_iterations: int
    daly_interval_iterations: int


def _rate(scenario: Scenario) -> float | None:
    churn = scenario.churn
    return churn.failure_probability_per_stage_hour if isinstance(churn, StageHourlyChurn) else None


def _point_key(scenario_name: str, rate: float | None) -> tuple[str, float | None]:
    return scenario_name, None if rate is None or (isinstance(rate, float) and math.isnan(rate)) else float(rate)


def _runs_of_point(runs: pd.DataFrame, key: tuple[str, float | None]) -> pd.DataFrame:
    name, rate = key
    rates = runs["failure_probability_per_stage_hour"]
    same_rate = rates.isna() if rate is None else rates == rate
    return runs[(runs["scenario"] == name) & same_rate]


def _pipeline_failure_rate_per_s(point: Scenario) -> float:
    num_stages = point.pipeline.num_stages
    return mean_stage_failure_rate_per_s(point.churn, num_stages=num_stages) * num_stages


def _interval_methods(point: Scenario, swept_fields: Sequence[str]) -> list[tuple[MethodConfig, str, int]]:
    """The point's methods with a checkpoint interval a sweep's grid does not set: (method, field, interval)."""
    out = []
    for method in point.methods:
        interval_field = type(method).checkpoint_interval_field
        if interval_field is None or f"methods.{method.name}.{interval_field}" in swept_fields:
            continue
        out.append((method, interval_field, int(getattr(method, interval_field))))
    return out


def _daly_interval_far_off(own_runs: pd.DataFrame, interval: int, pipeline_failure_rate_per_s: float) -> int | None:
    """Daly's interval in iterations for a blocking checkpoint's runs (δ read off them), where the
    configured `interval` is `UNTUNED_INTERVAL_RATIO` or more away from it; None otherwise."""
    daly = interval_optimum_from_runs(own_runs, interval, 1.0 / pipeline_failure_rate_per_s).daly_interval_iterations
    if daly is None:
        return None
    daly_interval = max(1, round(daly))
    return daly_interval if max(interval / daly_interval, daly_interval / interval) >= UNTUNED_INTERVAL_RATIO else None


def daly_reruns(points: Sequence[Scenario], runs: pd.DataFrame, *, swept_fields: Sequence[str] = ()) -> list[DalyRerun]:
    """The (point, method) pairs whose blocking checkpoint interval is `UNTUNED_INTERVAL_RATIO` or
    more away from Daly's optimum at that point; `runs` are the points' runs (runs.csv). A method
    whose interval is among a sweep's `swept_fields` is left alone: its grid already varies it."""
    reruns = []
    for tuning in _tunings(points, runs, swept_fields):
        if tuning.rule != DALY_RULE:
            continue
        (daly_interval,) = tuning.next_intervals
        tuned = tuning.method.model_copy(update={tuning.interval_field: daly_interval})
        reruns.append(DalyRerun(
            point=Scenario.model_validate(tuning.point.model_copy(update={"methods": (tuned,)}).model_dump()),
            method=tuning.method.name, interval_field=tuning.interval_field,
            scenario_interval_iterations=tuning.configured, daly_interval_iterations=daly_interval,
        ))
    return reruns


def interval_beyond_edge(grid: Sequence[int], best_interval: int, iterations_executed: float) -> int | None:
    """The next interval past the grid's edge where the best one lies on it: half the smallest (not
    below 1), twice the largest (while a run still takes a checkpoint at it); None where the best
    point has neighbours on both sides or the grid cannot grow that way."""
    if len(grid) < 2:
        return None
    if best_interval == min(grid) and best_interval > 1:
        return max(1, best_interval // 2)
    if best_interval == max(grid) and 2 * best_interval <= iterations_executed:
        return 2 * best_interval
    return None


@dataclass(kw_only=True)
class _Tuning:
    """The intervals tried for one method at one point, and their runs."""

    point: Scenario
    method: MethodConfig
    interval_field: str
    configured: int
    rule: str
    max_interval: float
    """No checkpoint is taken at an interval beyond the iterations a run executes."""
    tried: dict[int, pd.DataFrame] = field(default_factory=dict)
    next_intervals: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, float | None]:
        return _point_key(self.point.name, _rate(self.point))

    def best(self) -> int:
        return min(self.tried, key=lambda interval: _score(self.tried[interval]))

    def plan_next_step(self) -> None:
        """The search's next interval: past the best, in the direction it improved; none once it stops."""
        self.next_intervals = []
        if self.rule != SEARCH_RULE:
            return
        beyond = interval_beyond_edge(sorted(self.tried), self.best(), self.max_interval)
        if beyond is not None and beyond not in self.tried and len(self.tried) < 2 + 1 + MAX_SEARCH_STEPS:
            self.next_intervals = [beyond]


def _score(runs: pd.DataFrame) -> tuple[float, float]:
    """Reaching the target in more replications first, then the lower mean time to target."""
    mean = Estimate.of_values(runs["time_to_target_s"].tolist()).mean
    return (-_reached_share(runs), mean if mean is not None else math.inf)


def _tunings(points: Sequence[Scenario], runs: pd.DataFrame, swept_fields: Sequence[str]) -> list[_Tuning]:
    """What to try at every point with failures: Daly's interval for a blocking checkpoint far from
    it, half and twice the interval for the others (a search)."""
    tunings = []
    for point in points:
        rate_per_s = _pipeline_failure_rate_per_s(point)
        if not rate_per_s > 0:
            continue
        point_runs = _runs_of_point(runs, _point_key(point.name, _rate(point)))
        for method, interval_field, interval in _interval_methods(point, swept_fields):
            own = point_runs[point_runs["method"] == method.name]
            tuning = _Tuning(point=point, method=method, interval_field=interval_field, configured=interval,
                             rule=SEARCH_RULE, max_interval=float(own["iterations_executed"].max()), tried={interval: own})
            if type(method).blocking_checkpoint:
                daly_interval = _daly_interval_far_off(own, interval, rate_per_s)
                if daly_interval is None:
                    continue
                tuning.rule, tuning.next_intervals = DALY_RULE, [daly_interval]
            else:
                tuning.next_intervals = [value for value in (max(1, interval // 2), 2 * interval) if value != interval and value <= tuning.max_interval]
            tunings.append(tuning)
    return tunings


def _run_steps(tunings: Sequence[_Tuning], *, workers: int | None, client: Any) -> None:
    """Run every tuning's next intervals in one sweep a step, until no search goes on."""
    while any(tuning.next_intervals for tuning in tunings):
        tasks = []
        for index, tuning in enumerate(tunings):
            for interval in tuning.next_intervals:
                method = tuning.method.model_copy(update={tuning.interval_field: interval})
                point = Scenario.model_validate(tuning.point.model_copy(update={"methods": (method,)}).model_dump())
                tasks += [SweepTask(task=task, settings={TUNED_INTERVAL_SETTING: interval, TUNING_SETTING: index}, keep_trajectories=False)
                          for task in replication_tasks(point)]
        new = run_sweep(tasks, workers=workers, client=client).runs
        for index, tuning in enumerate(tunings):
            for interval in tuning.next_intervals:
                tuning.tried[interval] = new[(new[TUNING_SETTING] == index) & (new[TUNED_INTERVAL_SETTING] == interval)]
            tuning.plan_next_step()


def _times_by_replication(runs: pd.DataFrame) -> pd.Series:
    return runs.set_index("replication")["time_to_target_s"]


def _reached_share(runs: pd.DataFrame) -> float:
    return float(runs["reached_target"].mean()) if len(runs) else 0.0


def _tuning_result(tuning: _Tuning) -> IntervalRerun | None:
    """The tuned interval where it is clearly better than the configured one: it reaches the target
    in more replications, or it is faster: the 95 % interval of the paired speed-up (configured
    time / tuned time, replication by replication: the same failures) above 1. That interval is the
    one rule for positive quantities, on the log scale, where one replication's large ratio widens
    it least."""
    best = tuning.best()
    if best == tuning.configured:
        return None
    untuned_runs, tuned_runs = tuning.tried[tuning.configured], tuning.tried[best]
    tuned = Estimate.of_values(tuned_runs["time_to_target_s"].tolist())
    if tuned.mean is None:
        return None
    reaches_more_often = _reached_share(tuned_runs) > _reached_share(untuned_runs)
    ratios = (_times_by_replication(untuned_runs) / _times_by_replication(tuned_runs)).tolist()
    paired = Estimate.of_values([ratio for ratio in ratios if math.isfinite(ratio) and ratio > 0])
    faster = paired.ci95_low is not None and paired.ci95_low > 1.0
    if not (reaches_more_often or faster):
        return None
    return IntervalRerun(
        method=tuning.method.name, interval_field=tuning.interval_field, configured_interval_iterations=tuning.configured,
        tuned_interval_iterations=best, tuned_by=tuning.rule,
        intervals_tried=tuple(sorted(tuning.tried)), fraction_reached=_reached_share(tuned_runs), time_to_target_s=tuned,
    )


def _tuning_note(results: Sequence[IntervalRerun]) -> str:
    """One caveat for a point: which intervals the answer with tuned intervals used."""
    def one(result: IntervalRerun) -> str:
        how = DALY_RULE if result.tuned_by == DALY_RULE else f"the best of {', '.join(map(str, result.intervals_tried))}"
        return f"{result.method}'s {result.interval_field} {result.configured_interval_iterations} → {result.tuned_interval_iterations} ({how})"

    return (
        f"the answer with checkpoint intervals tuned here takes {'; '.join(one(result) for result in results)}; a tuned time is "
        "the best of a few tried on the same failures, so somewhat optimistic (`churnsim recommend` tunes every method's knobs)"
    )


def _tuned_point(point: PointVerdict, point_runs: pd.DataFrame, tuned: Sequence["TunedInterval"]) -> PointVerdict:
    """The point's answer with the tuned methods' runs in place of their configured ones."""
    frames = [point_runs[~point_runs["method"].isin([tuned_interval.result.method for tuned_interval in tuned])]]
    for tuned_interval in tuned:
        # A sweep's grid columns are constant at a point; the tuning sweep did not set them.
        runs = tuned_interval.runs
        missing = {column: point_runs[column].iloc[0] for column in point_runs.columns if column not in runs.columns}
        frames.append(runs.assign(**missing)[list(point_runs.columns)])
    runs = pd.concat(frames, ignore_index=True)
    grid_columns = [column for column in point.grid if column in runs.columns]
    return point_verdict(summary_table(runs, grid_columns), grid_columns=grid_columns)


def points_of_tasks(tasks: Sequence[SweepTask]) -> list[Scenario]:
    """The scenarios of a what-if's or a sweep's points, once each, from its tasks."""
    return list({_point_key(task.task.scenario.name, _rate(task.task.scenario)): task.task.scenario for task in tasks}.values())


@dataclass(frozen=True, kw_only=True)
class TunedInterval:
    """A method's interval tuned at one point, clearly better than the configured one there."""

    point_key: tuple[str, float | None]
    """(scenario name, failure probability per stage-hour or None), as in runs.csv."""
    result: IntervalRerun
    runs: pd.DataFrame
    """The runs at the tuned interval."""


def tune_intervals(
    points: Sequence[Scenario], runs: pd.DataFrame, *, swept_fields: Sequence[str] = (), workers: int | None = None, client: Any = None
) -> list[TunedInterval]:
    """Each method's checkpoint interval tuned at each point with failures (Daly's optimum or a
    search), where that is clearly better; `runs` are the points' runs at the configured intervals."""
    tunings = _tunings(points, runs, swept_fields)
    _run_steps(tunings, workers=workers, client=client)
    return [
        TunedInterval(point_key=tuning.key, result=result, runs=tuning.tried[result.tuned_interval_iterations])
        for tuning in tunings
        for result in [_tuning_result(tuning)]
        if result is not None
    ]


def rerun_untuned_intervals(
    verdict: Verdict,
    points: Sequence[Scenario],
    runs: pd.DataFrame,
    *,
    swept_fields: Sequence[str] = (),
    workers: int | None = None,
    client: Any = None,
) -> Verdict:
    """`verdict` with a caveat at every point where a method's checkpoint interval, tuned there, is
    clearly better. `points` (the scenarios the answer ran) and `runs` are the answer's own
    (`swept_fields` a sweep's); the tuning runs are a few more, small sweeps."""
    tuned = tune_intervals(points, runs, swept_fields=swept_fields, workers=workers, client=client)
    updated = []
    for point in verdict.points:
        key = _point_key(point.scenario, point.failure_probability_per_stage_hour)
        here = [tuned_interval for tuned_interval in tuned if tuned_interval.point_key == key]
        if not here:
            updated.append(point)
            continue
        results = [tuned_interval.result for tuned_interval in here]
        updated.append(replace(
            point,
            caveats=point.caveats + (_tuning_note(results),),
            interval_reruns=tuple(results),
            with_tuned_intervals=_tuned_point(point, _runs_of_point(runs, key), here),
        ))
    return replace(verdict, points=tuple(updated))
