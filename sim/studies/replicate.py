"""Replications with common random numbers, and the statistics that compare methods.

Replication r of a scenario draws its failure path from a stream seeded by (seed, r, churn) once
(`calibration.failure_sampling.failures_for_replication`),
and hands the same path to every method (common random numbers), so that differences between
methods are differences of the methods, not of luck. Speed-ups are paired: the ratio of two methods'
times in the same replication. Times and speed-ups are positive, so both are summarised by
`calibration.statistics.positive_mean_with_ci95`: the geometric mean over replications with the
Student-t 95 % interval of the logs (for a speed-up, of the log paired ratios), never below zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.convergence import PowerLawLossCurve
from churnsim.calibration.failure_sampling import FailurePathSpec, LazyFailurePath
from churnsim.calibration.methods import METHOD_CONFIGS, MethodConfig, speedup_baselines
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.setback_uncertainty import replication_convergence
from churnsim.calibration.speed_uncertainty import replication_compute_factor, with_compute_scaled
from churnsim.calibration.statistics import geometric_mean, intervals_unreliable, positive_mean_with_ci95
from churnsim.calibration.tables import RUN_COLUMNS, TRAJECTORY_COLUMNS, speedup_at_most_column, speedup_columns, summary_columns

from ..model.iteration import shared_iteration_model
from ..model.results import RunResult
from ..model.run import simulate_run

@dataclass(frozen=True, kw_only=True)
class ReplicationTask:
    """One replication of one scenario for a set of methods: the unit of work a sweep distributes."""

    scenario: Scenario
    replication: int
    methods: tuple[MethodConfig, ...]


def replication_scenario(scenario: Scenario, replication: int) -> Scenario:
    """`scenario` with replication `replication`'s setback draws (calibration/setback_uncertainty.py)
    and machine speed (calibration/speed_uncertainty.py); the draws come from streams of their own,
    so the failure path does not change."""
    convergence = replication_convergence(scenario.convergence, seed=scenario.seed, replication=replication)
    drawn = scenario if convergence is scenario.convergence else scenario.model_copy(update={"convergence": convergence})
    return with_compute_scaled(drawn, replication_compute_factor(scenario, replication))


def run_replication(task: ReplicationTask) -> list[RunResult]:
    """Every method of `task` on the same failure path and setback draws, sharing one iteration-model cache."""
    # Sampled only as far as the longest run of this replication gets (shared by its methods).
    failures = LazyFailurePath(FailurePathSpec.of(task.scenario, replication=task.replication))
    scenario = replication_scenario(task.scenario, task.replication)
    iteration_model = shared_iteration_model()
    return [
        simulate_run(scenario, method, failures, replication=task.replication, seed=task.scenario.seed, iteration_model=iteration_model)
        for method in task.methods
    ]


def _setbacks_charged(scenario: Scenario, method: str, replication: int) -> dict[str, object]:
    """The setback source and the setbacks a run charged per rebuilt stage: the constant part and the
    growth per iteration of progress past the offset (NaN for methods without setbacks)."""
    traits = METHOD_CONFIGS.get(method)
    convergence = replication_convergence(scenario.convergence, seed=scenario.seed, replication=replication)
    uses = traits is not None and traits.uses_setbacks
    charged: dict[str, object] = {"setback_source": scenario.convergence.setback_source}
    for position in ("interior", "edge"):
        charged[f"setback_{position}_iterations"] = convergence.setback_iterations(method, position) if uses else math.nan
        charged[f"setback_{position}_per_progress_iteration"] = convergence.setback_per_progress_iteration(method, position) if uses else math.nan
    return charged


def replication_tasks(scenario: Scenario, methods: Sequence[MethodConfig] | None = None) -> list[ReplicationTask]:
    chosen = tuple(methods) if methods is not None else scenario.methods
    return [ReplicationTask(scenario=scenario, replication=r, methods=chosen) for r in range(scenario.replications)]


def run_replications(
    scenario: Scenario,
    methods: Sequence[MethodConfig] | None = None,
    *,
    on_replication_done: Callable[[], None] | None = None,
) -> list[RunResult]:
    results: list[RunResult] = []
    for task in replication_tasks(scenario, methods):
        results.extend(run_replication(task))
        if on_replication_done is not None:
            on_replication_done()
    return results


def failure_probability_of(scenario: Scenario) -> float:
    churn = scenario.churn
    return churn.failure_probability_per_stage_hour if isinstance(churn, StageHourlyChurn) else math.nan


def runs_table(scenario: Scenario, results: Iterable[RunResult]) -> pd.DataFrame:
    """One row per run, columns `calibration.tables.RUN_COLUMNS`."""
    rows = []
    for result in results:
        row = {
            "scenario": scenario.name,
            "failure_probability_per_stage_hour": failure_probability_of(scenario),
            "method": result.method,
            "replication": result.replication,
            "seed": result.seed,
            "setbacks_calibrated": scenario.convergence.calibrated,
            **_setbacks_charged(scenario, result.method, result.replication),
            **result.summary(),
        }
        rows.append(row)
    return pd.DataFrame(rows, columns=list(RUN_COLUMNS))


def _paired_speedups(times: pd.DataFrame, method: str, baseline: str) -> list[float]:
    """T_baseline / T_method per replication where both reached the target; `times` is one point's
    times to target, a row per replication and a column per method (`_by_replication`)."""
    if baseline not in times or method not in times:
        return []
    ratios = times[baseline] / times[method]
    return [float(r) for r in ratios if np.isfinite(r)]


def _by_replication(group: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    """`values` (one per run of `group`, one point's runs) as a row per replication and a column per method."""
    return group.assign(value=values).pivot_table(index="replication", columns="method", values="value", aggfunc="first")


def _times_at_least(method_runs: pd.DataFrame) -> pd.Series:
    """Each run's time to target, or where it missed the target the time it was stopped
    (`target.max_wall_clock_s`): a lower bound on the time it would have needed."""
    reached = method_runs["reached_target"].astype(bool)
    stopped_s = method_runs["wall_clock_s"] if "wall_clock_s" in method_runs else math.nan  # unknown: no bound
    return method_runs["time_to_target_s"].where(reached, stopped_s).astype(float)


def time_to_target_at_least_s(method_runs: pd.DataFrame) -> float:
    """A lower bound on one method's (geometric) mean time to target over all its runs, the mean the
    summary reports; NaN without runs or where a run's stopping time is not finite."""
    times = _times_at_least(method_runs)
    return geometric_mean(times) if len(times) and bool(np.isfinite(times).all()) else math.nan


def _paired_speedup_at_most(times: pd.DataFrame, times_at_least: pd.DataFrame, method: str, baseline: str) -> float:
    """An upper bound on the (geometric) mean paired speed-up T_baseline / T_method over every replication (the
    method's missed runs count at their stopping time, `times_at_least`); NaN unless the baseline
    reached the target in every replication the method ran."""
    if method not in times_at_least or baseline not in times:
        return math.nan
    bound = times_at_least[method].dropna()  # the replications the method ran
    paired = times[baseline].reindex(bound.index)
    if bound.empty or not np.isfinite(paired).all():
        return math.nan
    return geometric_mean(paired / bound)


def summary_table(runs: pd.DataFrame, grid_columns: Sequence[str] = ()) -> pd.DataFrame:
    """One row per (scenario, failure rate, method): time to target and paired speed-ups, geometric
    means with 95 % intervals (`positive_mean_with_ci95`), and whether that many replications make
    the intervals reliable (`intervals_reliable`).

    `grid_columns` (a sweep's swept fields, columns of `runs`) are carried over right after
    `scenario`: a grid point is one scenario, so each is constant within a row's runs.
    """
    rows = []
    # The grid columns are keys too: points of a grid that share a scenario name (a what-if's
    # interval study) must not be pooled, since replication r of each is a different run.
    keys = ["scenario", *grid_columns, "failure_probability_per_stage_hour"]
    for (scenario_name, *_, probability), group in runs.groupby(keys, sort=False, dropna=False):
        # One table of the point's times per replication serves every (method, baseline) pair.
        times = _by_replication(group, group["time_to_target_s"])
        times_at_least = _by_replication(group, _times_at_least(group))
        for method, method_runs in group.groupby("method", sort=False):
            mean, low, high = positive_mean_with_ci95(method_runs["time_to_target_s"].tolist())
            row = {
                "scenario": scenario_name,
                **{column: method_runs[column].iloc[0] for column in grid_columns},
                "failure_probability_per_stage_hour": probability,
                "method": method,
                "num_replications": len(method_runs),
                "intervals_reliable": not intervals_unreliable(len(method_runs)),
                "fraction_reached": float(method_runs["reached_target"].mean()),
                "time_to_target_mean_s": mean,
                "time_to_target_ci95_low_s": low,
                "time_to_target_ci95_high_s": high,
                "time_to_target_at_least_s": time_to_target_at_least_s(method_runs),
                "setbacks_calibrated": bool(method_runs["setbacks_calibrated"].all()),
                "setback_source": method_runs["setback_source"].iloc[0] if "setback_source" in method_runs else None,
            }
            for baseline in speedup_baselines():
                row.update(zip(speedup_columns(baseline), positive_mean_with_ci95(_paired_speedups(times, method, baseline))))
                row[speedup_at_most_column(baseline)] = (
                    _paired_speedup_at_most(times, times_at_least, method, baseline) if math.isfinite(row["time_to_target_at_least_s"]) else math.nan
                )
            rows.append(row)
    columns = list(summary_columns())
    return pd.DataFrame(rows, columns=columns[:1] + list(grid_columns) + columns[1:])


def trajectories_table(scenario: Scenario, results: Iterable[RunResult], *, max_replications: int = 1) -> pd.DataFrame:
    """Loss against wall-clock for the first `max_replications` replications of each method."""
    curve: PowerLawLossCurve = scenario.convergence.baseline
    rows = []
    for result in results:
        if result.replication >= max_replications:
            continue
        for time_s, progress in result.trajectory:
            rows.append(
                (scenario.name, failure_probability_of(scenario), result.method, result.replication, time_s, progress, curve.loss(progress))
            )
    return pd.DataFrame(rows, columns=list(TRAJECTORY_COLUMNS))
