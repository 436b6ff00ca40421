"""Sweeps: a grid over scenario fields, run in local processes or on a Dask cluster.

A grid is a list of `field.path=value1,value2,...` settings; their Cartesian product gives one
scenario per point. The unit of work is one replication of one point (every method on the same
failure path), so results do not depend on where or in which order the work runs: a Dask cluster
returns exactly the numbers of the local pool for the same seeds.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.scenario_overrides import GridSetting, apply_settings, repeated_value
from churnsim.calibration.tables import write_table

from .outputs import scenario_notes, write_manifest

from .replicate import ReplicationTask, replication_tasks, run_replication, runs_table, summary_table, trajectories_table
from .verdict import Verdict, tuned_intervals_table, verdict_from_summary

def grid_points(grid: Sequence[GridSetting]) -> list[dict[str, Any]]:
    if not grid:
        return [{}]
    paths = [path for path, _ in grid]
    if len(set(paths)) != len(paths):
        raise InputError(f"--set names a field twice: {paths}; give all its values in one --set")
    for path, values in grid:
        repeated = repeated_value(values)
        if repeated is not None:
            raise InputError(f"--set {path}: the value {repeated!r} is given twice; give each value once")
    return [dict(zip(paths, combination)) for combination in itertools.product(*(values for _, values in grid))]


@dataclass(frozen=True, kw_only=True)
class SweepTask:
    task: ReplicationTask
    settings: dict[str, Any]
    keep_trajectories: bool


def run_sweep_task(sweep_task: SweepTask) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Runs table (plus one column per swept field) and, for replication 0, trajectories."""
    scenario = sweep_task.task.scenario
    results = run_replication(sweep_task.task)
    runs = runs_table(scenario, results)
    trajectories = trajectories_table(scenario, results) if sweep_task.keep_trajectories else pd.DataFrame()
    for path, value in sweep_task.settings.items():
        # A list or mapping (`pipeline.layers_per_stage=[3,3,3,3]`) is one cell, as its JSON text.
        cell = json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else value
        runs[path] = cell
        if not trajectories.empty:
            trajectories[path] = cell
    return runs, trajectories


@dataclass(frozen=True)
class SweepResult:
    runs: pd.DataFrame
    summary: pd.DataFrame
    trajectories: pd.DataFrame
    grid_columns: tuple[str, ...] = ()
    """The swept fields (dotted paths): one column each in runs, summary and trajectories, after `scenario`."""
    notes: tuple[str, ...] | None = None
    """Caveats of the grid's points (`point_notes`); None: the base scenario's."""


def swept_fields(tasks: Sequence[SweepTask]) -> tuple[str, ...]:
    """Every field any task sets, in the order the grid names them."""
    return tuple(dict.fromkeys(path for task in tasks for path in task.settings))


def point_notes(tasks: Sequence[SweepTask]) -> tuple[str, ...]:
    """Caveats of every point of a grid: one every point carries, once; one only some carry, once
    per point, after the point's settings (a curve carried to another batch or model size, compute
    carried to another setup)."""
    notes_of_points: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {}
    for sweep_task in tasks:
        key = repr(sorted(sweep_task.settings.items()))
        if key not in notes_of_points:
            notes_of_points[key] = (sweep_task.settings, scenario_notes(sweep_task.task.scenario))
    if not notes_of_points:
        return ()
    everywhere = set.intersection(*(set(notes) for _, notes in notes_of_points.values()))
    common = [note for note in dict.fromkeys(note for _, notes in notes_of_points.values() for note in notes) if note in everywhere]
    specific = [
        f"{', '.join(f'{path} = {value}' for path, value in settings.items())}: {note}"
        for settings, notes in notes_of_points.values()
        for note in notes
        if note not in everywhere
    ]
    return tuple(common + specific)


def _grid_first(frame: pd.DataFrame, grid_columns: Sequence[str]) -> pd.DataFrame:
    """`frame` with the grid columns moved right after `scenario`, where a reader looks for them."""
    if frame.empty or "scenario" not in frame:
        return frame
    present = [column for column in grid_columns if column in frame]
    rest = [column for column in frame.columns if column not in present]
    position = rest.index("scenario") + 1
    return frame[rest[:position] + present + rest[position:]]


def _ignore_interrupts() -> None:
    # Ctrl-C reaches every process of the terminal's group: the workers leave it to the parent,
    # which stops the sweep and reports one line, instead of each printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_tasks(
    scenario: Scenario,
    grid: Sequence[GridSetting],
    methods: Sequence[MethodConfig] | None = None,
    *,
    points: Sequence[Scenario] | None = None,
) -> list[SweepTask]:
    """One task per grid point and replication; a point is `scenario` with the point's settings, or
    the given `points`, one per `grid_points(grid)` in its order (a calibrated preset calibrated for
    each point's setup: `presets.preset`)."""
    tasks = []
    settings_of_points = grid_points(grid)
    if points is None:
        points = [apply_settings(scenario, settings) for settings in settings_of_points]
    elif len(points) != len(settings_of_points):
        raise ValueError(f"{len(points)} points given for a grid of {len(settings_of_points)}")
    for settings, point in zip(settings_of_points, points):
        for task in replication_tasks(point, methods):
            tasks.append(SweepTask(task=task, settings=settings, keep_trajectories=task.replication == 0))
    return tasks


def connect_scheduler(scheduler_address: str):
    """A Dask client for `scheduler_address`, or one clear InputError."""
    try:
        from distributed import Client
    except ImportError:
        raise InputError("--scheduler needs Dask: pip install 'churnsim[dask]'") from None
    try:
        return Client(scheduler_address, timeout="5s")
    except (OSError, ValueError, TimeoutError) as error:
        raise InputError(
            f"--scheduler {scheduler_address!r}: cannot reach a Dask scheduler ({error.__class__.__name__}); "
            "check the address, e.g. tcp://host:8786"
        ) from None


def run_sweep(
    tasks: Sequence[SweepTask],
    *,
    workers: int | None = None,
    scheduler_address: str | None = None,
    client: Any = None,
    on_task_done: Callable[[], None] | None = None,
) -> SweepResult:
    """Run every task locally (a process pool), on a Dask cluster (address or client), or inline (workers=1)."""
    if not tasks:
        raise InputError("the sweep has no work: check the grid and --replications")
    outcomes: list[tuple[pd.DataFrame, pd.DataFrame]] = []
    if client is not None or scheduler_address is not None:
        own_client = client is None
        client = client if client is not None else connect_scheduler(scheduler_address)  # type: ignore[arg-type]
        try:
            from distributed import as_completed

            futures = client.map(run_sweep_task, list(tasks), pure=False)
            index_of = {future.key: index for index, future in enumerate(futures)}
            results: list[Any] = [None] * len(futures)
            try:
                for future in as_completed(futures):
                    results[index_of[future.key]] = future.result()
                    if on_task_done:
                        on_task_done()
            except BaseException:
                client.cancel(futures)  # interrupted or failed: the cluster drops the rest of this sweep
                raise
            outcomes = results
        finally:
            if own_client:
                client.close()
    else:
        num_workers = workers if workers is not None else min(len(tasks), os.cpu_count() or 1)
        if num_workers < 1:
            raise InputError(f"--workers {num_workers}: must be >= 1")
        if num_workers == 1:
            for task in tasks:
                outcomes.append(run_sweep_task(task))
                if on_task_done:
                    on_task_done()
        else:
            pool = ProcessPoolExecutor(max_workers=num_workers, initializer=_ignore_interrupts)
            try:
                for outcome in pool.map(run_sweep_task, tasks, chunksize=1):
                    outcomes.append(outcome)
                    if on_task_done:
                        on_task_done()
            except BaseException:
                # Interrupted or failed: drop the queued replications and end the workers now.
                from .worker_pool import stop_worker_pool

                stop_worker_pool(pool)
                raise
            pool.shutdown()
    grid_columns = swept_fields(tasks)
    runs = _grid_first(pd.concat([runs for runs, _ in outcomes], ignore_index=True), grid_columns)
    trajectory_frames = [frame for _, frame in outcomes if not frame.empty]
    trajectories = _grid_first(pd.concat(trajectory_frames, ignore_index=True), grid_columns) if trajectory_frames else pd.DataFrame()
    return SweepResult(
        runs=runs, summary=summary_table(runs, grid_columns), trajectories=trajectories, grid_columns=grid_columns, notes=point_notes(tasks)
    )


def sweep_verdict(
    result: SweepResult, scenario: Scenario, *, tasks: Sequence[SweepTask] | None = None, workers: int | None = None, client: Any = None
) -> Verdict:
    """The answer at every grid point and failure rate of a sweep of `scenario`. With the sweep's
    `tasks`, each checkpoint interval is also tuned at every point, and where that is clearly better
    the point is answered again with it (sim/studies/untuned_intervals.py: a few more, small sweeps)."""
    notes = scenario_notes(scenario) if result.notes is None else result.notes
    verdict = verdict_from_summary(result.summary, grid_columns=result.grid_columns, notes=notes, runs=result.runs)
    if tasks is None:
        return verdict
    from .untuned_intervals import points_of_tasks, rerun_untuned_intervals  # they run their sweep with run_sweep here

    return rerun_untuned_intervals(
        verdict, points_of_tasks(tasks), result.runs, swept_fields=swept_fields(tasks), workers=workers, client=client
    )


def write_sweep(
    result: SweepResult,
    out_directory: str | Path,
    *,
    scenario: Scenario,
    grid: Sequence[GridSetting],
    parquet: bool = False,
    verdict: Verdict | None = None,
) -> list[Path]:
    """runs, summary and trajectories tables and a manifest (the base scenario, the grid and the
    answer: `verdict`, or `sweep_verdict` without tuned intervals) in `out_directory`."""
    out_directory = Path(out_directory)
    files: list[Path] = []
    for name, frame in (("runs", result.runs), ("summary", result.summary), ("trajectories", result.trajectories)):
        files += write_table(frame, out_directory / f"{name}.csv", parquet=parquet)
    verdict = verdict if verdict is not None else sweep_verdict(result, scenario)
    files += write_table(tuned_intervals_table(verdict), out_directory / "tuned_intervals.csv", parquet=parquet)
    files.append(
        write_manifest(
            out_directory,
            command="sweep",
            scenario=scenario,
            grid={path: list(values) for path, values in grid},
            notes=list(verdict.caveats),
            verdict=verdict.to_json(),
        )
    )
    return files
