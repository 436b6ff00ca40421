"""Commands that need only the simulator and the contract: presets, simulate, whatif, sweep, plot, validate."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import typer

from churnsim.app import app

if TYPE_CHECKING:
    from rich.console import Console


@functools.cache
def stderr_console() -> Console:
    """The console for progress, notes and messages on stderr, made on first use: importing rich
    takes ~50 ms that `--help` must not pay."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr; yields the function that advances it by one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=stderr_console(), transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def finish(out: Path, notes, *, draw_figures: bool, wrote: Path | None = None) -> None:
    """The end of every command that writes results: figures, the caveats, where it all went."""
    console = stderr_console()
    if draw_figures:
        from churnsim.figures.make_all import make_all_figures

        drawn = make_all_figures(out)
        console.print(f"drew {len(drawn)} figure(s) in {out / 'figures'}")
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"wrote {wrote or out}")


@app.command("presets")
def presets_command(
    show: Optional[str] = typer.Option(None, "--show", help="Print one preset as a scenario JSON file (edit it, then `churnsim simulate FILE`)."),
) -> None:
    """List the built-in scenarios, or print one as JSON."""
    from rich.console import Console
    from rich.table import Table

    from churnsim.calibration.presets import PRESETS, preset

    if show is not None:
        typer.echo(preset(show).model_dump_json(indent=2))
        return
    table = Table("preset", "model", "stages", "churn", "target", title="built-in scenarios")
    for name in sorted(PRESETS):
        scenario = PRESETS[name]()
        target = f"loss {scenario.target.loss}" if scenario.target.loss is not None else f"{scenario.target.iterations} iterations"
        table.add_row(name, scenario.model.name, str(scenario.pipeline.num_stages), scenario.churn.kind, target)
    Console(width=max(Console().width, 100)).print(table)


def load_scenario_argument(scenario_path: Optional[Path], preset_name: Optional[str]):
    """The scenario named on the command line: a file or a preset, exactly one."""
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.presets import preset
    from churnsim.calibration.scenario import load_scenario

    if (scenario_path is None) == (preset_name is None):
        raise InputError("give a scenario file or --preset NAME (exactly one); `churnsim presets` lists the presets")
    return load_scenario(str(scenario_path)) if scenario_path is not None else preset(preset_name)


def with_settings(
    base,
    preset_name: Optional[str],
    settings: dict,
    *,
    methods: Sequence[str] = (),
    overrides: Callable = lambda scenario: scenario,
    calibration=None,
    calibration_mode: str = "full",
):
    """`base` (the named scenario, already narrowed to `methods` and with `overrides` applied) with
    the --set settings and on the --calibration's machine (`presets.configured_scenario`);
    `overrides` again after a calibrated preset was built anew."""
    from churnsim.calibration.presets import configured_scenario

    if not settings and calibration is None:
        return base
    configured = configured_scenario(
        base, preset_name, settings, methods=methods, calibration=calibration, calibration_mode=calibration_mode  # type: ignore[arg-type]
    )
    return overrides(configured)


CALIBRATION_HELP = "Run on a calibrated machine: a file from `churnsim calibrate`, or a built-in calibration's name (cpu-tiny)."
CALIBRATION_MODE_HELP = (
    "With --calibration: full (every measured quantity replaces the scenario's: compute, link, storage, recovery, "
    "convergence) or setbacks (only the measured convergence setbacks)."
)


def resolve_calibration_option(text: Optional[str], mode: str):
    """The --calibration named (None without one), its --calibration-mode checked."""
    from churnsim.calibration.errors import InputError

    if mode not in ("full", "setbacks"):
        raise InputError(f"--calibration-mode {mode!r}: use full or setbacks")
    if text is None:
        return None
    from churnsim.calibration.builtin import resolve_calibration

    return resolve_calibration(text)


def scenario_source(scenario_path: Optional[Path], preset_name: Optional[str]) -> str:
    """How messages name the scenario: its file, or the preset."""
    return str(scenario_path) if scenario_path is not None else f"preset {preset_name}"


def check_up_front(scenarios, *, source: str, workers: Optional[int] = None, parquet: bool = False) -> None:
    """Every check that needs no work, before any progress line: sizes, trace files, --workers, a
    Parquet engine for --parquet, and the pipeline each scenario makes (times and links the simulator
    can run)."""
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.input_limits import check_scenario_size, check_workers
    from churnsim.calibration.tables import check_parquet_writer
    from churnsim.sim.pipeline_state import build_pipeline_state

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


def override_run_settings(scenario, *, methods: Optional[list[str]], replications: Optional[int], seed: Optional[int]):
    """Apply --method/--replications/--seed to a scenario (re-validated), each flag checked first."""
    from churnsim.calibration.errors import InputError

    if replications is not None and replications < 1:
        raise InputError(f"--replications {replications}: must be >= 1")
    if seed is not None and seed < 0:
        raise InputError(f"--seed {seed}: must be >= 0")
    narrowed = scenario.with_methods(methods) if methods else scenario
    return narrowed.with_run_settings(replications=replications, seed=seed)


OVERWRITE_HELP = "Write into --out even though it holds another run's results or other files (churnsim's own old results there are replaced)."
JSON_HELP = "Print the answer as strict JSON on stdout (tables go to stderr), for scripts."
SET_HELP = "FIELD=VALUE override of a scenario field (dotted path, as in `sweep`); repeatable."


@app.command("simulate")
def simulate_command(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="[SCENARIO]", help="Scenario JSON file."),
    preset_name: Optional[str] = typer.Option(None, "--preset", help="A built-in scenario (see `churnsim presets`)."),
    methods: Optional[list[str]] = typer.Option(None, "--method", help="Method to simulate; repeat for several (default: the scenario's)."),
    replications: Optional[int] = typer.Option(None, "--replications", help="Replications (common random numbers across methods)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Base seed of the failure paths."),
    settings: list[str] = typer.Option([], "--set", help=SET_HELP),
    calibration_argument: Optional[str] = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    calibration_mode: str = typer.Option("full", "--calibration-mode", help=CALIBRATION_MODE_HELP),
    out: Path = typer.Option(..., "--out", help="Directory for run records, tables and timelines."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    parquet: bool = typer.Option(False, "--parquet", help="Also write tables as Parquet (needs pyarrow)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Simulate one scenario: a summary table with one row per method, run records, a timeline."""
    from churnsim.calibration.scenario_overrides import parse_settings
    from churnsim.out_directory import prepare_out_directory
    from churnsim.report import show_verdict
    from churnsim.sim.simulate import simulate_scenario

    def overrides(scenario):
        return override_run_settings(scenario, methods=methods, replications=replications, seed=seed)

    calibration = resolve_calibration_option(calibration_argument, calibration_mode)
    scenario = with_settings(
        overrides(load_scenario_argument(scenario_path, preset_name)), preset_name, parse_settings(settings), methods=methods or (),
        overrides=overrides, calibration=calibration, calibration_mode=calibration_mode,
    )
    check_up_front([scenario], source=scenario_source(scenario_path, preset_name), parquet=parquet)
    prepare_out_directory(out, command="simulate", subject=scenario.name, overwrite=overwrite)
    with progress_bar(scenario.replications, f"simulating {scenario.name}") as advance:
        output = simulate_scenario(scenario, out_directory=out, parquet=parquet, on_replication_done=advance)
    show_verdict(output.verdict, as_json=as_json, extra={"command": "simulate", "out": str(out)})
    finish(out, output.notes if as_json else (), draw_figures=False)


@app.command("whatif")
def whatif_command(
    preset_name: str = typer.Option("checkfree-500m-geo-10pct", "--preset", help="Scenario to sweep (see `churnsim presets`)."),
    scenario_path: Optional[Path] = typer.Option(None, "--scenario", help="A scenario file instead of a preset."),
    rates: Optional[str] = typer.Option(
        None, "--rates",
        help="Failure probabilities per stage-hour, comma-separated (default 0,0.05,0.1,0.16,0.33); they replace the scenario's churn. "
        "Without it, a scenario with another churn model (Poisson, Weibull, bursts, a trace) is asked under its own churn at 0.5, 1, 2 and 4 times its rate (1 and 4 with --quick), and without failures where its rate is a count per hour (Poisson, bursts).",
    ),
    methods: Optional[list[str]] = typer.Option(None, "--method", help="Method to include; repeat for several (default: all)."),
    settings: list[str] = typer.Option([], "--set", help=SET_HELP),
    calibration_argument: Optional[str] = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    calibration_mode: str = typer.Option("full", "--calibration-mode", help=CALIBRATION_MODE_HELP),
    replications: Optional[int] = typer.Option(
        None, "--replications", help="Replications per failure rate (default 10, 3 with --quick; common random numbers across methods)."
    ),
    quick: bool = typer.Option(False, "--quick", help="A fast smoke run: 3 replications, 3 rates, a short interval study (--replications and --rates still win)."),
    out: Path = typer.Option(Path("churnsim-out"), "--out", help="Directory for tables and figures."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: one per core)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address, e.g. tcp://host:8786."),
    parquet: bool = typer.Option(False, "--parquet", help="Also write tables as Parquet (needs pyarrow)."),
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Draw the figures."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    setback_sensitivity: bool = typer.Option(
        False, "--setback-sensitivity", help="Also rerun it with every convergence setback scaled ×0.5, 1, 2, 3, 5: setback_sensitivity.csv, where the winner changes."
    ),
) -> None:
    """The main job: which method reaches the target loss first, at each failure rate, and by how much."""
    from churnsim.sim.whatif import run_whatif, whatif_plan

    from churnsim.calibration.scenario_overrides import parse_settings

    named_preset = None if scenario_path else preset_name
    calibration = resolve_calibration_option(calibration_argument, calibration_mode)
    scenario = with_settings(
        load_scenario_argument(scenario_path, named_preset), named_preset, parse_settings(settings), methods=methods or (),
        calibration=calibration, calibration_mode=calibration_mode,
    )
    failure_rates = parse_float_list(rates, "--rates") if rates is not None else None
    chosen = override_run_settings(scenario, methods=methods, replications=None, seed=None).methods if methods else ()
    if replications is not None and replications < 2:
        from churnsim.calibration.errors import InputError

        raise InputError(f"--replications {replications}: confidence intervals need at least 2")
    plan = whatif_plan(scenario, failure_rates=failure_rates, methods=chosen, replications=replications, quick=quick)
    from churnsim.out_directory import prepare_out_directory
    from churnsim.report import show_verdict
    from churnsim.sim.sweep import connect_scheduler
    from churnsim.sim.whatif import interval_tasks, plan_at_rate, rate_tasks

    # Checked per rate before the tasks exist: a huge replication count must not be built first.
    rate_scenarios = [plan_at_rate(plan, rate) for rate in plan.failure_rates]
    check_up_front(rate_scenarios, source=scenario_source(scenario_path, named_preset), workers=workers, parquet=parquet)
    if setback_sensitivity:
        from churnsim.sensitivity_report import check_setback_sensitivity

        check_setback_sensitivity(plan)
    tasks = rate_tasks(plan) + interval_tasks(plan)
    prepare_out_directory(out, command="whatif", subject=scenario.name, overwrite=overwrite)
    total = len(tasks)
    client = connect_scheduler(scheduler) if scheduler is not None else None
    try:
        with progress_bar(total, f"what-if on {scenario.name}") as advance:
            result = run_whatif(plan, out, workers=workers, client=client, parquet=parquet, on_task_done=advance)
        if setback_sensitivity:
            from churnsim.sensitivity_report import run_setback_sensitivity

            run_setback_sensitivity(plan, out, workers=workers, client=client, parquet=parquet, console=stderr_console())
    finally:
        if client is not None:
            client.close()
    show_verdict(result.verdict, as_json=as_json, extra={"command": "whatif", "out": str(out)})
    finish(out, result.notes if as_json else (), draw_figures=figures)


@app.command("recommend")
def recommend_command(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="[SCENARIO]", help="Scenario JSON file."),
    preset_name: Optional[str] = typer.Option(None, "--preset", help="A built-in scenario (see `churnsim presets`)."),
    settings: list[str] = typer.Option([], "--set", help=SET_HELP),
    calibration_argument: Optional[str] = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    calibration_mode: str = typer.Option("full", "--calibration-mode", help=CALIBRATION_MODE_HELP),
    replications: Optional[int] = typer.Option(None, "--replications", help="Replications per variant (default: the scenario's)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: one per core)."),
    as_json: bool = typer.Option(False, "--json", help="Print the recommendation as strict JSON on stdout, for scripts."),
) -> None:
    """What to use: the best method and its knobs (checkpoint interval against Young/Daly, CheckFree's
    edge fallback), its time to target, and whether the winner changes with the setbacks or the failure rate."""
    from churnsim.calibration.scenario_overrides import parse_settings
    from churnsim.recommend_report import show_recommendation
    from churnsim.sim.recommend import recommend

    calibration = resolve_calibration_option(calibration_argument, calibration_mode)
    scenario = with_settings(
        load_scenario_argument(scenario_path, preset_name), preset_name, parse_settings(settings), calibration=calibration, calibration_mode=calibration_mode
    )
    if replications is not None and replications < 1:
        from churnsim.calibration.errors import InputError

        raise InputError(f"--replications {replications}: must be >= 1")
    checked = override_run_settings(scenario, methods=None, replications=replications, seed=None)
    check_up_front([checked], source=scenario_source(scenario_path, preset_name), workers=workers)
    console = stderr_console()
    console.print(f"recommending for {scenario.name} (methods, interval grids, then robustness cases)")
    result = recommend(scenario, replications=replications, workers=workers, on_pass_done=lambda name: console.print(f"  done: {name}"))
    show_recommendation(result, as_json=as_json)


def parse_float_list(text: str, flag: str) -> tuple[float, ...]:
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.scenario_overrides import comma_separated

    parts = comma_separated(text, f"{flag} {text!r}", empty="give at least one value")
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0,0.05,0.1") from None
    if any(not 0.0 <= value < 1.0 for value in values):
        raise InputError(f"{flag} {text!r}: failure probabilities per stage-hour must be in [0, 1), e.g. 0.1 for 10 %/h")
    return values


@app.command("sweep")
def sweep_command(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="[SCENARIO]", help="Scenario JSON file."),
    preset_name: Optional[str] = typer.Option(None, "--preset", help="A built-in scenario."),
    settings: list[str] = typer.Option(..., "--set", help="FIELD=V1,V2,... over a scenario field (dotted path); repeat for a grid."),
    methods: Optional[list[str]] = typer.Option(None, "--method", help="Method to include; repeat for several."),
    calibration_argument: Optional[str] = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    calibration_mode: str = typer.Option("full", "--calibration-mode", help=CALIBRATION_MODE_HELP),
    replications: Optional[int] = typer.Option(None, "--replications"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    out: Path = typer.Option(..., "--out", help="Directory for runs.csv, summary.csv and trajectories.csv."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: one per core)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address, e.g. tcp://host:8786."),
    parquet: bool = typer.Option(False, "--parquet"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """A grid over scenario fields, in local processes or on a Dask cluster."""
    from churnsim.calibration.scenario_overrides import parse_grid_setting
    from churnsim.out_directory import prepare_out_directory
    from churnsim.report import show_verdict
    from churnsim.sim.sweep import build_tasks, connect_scheduler, run_sweep, sweep_verdict, write_sweep

    def overrides(scenario):
        return override_run_settings(scenario, methods=methods, replications=replications, seed=seed)

    calibration = resolve_calibration_option(calibration_argument, calibration_mode)
    base = overrides(load_scenario_argument(scenario_path, preset_name))
    # Every grid point is made from the base as loaded, then calibrated once (a calibration applied
    # twice would count its measured write latency twice).
    configure = dict(methods=methods or (), overrides=overrides, calibration=calibration, calibration_mode=calibration_mode)
    scenario = with_settings(base, preset_name, {}, **configure)
    grid = [parse_grid_setting(text) for text in settings]
    from churnsim.sim.sweep import grid_points

    points = [with_settings(base, preset_name, point, **configure) for point in grid_points(grid)]
    check_up_front(points, source=scenario_source(scenario_path, preset_name), workers=workers, parquet=parquet)
    tasks = build_tasks(scenario, grid, points=points)
    prepare_out_directory(out, command="sweep", subject=scenario.name, overwrite=overwrite)
    client = connect_scheduler(scheduler) if scheduler is not None else None
    try:
        with progress_bar(len(tasks), f"sweeping {scenario.name}") as advance:
            result = run_sweep(tasks, workers=workers, client=client, on_task_done=advance)
        verdict = sweep_verdict(result, scenario, tasks=tasks, workers=workers, client=client)
    finally:
        if client is not None:
            client.close()
    write_sweep(result, out, scenario=scenario, grid=grid, parquet=parquet, verdict=verdict)
    show_verdict(verdict, as_json=as_json, extra={"command": "sweep", "out": str(out)})
    finish(out, verdict.caveats if as_json else (), draw_figures=False)


@app.command("plot")
def plot_command(
    results: Path = typer.Argument(..., help="A directory written by whatif, simulate, sweep or validate."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to put the PNGs (default RESULTS/figures)."),
) -> None:
    """Remake every figure from saved results."""
    from rich.console import Console

    from churnsim.calibration.errors import InputError
    from churnsim.figures.make_all import make_all_figures

    if not results.is_dir():
        raise InputError(f"{results}: not a results directory; pass the --out directory of whatif, simulate, sweep or validate")
    drawn = make_all_figures(results, out)
    if not drawn:
        raise InputError(f"{results}: holds no result table a figure can be drawn from (runs.csv, summary.csv, ...)")
    for path in drawn:
        Console().print(str(path))
