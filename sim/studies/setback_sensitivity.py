"""How the answer moves with the convergence setbacks: the setback-sensitivity study.

Every setback of the scenario is multiplied by a common factor (`convergence.setback_scale`: 0.5, 1,
2, 3, 5 by default; 1 is the scenario as it is, with its replications' setback draws) and the
what-if is repeated at each factor and failure rate. The table says which method wins at each
(rate, factor) (`sim/studies/verdict.py`'s rule) and where the winner changes: between two factors whose
winners differ, the crossover is where the two methods' mean times to target meet, interpolated
linearly in the factor (a method's time grows about linearly with its setbacks while its progress
is not clipped at zero). Common random numbers: every factor sees the same failure paths and the
same setback draws, so the differences are the factor's.

Methods without setbacks (checkpointing, redundant computation) do not depend on the factor: they
run once per rate and their rows are repeated for every factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pandas as pd

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.tables import CROSSOVER_COLUMNS, sensitivity_columns

from .replicate import replication_tasks, summary_table
from .sweep import SweepTask, run_sweep
from .verdict import method_role, point_verdict
from .whatif import RATE_SETTING, at_rate

SENSITIVITY_SCALES: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 5.0)
SENSITIVITY_FAILURE_RATES: tuple[float, ...] = (0.10, 0.33)
SCALE_SETTING = "convergence.setback_scale"
RATE_COLUMN = "failure_probability_per_stage_hour"


@dataclass(frozen=True)
class SetbackSensitivity:
    table: pd.DataFrame
    """One row per (failure rate, setback scale, method): `calibration.tables.sensitivity_columns()`."""
    crossovers: pd.DataFrame
    """One row per change of winner between neighbouring scales, or per rate where it never changes:
    `calibration.tables.CROSSOVER_COLUMNS`."""


def sensitivity_methods(scenario: Scenario) -> tuple[MethodConfig, ...]:
    """The methods that can win (neither the no-failure reference nor an ablation)."""
    return tuple(method for method in scenario.methods if method_role(method.name) == "method")


def sensitivity_tasks(
    scenario: Scenario,
    *,
    scales: Sequence[float],
    failure_rates: Sequence[float] | None,
    replications: int,
    methods: Sequence[MethodConfig],
) -> list[SweepTask]:
    """Setback methods once per (rate, scale, replication); the others once per (rate, replication).

    `failure_rates` None keeps the scenario's own churn (any churn model); otherwise each rate
    replaces it with the per-stage hourly probability, as `churnsim whatif` does.
    """
    if not scales or any(not (scale > 0 and math.isfinite(scale)) for scale in scales):
        raise InputError(f"setback scales {list(scales)}: give at least one finite factor > 0")
    scaled = tuple(method for method in methods if method.uses_setbacks)
    fixed = tuple(method for method in methods if not method.uses_setbacks)
    tasks = []
    for rate in failure_rates if failure_rates is not None else (None,):
        base = scenario.model_copy(update={"replications": replications})
        if rate is not None:
            base = at_rate(scenario, rate, replications=replications, methods=methods)
        point_settings = {} if rate is None else {RATE_SETTING: rate}
        groups = [(fixed, {})] + [(scaled, {SCALE_SETTING: scale}) for scale in scales]
        for group, settings in groups:
            if not group:
                continue
            convergence = base.convergence.model_copy(update={"setback_scale": settings.get(SCALE_SETTING, base.convergence.setback_scale)})
            point = Scenario.model_validate(base.model_copy(update={"methods": group, "convergence": convergence}).model_dump())
            for task in replication_tasks(point):
                tasks.append(SweepTask(task=task, settings={**point_settings, **settings}, keep_trajectories=False))
    return tasks


def _expand_fixed_runs(runs: pd.DataFrame, scales: Sequence[float]) -> pd.DataFrame:
    """Repeat the runs of setback-free methods (no scale column value) once per scale."""
    has_scale = runs[SCALE_SETTING].notna() if SCALE_SETTING in runs else pd.Series(False, index=runs.index)
    fixed = runs[~has_scale]
    copies = [fixed.assign(**{SCALE_SETTING: float(scale)}) for scale in scales]
    return pd.concat([runs[has_scale], *copies], ignore_index=True)


def _crossover_rows(table: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for (scenario, rate), group in table.groupby(["scenario", RATE_COLUMN], sort=False, dropna=False):
        winners = group[group["winner"]].set_index("setback_scale")["method"].sort_index()
        times = group.pivot_table(index="setback_scale", columns="method", values="time_to_target_mean_s", aggfunc="first")
        scales = list(winners.index)
        changes = 0
        for low, high in zip(scales, scales[1:]):
            before, after = winners[low], winners[high]
            if before == after:
                continue
            changes += 1
            difference_low = times.at[low, before] - times.at[low, after]
            difference_high = times.at[high, before] - times.at[high, after]
            crossover = math.nan
            if all(math.isfinite(value) for value in (difference_low, difference_high)) and difference_high != difference_low:
                crossover = low + (high - low) * (-difference_low) / (difference_high - difference_low)
            rows.append(dict(scenario=scenario, **{RATE_COLUMN: rate}, scale_low=low, scale_high=high,
                             winner_below=before, winner_above=after, crossover_scale=crossover))
        if not changes and scales:
            rows.append(dict(scenario=scenario, **{RATE_COLUMN: rate}, scale_low=scales[0], scale_high=scales[-1],
                             winner_below=winners.iloc[0], winner_above=winners.iloc[-1], crossover_scale=math.nan))
    return rows


def _rate_key(rate: float) -> float | None:
    """A dictionary key for a failure rate: NaN (a churn model without one) never equals itself."""
    return None if pd.isna(rate) else float(rate)


def sensitivity_from_runs(runs: pd.DataFrame, scales: Sequence[float]) -> SetbackSensitivity:
    """The sensitivity tables from the runs of `sensitivity_tasks` (a runs table with a scale column)."""
    runs = _expand_fixed_runs(runs, scales)
    parts = []
    for scale in sorted(set(float(scale) for scale in scales)):
        summary = summary_table(runs[runs[SCALE_SETTING] == scale].reset_index(drop=True))
        summary.insert(summary.columns.get_loc(RATE_COLUMN) + 1, "setback_scale", scale)
        winners = {}
        for (scenario, rate), rows in summary.groupby(["scenario", RATE_COLUMN], sort=False, dropna=False):
            winners[(scenario, _rate_key(rate))] = point_verdict(rows).winner
        summary["winner"] = [winners.get((row.scenario, _rate_key(getattr(row, RATE_COLUMN)))) == row.method for row in summary.itertuples()]
        parts.append(summary)
    table = pd.concat(parts, ignore_index=True)[list(sensitivity_columns())]
    return SetbackSensitivity(table=table, crossovers=pd.DataFrame(_crossover_rows(table), columns=list(CROSSOVER_COLUMNS)))


def check_setback_methods(methods: Sequence[MethodConfig]) -> None:
    """The study scales setbacks: without a method that has any, it would change nothing."""
    if not any(method.uses_setbacks for method in methods):
        raise InputError("the setback sensitivity needs a method with convergence setbacks (checkfree, checkfree_plus, ...)")


def setback_sensitivity(
    scenario: Scenario,
    *,
    scales: Sequence[float] = SENSITIVITY_SCALES,
    failure_rates: Sequence[float] | None = SENSITIVITY_FAILURE_RATES,
    replications: int | None = None,
    methods: Sequence[MethodConfig] | None = None,
    workers: int | None = None,
    client: Any = None,
    on_task_done: Callable[[], None] | None = None,
) -> SetbackSensitivity:
    """How the ranking moves with a common factor on every setback, and at which factor the winner changes."""
    chosen = tuple(methods) if methods is not None else sensitivity_methods(scenario)
    check_setback_methods(chosen)
    tasks = sensitivity_tasks(
        scenario, scales=scales, failure_rates=failure_rates, replications=replications or scenario.replications, methods=chosen
    )
    result = run_sweep(tasks, workers=workers, client=client, on_task_done=on_task_done)
    runs = result.runs.drop(columns=[RATE_SETTING], errors="ignore")
    return sensitivity_from_runs(runs, scales)


def change_text(crossover: Any) -> str:
    """`checkfree → redundant at ×1.40` for one row of the crossovers table."""
    if math.isfinite(crossover.crossover_scale):
        return f"{crossover.winner_below} → {crossover.winner_above} at ×{crossover.crossover_scale:.2f}"
    return f"{crossover.winner_below} → {crossover.winner_above} between ×{crossover.scale_low:g} and ×{crossover.scale_high:g}"


def sensitivity_lines(sensitivity: SetbackSensitivity) -> list[str]:
    """One line per failure rate: the winner at each scale and where it changes."""
    lines = []
    for rate, rows in sensitivity.crossovers.groupby(RATE_COLUMN, sort=True, dropna=False):
        table = sensitivity.table[sensitivity.table[RATE_COLUMN] == rate] if not pd.isna(rate) else sensitivity.table
        winners = ", ".join(f"×{row.setback_scale:g} {row.method}" for row in table[table["winner"]].itertuples())
        changes = [change_text(row) for row in rows.itertuples() if row.winner_below != row.winner_above]
        where = "all rates" if pd.isna(rate) else f"{rate:.0%}/h"
        lines.append(f"{where}: winner {winners}; " + ("; ".join(changes) if changes else "the winner does not change"))
    return lines
