"""`churnsim whatif`: failure rates × methods on one scenario, tables and everything the figures need.

The rates are the CheckFree paper's per-stage hourly failure probability, replacing the scenario's
churn, for a scenario whose churn is that model (or none); a scenario with another churn model with a
rate (Poisson nodes, Weibull lifetimes, bursts, a trace) is asked under its own churn at a few
multiples of its rate instead (`whatif_plan`), unless rates are given. Beside it, a checkpoint
interval study at one rate compares synchronous and lazy asynchronous checkpointing and places the
simulated optimum next to Young's and Daly's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from churnsim.calibration.churn import RATE_FIELD_OF_KIND, StageHourlyChurn, own_rate, rate_field_of_setting, rate_sweep
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
from churnsim.calibration.methods import MethodConfig, method_names_where, method_traits
from churnsim.calibration.errors import InputError
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.scenario_overrides import repeated_value
from churnsim.calibration.tables import INTERVAL_COLUMNS, write_table

from ..model.analytic import interval_optimum_from_runs
from ..model.iteration import simulate_iteration
from .outputs import iteration_spans_table, scenario_notes, write_manifest
from ..model.pipeline_state import build_pipeline_state
from churnsim.calibration.statistics import positive_mean_with_ci95

from .replicate import replication_tasks, summary_table
from .sweep import SweepResult, SweepTask, run_sweep
from .untuned_intervals import points_of_tasks, rerun_untuned_intervals
from .verdict import Verdict, rare_stage_loss_note, tuned_intervals_table, verdict_from_summary

WHATIF_FAILURE_RATES: tuple[float, ...] = (0.0, 0.05, 0.10, 0.16, 0.33)
QUICK_FAILURE_RATES: tuple[float, ...] = (0.0, 0.10, 0.33)
OWN_CHURN_FACTORS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
"""Multiples of a scenario's own failure rate that `whatif` asks at (and at none, where its churn
model can say so); `--quick` asks at `QUICK_OWN_CHURN_FACTORS`."""
QUICK_OWN_CHURN_FACTORS: tuple[float, ...] = (1.0, 4.0)
CHECKPOINT_INTERVALS: tuple[int, ...] = (5, 10, 20, 50, 100, 200, 500)
QUICK_CHECKPOINT_INTERVALS: tuple[int, ...] = (10, 50, 200)
WHATIF_REPLICATIONS = 10
QUICK_REPLICATIONS = 3
RATE_SETTING = RATE_FIELD_OF_KIND["stage_hourly"].setting


@dataclass(frozen=True, kw_only=True)
class WhatIfPlan:
    scenario: Scenario
    failure_rates: tuple[float, ...] = WHATIF_FAILURE_RATES
    """Values of `rate_setting`, one answer each."""
    rate_setting: str = RATE_SETTING
    """The field the rates set: the per-stage hourly probability, which replaces the scenario's churn,
    or the rate field of its own churn model (`calibration.churn.RATE_FIELD_OF_KIND`), which keeps it."""
    methods: tuple[MethodConfig, ...] = ()
    replications: int = 10
    interval_study_rate: float | None = 0.10
    """The `rate_setting` value of the checkpoint interval study; None leaves the study out."""
    intervals: tuple[int, ...] = CHECKPOINT_INTERVALS

    def chosen_methods(self) -> tuple[MethodConfig, ...]:
        return self.methods or self.scenario.methods

    @property
    def replaces_churn(self) -> bool:
        """True when the rates are per-stage hourly probabilities standing in for the scenario's churn."""
        return self.rate_setting == RATE_SETTING

    @property
    def grid_columns(self) -> tuple[str, ...]:
        """The tables' column of the rate under the scenario's own churn (the hourly probability has its own)."""
        return () if self.replaces_churn else (self.rate_setting,)


def whatif_plan(
    scenario: Scenario,
    *,
    failure_rates: Sequence[float] | None = None,
    methods: Sequence[MethodConfig] = (),
    replications: int | None = None,
    quick: bool = False,
    interval_study: bool = True,
) -> WhatIfPlan:
    """The what-if the commands run: at `failure_rates` per-stage hourly probabilities where given, or
    where the scenario's churn is that model, has none, or has no rate to scale (a fixed schedule, a
    rate of 0); otherwise under the scenario's own churn at `OWN_CHURN_FACTORS` times its rate (and at none
    where the churn model can say so), the interval study at its own rate."""
    own = own_rate(scenario.churn) if failure_rates is None and scenario.churn.kind != "stage_hourly" else None
    swept = rate_sweep(scenario.churn, QUICK_OWN_CHURN_FACTORS if quick else OWN_CHURN_FACTORS) if own is not None and own[1] > 0 else None
    if own is not None and swept is not None:
        rate_setting, rates = swept
        study_rate: float | None = own[1]
    else:
        rate_setting = RATE_SETTING
        rates = tuple(failure_rates) if failure_rates is not None else QUICK_FAILURE_RATES if quick else WHATIF_FAILURE_RATES
        repeated = repeated_value([float(rate) for rate in rates])
        if repeated is not None:
            raise InputError(f"--rates: {repeated:g} is given twice; give each failure rate once")
        study_rate = 0.10
    return WhatIfPlan(
        scenario=scenario,
        failure_rates=tuple(float(rate) for rate in rates),
        rate_setting=rate_setting,
        methods=tuple(methods),
        # Given replications win over --quick's default, as given rates do.
        replications=replications if replications is not None else QUICK_REPLICATIONS if quick else WHATIF_REPLICATIONS,
        interval_study_rate=study_rate if interval_study else None,
        intervals=QUICK_CHECKPOINT_INTERVALS if quick else CHECKPOINT_INTERVALS,
    )


def at_rate(
    scenario: Scenario, rate: float, *, replications: int, methods: Sequence[MethodConfig], rate_setting: str = RATE_SETTING
) -> Scenario:
    """`scenario` at one what-if rate: its churn replaced by the per-stage hourly probability `rate`,
    or (another `rate_setting`) its own churn with that field set to `rate`."""
    if rate_setting == RATE_SETTING:
        base_name = scenario.name.rsplit("-", 1)[0] if scenario.name.endswith("pct") else scenario.name
        churn: Any = StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=rate)
    else:
        # Named as a sweep names its grid points: one scenario per rate, which the summary groups by.
        base_name = f"{scenario.name}[{rate_setting}={rate}]"
        rate_field = rate_field_of_setting(rate_setting)
        assert rate_field is not None, f"{rate_setting} is no churn model's rate field"
        churn = scenario.churn.model_copy(update={rate_field.field: rate})
    return scenario.model_copy(update={"name": base_name, "churn": churn, "replications": replications, "methods": tuple(methods)})


def plan_at_rate(plan: WhatIfPlan, rate: float, methods: Sequence[MethodConfig] | None = None) -> Scenario:
    """The plan's scenario at one of its rates, validated."""
    scenario = at_rate(
        plan.scenario, rate, replications=plan.replications, methods=plan.chosen_methods() if methods is None else methods, rate_setting=plan.rate_setting
    )
    return Scenario.model_validate(scenario.model_dump())


def rate_tasks(plan: WhatIfPlan) -> list[SweepTask]:
    tasks = []
    for rate in plan.failure_rates:
        for task in replication_tasks(plan_at_rate(plan, rate)):
            tasks.append(SweepTask(task=task, settings={plan.rate_setting: rate}, keep_trajectories=task.replication == 0))
    return tasks


def interval_study_methods() -> tuple[str, ...]:
    """The checkpoint-family methods with a checkpoint interval: the ones the interval study sweeps."""
    return tuple(name for name in method_names_where(family="checkpoint") if method_traits(name).checkpoint_interval_field)


def interval_study_configs(plan: WhatIfPlan) -> list[MethodConfig]:
    """What the interval study varies the interval of: the scenario's own configuration of each
    checkpointing method (its storage tier or levels), or the default one where the scenario lists no
    such method and the default fits its storage. A default that names a tier the scenario lacks
    (the DataStates presets keep their checkpoints on Lustre) is left out rather than failing."""
    configs = (plan.scenario.method_config(name) for name in interval_study_methods())
    return [config for config in configs if plan.scenario.method_problem(config) is None]


def interval_tasks(plan: WhatIfPlan) -> list[SweepTask]:
    if plan.interval_study_rate is None:
        return []
    tasks = []
    for config in interval_study_configs(plan):
        interval_field = method_traits(config.name).checkpoint_interval_field
        for interval in plan.intervals:
            method = config.model_copy(update={interval_field: interval})
            for task in replication_tasks(plan_at_rate(plan, plan.interval_study_rate, methods=(method,))):
                tasks.append(SweepTask(task=task, settings={"interval_iterations": interval}, keep_trajectories=False))
    return tasks


def interval_table(plan: WhatIfPlan, runs: pd.DataFrame) -> pd.DataFrame:
    """Stall fraction and time to target per (method, interval), with Young's and Daly's intervals."""
    if runs.empty or plan.interval_study_rate is None:
        return pd.DataFrame(columns=list(INTERVAL_COLUMNS))
    scenario = plan.scenario
    num_stages = scenario.pipeline.num_stages
    churn = plan_at_rate(plan, plan.interval_study_rate).churn
    pipeline_failure_rate_per_s = mean_stage_failure_rate_per_s(churn, num_stages=num_stages) * num_stages
    rows = []
    sync = runs[runs["method"].isin(method_names_where(blocking_checkpoint=True))]
    mtbf_s = 1.0 / pipeline_failure_rate_per_s if pipeline_failure_rate_per_s > 0 else None
    optimum = interval_optimum_from_runs(sync, sync["interval_iterations"], mtbf_s)
    young = optimum.young_interval_iterations if optimum.young_interval_iterations is not None else math.nan
    daly = optimum.daly_interval_iterations if optimum.daly_interval_iterations is not None else math.nan
    for (method, interval), group in runs.groupby(["method", "interval_iterations"], sort=True):
        mean, low, high = positive_mean_with_ci95(group["time_to_target_s"].tolist())
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
    if scenario.churn.kind != "stage_hourly" and _scalable_rate(scenario.churn):
        own = "leave out --rates: whatif then asks under the scenario's own churn"
    else:
        own = "give --rates up to 0.99, or sweep a churn of this scale with `churnsim sweep`"
    return (
        f"even at {100 * highest:g} %/h per stage a run saw {failures_per_run:.2g} failures on average: at these rates the methods "
        f"differ by their failure-free costs alone; to ask at the scale of this run, {own}"
    )


def _scalable_rate(churn: Any) -> bool:
    """Whether `churn` has a failure rate above 0 to ask at multiples of (`whatif_plan`): a mean
    lifetime or a time scale is always above 0, a rate may be 0."""
    own = own_rate(churn)
    return own is not None and own[1] > 0


def rare_stage_loss_notes(plan: WhatIfPlan) -> tuple[str, ...]:
    """`verdict.rare_stage_loss_note` at each rate of the plan where it applies, named by its rate."""
    words = rate_field_of_setting(plan.rate_setting)
    notes = []
    for rate in plan.failure_rates:
        note = rare_stage_loss_note(plan_at_rate(plan, rate))
        if note is not None:
            notes.append(f"at {words.words(rate) if words is not None else f'{plan.rate_setting} = {rate:g}'}: {note}")
    return tuple(notes)


def churn_replaced_note(scenario: Scenario) -> str | None:
    """Rates given as per-stage hourly probabilities to a scenario with another churn model (a trace,
    Weibull lifetimes, bursts, Poisson nodes, a schedule) ask under that churn instead of its own,
    which the answer must say, with how to keep its own."""
    churn = scenario.churn
    if churn.kind in ("stage_hourly", "none"):
        return None
    swept = rate_sweep(churn)
    if swept is None:
        own = "`churnsim simulate` replays it as it is"
    elif not _scalable_rate(churn):
        own = f"its own fails at a rate of 0: give it one (`--set {swept[0]}=…`) to ask under it"
    else:
        own = f"without --rates, `churnsim whatif` asks under its own churn at {', '.join(f'{factor:g}' for factor in OWN_CHURN_FACTORS)} times its rate"
    return (
        f"the rates replace the scenario's own churn ({churn.kind}) with independent per-stage failures at each "
        f"hourly probability, the CheckFree paper's unit; {own}"
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
    # A swept hourly probability is already the failure_probability_per_stage_hour column: no second
    # copy. Another churn's rate keeps its column, as a sweep's does.
    dropped = ["interval_iterations", *(() if plan.grid_columns else (RATE_SETTING,))]
    main_runs = runs[~is_study].drop(columns=dropped, errors="ignore").reset_index(drop=True)
    trajectories = everything.trajectories.drop(columns=dropped, errors="ignore")
    grid_columns = plan.grid_columns
    sweep = SweepResult(runs=main_runs, summary=summary_table(main_runs, grid_columns), trajectories=trajectories, grid_columns=grid_columns)
    intervals = interval_table(plan, runs[is_study])
    notes = scenario_notes(plan.scenario.model_copy(update={"methods": plan.chosen_methods()}))
    # Whether stage losses are too rare to tell the methods apart depends on the rate: said per rate asked.
    notes = tuple(note for note in notes if note != rare_stage_loss_note(plan.scenario)) + rare_stage_loss_notes(plan)
    churn_notes: tuple[str, ...] = ()
    if plan.replaces_churn:
        few = few_failures_note(plan.scenario, main_runs)
        churn_notes = tuple(note for note in (churn_replaced_note(plan.scenario), few) if note)
    verdict = verdict_from_summary(sweep.summary, grid_columns=grid_columns, notes=notes + churn_notes, runs=sweep.runs)
    # Each checkpoint interval tuned at every rate with failures, a few more small sweeps.
    verdict = rerun_untuned_intervals(
        verdict, points_of_tasks(main_tasks), main_runs, swept_fields=grid_columns, workers=workers, client=client
    )
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
            rate_setting=plan.rate_setting,
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
