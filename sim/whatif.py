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

from churnsim.calibration.churn import StageHourlyChurn, rate_sweep_setting
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
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
from .untuned_intervals import points_of_tasks, rerun_untuned_intervals
from .verdict import Verdict, tuned_intervals_table, verdict_from_summary

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
    setting = rate_sweep_setting(scenario.churn) if scenario.churn.kind != "stage_hourly" else None
    if setting is not None and mean_stage_failure_rate_per_s(scenario.churn, num_stages=scenario.pipeline.num_stages) > 0:
        own = f"sweep the scenario's own churn instead: `churnsim sweep ... --set {setting}`"
    else:
        own = "give --rates up to 0.99, or sweep a churn of this scale with `churnsim sweep`"
    return (
        f"even at {100 * highest:g} %/h per stage a run saw {failures_per_run:.2g} failures on average: at these rates the methods "
        f"differ by their failure-free costs alone; to ask at the scale of this run, {own}"
    )


def churn_replaced_note(scenario: Scenario, *, with_command: bool = True) -> str | None:
    """What-if rates are per-stage hourly probabilities: a scenario with another churn model (a
    trace, Weibull lifetimes, bursts, Poisson nodes, a schedule) is asked under that churn instead
    of its own, which the answer must say, with the sweep that keeps its own (`with_command`)."""
    churn = scenario.churn
    if churn.kind in ("stage_hourly", "none"):
        return None
    replaced = (
        f"the rates replace the scenario's own churn ({churn.kind}) with independent per-stage failures at each "
        "hourly probability, the CheckFree paper's unit"
    )
    if not with_command:
        return replaced
    setting = rate_sweep_setting(churn)
    own = (
        f"`churnsim sweep ... --set {setting}` asks under its own churn at ½, 1 and 2 times its rate"
        if setting is not None
        else "`churnsim simulate` replays it as it is"
    )
    return f"{replaced}: {own}"


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
    few = few_failures_note(plan.scenario, main_runs)  # names the sweep of the scenario's own churn itself
    churn_notes = tuple(note for note in (churn_replaced_note(plan.scenario, with_command=few is None), few) if note)
    verdict = verdict_from_summary(sweep.summary, notes=notes + churn_notes, runs=sweep.runs)
    # Each checkpoint interval tuned at every rate with failures, a few more small sweeps.
    verdict = rerun_untuned_intervals(verdict, points_of_tasks(main_tasks), main_runs, workers=workers, client=client)
    return WhatIfResult(sweep=sweep, intervals=intervals, notes=verdict.caveats, verdict=verdict)


def write_whatif(plan: WhatIfPlan, result: WhatIfResult, out_directory: str | Path, *, parquet: bool = False) -> WhatIfResult:
    """Write the tables and the manifest of `result` to `out_directory`; returns it with the files listed."""
    out_directory = Path(out_directory)
    files: list[Path] = []
    files += write_table(result.sweep.runs, out_directory / "runs.csv", parquet=parquet)
    files += write_table(result.sweep.summary, out_directory / "summary.csv", parquet=parquet)
    files += write_table(result.sweep.trajectories, out_directory / "trajectories.csv", parquet=parquet)
    files += write_table(result.intervals, out_directory / "checkpoint_intervals.csv", parquet=parquet)
    files += write_table(tuned_intervals_table(result.verdict), out_directory / "tuned_intervals.csv", parquet=parquet)
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
