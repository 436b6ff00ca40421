"""`churnsim whatif --setback-sensitivity`: the setback-sensitivity study beside the what-if.

Runs `churnsim.sim.studies.setback_sensitivity.setback_sensitivity` at the what-if's nonzero failure rates
with its replications and methods, writes setback_sensitivity.csv and setback_crossovers.csv into
the what-if's directory (the figure is drawn with the others) and prints one short table on stderr,
so that `--json` keeps stdout to the answer.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from churnsim.calibration.tables import write_table


def study_scenario_and_methods(plan):
    """The what-if's scenario narrowed to its chosen methods, and the methods the study compares."""
    from churnsim.sim.studies.setback_sensitivity import sensitivity_methods

    scenario = plan.scenario.model_copy(update={"methods": plan.chosen_methods()})
    return scenario, sensitivity_methods(scenario)


def check_setback_sensitivity(plan) -> None:
    """Before the what-if runs: the study needs a method with setbacks (`sim.studies.setback_sensitivity`)."""
    from churnsim.sim.studies.setback_sensitivity import check_setback_methods

    check_setback_methods(study_scenario_and_methods(plan)[1])


def run_setback_sensitivity(plan, out: Path, *, workers: int | None, client: Any, parquet: bool, console: Console, progress: Callable) -> list[Path]:
    """The study for a `WhatIfPlan`, its tables written to `out`, its summary printed on `console`;
    `progress(total, description)` yields the function to call per finished task (`jobs.Progress`)."""
    from churnsim.sim.studies.setback_sensitivity import SENSITIVITY_SCALES, sensitivity_tasks, setback_sensitivity

    # Under the scenario's own churn the study runs at its own rate (the sensitivity tables are keyed
    # by the hourly probability, which that churn has none of).
    rates: tuple[float, ...] | None = tuple(rate for rate in plan.failure_rates if rate > 0) if plan.replaces_churn else None
    if rates == ():  # a plan under the scenario's own churn has a rate above 0 (whatif_plan)
        console.print("[yellow]note:[/yellow] --setback-sensitivity skipped: no nonzero failure rate, so setbacks change nothing")
        return []
    scenario, methods = study_scenario_and_methods(plan)
    total = len(sensitivity_tasks(scenario, scales=SENSITIVITY_SCALES, failure_rates=rates, replications=plan.replications, methods=methods))
    with progress(total, f"setback sensitivity on {scenario.name}") as advance:
        result = setback_sensitivity(
            scenario, failure_rates=rates, replications=plan.replications, methods=methods, workers=workers, client=client, on_task_done=advance
        )
    files = write_table(result.table, out / "setback_sensitivity.csv", parquet=parquet)
    files += write_table(result.crossovers, out / "setback_crossovers.csv", parquet=parquet)
    Console(stderr=True, width=max(console.width, 120)).print(sensitivity_table(result, source=scenario.convergence.setback_source or "default"))
    return files


def sensitivity_table(result, *, source: str) -> Table:
    """Winner per (rate, setback scale) and where it changes."""
    from churnsim.sim.studies.setback_sensitivity import change_text

    scales = sorted(set(result.table["setback_scale"]))
    table = Table(
        "failure rate", *(f"×{scale:g}" for scale in scales), "winner changes",
        title=f"winner as every setback is scaled (×1 = the scenario's {source.replace('_', '-')} setbacks)",
    )
    for rate, rows in result.table.groupby("failure_probability_per_stage_hour", sort=True, dropna=False):
        winners = rows[rows["winner"]].set_index("setback_scale")["method"]
        crossovers = result.crossovers
        at_rate = crossovers[crossovers["failure_probability_per_stage_hour"].isna()] if math.isnan(rate) else crossovers[
            crossovers["failure_probability_per_stage_hour"] == rate
        ]
        changes = [change_text(row) for row in at_rate.itertuples() if row.winner_below != row.winner_above]
        table.add_row(
            "the scenario's own churn" if math.isnan(rate) else f"{100 * rate:.3g} %/h",
            *(str(winners.get(scale, "—")) for scale in scales),
            "; ".join(changes) or "none",
        )
    return table
