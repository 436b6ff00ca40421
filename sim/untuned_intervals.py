"""Blocking checkpoints far from Daly's optimum, run again at Daly's interval, and what that changes.

An answer compares the methods as the scenario configures them: a preset's checkpoint interval is
its paper's (the CheckFree replay's 20 iterations), which at a high failure rate is far longer than
the optimum, so the speed-up over checkpointing would overstate what a user with a tuned interval
gains. At every point of a what-if or a sweep (and in the one scenario of `simulate`) where a
method that blocks training to checkpoint
has an interval `UNTUNED_INTERVAL_RATIO` or more away from Daly's optimum (δ read off the point's
own runs, M the whole pipeline's at the point's churn: `analytic.interval_optimum_from_runs`), the
method runs again at Daly's interval, with the same failures (common random numbers), and that
point's caveats give its time to target and the winner's paired speed-up over it. Methods that
block nothing (the lazy asynchronous checkpoint) have no Daly point; `churnsim recommend` searches
their interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import pandas as pd

from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
from churnsim.calibration.scenario import Scenario

from .analytic import interval_optimum_from_runs
from .replicate import replication_tasks
from .sweep import SweepTask, run_sweep
from .verdict import Estimate, IntervalRerun, PointVerdict, Verdict, duration_unit, format_duration, format_ratio

UNTUNED_INTERVAL_RATIO = 1.5
"""An interval this many times Daly's, or less than 1/1.5 of it, is run again at Daly's."""
DALY_INTERVAL_SETTING = "daly_interval_iterations"


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


def daly_reruns(points: Sequence[Scenario], runs: pd.DataFrame, *, swept_fields: Sequence[str] = ()) -> list[DalyRerun]:
    """The (point, method) pairs whose blocking checkpoint interval is `UNTUNED_INTERVAL_RATIO` or
    more away from Daly's optimum at that point; `runs` are the points' runs (runs.csv). A method
    whose interval is among a sweep's `swept_fields` is left alone: its grid already varies it."""
    reruns = []
    for point in points:
        num_stages = point.pipeline.num_stages
        rate_per_s = mean_stage_failure_rate_per_s(point.churn, num_stages=num_stages) * num_stages
        if not rate_per_s > 0:
            continue
        point_runs = _runs_of_point(runs, _point_key(point.name, _rate(point)))
        for method in point.methods:
            traits = type(method)
            if not traits.blocking_checkpoint or traits.checkpoint_interval_field is None:
                continue
            if f"methods.{method.name}.{traits.checkpoint_interval_field}" in swept_fields:
                continue
            interval = int(getattr(method, traits.checkpoint_interval_field))
            own = point_runs[point_runs["method"] == method.name]
            daly = interval_optimum_from_runs(own, interval, 1.0 / rate_per_s).daly_interval_iterations
            if daly is None:
                continue
            daly_interval = max(1, round(daly))
            if max(interval / daly_interval, daly_interval / interval) < UNTUNED_INTERVAL_RATIO:
                continue
            tuned = method.model_copy(update={traits.checkpoint_interval_field: daly_interval})
            reruns.append(
                DalyRerun(
                    point=Scenario.model_validate(point.model_copy(update={"methods": (tuned,)}).model_dump()),
                    method=method.name, interval_field=traits.checkpoint_interval_field,
                    scenario_interval_iterations=interval, daly_interval_iterations=daly_interval,
                )
            )
    return reruns


def _times_by_replication(runs: pd.DataFrame) -> pd.Series:
    return runs.set_index("replication")["time_to_target_s"]


def _reached_share(runs: pd.DataFrame) -> float:
    return float(runs["reached_target"].mean()) if len(runs) else 0.0


def _in_share(share: float) -> str:
    return "" if share >= 1.0 else f" in {share:.0%} of replications"


def daly_rerun_result(
    rerun: DalyRerun, point: PointVerdict, point_runs: pd.DataFrame, tuned_runs: pd.DataFrame
) -> tuple[IntervalRerun, str] | None:
    """What checkpointing at Daly's interval changes at this point, where it is clearly better: it
    reaches the target in more replications, or its mean time lies below the configured interval's
    95 % interval. Its result, with the winner's paired speed-up over it, and the caveat saying so;
    None otherwise."""
    untuned_runs = point_runs[point_runs["method"] == rerun.method]
    untuned = Estimate.of_values(_times_by_replication(untuned_runs).tolist())
    tuned_times = _times_by_replication(tuned_runs)
    tuned = Estimate.of_values(tuned_times.tolist())
    untuned_share, tuned_share = _reached_share(untuned_runs), _reached_share(tuned_runs)
    if tuned.mean is None:
        return None
    reaches_more_often = tuned_share > untuned_share
    faster = untuned.ci95_low is not None and tuned.mean < untuned.ci95_low
    if not (reaches_more_often or faster):
        return None
    unit = duration_unit(max(value for value in (tuned.ci95_high, untuned.ci95_high, tuned.mean, untuned.mean) if value is not None))
    ratio = rerun.scenario_interval_iterations / rerun.daly_interval_iterations
    how_far = f"{ratio:.1f}×" if ratio >= 1 else f"1/{1 / ratio:.1f} of"
    if untuned.mean is None:
        before = f"where at {rerun.scenario_interval_iterations} it never did"
    else:
        untuned_mean = Estimate(mean=untuned.mean, ci95_low=None, ci95_high=None)
        before = f"not {format_duration(untuned_mean, unit, suffix=' ' + unit[0])}{_in_share(untuned_share)}"
    text = (
        f"{rerun.method}'s {rerun.interval_field} {rerun.scenario_interval_iterations} is {how_far} Daly's optimum here: "
        f"at {rerun.daly_interval_iterations} it reaches the target in {format_duration(tuned, unit, suffix=' ' + unit[0])}"
        f"{_in_share(tuned_share)}, {before}"
    )
    speedup: Estimate | None = None
    if point.winner is not None and point.winner != rerun.method:
        winner_times = _times_by_replication(point_runs[point_runs["method"] == point.winner])
        paired = Estimate.of_values((tuned_times / winner_times).tolist())
        speedup = paired if paired.mean is not None else None
    if speedup is not None and speedup.mean is not None:
        if speedup.ci95_low is not None and speedup.ci95_high is not None and speedup.ci95_low <= 1 <= speedup.ci95_high:
            verdict_word = ": the two cannot be told apart"
        elif speedup.mean < 1:
            verdict_word = f": it would reach the target before {point.winner}"
        else:
            verdict_word = ""
        text += f"; {point.winner}'s speed-up over it is {format_ratio(speedup, suffix='×')}{verdict_word}"
    result = IntervalRerun(
        method=rerun.method, interval_field=rerun.interval_field, configured_interval_iterations=rerun.scenario_interval_iterations,
        daly_interval_iterations=rerun.daly_interval_iterations, fraction_reached=tuned_share, time_to_target_s=tuned,
        winner_speedup=speedup,
    )
    return result, text + " (`churnsim recommend` tunes every method's knobs)"


def points_of_tasks(tasks: Sequence[SweepTask]) -> list[Scenario]:
    """The scenarios of a what-if's or a sweep's points, once each, from its tasks."""
    return list({(task.task.scenario.name, _rate(task.task.scenario)): task.task.scenario for task in tasks}.values())


def rerun_untuned_intervals(
    verdict: Verdict,
    points: Sequence[Scenario],
    runs: pd.DataFrame,
    *,
    swept_fields: Sequence[str] = (),
    workers: int | None = None,
    client: Any = None,
) -> Verdict:
    """`verdict` with a caveat at every point where a blocking checkpoint's interval is far from
    Daly's and running it at Daly's is clearly faster. `points` (the scenarios the answer ran) and
    `runs` are the answer's own (`swept_fields` a sweep's); the reruns are a second, small sweep."""
    reruns = daly_reruns(points, runs, swept_fields=swept_fields)
    if not reruns:
        return verdict
    rerun_tasks = [
        SweepTask(task=task, settings={DALY_INTERVAL_SETTING: rerun.daly_interval_iterations}, keep_trajectories=False)
        for rerun in reruns
        for task in replication_tasks(rerun.point)
    ]
    tuned_runs = run_sweep(rerun_tasks, workers=workers, client=client).runs
    updated = []
    for point in verdict.points:
        key = _point_key(point.scenario, point.failure_probability_per_stage_hour)
        found = []
        for rerun in reruns:
            if _point_key(rerun.point.name, _rate(rerun.point)) != key:
                continue
            tuned = _runs_of_point(tuned_runs, key)
            outcome = daly_rerun_result(rerun, point, _runs_of_point(runs, key), tuned[tuned["method"] == rerun.method])
            if outcome is not None:
                found.append(outcome)
        updated.append(replace(
            point,
            caveats=point.caveats + tuple(note for _, note in found),
            interval_reruns=point.interval_reruns + tuple(result for result, _ in found),
        ))
    return replace(verdict, points=tuple(updated))
