"""`churnsim calibrate` (real runs or existing run records → calibration file) and `churnsim validate`.

These commands bridge both sides: they import real/ (torch) only when real runs or link
measurements are needed, and sim/ for the iteration model and the replays.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from churnsim.app import app
from churnsim.commands_sim import finish, stderr_console
from churnsim.extras import require_torch

LINK_PROFILE_FILE = "link_profile.csv"
"""bytes, seconds: the ping-pong measurement, kept next to the run records it belongs to."""
STORAGE_FILE = "storage.csv"
"""name, num_bytes, write_s, read_s: one row per repeat of the storage measurement."""


def _measure_link(device: str):
    """The ping-pong link profile on `device`; a CUDA device on a machine without CUDA is refused in one line."""
    require_torch("measuring the link profile (no link_profile.csv beside the run records)")
    import torch

    from churnsim.calibration.errors import InputError
    from churnsim.real.calibration_suite import measure_link_profile

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "device cuda (from --device, the scenario's training.device or the records): CUDA is not available on this machine; pass --device cpu"
        )

    stderr_console().print("measuring the point-to-point link (1 KiB … 16 MiB ping-pong) ...")
    return measure_link_profile(device=device)


def _measure_storage(tiers: dict[str, Path]):
    import pandas as pd

    require_torch("measuring storage bandwidth (no storage.csv beside the run records)")
    from churnsim.real.calibration_suite import measure_storage_bandwidth

    rows = []
    for name, directory in tiers.items():
        directory.mkdir(parents=True, exist_ok=True)
        measurement = measure_storage_bandwidth(directory, name=name)
        rows.extend(
            dict(name=name, num_bytes=measurement.num_bytes, write_s=write_s, read_s=read_s)
            for write_s, read_s in zip(measurement.write_seconds, measurement.read_seconds)
        )
    return pd.DataFrame(rows, columns=["name", "num_bytes", "write_s", "read_s"])


def _find_measurement(directories: list[Path], file_name: str) -> Path | None:
    for directory in directories:
        for candidate in (directory / file_name, directory.parent / file_name):
            if candidate.is_file():
                return candidate
    return None


def _tier_bandwidths(storage):
    from churnsim.calibration.fit_timing import fit_tier_bandwidth

    return [
        fit_tier_bandwidth(str(name), rows["num_bytes"].to_numpy(), rows["write_s"].to_numpy(), rows["read_s"].to_numpy())
        for name, rows in storage.groupby("name", sort=False)
    ]


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
        False, "--quick", help="The short suite (the tiny model: at most 5 minutes on 2 CPU cores; another model as long as its runs take)."
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
) -> None:
    """Short real runs on this machine (or existing run records) → a calibration file."""
    import pandas as pd

    from churnsim.calibration.calibration_file import save_calibration
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.fit import build_calibration
    from churnsim.calibration.fit_timing import fit_link_profile
    from churnsim.calibration.run_record import read_run_record
    from churnsim.calibration.safe_files import input_stream
    from churnsim.sim.calibrated import iteration_predictor, method_extra_predictor
    from churnsim.sim.validate import run_record_directories

    console = stderr_console()
    if device not in (None, "cpu", "cuda"):
        raise InputError(f"--device {device!r}: use cpu or cuda")
    from churnsim.out_directory import check_writable_file

    check_writable_file(out, flag="--out", overwrite=overwrite)  # before minutes of real runs, not after them
    configures_the_suite = preset_name is not None or scenario_path is not None or bool(settings)
    lab_flags = {"--base": base, "--seeds": seeds, "--lab-iterations": lab_iterations, "--failure-points": failure_points, "--setback-table": setback_table}
    if convergence:
        if runs or quick or methods or configures_the_suite:
            raise InputError("--convergence runs the convergence lab on --base: drop --runs, --quick, --method, --preset, --scenario and --set")
        from churnsim.calibration.fit_setbacks import LAB_FAILURE_POINTS, LAB_ITERATIONS

        calibrate_convergence(
            out, base=base or DEFAULT_LAB_BASE, seeds=parse_seeds(seeds if seeds is not None else DEFAULT_LAB_SEEDS),
            num_iterations=lab_iterations if lab_iterations is not None else LAB_ITERATIONS,
            num_failure_points=failure_points if failure_points is not None else LAB_FAILURE_POINTS, table=setback_table,
            device=device or "cpu",
        )  # fmt: skip
        return
    given_lab_flags = [flag for flag, value in lab_flags.items() if value is not None]
    if given_lab_flags:
        # Without --convergence nothing reads them: a run that ignored them would look like it had used them.
        verb, pronoun = ("configures", "it") if len(given_lab_flags) == 1 else ("configure", "them")
        raise InputError(f"{', '.join(given_lab_flags)} {verb} the convergence lab: add --convergence, or drop {pronoun}")
    started = time.perf_counter()
    if runs:
        if quick or runs_out is not None or methods or configures_the_suite:
            raise InputError(
                "--runs fits existing records: drop --quick, --runs-out, --method, --preset, --scenario and --set (they configure the suite)"
            )
        directories = run_record_directories(runs)
        records = [read_run_record(directory) for directory in directories]
        device = device or _records_device(records)
        link_file = _find_measurement([Path(path) for path in runs], LINK_PROFILE_FILE)
        link_points = pd.read_csv(input_stream(link_file)) if link_file is not None else _measure_link(device)
        storage_file = _find_measurement([Path(path) for path in runs], STORAGE_FILE)
        storage = pd.read_csv(input_stream(storage_file)) if storage_file is not None else _measure_storage({"local_disk": out.resolve().parent})
    else:
        require_torch("calibrating with real runs")
        from churnsim.real.calibration_suite import full_settings, quick_settings, run_suite, suite_plan, suite_shared_cores

        suite_settings = quick_settings() if quick else full_settings()
        if configures_the_suite:
            suite_settings, device = _scenario_suite_settings(scenario_path, preset_name, settings, suite_settings, device=device)
        device = device or "cpu"
        link_points = _measure_link(device)  # first: it refuses a device this machine lacks before anything is written
        runs_out = runs_out if runs_out is not None else out.parent / f"{out.stem}-runs"
        runs_out.mkdir(parents=True, exist_ok=True)
        link_points.to_csv(runs_out / LINK_PROFILE_FILE, index=False)
        tiers = {"local_disk": runs_out}
        if remote_dir is not None:
            tiers["remote"] = remote_dir
        storage = _measure_storage(tiers)
        storage.to_csv(runs_out / STORAGE_FILE, index=False)
        plan = suite_plan(suite_settings, device=device, shared_cores=suite_shared_cores(device), methods=methods)
        console.print(f"running {len(plan)} short real runs into {runs_out} ...")

        def done(run, seconds: float) -> None:
            console.print(f"  {run.run_id}: {seconds:.1f} s")

        directories = run_suite(plan, runs_out, on_run_done=done)
        records = [read_run_record(directory) for directory in directories]
    settings = records[0].manifest.real_settings
    if settings is None:
        raise InputError(f"{directories[0]}: manifest.json field 'real_settings' is missing; calibrate from real run records")
    link = fit_link_profile(link_points)
    tier_bandwidths = _tier_bandwidths(storage)
    calibration = build_calibration(
        name or out.stem,
        records,
        link_points=link_points,
        tier_bandwidths=tier_bandwidths,
        device=device,  # type: ignore[arg-type]
        command="churnsim " + " ".join(sys.argv[1:]) if sys.argv and "calibrate" in sys.argv else "churnsim calibrate",
        predict_iteration_s=iteration_predictor(link=link),
        predict_method_extra_s=method_extra_predictor(link=link, storage=tier_bandwidths),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(calibration, out)  # atomic: temporary file + rename
    print_calibration(calibration)
    console.print(f"wrote {out} in {time.perf_counter() - started:.0f} s (fitted on {len(records)} run records)")
    console.print(
        f"use it: churnsim whatif --calibration {out} [--preset NAME | --scenario FILE]; "
        f"check it: churnsim validate --calibration {out} RUN_DIR ... (held-out `churnsim real run` records)",
        markup=False,
    )


def _records_device(records) -> str:
    """The device the records ran on (--runs without --device); cpu for records that do not say."""
    from churnsim.calibration.errors import InputError

    devices = sorted({record.manifest.real_settings.device for record in records if record.manifest.real_settings is not None})
    if len(devices) > 1:
        raise InputError(f"--runs: the records ran on {' and '.join(devices)}; calibrate one device at a time, or say which with --device")
    return devices[0] if devices else "cpu"


def _scenario_suite_settings(scenario_path: Optional[Path], preset_name: Optional[str], settings: list[str], base, *, device: Optional[str]):
    """The suite's sizes on the model and pipeline of the scenario named (cpu-tiny's when only --set
    is given), refused in one line where this machine cannot run it; and the device it runs on
    (`device`, else the scenario's training.device)."""
    from churnsim.calibration.presets import configured_scenario
    from churnsim.calibration.scenario_overrides import apply_settings, parse_settings
    from churnsim.commands_sim import load_scenario_argument
    from churnsim.calibration.errors import InputError
    from churnsim.real.calibration_suite import SHAPE_ITERATIONS, SHAPE_SCENARIO_FIELDS, scenario_suite_settings, suite_shapes, suite_shared_cores
    from churnsim.real.scenario_run import check_fits_machine

    if scenario_path is None and preset_name is None:
        preset_name = "cpu-tiny"
    base_scenario, overrides = load_scenario_argument(scenario_path, preset_name), parse_settings(settings)

    def suite_scenario(shape: dict[str, object]):
        # Only the model, pipeline and training are calibrated; the suite picks its own methods (--method).
        return configured_scenario(base_scenario, preset_name, {**overrides, **shape}, methods=("none",))

    scenario = suite_scenario({})
    suite_settings = scenario_suite_settings(scenario, base)
    device = device or scenario.training.device
    # The longest run of the suite, on the device it will use: the same check as `real run`'s.
    run = {"target.loss": None, "target.iterations": suite_settings.num_iterations, "training.device": device}
    check_fits_machine(apply_settings(scenario, run))
    # And each shape run: twice the microbatch, or twice the layers, holds more than the longest run.
    for name, sizes in suite_shapes(suite_settings, shared_cores=suite_shared_cores(device)):
        fields = {SHAPE_SCENARIO_FIELDS[size]: value for size, value in sizes.items()}
        try:
            check_fits_machine(apply_settings(suite_scenario(fields), {**run, "target.iterations": SHAPE_ITERATIONS}))
        except InputError as error:
            changed = ", ".join(f"{field}={value}" for field, value in fields.items())
            raise InputError(f"the suite's shape run {name!r} ({changed}, {SHAPE_ITERATIONS} iterations) cannot run here: {error}") from None
    return suite_settings, device


DEFAULT_LAB_BASE = "cpu-tiny"
DEFAULT_LAB_SEEDS = "0,1"
LARGEST_SEED = 2**63 - 1
"""torch.manual_seed takes a signed 64-bit integer; a larger seed failed in every lab process."""
MAX_LAB_ITERATIONS = 100_000
"""100 times the default: 2 seeds × 1,000 iterations took 10 min on 2 CPU cores (README)."""


def parse_seeds(text: str) -> tuple[int, ...]:
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.scenario_overrides import comma_separated

    values = comma_separated(text, f"--seeds {text!r}", empty="give distinct seeds >= 0, e.g. 0,1")
    try:
        seeds = tuple(int(value) for value in values)
    except ValueError:
        raise InputError(f"--seeds {text!r}: give whole numbers separated by commas, e.g. 0,1") from None
    if any(not 0 <= seed <= LARGEST_SEED for seed in seeds) or len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {text!r}: give distinct seeds from 0 to {LARGEST_SEED}, e.g. 0,1")
    return seeds


def calibrate_convergence(
    out: Path, *, base: str, seeds: tuple[int, ...], num_iterations: int, num_failure_points: int, table: Path | None = None,
    device: str = "cpu",
) -> None:
    """`calibrate --convergence`: the lab's per-rebuild table beside OUT, and OUT = BASE with measured setbacks."""
    from rich.console import Console
    from rich.table import Table

    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.calibration_file import save_calibration
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.fit_setbacks import lab_failure_span, methods_told_apart, setback_summary, with_lab_setbacks
    from churnsim.calibration.run_record import provenance_fields
    from churnsim.calibration.safe_files import input_stream

    console = stderr_console()
    if num_iterations < 50 or num_failure_points < 1:
        raise InputError("--lab-iterations must be >= 50 and --failure-points >= 1")
    if num_iterations > MAX_LAB_ITERATIONS:
        raise InputError(
            f"--lab-iterations {num_iterations}: more than the limit of {MAX_LAB_ITERATIONS:,} (2 seeds × 1,000 iterations took "
            "10 min on 2 CPU cores); use fewer"
        )
    first, last = lab_failure_span(num_iterations)
    if num_failure_points > last - first + 1:
        raise InputError(
            f"--failure-points {num_failure_points}: more than the {last - first + 1} iterations failures may strike in a "
            f"{num_iterations}-iteration lab (from {first} to {last}); use fewer, or a longer --lab-iterations"
        )
    calibration = resolve_calibration(base)
    started = time.perf_counter()
    table_path = out.with_name(f"{out.stem}-setbacks.csv")
    if table is not None:
        import pandas as pd

        try:
            rows = pd.read_csv(input_stream(table, what="--setback-table"))
        except InputError:
            raise
        except (OSError, ValueError) as error:
            raise InputError(f"--setback-table {table}: cannot read it as CSV ({error.__class__.__name__}); give a lab table") from None
        seeds = tuple(sorted(int(seed) for seed in rows["seed"].unique())) if "seed" in rows.columns else seeds
        num_iterations = int(rows["failure_iteration"].max() + rows["window_iterations"].max()) if "failure_iteration" in rows.columns else 0
        description = f"{calibration.name} model, lab table {table.name}, seeds {','.join(map(str, seeds))}"
    else:
        require_torch("the convergence lab")
        import torch

        from churnsim.real.convergence_lab import lab_settings, measure_setbacks
        from churnsim.real.scenario_run import model_config

        if device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine; use --device cpu")

        settings = lab_settings(
            model_config(calibration.model),
            num_stages=calibration.pipeline.num_stages,
            num_microbatches=calibration.pipeline.num_microbatches,
            microbatch_size=calibration.pipeline.microbatch_size,
            num_iterations=num_iterations,
            num_failure_points=num_failure_points,
            device=device,
        )
        console.print(
            f"convergence lab: {len(seeds)} seed(s) × {num_iterations} iterations, {num_failure_points} failure points × "
            f"{len(settings.methods)} methods × 2 positions, window {settings.window_iterations} iterations ..."
        )
        rows, curve, _ = measure_setbacks(settings, seeds, workers=min(len(seeds), os.cpu_count() or 1))
        out.parent.mkdir(parents=True, exist_ok=True)
        curve.to_csv(out.with_name(f"{out.stem}-lab-curve.csv"), index=False)
        description = f"{calibration.name} model, seeds {','.join(map(str, seeds))}, {num_iterations}-iteration no-failure runs"
    measured = with_lab_setbacks(calibration, rows, description=description)  # checks the table before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(table_path, index=False)
    provenance = measured.provenance.model_copy(
        update={**{key: value for key, value in provenance_fields().items() if key in type(measured.provenance).model_fields},
                "command": "churnsim " + " ".join(sys.argv[1:])}
    )  # fmt: skip
    save_calibration(measured.model_copy(update={"name": out.stem, "provenance": provenance}), out)
    summary = setback_summary(rows)
    kept = summary[summary["window_iterations"] == summary["window_iterations"].max()]
    table = Table("method", "position", "rebuilds", "setback iterations [95 % CI]", "per iteration of progress [95 % CI]", title="measured setbacks")
    for row in kept.itertuples(index=False):
        table.add_row(
            row.method, row.position, str(row.num_rebuilds),
            f"{row.mean_setback_iterations:.1f} [{row.ci95_low_iterations:.1f}, {row.ci95_high_iterations:.1f}]",
            f"{row.setback_per_iteration_of_progress:.3f} [{row.slope_ci95_low:.3f}, {row.slope_ci95_high:.3f}]",
        )  # fmt: skip
    Console().print(table)
    for position in ("interior", "edge"):
        pairs = methods_told_apart(rows, position)
        apart = pairs[pairs["told_apart"]] if not pairs.empty else pairs
        told = ", ".join(f"{r.method} vs {r.other} ({r.mean_difference_iterations:+.1f})" for r in apart.itertuples()) or "none"
        Console().print(f"{position}: pairs told apart (paired 95 % interval excludes 0): {told}")
    console.print(f"wrote {out} and {table_path} in {time.perf_counter() - started:.0f} s")


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def print_calibration(calibration) -> None:
    """The short human-readable summary of a calibration file."""
    from rich.console import Console
    from rich.table import Table

    from churnsim.calibration.speed_uncertainty import run_speed_log_sd, speed_interval_factors

    out = Console()
    timings = Table("stage", "forward/microbatch [IQR]", "backward/microbatch [IQR]", "samples", title=f"calibration {calibration.name!r}: stage timings")
    for timing in calibration.stage_timings:
        timings.add_row(
            str(timing.stage),
            f"{_seconds(timing.block_forward.median_s)} [{_seconds(timing.block_forward.interquartile_range_s)}]",
            f"{_seconds(timing.block_backward.median_s)} [{_seconds(timing.block_backward.interquartile_range_s)}]",
            str(timing.block_forward.num_samples),
        )
    out.print(timings)
    link = calibration.link
    evaluation = calibration.evaluation
    lines = [
        f"optimizer step {_seconds(calibration.optimizer_step.median_s)}, per-iteration overhead {_seconds(calibration.iteration_overhead_s)}, "
        f"warm-up extra {_seconds(calibration.warmup_extra_s)}, evaluation {_seconds(evaluation.median_s) if evaluation else 'not measured'}, "
        f"checkpoint write fixed cost {_seconds(calibration.checkpoint_write_latency_s)}",
        "steady extra per iteration over plain methods: "
        + (", ".join(f"{method} {_seconds(value) if value >= 0 else '−' + _seconds(-value)}" for method, value in sorted(calibration.method_iteration_extra_s.items())) or "none measured"),
        f"link: latency {_seconds(link.latency_s)}, bandwidth {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s (r² {link.r_squared:.3f}, {link.num_points} sizes)"
        if link.r_squared is not None
        else f"link: latency {_seconds(link.latency_s)}, bandwidth {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s",
    ]
    lines += [
        f"tier {tier.name}: write {tier.write_bandwidth_bytes_per_s / 1e6:.0f} MB/s, read {tier.read_bandwidth_bytes_per_s / 1e6:.0f} MB/s"
        for tier in calibration.storage
    ]
    if calibration.machine_step_s is not None:
        speeds = sorted(calibration.run_speed_factors.values())
        spread = f"; its runs' hops took {speeds[0]:.2f}–{speeds[-1]:.2f}× their pooled median ({len(speeds)} runs)" if speeds else ""
        log_sd = run_speed_log_sd(speeds)
        if log_sd > 0:
            low, high = speed_interval_factors(log_sd)
            spread += f", so a run's compute is predicted within ×{low:.3f}–{high:.3f} (95 %)"
        lines.append(f"machine speed while calibrating: median no-failure step {_seconds(calibration.machine_step_s)}{spread}")
    compute = calibration.compute_model

    def _hop_cost_text(hop) -> str:
        shared = hop.seconds_per_shared_core_parameter
        return (
            f"{_seconds(hop.fixed_s)} + {hop.seconds_per_matmul_flop * 1e9:.3g} s/GFLOP + {_seconds(hop.seconds_per_neighbour)} per neighbouring stage"
            + (f" + {_seconds(shared * 1e6)} per million stage parameters on shared cores" if shared > 0 else "")
        )

    if compute is not None:
        cores = f"{compute.shared_cores} shared cores" if compute.shared_cores else "a device per stage"
        lines.append(
            f"compute model ({compute.num_configurations} setups, {cores}, median residual {100 * compute.hop_relative_residual:.1f} %): "
            f"forward hop {_hop_cost_text(compute.forward)}, backward hop {_hop_cost_text(compute.backward)}; "
            f"overhead of other setups {_seconds(compute.iteration_overhead_s)} + {_seconds(compute.overhead_per_stage_microbatch_s)} per stage × microbatch"
            # Calibrations made before the stages × microbatches fit scaled it per microbatch.
            + (f" + {_seconds(compute.overhead_per_microbatch_s)} per microbatch" if compute.overhead_per_microbatch_s else "")
        )
    for line in lines:
        out.print(line)
    recovery = Table(
        "method", "join", "transfer", "load", "rebuild", "restart", "n",
        title="recovery component times (median of n events; restart: the step's time no span records)",
    )
    recovery.columns[0].min_width = max((len(method) for method in calibration.recovery), default=0)  # names whole on 80 columns
    for method, times in sorted(calibration.recovery.items()):
        recovery.add_row(
            method, *(_seconds(value) for value in (times.join_s, times.transfer_s, times.load_s, times.rebuild_s, times.unrecorded_s)), str(times.num_samples)
        )
    out.print(recovery)
    convergence = calibration.convergence
    curve = convergence.baseline
    setbacks = Table("method", "position", "setback iterations [95 % CI]", "samples", title="convergence setbacks (measured where samples > 0)")
    for method, spec in sorted(convergence.setbacks.items()):
        for position in ("interior", "edge"):
            value = spec.for_position(position)
            interval = (
                f" [{value.ci95_low_iterations:.1f}, {value.ci95_high_iterations:.1f}]"
                if value.ci95_low_iterations is not None and value.ci95_high_iterations is not None
                else ""
            )
            setbacks.add_row(method, position, f"{value.mean_iterations:.1f}{interval}", str(value.num_samples) if value.num_samples else "0 (default)")
    out.print(setbacks)
    r_squared = "n/a" if curve.r_squared is None else f"{curve.r_squared:.3f}"
    from churnsim.calibration.fit_convergence import MAXIMUM_CURVE_EXPONENT, exponent_at_bound

    at_bound = (
        f" (the exponent at its bound {MAXIMUM_CURVE_EXPONENT}: these runs do not tell a steeper curve with a higher floor "
        "from this one)"
        if exponent_at_bound(curve)
        else ""
    )
    out.print(
        f"baseline loss = {curve.floor_loss:.3f} + {curve.scale:.3g}·(i + {curve.offset_iterations:.3g})^−{curve.exponent:.3f}, r² {r_squared}"
        + at_bound
    )
    provenance = calibration.provenance
    out.print(
        f"provenance: created {provenance.created_utc}, git {provenance.git_revision}, "
        f"hardware {', '.join(f'{key}={value}' for key, value in sorted(provenance.hardware.items()))}"
    )
    out.print(f"fitted on runs: {', '.join(provenance.fit_run_ids)}")


@app.command("validate")
def validate_command(
    run_directories: list[Path] = typer.Argument(..., metavar="RUN_DIR...", help="Held-out run records (or directories of them)."),
    calibration_argument: str = typer.Option(..., "--calibration", help="Calibration file, or a built-in name such as cpu-tiny."),
    out: Path = typer.Option(Path("churnsim-validation"), "--out", help="Directory for validation.csv and the figure."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into --out even though it holds another run's results or other files."),
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Draw the validation figure."),
) -> None:
    """Replay held-out runs in the simulator; predicted against measured as a table and a figure."""
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.tables import write_table
    from churnsim.out_directory import prepare_out_directory
    from churnsim.sim.outputs import write_manifest
    from churnsim.sim.validate import load_held_out_records, validate_records

    calibration = resolve_calibration(calibration_argument)
    records = load_held_out_records(run_directories, calibration)  # every input checked before --out is touched
    prepare_out_directory(out, command="validate", subject=calibration.name, overwrite=overwrite)
    report = validate_records(records, calibration)
    write_table(report.table, out / "validation.csv")
    write_manifest(
        out,
        command="validate",
        scenario=None,
        calibration=calibration.name,
        fit_run_ids=list(report.fit_run_ids),
        validated_run_ids=list(report.validated_run_ids),
        notes=list(report.notes),
    )
    print_validation(report)
    finish(out, report.notes, draw_figures=figures, wrote=out / "validation.csv")


def print_validation(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from churnsim.sim.validate import interval_coverage, machine_speed, median_absolute_error, steady_step_carry

    out = Console(width=max(Console().width, 120))
    out.print(f"fitted on (not validated): {', '.join(report.fit_run_ids) or 'none recorded'}")
    out.print(f"validated (held out): {', '.join(report.validated_run_ids)}")
    table = Table("run", "method", "quantity", "measured", "predicted", "error", title="predicted against measured")
    for row in report.table.itertuples(index=False):
        error = "—" if not math.isfinite(row.relative_error) else f"{100 * row.relative_error:+.1f} %"
        table.add_row(row.run_id, row.method, row.quantity, f"{row.measured:.4g}", f"{row.predicted:.4g}", error)
    out.print(table)
    summary = Table("method", "runs", "median |error| of total wall-clock", "its 95 % interval", "load-normalised", title="wall-clock error per method")
    for row in median_absolute_error(report.table).itertuples(index=False):
        normalised = row.median_load_normalised_absolute_relative_error
        summary.add_row(
            row.method,
            str(row.num_runs),
            f"{100 * row.median_absolute_relative_error:.1f} %",
            f"{100 * row.median_absolute_relative_error_ci95_low:.1f}–{100 * row.median_absolute_relative_error_ci95_high:.1f} %",
            f"{100 * normalised:.1f} %" if math.isfinite(normalised) else "—",
        )
    out.print(summary)
    speed = machine_speed(report.table)
    if speed is not None:
        if speed.num_runs == 1:
            measured = f"the real run's steady step was {speed.median_factor:.2f}× the calibration's prediction"
        else:
            measured = (
                f"the {speed.num_runs} real runs' steady steps were {speed.lowest_factor:.2f}–{speed.highest_factor:.2f}× the calibration's "
                f"prediction (median {speed.median_factor:.2f}×, a single run {100 * speed.scatter:.1f} % from it in the median)"
            )
        out.print(
            f"machine speed: {measured}; the absolute errors include this, the load-normalised ones rescale each run's compute by its own factor"
        )
        if math.isfinite(speed.log_standard_deviation):
            out.print(
                f"their speeds spread by {speed.log_standard_deviation:.3f} (standard deviation of the log factor): a scenario with "
                f"--set compute.run_speed_log_sd={speed.log_standard_deviation:.3f} draws speeds that spread as these runs' did"
            )
    on_calibrated_setup = report.table["calibrated_setup"].astype(bool)
    carry = steady_step_carry(report.table, on_calibrated_setup, report.table["setup"].where(~on_calibrated_setup))
    if carry:
        out.print(
            "the compute model's carry, with the machine's speed cancelled (each setup's median steady step over its prediction, "
            "over that of the calibrated setup's runs here): " + "; ".join(f"{setup}: {ratio:.3f}×" for setup, ratio in carry.items())
        )
    coverage = interval_coverage(report.table)
    if coverage is not None:
        runs_possessive = "run's" if coverage.num_runs == 1 else "runs'"
        out.print(
            f"{coverage.num_inside} of {coverage.num_runs} real {runs_possessive} total wall-clock fell inside the prediction's 95 % interval of the "
            f"calibrated machine's run-to-run speed ({coverage.num_slower} slower, {coverage.num_faster} faster): columns "
            "predicted_ci95_low/high; a machine that drifted further since calibrating lies outside"
        )
