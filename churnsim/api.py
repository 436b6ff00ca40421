"""The Python API: the main jobs of the command line as functions that return pandas DataFrames and
write nothing (for notebooks and scripts).

    from churnsim import api

    result = api.whatif("checkfree-124m-geo-10pct", failure_rates=[0.1, 0.33], replications=3)
    result.summary                    # one row per failure rate × method, 95 % intervals
    result.verdict.points[-1].winner  # 'checkfree'

Every function takes a scenario as a `Scenario`, a preset name (`churnsim presets`) or the path of a
scenario JSON file; bad input raises `churnsim.calibration.errors.InputError` with the one-line
message the CLI prints. torch is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from churnsim.calibration.builtin import resolve_calibration
from churnsim.calibration.calibration_file import Calibration
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import PRESETS, configured_scenario, preset
from churnsim.calibration.scenario import Scenario, load_scenario
from churnsim.sim.verdict import Verdict


@dataclass(frozen=True)
class Results:
    """What a job found: the tables `churnsim` writes as CSV, the verdict, and its caveats."""

    runs: pd.DataFrame
    """One row per run (runs.csv)."""
    summary: pd.DataFrame
    """One row per scenario × failure rate × method, with 95 % intervals and paired speed-ups (summary.csv)."""
    trajectories: pd.DataFrame
    """Loss against wall-clock, first replication of each method (trajectories.csv)."""
    verdict: Verdict
    """The answer at each failure rate (and grid point): winner, speed-ups, ties (`sim/verdict.py`)."""
    notes: tuple[str, ...] = ()
    """Caveats that apply to these results."""
    intervals: pd.DataFrame | None = field(default=None)
    """whatif only: the checkpoint-interval study (checkpoint_intervals.csv)."""


def scenario_of(scenario: Scenario | str | Path) -> Scenario:
    """A Scenario from a Scenario, a preset name or a scenario file path."""
    if isinstance(scenario, Scenario):
        return scenario
    if isinstance(scenario, str) and scenario in PRESETS:
        return preset(scenario)
    if Path(scenario).is_file():
        return load_scenario(str(scenario))
    raise InputError(f"{scenario!r} is neither a preset (`churnsim presets`) nor a scenario file")


def calibration_of(calibration: Calibration | str | Path | None) -> Calibration | None:
    """A Calibration from a Calibration, a calibration file path or a built-in name (cpu-tiny)."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    return resolve_calibration(str(calibration))


def _configured(
    scenario: Scenario | str | Path,
    *,
    methods: Sequence[str] | None = None,
    replications: int | None = None,
    seed: int | None = None,
    settings: Mapping[str, object] | None = None,
    calibration: Calibration | str | Path | None = None,
    calibration_mode: str = "full",
) -> Scenario:
    """The scenario with the methods, settings, calibration, replications and seed asked for, as the
    command line makes it (`presets.configured_scenario`: a calibrated preset is built again with the
    settings)."""
    preset_name = scenario if isinstance(scenario, str) and scenario in PRESETS else None
    configured = configured_scenario(
        scenario_of(scenario), preset_name, settings, methods=methods or (), calibration=calibration_of(calibration),
        calibration_mode=calibration_mode,  # type: ignore[arg-type]
    )
    return configured.with_run_settings(replications=replications, seed=seed)


def simulate(
    scenario: Scenario | str | Path,
    *,
    methods: Sequence[str] | None = None,
    replications: int | None = None,
    seed: int | None = None,
    settings: Mapping[str, object] | None = None,
    calibration: Calibration | str | Path | None = None,
    calibration_mode: str = "full",
) -> Results:
    """`churnsim simulate`: every method of one scenario over its replications (common random numbers).

    `settings` overrides fields by dotted path, e.g. `{"pipeline.num_microbatches": 8}`; `calibration`
    (a file from `churnsim calibrate`, a built-in name or a Calibration) runs it on that machine, as
    `--calibration` does (`calibration_mode` "full" or "setbacks").
    """
    from churnsim.sim.simulate import simulate_tables

    configured = _configured(
        scenario, methods=methods, replications=replications, seed=seed, settings=settings, calibration=calibration, calibration_mode=calibration_mode
    )
    output = simulate_tables(configured)
    return Results(runs=output.runs, summary=output.summary, trajectories=output.trajectories, verdict=output.verdict, notes=output.notes)


def whatif(
    scenario: Scenario | str | Path = "checkfree-500m-geo-10pct",
    *,
    failure_rates: Sequence[float] | None = None,
    methods: Sequence[str] | None = None,
    replications: int = 10,
    interval_study: bool = True,
    workers: int = 1,
    settings: Mapping[str, object] | None = None,
    calibration: Calibration | str | Path | None = None,
    calibration_mode: str = "full",
) -> Results:
    """`churnsim whatif`: failure rates × methods, with the checkpoint-interval study.

    `failure_rates` are per-stage hourly probabilities that replace the scenario's churn; without
    them a scenario with another churn model is asked under its own churn at a few multiples of its
    rate (`churnsim.sim.whatif.whatif_plan`). `workers=1` runs in this process; more use a local
    process pool (same numbers, faster). `settings` and `calibration` as in `simulate`.
    """
    from churnsim.sim.whatif import compute_whatif, whatif_plan

    if replications < 2:
        raise InputError(f"replications = {replications}: confidence intervals need at least 2")
    base = _configured(scenario, methods=methods, settings=settings, calibration=calibration, calibration_mode=calibration_mode)
    chosen = base.methods if methods is not None else ()
    plan = whatif_plan(base, failure_rates=failure_rates, methods=chosen, replications=replications, interval_study=interval_study)
    result = compute_whatif(plan, workers=workers)
    return Results(
        runs=result.sweep.runs,
        summary=result.sweep.summary,
        trajectories=result.sweep.trajectories,
        verdict=result.verdict,
        notes=result.notes,
        intervals=result.intervals,
    )


def sweep(
    scenario: Scenario | str | Path,
    grid: Mapping[str, Sequence[object]],
    *,
    methods: Sequence[str] | None = None,
    replications: int | None = None,
    seed: int | None = None,
    workers: int = 1,
    calibration: Calibration | str | Path | None = None,
    calibration_mode: str = "full",
) -> Results:
    """`churnsim sweep`: the Cartesian product of `grid` ({dotted field path: values}); the tables get
    one column per swept field, and the verdict one point per grid point and failure rate. Each point
    is made as the command line makes it (a calibrated preset calibrated for its setup); `calibration`
    as in `simulate`."""
    from churnsim.sim.sweep import build_tasks, grid_points, run_sweep, sweep_verdict

    def configured(settings: Mapping[str, object] | None) -> Scenario:
        return _configured(
            scenario, methods=methods, replications=replications, seed=seed, settings=settings, calibration=calibration,
            calibration_mode=calibration_mode,
        )

    base = configured(None)
    settings_grid = [(path, tuple(values)) for path, values in grid.items()]
    points = [configured(point) for point in grid_points(settings_grid)]
    tasks = build_tasks(base, settings_grid, points=points)
    result = run_sweep(tasks, workers=workers)
    verdict = sweep_verdict(result, base, tasks=tasks, workers=workers)
    return Results(runs=result.runs, summary=result.summary, trajectories=result.trajectories, verdict=verdict, notes=verdict.caveats)


def recommend(
    scenario: Scenario | str | Path,
    *,
    replications: int | None = None,
    workers: int = 1,
    settings: Mapping[str, object] | None = None,
    calibration: Calibration | str | Path | None = None,
    calibration_mode: str = "full",
):
    """`churnsim recommend`: the best method with its knobs, its time to target and how robust the
    choice is (`churnsim.sim.recommend.Recommendation`; `.to_json()` for plain data). `settings` and
    `calibration` as in `simulate`."""
    from churnsim.sim.recommend import recommend as recommend_scenario

    configured = _configured(scenario, settings=settings, calibration=calibration, calibration_mode=calibration_mode)
    return recommend_scenario(configured, replications=replications, workers=workers)


__all__ = ["Results", "calibration_of", "recommend", "scenario_of", "simulate", "sweep", "whatif"]
