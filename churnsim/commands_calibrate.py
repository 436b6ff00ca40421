"""`churnsim calibrate` (real runs or existing run records → calibration file) and `churnsim validate`.

Each checks its options, calls one library function (`churnsim.calibrating`) and prints
(`churnsim.calibration_report`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from churnsim.app import app
from churnsim.console import finish, stderr_console


@app.command("calibrate")
def calibrate_command(
    out: Path = typer.Option(..., "--out", help="Calibration JSON file to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out file."),
    device: Optional[str] = typer.Option(
        None,
        "--device",
        help="cpu or cuda (default: the scenario's training.device with --preset, --scenario or --set; the records' device with --runs; else cpu).",
    ),
    quick: bool = typer.Option(
        False, "--quick", help="The short suite (the tiny model: a few minutes on a CPU; another model as long as its runs take)."
    ),
    runs: Optional[list[Path]] = typer.Option(None, "--runs", help="Fit on existing run records (a record or a directory of records); repeatable."),
    runs_out: Optional[Path] = typer.Option(None, "--runs-out", help="Where the suite writes its run records (default: <OUT stem>-runs next to OUT)."),
    name: Optional[str] = typer.Option(None, "--name", help="Calibration name (default: OUT's file stem)."),
    remote_dir: Optional[Path] = typer.Option(None, "--remote-dir", help="A directory on slower storage to measure as the 'remote' tier."),
    methods: Optional[list[str]] = typer.Option(None, "--method", help="Methods of the suite's failure runs (default: every method real runs implement)."),
    preset_name: Optional[str] = typer.Option(
        None, "--preset", help="Run the suite on this built-in scenario's model and pipeline (default: the tiny model in 4 stages, cpu-tiny)."
    ),
    scenario_path: Optional[Path] = typer.Option(None, "--scenario", help="Run the suite on this scenario file's model and pipeline."),
    settings: list[str] = typer.Option([], "--set", help="FIELD=VALUE override of the scenario calibrated (dotted path); repeatable."),
    convergence: bool = typer.Option(False, "--convergence", help="Measure convergence setbacks with the convergence lab (paired forks of no-failure runs) into a copy of --base."),
    base: Optional[str] = typer.Option(
        None, "--base", help="With --convergence: the calibration (file or built-in name) whose model is trained and whose setbacks are replaced (default cpu-tiny)."
    ),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="With --convergence: seeds of the paired no-failure runs, comma-separated (one process each; default 0,1)."),
    lab_iterations: Optional[int] = typer.Option(
        None, "--lab-iterations", help="With --convergence: length of each no-failure run (default 1000); failures strike from 10 % of it on."
    ),
    failure_points: Optional[int] = typer.Option(
        None, "--failure-points", help="With --convergence: failure iterations per seed (default 16; each forks an interior and an edge stage)."
    ),
    setback_table: Optional[Path] = typer.Option(None, "--setback-table", help="With --convergence: fit an existing lab table (a *-setbacks.csv) instead of running the lab."),
    refresh_speed_reference: bool = typer.Option(
        False, "--refresh-speed-reference",
        help="Time the machine's speed probe again (seconds) and store it in the existing --out calibration, changing nothing else; on the calibrated machine.",
    ),
) -> None:
    """Short real runs on this machine (or existing run records) → a calibration file."""
    from churnsim.calibrating import DEFAULT_LAB_BASE, DEFAULT_LAB_SEEDS, calibrate, calibrate_convergence, parse_seeds
    from churnsim.calibration.errors import InputError
    from churnsim.calibration_report import print_calibration, print_lab_setbacks

    console = stderr_console()
    if device not in (None, "cpu", "cuda"):
        raise InputError(f"--device {device!r}: use cpu or cuda")
    if refresh_speed_reference:
        from churnsim.calibrating import refresh_speed_reference as refresh

        others = {
            "--overwrite": overwrite, "--device": device, "--quick": quick, "--runs": runs, "--runs-out": runs_out, "--name": name,
            "--remote-dir": remote_dir, "--method": methods, "--preset": preset_name, "--scenario": scenario_path, "--set": settings,
            "--convergence": convergence, **lab_flags_of(base, seeds, lab_iterations, failure_points, setback_table),
        }  # fmt: skip
        given = [flag for flag, value in others.items() if value not in (None, False, [], ())]
        if given:
            raise InputError(f"--refresh-speed-reference changes only the speed reference of the --out file: drop {', '.join(given)}")
        started = time.perf_counter()
        refreshed = refresh(out, on_message=console.print)
        reference = refreshed.speed_reference
        console.print(
            f"updated the speed reference of {out} in {time.perf_counter() - started:.0f} s: the probe took {1000 * reference.probe_s:.1f} ms "
            f"(median of {reference.num_repeats} passes, interquartile range {1000 * reference.interquartile_range_s:.1f} ms)"
        )
        return
    from churnsim.out_directory import check_writable_file

    check_writable_file(out, flag="--out", overwrite=overwrite)  # before minutes of real runs, not after them
    configures_the_suite = preset_name is not None or scenario_path is not None or bool(settings)
    lab_flags = lab_flags_of(base, seeds, lab_iterations, failure_points, setback_table)
    if convergence:
        if runs or quick or methods or configures_the_suite:
            raise InputError("--convergence runs the convergence lab on --base: drop --runs, --quick, --method, --preset, --scenario and --set")
        from churnsim.calibration.fit_setbacks import LAB_FAILURE_POINTS, LAB_ITERATIONS

        rows, table_path, started = calibrate_convergence(
            out, base=base or DEFAULT_LAB_BASE, seeds=parse_seeds(seeds if seeds is not None else DEFAULT_LAB_SEEDS),
            num_iterations=lab_iterations if lab_iterations is not None else LAB_ITERATIONS,
            num_failure_points=failure_points if failure_points is not None else LAB_FAILURE_POINTS, table=setback_table,
            device=device or "cpu", on_message=console.print,
        )  # fmt: skip
        print_lab_setbacks(rows)
        console.print(f"wrote {out} and {table_path} in {time.perf_counter() - started:.0f} s")
        return
    given_lab_flags = [flag for flag, value in lab_flags.items() if value is not None]
    if given_lab_flags:
        # Without --convergence nothing reads them: a run that ignored them would look like it had used them.
        verb, pronoun = ("configures", "it") if len(given_lab_flags) == 1 else ("configure", "them")
        raise InputError(f"{', '.join(given_lab_flags)} {verb} the convergence lab: add --convergence, or drop {pronoun}")
    if runs and (quick or runs_out is not None or methods or configures_the_suite):
        raise InputError(
            "--runs fits existing records: drop --quick, --runs-out, --method, --preset, --scenario and --set (they configure the suite)"
        )
    calibration, num_records, started = calibrate(
        out, runs=runs or (), device=device, quick=quick, runs_out=runs_out, name=name, remote_dir=remote_dir, methods=methods,
        preset_name=preset_name, scenario_path=scenario_path, settings=settings, on_message=console.print,
    )
    print_calibration(calibration)
    console.print(f"wrote {out} in {time.perf_counter() - started:.0f} s (fitted on {num_records} run records)")
    console.print(
        f"use it: churnsim whatif --calibration {out} [--preset NAME | --scenario FILE]; "
        f"check it: churnsim validate --calibration {out} RUN_DIR ... (held-out `churnsim real run` records)",
        markup=False,
    )


def lab_flags_of(base, seeds, lab_iterations, failure_points, setback_table) -> dict[str, object]:
    """The convergence lab's flags by name, as given (None where not)."""
    return {"--base": base, "--seeds": seeds, "--lab-iterations": lab_iterations, "--failure-points": failure_points, "--setback-table": setback_table}


@app.command("validate")
def validate_command(
    run_directories: list[Path] = typer.Argument(..., metavar="RUN_DIR...", help="Held-out run records (or directories of them)."),
    calibration_argument: str = typer.Option(..., "--calibration", help="Calibration file, or a built-in name such as cpu-tiny."),
    out: Path = typer.Option(Path("churnsim-validation"), "--out", help="Directory for validation.csv and the figure."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into --out even though it holds another run's results or other files."),
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Draw the validation figure."),
    speed_probe: bool = typer.Option(
        True, "--speed-probe/--no-speed-probe",
        help="Time the machine's speed probe (seconds) against the calibration's speed reference, on the calibrated machine.",
    ),
) -> None:
    """Replay held-out runs in the simulator; predicted against measured as a table and a figure."""
    from churnsim.calibrating import validate
    from churnsim.calibration_report import print_validation

    report = validate(run_directories, calibration_argument, out=out, overwrite=overwrite, speed_probe=speed_probe, on_message=stderr_console().print)
    print_validation(report)
    finish(out, report.notes, draw_figures=figures, wrote=out / "validation.csv")
