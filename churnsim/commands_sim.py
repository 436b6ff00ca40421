"""Commands that need only the simulator and the contract: presets, simulate, whatif, recommend, sweep, plot.

Each parses its options, calls one library function (`churnsim.jobs`) and prints what it returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from churnsim.app import app
from churnsim.console import finish, progress_bar, stderr_console
from churnsim.work_bounds import MAX_WORK_HELP  # a string; the module imports nothing heavy
from churnsim.options import (
    CALIBRATION_HELP,
    CALIBRATION_MODE_HELP,
    JSON_HELP,
    OVERWRITE_HELP,
    SET_HELP,
    calibration_option,
    check_run_flags,
    parse_float_list,
    scenario_argument,
    scenario_source,
)


@app.command("presets")
def presets_command(
    show: Optional[str] = typer.Option(None, "--show", help="Print one preset as a scenario JSON file (edit it, then `churnsim simulate FILE`)."),
    as_json: bool = typer.Option(False, "--json", help="List the presets as a JSON list (name, description, key fields), for scripts."),
) -> None:
    """List the built-in scenarios, or print one as JSON."""
    from churnsim.calibration.presets import preset
    from churnsim.presets_listing import presets_json, print_presets_table

    if show is not None:
        typer.echo(preset(show).model_dump_json(indent=2))
        return
    typer.echo(presets_json()) if as_json else print_presets_table()


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
    from churnsim.jobs import ScenarioChoice, simulate_job
    from churnsim.report import show_verdict

    calibration = calibration_option(calibration_argument, calibration_mode)
    source = scenario_argument(scenario_path, preset_name)
    check_run_flags(replications=replications, seed=seed)
    choice = ScenarioChoice(
        source, methods=methods or (), settings=parse_settings(settings), calibration=calibration, calibration_mode=calibration_mode,
        replications=replications, seed=seed, described_as=scenario_source(scenario_path, preset_name),
    )
    output = simulate_job(choice, out=out, overwrite=overwrite, parquet=parquet, progress=progress_bar)
    show_verdict(output.verdict, as_json=as_json, extra={"command": "simulate", "out": str(out)})
    finish(out, output.notes if as_json else (), draw_figures=False, verdict=output.verdict)


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
    max_work: Optional[float] = typer.Option(None, "--max-work", help=MAX_WORK_HELP),
) -> None:
    """The main job: which method reaches the target loss first, at each failure rate, and by how much."""
    from churnsim.calibration.scenario_overrides import parse_settings
    from churnsim.jobs import ScenarioChoice, whatif_job
    from churnsim.report import show_verdict

    named_preset = None if scenario_path else preset_name
    calibration = calibration_option(calibration_argument, calibration_mode)
    source = scenario_argument(scenario_path, named_preset)
    choice = ScenarioChoice(
        source, methods=methods or (), settings=parse_settings(settings), calibration=calibration, calibration_mode=calibration_mode,
        described_as=scenario_source(scenario_path, named_preset),
    )
    failure_rates = parse_float_list(rates, "--rates") if rates is not None else None
    check_run_flags(replications=replications, minimum_replications=2, why="confidence intervals need at least 2")
    result = whatif_job(
        choice, failure_rates=failure_rates, replications=replications, quick=quick, out=out, overwrite=overwrite, workers=workers,
        scheduler=scheduler, parquet=parquet, setback_sensitivity=setback_sensitivity, max_work_hours=max_work, progress=progress_bar,
        console=stderr_console(),
    )
    show_verdict(result.verdict, as_json=as_json, extra={"command": "whatif", "out": str(out)})
    finish(out, result.notes if as_json else (), draw_figures=figures, verdict=result.verdict)


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
    max_work: Optional[float] = typer.Option(None, "--max-work", help=MAX_WORK_HELP),
) -> None:
    """What to use: the best method and its knobs (checkpoint interval against Young/Daly, CheckFree's
    edge fallback), its time to target, and whether the winner changes with the setbacks or the failure rate."""
    from churnsim.calibration.scenario_overrides import parse_settings
    from churnsim.jobs import ScenarioChoice, recommend_job
    from churnsim.recommend_report import show_recommendation

    calibration = calibration_option(calibration_argument, calibration_mode)
    source = scenario_argument(scenario_path, preset_name)
    check_run_flags(replications=replications)
    choice = ScenarioChoice(
        source, settings=parse_settings(settings), calibration=calibration, calibration_mode=calibration_mode,
        described_as=scenario_source(scenario_path, preset_name),
    )
    console = stderr_console()
    result = recommend_job(
        choice, replications=replications, workers=workers, max_work_hours=max_work,
        on_start=lambda scenario: console.print(f"recommending for {scenario.name} (methods, interval grids, then robustness cases)"),
        on_pass_done=lambda name: console.print(f"  done: {name}"),
    )
    show_recommendation(result, as_json=as_json)


@app.command("sweep")
def sweep_command(
    scenario_path: Optional[Path] = typer.Argument(None, metavar="[SCENARIO]", help="Scenario JSON file."),
    preset_name: Optional[str] = typer.Option(None, "--preset", help="A built-in scenario."),
    settings: list[str] = typer.Option(..., "--set", help="FIELD=V1,V2,... over a scenario field (dotted path); repeat for a grid."),
    methods: Optional[list[str]] = typer.Option(None, "--method", help="Method to include; repeat for several."),
    calibration_argument: Optional[str] = typer.Option(None, "--calibration", help=CALIBRATION_HELP),
    calibration_mode: str = typer.Option("full", "--calibration-mode", help=CALIBRATION_MODE_HELP),
    replications: Optional[int] = typer.Option(
        None, "--replications", help="Replications per grid point (default: the scenario's; common random numbers across methods)."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="Base seed of the failure paths (default: the scenario's)."),
    out: Path = typer.Option(..., "--out", help="Directory for runs.csv, summary.csv and trajectories.csv."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: one per core)."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address, e.g. tcp://host:8786."),
    parquet: bool = typer.Option(False, "--parquet", help="Also write tables as Parquet (needs pyarrow)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    max_work: Optional[float] = typer.Option(None, "--max-work", help=MAX_WORK_HELP),
) -> None:
    """A grid over scenario fields, in local processes or on a Dask cluster."""
    from churnsim.calibration.scenario_overrides import parse_grid_setting
    from churnsim.jobs import ScenarioChoice, sweep_job
    from churnsim.report import show_verdict

    calibration = calibration_option(calibration_argument, calibration_mode)
    source = scenario_argument(scenario_path, preset_name)
    check_run_flags(replications=replications, seed=seed)
    choice = ScenarioChoice(
        source, methods=methods or (), calibration=calibration, calibration_mode=calibration_mode, replications=replications, seed=seed,
        described_as=scenario_source(scenario_path, preset_name),
    )
    grid = [parse_grid_setting(text) for text in settings]
    verdict = sweep_job(choice, grid, out=out, overwrite=overwrite, workers=workers, scheduler=scheduler, parquet=parquet, max_work_hours=max_work, progress=progress_bar)
    show_verdict(verdict, as_json=as_json, extra={"command": "sweep", "out": str(out)})
    finish(out, verdict.caveats if as_json else (), draw_figures=False, verdict=verdict)


@app.command("plot")
def plot_command(
    results: Path = typer.Argument(..., help="A directory written by whatif, simulate, sweep or validate."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to put the PNGs (default RESULTS/figures)."),
) -> None:
    """Remake every figure from saved results."""
    from rich.console import Console

    from churnsim.calibration.errors import InputError
    from churnsim.figures.make_all import make_all_figures

    from churnsim.out_directory import check_figure_directory

    check_figure_directory(results, out)
    if not results.is_dir():
        raise InputError(f"{results}: not a results directory; pass the --out directory of whatif, simulate, sweep or validate")
    drawn = make_all_figures(results, out)
    if not drawn:
        raise InputError(f"{results}: holds no result table a figure can be drawn from (runs.csv, summary.csv, ...)")
    for path in drawn:
        Console().print(str(path))
