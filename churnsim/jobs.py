"""The command line's jobs as library functions: the commands parse their options, call one of these
and print what it returns.

Each job builds its scenario as the Python API does (`ScenarioChoice.build`, which is
`presets.build_scenario`), runs every check that needs no work before any (`check_up_front`),
prepares the out directory, then runs the study, reporting progress through `progress` (a context
manager factory: `progress(total, description)` yields the function to call per finished task).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

from churnsim.calibration.calibration_file import Calibration
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import build_scenario
from churnsim.calibration.scenario import Scenario

Progress = Callable[[int, str], ContextManager[Callable[[], None]]]


@contextlib.contextmanager
def no_progress(total: int, description: str) -> Iterator[Callable[[], None]]:
    """A `Progress` that shows nothing."""
    yield lambda: None


@dataclass(frozen=True)
class ScenarioChoice:
    """The scenario a command was asked to run, before it is built: `source` (a `Scenario`, a scenario
    file as a `Path`, or a preset's name) and what changes it (`presets.build_scenario`)."""

    source: Scenario | Path | str
    methods: Sequence[str] = ()
    settings: Mapping[str, object] = field(default_factory=dict)
    calibration: Calibration | None = None
    calibration_mode: str = "full"
    replications: int | None = None
    seed: int | None = None
    described_as: str = "the scenario"
    """How messages name it (its file, or the preset)."""

    def build(self, *, settings: Mapping[str, object] | None = None, methods: Sequence[str] | None = None) -> Scenario:
        """The scenario, with `settings` or `methods` in place of the choice's own where given."""
        return build_scenario(
            self.source,
            methods=self.methods if methods is None else methods,
            settings=self.settings if settings is None else settings,
            calibration=self.calibration,
            calibration_mode=self.calibration_mode,  # type: ignore[arg-type]
            replications=self.replications,
            seed=self.seed,
        )


def check_up_front(scenarios: Sequence[Scenario], *, source: str, workers: Optional[int] = None, parquet: bool = False) -> None:
    """Every check that needs no work, before any progress line: sizes, trace files, --workers, a
    Parquet engine for --parquet, and the pipeline each scenario makes (times and links the simulator
    can run)."""
    from churnsim.calibration.input_limits import check_scenario_size, check_workers
    from churnsim.calibration.tables import check_parquet_writer
    from churnsim.sim.model.pipeline_state import build_pipeline_state

    check_workers(workers)
    check_parquet_writer(parquet)
    distinct = list({id(scenario): scenario for scenario in scenarios}.values())
    for scenario in distinct:
        where = source if len(distinct) == 1 else f"{source}, grid point {scenario.name!r}"
        check_scenario_size(scenario, source=where)
        try:
            build_pipeline_state(scenario)
        except InputError as error:
            raise InputError(f"{where}: {error}") from None


def simulate_job(choice: ScenarioChoice, *, out: Path, overwrite: bool = False, parquet: bool = False, progress: Progress = no_progress):
    """`churnsim simulate`: every method of one scenario over its replications, written to `out`
    (`sim.studies.simulate.SimulationOutput`)."""
    from churnsim.out_directory import prepare_out_directory
    from churnsim.sim.studies.simulate import simulate_scenario

    scenario = choice.build()
    check_up_front([scenario], source=choice.described_as, parquet=parquet)
    prepare_out_directory(out, command="simulate", subject=scenario.name, overwrite=overwrite)
    with progress(scenario.replications, f"simulating {scenario.name}") as advance:
        return simulate_scenario(scenario, out_directory=out, parquet=parquet, on_replication_done=advance)


def whatif_job(
    choice: ScenarioChoice,
    *,
    failure_rates: Sequence[float] | None = None,
    replications: int | None = None,
    quick: bool = False,
    out: Path,
    overwrite: bool = False,
    workers: int | None = None,
    scheduler: str | None = None,
    parquet: bool = False,
    setback_sensitivity: bool = False,
    max_work_hours: float | None = None,
    progress: Progress = no_progress,
    console: Any = None,
):
    """`churnsim whatif`: the choice's methods at each failure rate, with the interval study, written
    to `out` (`sim.studies.whatif.WhatIfResult`). The scenario keeps its other methods' configurations
    (the interval study varies the scenario's own checkpointing methods); `choice.methods` only picks
    the compared ones. With `setback_sensitivity`, the study of `sensitivity_report` as well, its
    summary printed on `console` (stderr by default)."""
    from churnsim.out_directory import prepare_out_directory
    from churnsim.sim.studies.sweep import connect_scheduler
    from churnsim.sim.studies.whatif import interval_tasks, plan_at_rate, rate_tasks, run_whatif, whatif_plan
    from churnsim.work_bounds import check_whatif_work

    scenario = choice.build(methods=())
    chosen = scenario.with_methods(choice.methods).methods if choice.methods else ()
    plan = whatif_plan(scenario, failure_rates=failure_rates, methods=chosen, replications=replications, quick=quick)
    # Checked per rate before the tasks exist: a huge replication count must not be built first.
    check_whatif_work(plan, max_work=max_work_hours)
    rate_scenarios = [plan_at_rate(plan, rate) for rate in plan.failure_rates]
    check_up_front(rate_scenarios, source=choice.described_as, workers=workers, parquet=parquet)
    if setback_sensitivity:
        from churnsim.sensitivity_report import check_setback_sensitivity

        check_setback_sensitivity(plan)
    tasks = rate_tasks(plan) + interval_tasks(plan)
    prepare_out_directory(out, command="whatif", subject=scenario.name, overwrite=overwrite)
    client = connect_scheduler(scheduler) if scheduler is not None else None
    try:
        with progress(len(tasks), f"what-if on {scenario.name}") as advance:
            result = run_whatif(plan, out, workers=workers, client=client, parquet=parquet, on_task_done=advance)
        if setback_sensitivity:
            from churnsim.console import stderr_console
            from churnsim.sensitivity_report import run_setback_sensitivity

            run_setback_sensitivity(plan, out, workers=workers, client=client, parquet=parquet, console=console or stderr_console(), progress=progress)
    finally:
        if client is not None:
            client.close()
    return result


def sweep_job(
    choice: ScenarioChoice,
    grid: Sequence[tuple[str, tuple]],
    *,
    out: Path,
    overwrite: bool = False,
    workers: int | None = None,
    scheduler: str | None = None,
    parquet: bool = False,
    max_work_hours: float | None = None,
    progress: Progress = no_progress,
):
    """`churnsim sweep`: the choice at every point of `grid` ((dotted field path, values) pairs), its
    tables written to `out`; returns the verdict (`sim.studies.verdict.Verdict`)."""
    from churnsim.out_directory import prepare_out_directory
    from churnsim.sim.studies.sweep import build_tasks, connect_scheduler, grid_points, run_sweep, sweep_verdict, write_sweep
    from churnsim.work_bounds import check_sweep_work

    # Every grid point is made from the source as named, then calibrated once (a calibration applied
    # twice would count its measured write latency twice).
    scenario = choice.build()
    check_sweep_work(scenario, grid, max_work=max_work_hours)  # before a huge grid's points are built
    points = [choice.build(settings=point) for point in grid_points(grid)]
    check_up_front(points, source=choice.described_as, workers=workers, parquet=parquet)
    tasks = build_tasks(scenario, grid, points=points)
    prepare_out_directory(out, command="sweep", subject=scenario.name, overwrite=overwrite)
    client = connect_scheduler(scheduler) if scheduler is not None else None
    try:
        with progress(len(tasks), f"sweeping {scenario.name}") as advance:
            result = run_sweep(tasks, workers=workers, client=client, on_task_done=advance)
        verdict = sweep_verdict(result, scenario, tasks=tasks, workers=workers, client=client)
    finally:
        if client is not None:
            client.close()
    write_sweep(result, out, scenario=scenario, grid=grid, parquet=parquet, verdict=verdict)
    return verdict


def recommend_job(
    choice: ScenarioChoice,
    *,
    replications: int | None = None,
    workers: int | None = None,
    max_work_hours: float | None = None,
    on_start: Callable[[Scenario], None] = lambda scenario: None,
    on_pass_done: Callable[[str], None] = lambda name: None,
):
    """`churnsim recommend`: the best method and its knobs (`sim.studies.recommend.Recommendation`);
    `on_start` is called with the scenario once it is checked, `on_pass_done` after each pass."""
    from churnsim.sim.studies.recommend import recommend
    from churnsim.work_bounds import check_recommend_work

    scenario = choice.build()
    checked = scenario.with_run_settings(replications=replications)
    check_recommend_work(checked, max_work=max_work_hours)
    check_up_front([checked], source=choice.described_as, workers=workers)
    on_start(scenario)
    return recommend(scenario, replications=replications, workers=workers, on_pass_done=on_pass_done)
