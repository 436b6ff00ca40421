"""`churnsim whatif`: failure rates × methods on one scenario, tables and everything the figures need.

The sweep replaces the scenario's churn with the CheckFree paper's per-stage hourly failure
probability at each rate (use `churnsim sweep` for other churn models). Beside it, a checkpoint
interval study at one rate compares synchronous and lazy asynchronous checkpointing and places the
simulated optimum next to Young's and Daly's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from churnsim.calibration.churn import PoissonChurn, StageHourlyChurn
from churnsim.calibration.methods import MethodConfig, method_from_name, method_names_where, method_traits
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.tables import INTERVAL_COLUMNS, write_table

from .analytic import interval_optimum_from_runs
from .iteration import simulate_iteration
from .outputs import iteration_spans_table, scenario_notes, write_manifest
from .pipeline_state import build_pipeline_state
from churnsim.calibration.statistics import mean_with_ci95

from .replicate import replication_tasks, summary_table
from .sweep import SweepResult, SweepTask, run_sweep
from .verdict import Estimate, PointVerdict, Verdict, duration_unit, finite_or_none, format_duration, format_ratio, verdict_from_summary

WHATIF_FAILURE_RATES: tuple[float, ...] = (0.0, 0.05, 0.10, 0.16, 0.33)
CHECKPOINT_INTERVALS: tuple[int, ...] = (5, 10, 20, 50, 100, 200, 500)
RATE_SETTING = "churn.failure_probability_per_stage_hour"


@dataclass(frozen=True, kw_only=True)
class WhatIfPlan:
    scenario: Scenario
    failure_rates: tuple[float, ...] = WHATIF_FAILURE_RATES
    methods: tuple[MethodConfig, ...] = ()
    replications: int = 10
    interval_study_rate: float | None = 0.10
    intervals: tuple[int, ...] = CHECKPOINT_INTERVALS

    def chosen_methods(self) -> tuple[MethodConfig, ...]:
        return self.methods or self.scenario.methods


def at_rate(scenario: Scenario, rate: float, *, replications: int, methods: Sequence[MethodConfig]) -> Scenario:
    base_name = scenario.name.rsplit("-", 1)[0] if scenario.name.endswith("pct") else scenario.name
    return scenario.model_copy(
        update={
            "name": base_name,
            "churn": StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=rate),
            "replications": replications,
            "methods": tuple(methods),
        }
    )


def rate_tasks(plan: WhatIfPlan) -> list[SweepTask]:
    tasks = []
    for rate in plan.failure_rates:
        scenario = Scenario.model_validate(
            at_rate(plan.scenario, rate, replications=plan.replications, methods=plan.chosen_methods()).model_dump()
        )
        for task in replication_tasks(scenario):
            tasks.append(SweepTask(task=task, settings={RATE_SETTING: rate}, keep_trajectories=task.replication == 0))
    return tasks


def interval_study_methods() -> tuple[str, ...]:
    """The checkpoint-family methods with a checkpoint interval: the ones the interval study sweeps."""
    return tuple(name for name in method_names_where(family="checkpoint") if method_traits(name).checkpoint_interval_field)


def interval_tasks(plan: WhatIfPlan) -> list[SweepTask]:
    if plan.interval_study_rate is None:
        return []
    tasks = []
    for name in interval_study_methods():
        interval_field = method_traits(name).checkpoint_interval_field
        for interval in plan.intervals:
            method = method_from_name(name, **{interval_field: interval})
            scenario = at_rate(plan.scenario, plan.interval_study_rate, replications=plan.replications, methods=(method,))
            scenario = Scenario.model_validate(scenario.model_dump())
            for task in replication_tasks(scenario):
                tasks.append(SweepTask(task=task, settings={"interval_iterations": interval}, keep_trajectories=False))
    return tasks


def interval_table(plan: WhatIfPlan, runs: pd.DataFrame) -> pd.DataFrame:
    """Stall fraction and time to target per (method, interval), with Young's and Daly's intervals."""
    if runs.empty or plan.interval_study_rate is None:
        return pd.DataFrame(columns=list(INTERVAL_COLUMNS))
    scenario = plan.scenario
    num_stages = scenario.pipeline.num_stages
    churn = StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=plan.interval_study_rate)
    pipeline_failure_rate_per_s = churn.rate_per_stage_s * num_stages
    rows = []
    sync = runs[runs["method"].isin(method_names_where(blocking_checkpoint=True))]
    mtbf_s = 1.0 / pipeline_failure_rate_per_s if pipeline_failure_rate_per_s > 0 else None
    optimum = interval_optimum_from_runs(sync, sync["interval_iterations"], mtbf_s)
    young = optimum.young_interval_iterations if optimum.young_interval_iterations is not None else math.nan
    daly = optimum.daly_interval_iterations if optimum.daly_interval_iterations is not None else math.nan
    for (method, interval), group in runs.groupby(["method", "interval_iterations"], sort=True):
        mean, low, high = mean_with_ci95(group["time_to_target_s"].tolist())
        rows.append(
            {
                "source": "simulated",
                "method": method,
                "interval_iterations": int(interval),
                "stall_fraction": float((group["checkpoint_stall_s"] / group["wall_clock_s"]).mean()),
                "time_to_target_mean_s": mean,
                "time_to_target_ci95_low_s": low,
                "time_to_target_ci95_high_s": high,
                "young_interval_iterations": young,
                "daly_interval_iterations": daly,
            }
        )
    return pd.DataFrame(rows, columns=list(INTERVAL_COLUMNS))


UNTUNED_INTERVAL_RATIO = 1.5
"""A blocking checkpoint's interval this many times Daly's optimum at a rate, or less than its
1/1.5, is run again at Daly's there, so the answer can say what tuning it would change."""
DALY_INTERVAL_SETTING = "daly_interval_iterations"


@dataclass(frozen=True, kw_only=True)
class DalyRerun:
    """A blocking checkpoint method at one failure rate, its scenario interval far from Daly's."""

    rate: float
    method: MethodConfig
    interval_field: str
    scenario_interval_iterations: int
    daly_interval_iterations: int


def daly_reruns(plan: WhatIfPlan, runs: pd.DataFrame) -> list[DalyRerun]:
    """The (rate, method) pairs whose checkpoint interval is off Daly's optimum by `UNTUNED_INTERVAL_RATIO`.

    δ is read off the rate's own runs (`interval_optimum_from_runs`), M is the whole pipeline's at
    that rate; methods that block nothing (the lazy asynchronous checkpoint) have no δ and no Daly
    point, and are left to `churnsim recommend`'s grid."""
    num_stages = plan.scenario.pipeline.num_stages
    reruns = []
    for rate in plan.failure_rates:
        rate_per_s = StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=rate).rate_per_stage_s * num_stages
        if not rate_per_s > 0:
            continue
        for method in plan.chosen_methods():
            traits = type(method)
            if not traits.blocking_checkpoint or traits.checkpoint_interval_field is None:
                continue
            interval = int(getattr(method, traits.checkpoint_interval_field))
            own = runs[(runs["failure_probability_per_stage_hour"] == rate) & (runs["method"] == method.name)]
            daly = interval_optimum_from_runs(own, interval, 1.0 / rate_per_s).daly_interval_iterations
            if daly is None:
                continue
            daly_interval = max(1, round(daly))
            if max(interval / daly_interval, daly_interval / interval) < UNTUNED_INTERVAL_RATIO:
                continue
            reruns.append(DalyRerun(rate=rate, method=method, interval_field=traits.checkpoint_interval_field,
                                    scenario_interval_iterations=interval, daly_interval_iterations=daly_interval))
    return reruns


def daly_rerun_tasks(plan: WhatIfPlan, reruns: Sequence[DalyRerun]) -> list[SweepTask]:
    tasks = []
    for rerun in reruns:
        method = rerun.method.model_copy(update={rerun.interval_field: rerun.daly_interval_iterations})
        scenario = Scenario.model_validate(at_rate(plan.scenario, rerun.rate, replications=plan.replications, methods=(method,)).model_dump())
        for task in replication_tasks(scenario):
            tasks.append(SweepTask(task=task, settings={RATE_SETTING: rerun.rate, DALY_INTERVAL_SETTING: rerun.daly_interval_iterations},
                                   keep_trajectories=False))
    return tasks


def _times_by_replication(runs: pd.DataFrame) -> pd.Series:
    return runs.set_index("replication")["time_to_target_s"]


def daly_rerun_note(rerun: DalyRerun, point: PointVerdict, runs: pd.DataFrame, tuned_runs: pd.DataFrame) -> str | None:
    """What checkpointing at Daly's interval would change at this rate, where it would be clearly
    faster: its time to target, and the winner's paired speed-up over it (common random numbers:
    replication r sees the same failures either way)."""
    at_rate_runs = runs[runs["failure_probability_per_stage_hour"] == rerun.rate]
    untuned = _times_by_replication(at_rate_runs[at_rate_runs["method"] == rerun.method.name])
    tuned = _times_by_replication(tuned_runs)
    tuned_estimate = Estimate.of_values(tuned.tolist())
    untuned_low = mean_with_ci95(untuned.tolist())[1]
    if tuned_estimate.mean is None or not (tuned_estimate.mean < untuned_low):
        return None
    unit = duration_unit(max(untuned.max(), tuned.max()))
    name, field = rerun.method.name, rerun.interval_field
    text = (
        f"{name}'s {field} {rerun.scenario_interval_iterations} is {_how_far(rerun)} Daly's optimum at this rate: "
        f"at {rerun.daly_interval_iterations} it reaches the target in {format_duration(tuned_estimate, unit, suffix=' ' + unit[0])}, "
        f"not {format_duration(Estimate(mean=finite_or_none(untuned.mean()), ci95_low=None, ci95_high=None), unit, suffix=' ' + unit[0])}"
    )
    if point.winner is not None and point.winner != name:
        winner = _times_by_replication(at_rate_runs[at_rate_runs["method"] == point.winner])
        ratios = tuned / winner
        speedup = Estimate.of_values(ratios.tolist())
        if speedup.mean is not None:
            faster = "" if speedup.mean >= 1 else f"; it would reach the target before {point.winner}"
            text += f", and {point.winner}'s speed-up over it is {format_ratio(speedup, suffix='×')}{faster}"
    return text + " (`churnsim recommend` tunes every method's knobs)"


def _how_far(rerun: DalyRerun) -> str:
    ratio = rerun.scenario_interval_iterations / rerun.daly_interval_iterations
    return f"{ratio:.1f}×" if ratio >= 1 else f"1/{1 / ratio:.1f} of"


FEW_FAILURES_PER_RUN = 0.5
"""Below this many failures per run at the highest rate, the rates do not reach the runs' scale."""


def few_failures_note(scenario: Scenario, runs: pd.DataFrame) -> str | None:
    """A caveat when even the highest rate leaves most runs without a failure: a run far shorter than
    an hour (a tiny calibrated model) sees almost none at a few per cent per stage-hour, and the
    comparison is then of failure-free overheads alone. It says how to ask at the run's own scale."""
    if runs.empty or "num_failures" not in runs:
        return None
    highest = runs["failure_probability_per_stage_hour"].max()
    failures_per_run = float(runs.loc[runs["failure_probability_per_stage_hour"] == highest, "num_failures"].mean())
    if not highest > 0 or failures_per_run >= FEW_FAILURES_PER_RUN:
        return None
    churn = scenario.churn
    if isinstance(churn, PoissonChurn) and churn.failures_per_node_hour > 0:
        rate = churn.failures_per_node_hour
        own = f"sweep the scenario's own churn instead: `churnsim sweep ... --set churn.failures_per_node_hour=0,{rate / 2:g},{rate:g},{2 * rate:g}`"
    else:
        own = "give --rates up to 0.99, or sweep a churn of this scale with `churnsim sweep`"
    return (
        f"even at {100 * highest:g} %/h per stage a run saw {failures_per_run:.2g} failures on average: at these rates the methods "
        f"differ by their failure-free costs alone; to ask at the scale of this run, {own}"
    )


@dataclass(frozen=True)
class WhatIfResult:
    sweep: SweepResult
    intervals: pd.DataFrame
    notes: tuple[str, ...]
    verdict: Verdict
    files: tuple[Path, ...] = ()


def compute_whatif(
    plan: WhatIfPlan,
    *,
    workers: int | None = None,
    client: Any = None,
    on_task_done: Callable[[], None] | None = None,
) -> WhatIfResult:
    """Every table of the what-if and its verdict, in memory (nothing is written)."""
    main_tasks, study_tasks = rate_tasks(plan), interval_tasks(plan)
    everything = run_sweep(
        main_tasks + study_tasks, workers=workers, client=client, on_task_done=on_task_done
    )
    runs = everything.runs
    is_study = runs["interval_iterations"].notna() if "interval_iterations" in runs else pd.Series(False, index=runs.index)
    # The swept rate is already the failure_probability_per_stage_hour column: no second copy.
    main_runs = runs[~is_study].drop(columns=["interval_iterations", RATE_SETTING], errors="ignore").reset_index(drop=True)
    trajectories = everything.trajectories.drop(columns=["interval_iterations", RATE_SETTING], errors="ignore")
    sweep = SweepResult(runs=main_runs, summary=summary_table(main_runs), trajectories=trajectories)
    intervals = interval_table(plan, runs[is_study])
    notes = scenario_notes(plan.scenario.model_copy(update={"methods": plan.chosen_methods()}))
    few = few_failures_note(plan.scenario, main_runs)
    verdict = verdict_from_summary(sweep.summary, notes=notes + ((few,) if few else ()), runs=sweep.runs)
    # A second pass, small: blocking checkpoints far from Daly's interval at a rate, run at Daly's.
    reruns = daly_reruns(plan, main_runs)
    if reruns:
        tuned = run_sweep(daly_rerun_tasks(plan, reruns), workers=workers, client=client).runs
        points = []
        for point in verdict.points:
            notes_here = [
                daly_rerun_note(rerun, point, main_runs, tuned[(tuned[RATE_SETTING] == rerun.rate) & (tuned["method"] == rerun.method.name)])
                for rerun in reruns if rerun.rate == point.failure_probability_per_stage_hour
            ]
            points.append(replace(point, caveats=point.caveats + tuple(note for note in notes_here if note)))
        verdict = replace(verdict, points=tuple(points))
    return WhatIfResult(sweep=sweep, intervals=intervals, notes=verdict.caveats, verdict=verdict)


def write_whatif(plan: WhatIfPlan, result: WhatIfResult, out_directory: str | Path, *, parquet: bool = False) -> WhatIfResult:
    """Write the tables and the manifest of `result` to `out_directory`; returns it with the files listed."""
    out_directory = Path(out_directory)
    files: list[Path] = []
    files += write_table(result.sweep.runs, out_directory / "runs.csv", parquet=parquet)
    files += write_table(result.sweep.summary, out_directory / "summary.csv", parquet=parquet)
    files += write_table(result.sweep.trajectories, out_directory / "trajectories.csv", parquet=parquet)
    files += write_table(result.intervals, out_directory / "checkpoint_intervals.csv", parquet=parquet)
    healthy = simulate_iteration(build_pipeline_state(plan.scenario))
    files += write_table(iteration_spans_table(healthy), out_directory / "iteration_spans.csv", parquet=parquet)
    files.append(
        write_manifest(
            out_directory,
            command="whatif",
            scenario=plan.scenario,
            failure_rates=list(plan.failure_rates),
            methods=[method.name for method in plan.chosen_methods()],
            replications=plan.replications,
            interval_study_rate=plan.interval_study_rate,
            notes=list(result.notes),
            verdict=result.verdict.to_json(),
        )
    )
    return replace(result, files=tuple(files))


def run_whatif(
    plan: WhatIfPlan,
    out_directory: str | Path,
    *,
    workers: int | None = None,
    client: Any = None,
    parquet: bool = False,
    on_task_done: Callable[[], None] | None = None,
) -> WhatIfResult:
    """`compute_whatif`, then `write_whatif` to `out_directory`."""
    result = compute_whatif(plan, workers=workers, client=client, on_task_done=on_task_done)
    return write_whatif(plan, result, out_directory, parquet=parquet)
