"""`churnsim calibrate` and `churnsim validate` as library functions: real runs or existing run
records → a calibration file; the convergence lab → measured setbacks; held-out runs → a validation.

They bridge both sides: they import real/ (torch) only when real runs or link measurements are
needed, and sim/ for the iteration model and the replays. The commands (commands_calibrate.py) check
their options, call one of these and print (calibration_report.py).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

from churnsim.calibration.errors import InputError
from churnsim.calibration.safe_files import input_stream
from churnsim.extras import require_torch

LINK_PROFILE_FILE = "link_profile.csv"
"""bytes, seconds: the ping-pong measurement, kept next to the run records it belongs to."""
STORAGE_FILE = "storage.csv"
"""name, num_bytes, write_s, read_s: one row per repeat of the storage measurement."""


def _measure_link(device: str, on_message: Callable[[str], None]):
    """The ping-pong link profile on `device`; a CUDA device on a machine without CUDA is refused in one line."""
    require_torch("measuring the link profile (no link_profile.csv beside the run records)")
    import torch

    from churnsim.calibration.errors import InputError
    from churnsim.real.calibration_suite import measure_link_profile

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(
            "device cuda (from --device, the scenario's training.device or the records): CUDA is not available on this machine; pass --device cpu"
        )

    on_message("measuring the point-to-point link (1 KiB … 16 MiB ping-pong) ...")
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


SPEED_PROBE_HARDWARE_KEYS: tuple[str, ...] = ("machine", "processor", "cpu_count")
"""The parts of `hardware_description()` that must match for two probe times to compare one machine."""


def other_machine(hardware: dict[str, str]) -> str | None:
    """Where `hardware` (a calibration's or a record's provenance) is not this machine: how it differs; else None."""
    from churnsim.calibration.run_record import hardware_description

    here = hardware_description()
    differing = [f"{key} {hardware.get(key, 'unrecorded')} there, {here[key]} here" for key in SPEED_PROBE_HARDWARE_KEYS if hardware.get(key) != here[key]]
    return "; ".join(differing) or None


def measure_speed_reference(device: str, on_message: Callable[[str], None] = lambda text: None):
    """The speed probe (real/speed_probe.py) on this machine's `device`: a few seconds."""
    require_torch("the machine's speed probe")
    from churnsim.real.speed_probe import measure_speed_reference as measure

    on_message("timing the machine's speed probe (a few seconds) ...")
    return measure(device=device)  # type: ignore[arg-type]


def speed_probe_comparison(calibration, *, run_probe: bool = True, on_message: Callable[[str], None] = lambda text: None):
    """`churnsim validate`'s machine speed: the probe timed now over its time in `calibration`, or why not."""
    from churnsim.extras import has_torch
    from churnsim.sim.checks.validate import SpeedProbeComparison

    def not_measured(reason: str) -> SpeedProbeComparison:
        return SpeedProbeComparison(slowdown=None, reason_not_measured=reason)

    reference = calibration.speed_reference
    if reference is None:
        return not_measured(
            f"calibration {calibration.name!r} holds no speed reference (a built-in calibration, or one made before the probe); "
            "on the calibrated machine, churnsim calibrate --refresh-speed-reference --out FILE adds one"
        )
    if not run_probe:
        return not_measured("--no-speed-probe was given")
    elsewhere = other_machine(calibration.provenance.hardware)
    if elsewhere is not None:
        return not_measured(f"this is not the machine {calibration.name!r} was calibrated on ({elsewhere})")
    if not has_torch():
        return not_measured("the probe needs PyTorch, which is not installed here")
    if reference.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return not_measured("the reference was timed on CUDA, which is not available here")
    now = measure_speed_reference(reference.device, on_message)
    if now.workload != reference.workload:
        return not_measured(
            f"the reference times workload {reference.workload!r}, this version's probe {now.workload!r}; "
            "churnsim calibrate --refresh-speed-reference --out FILE times the current one"
        )
    return SpeedProbeComparison(slowdown=now.probe_s / reference.probe_s)


def refresh_speed_reference(path: Path, *, on_message: Callable[[str], None] = lambda text: None):
    """`calibrate --refresh-speed-reference`: the calibration at `path` with only its speed reference
    timed again on this machine (which must be the calibrated one), written in place; returns it."""
    from churnsim.calibration.calibration_file import load_calibration, save_calibration

    if not path.is_file():
        raise InputError(f"--out {path}: no calibration file there; --refresh-speed-reference updates an existing one")
    calibration = load_calibration(str(path))
    elsewhere = other_machine(calibration.provenance.hardware)
    if elsewhere is not None:
        raise InputError(
            f"--out {path}: calibration {calibration.name!r} was made on another machine ({elsewhere}); "
            "a speed reference belongs to the calibrated machine: refresh it there, or calibrate this one"
        )
    reference = measure_speed_reference(calibration.device, on_message)
    refreshed = calibration.model_copy(update={"speed_reference": reference})
    save_calibration(refreshed, path)  # atomic: temporary file + rename
    return refreshed


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


def calibrate(
    out: Path,
    *,
    runs: Sequence[Path] = (),
    device: str | None = None,
    quick: bool = False,
    runs_out: Path | None = None,
    name: str | None = None,
    remote_dir: Path | None = None,
    methods: Sequence[str] | None = None,
    preset_name: str | None = None,
    scenario_path: Path | None = None,
    settings: Sequence[str] = (),
    on_message: Callable[[str], None] = lambda text: None,
):
    """`churnsim calibrate` without `--convergence`: fitted on the run records `runs`, or on the suite
    of short real runs it runs first (the suite on the model and pipeline of `preset_name`,
    `scenario_path` and `settings` where given), with the link and storage measured where no
    measurement lies beside the records; OUT written. Returns the calibration, the number of run
    records it was fitted on, and when the work started (`time.perf_counter`)."""
    import pandas as pd

    from churnsim.calibration.calibration_file import save_calibration
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.fit import build_calibration
    from churnsim.calibration.fit_timing import fit_link_profile
    from churnsim.calibration.run_record import read_run_record
    from churnsim.sim.model.calibrated import iteration_predictor, method_extra_predictor
    from churnsim.sim.checks.validate import run_record_directories

    started = time.perf_counter()
    if runs:
        directories = run_record_directories(runs)
        records = [read_run_record(directory) for directory in directories]
        device = device or _records_device(records)
        link_file = _find_measurement([Path(path) for path in runs], LINK_PROFILE_FILE)
        link_points = pd.read_csv(input_stream(link_file)) if link_file is not None else _measure_link(device, on_message)
        storage_file = _find_measurement([Path(path) for path in runs], STORAGE_FILE)
        storage = pd.read_csv(input_stream(storage_file)) if storage_file is not None else _measure_storage({"local_disk": out.resolve().parent})
    else:
        require_torch("calibrating with real runs")
        from churnsim.real.calibration_suite import full_settings, quick_settings, run_suite, suite_plan, suite_shared_cores

        suite_settings = quick_settings() if quick else full_settings()
        if preset_name is not None or scenario_path is not None or settings:
            suite_settings, device = _scenario_suite_settings(scenario_path, preset_name, settings, suite_settings, device=device)
        device = device or "cpu"
        link_points = _measure_link(device, on_message)  # first: it refuses a device this machine lacks before anything is written
        runs_out = runs_out if runs_out is not None else out.parent / f"{out.stem}-runs"
        runs_out.mkdir(parents=True, exist_ok=True)
        link_points.to_csv(runs_out / LINK_PROFILE_FILE, index=False)
        tiers = {"local_disk": runs_out}
        if remote_dir is not None:
            tiers["remote"] = remote_dir
        storage = _measure_storage(tiers)
        storage.to_csv(runs_out / STORAGE_FILE, index=False)
        plan = suite_plan(suite_settings, device=device, shared_cores=suite_shared_cores(device), methods=methods)
        on_message(f"running {len(plan)} short real runs into {runs_out} ...")

        def done(run, seconds: float) -> None:
            on_message(f"  {run.run_id}: {seconds:.1f} s")

        directories = run_suite(plan, runs_out, on_run_done=done)
        records = [read_run_record(directory) for directory in directories]
    real_settings = records[0].manifest.real_settings
    if real_settings is None:
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
    calibration = calibration.model_copy(update={"speed_reference": _speed_reference_for(records, device, on_message)})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(calibration, out)  # atomic: temporary file + rename
    return calibration, len(records), started


def _speed_reference_for(records, device: str, on_message: Callable[[str], None]):
    """The probe timed now, where these records ran on this machine (they did when the suite just ran
    them) and torch is here; else None, said in one line."""
    from churnsim.extras import has_torch

    elsewhere = next((other for record in records if (other := other_machine(record.manifest.hardware)) is not None), None)
    why = None
    if elsewhere is not None:
        why = f"the records do not show they ran on this machine: {elsewhere}"
    elif not has_torch():
        why = "PyTorch is not installed"
    elif device == "cuda":
        import torch

        why = None if torch.cuda.is_available() else "the records ran on CUDA, which is not available here"
    if why is not None:
        on_message(f"speed reference: not measured ({why}); validation will not tell the machine's drift from the model's error")
        return None
    return measure_speed_reference(device, on_message)


def validate(
    run_directories: Sequence[Path], calibration_name: str, *, out: Path, overwrite: bool = False, speed_probe: bool = True,
    on_message: Callable[[str], None] = lambda text: None,
):
    """`churnsim validate`: held-out run records replayed on the calibration named (a file or a
    built-in name), validation.csv and the manifest written to `out`; the report
    (`sim.checks.validate.ValidationReport`). `speed_probe`: time the machine's speed probe against
    the calibration's reference (`speed_probe_comparison`) where it can."""
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.tables import write_table
    from churnsim.out_directory import prepare_out_directory
    from churnsim.sim.studies.outputs import write_manifest
    from churnsim.sim.checks.validate import load_held_out_records, validate_records

    calibration = resolve_calibration(calibration_name)
    records = load_held_out_records(run_directories, calibration)  # every input checked before --out is touched
    prepare_out_directory(out, command="validate", subject=calibration.name, overwrite=overwrite)
    probe = speed_probe_comparison(calibration, run_probe=speed_probe, on_message=on_message)
    report = validate_records(records, calibration, speed_probe=probe)
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
    return report


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
    from churnsim.calibration.presets import build_scenario
    from churnsim.calibration.scenario_overrides import apply_settings, parse_settings
    from churnsim.options import scenario_argument
    from churnsim.calibration.errors import InputError
    from churnsim.real.calibration_suite import SHAPE_ITERATIONS, SHAPE_SCENARIO_FIELDS, scenario_suite_settings, suite_shapes, suite_shared_cores
    from churnsim.real.scenario_run import check_fits_machine

    if scenario_path is None and preset_name is None:
        preset_name = "cpu-tiny"
    source, overrides = scenario_argument(scenario_path, preset_name), parse_settings(settings)

    def suite_scenario(shape: dict[str, object]):
        # Only the model, pipeline and training are calibrated; the suite picks its own methods (--method).
        return build_scenario(source, settings={**overrides, **shape}, methods=("none",))

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
"""100 times the default (2 seeds × 1,000 iterations, minutes on a CPU)."""


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
    device: str = "cpu", on_message: Callable[[str], None] = lambda text: None,
):
    """`calibrate --convergence`: the lab's per-rebuild table beside OUT, and OUT = BASE with measured
    setbacks; returns the table (its rows and its path) and when the work started (`time.perf_counter`)."""
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.calibration_file import save_calibration
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.fit_setbacks import lab_failure_span, with_lab_setbacks
    from churnsim.calibration.run_record import provenance_fields

    if num_iterations < 50 or num_failure_points < 1:
        raise InputError("--lab-iterations must be >= 50 and --failure-points >= 1")
    if num_iterations > MAX_LAB_ITERATIONS:
        raise InputError(
            f"--lab-iterations {num_iterations}: more than the limit of {MAX_LAB_ITERATIONS:,} (a lab that long takes "
            "many hours on a CPU); use fewer"
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
        on_message(
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
    return rows, table_path, started
