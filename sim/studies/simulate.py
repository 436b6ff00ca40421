"""`churnsim simulate`: one scenario, its methods and replications → tables, run records, timelines."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import pandas as pd

from churnsim.calibration.churn import own_rate
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.tables import write_table

from ..model.iteration import IterationResult, simulate_iteration
from ..model.method_extras import with_measured_method_extra
from ..model.methods import build_policy
from .outputs import iteration_spans_table, scenario_notes, write_chrome_trace, write_manifest, write_simulated_run_records
from .replicate import run_replications, runs_table, summary_table, trajectories_table
from ..model.results import RunResult
from .untuned_intervals import rerun_untuned_intervals
from .verdict import Verdict, tuned_intervals_table, verdict_from_summary


@dataclass(frozen=True)
class SimulationOutput:
    runs: pd.DataFrame
    summary: pd.DataFrame
    trajectories: pd.DataFrame
    notes: tuple[str, ...]
    verdict: Verdict
    files: tuple[Path, ...] = ()
    results: tuple[RunResult, ...] = field(default=(), repr=False)
    """Every run's full result (timelines, failures), which the run records are written from."""


def healthy_iterations(scenario: Scenario) -> dict[str, IterationResult]:
    """One failure-free iteration per method, at microbatch resolution (for Gantt charts and timelines)."""
    return {
        method.name: simulate_iteration(build_policy(method, with_measured_method_extra(scenario, method)).healthy_state())
        for method in scenario.methods
    }


def with_own_rate_named(verdict: Verdict, scenario: Scenario) -> Verdict:
    """The answer's points with the scenario's own churn rate among their settings, so that a title
    says it (`cpu-tiny, at 240 failures per node-hour`); the hourly probability has a column of its
    own, and a churn without a rate (none, a schedule) has nothing to say."""
    own = own_rate(scenario.churn)
    if own is None or scenario.churn.kind == "stage_hourly":
        return verdict
    setting = {own[0].setting: own[1]}
    return replace(verdict, points=tuple(replace(point, grid={**point.grid, **setting}) for point in verdict.points))


def simulate_tables(scenario: Scenario, *, on_replication_done: Callable[[], None] | None = None) -> SimulationOutput:
    """Every method of `scenario` over its replications, as tables and a verdict; nothing is written."""
    results = run_replications(scenario, on_replication_done=on_replication_done)
    runs = runs_table(scenario, results)
    summary = summary_table(runs)
    verdict = verdict_from_summary(summary, notes=scenario_notes(scenario), runs=runs)
    # Each checkpoint interval also tuned, and the answer given again with the better ones
    # (sim/studies/untuned_intervals.py), in this process as the rest.
    verdict = rerun_untuned_intervals(verdict, [scenario], runs, workers=1)
    verdict = with_own_rate_named(verdict, scenario)
    return SimulationOutput(
        runs=runs,
        summary=summary,
        trajectories=trajectories_table(scenario, results),
        notes=verdict.caveats,
        verdict=verdict,
        results=tuple(results),
    )


def simulate_scenario(
    scenario: Scenario,
    *,
    out_directory: str | Path,
    parquet: bool = False,
    write_records: bool = True,
    on_replication_done: Callable[[], None] | None = None,
) -> SimulationOutput:
    """Run every method of `scenario` over its replications and write the results to `out_directory`.

    Layout: manifest.json, runs.csv, summary.csv, trajectories.csv, iteration_spans.csv,
    timelines/<method>-r0.json (Perfetto / chrome://tracing), records/<method>-r<k>/ (run records).
    """
    out_directory = Path(out_directory)
    output = simulate_tables(scenario, on_replication_done=on_replication_done)
    iterations = healthy_iterations(scenario)
    files: list[Path] = []
    files += write_table(output.runs, out_directory / "runs.csv", parquet=parquet)
    files += write_table(output.summary, out_directory / "summary.csv", parquet=parquet)
    files += write_table(output.trajectories, out_directory / "trajectories.csv", parquet=parquet)
    files += write_table(tuned_intervals_table(output.verdict), out_directory / "tuned_intervals.csv", parquet=parquet)
    spans = pd.concat(
        [iteration_spans_table(result).assign(method=name) for name, result in iterations.items()], ignore_index=True
    )
    files += write_table(spans, out_directory / "iteration_spans.csv", parquet=parquet)
    for result in output.results:
        if result.replication == 0:
            files.append(
                write_chrome_trace(out_directory / "timelines" / f"{result.method}-r0.json", result, iterations.get(result.method))
            )
    if write_records:
        files += write_simulated_run_records(out_directory / "records", scenario, output.results, iterations)
    files.append(
        write_manifest(
            out_directory,
            command="simulate",
            scenario=scenario,
            methods=[method.name for method in scenario.methods],
            replications=scenario.replications,
            seed=scenario.seed,
            notes=list(output.notes),
            verdict=output.verdict.to_json(),
        )
    )
    return replace(output, files=tuple(files))
