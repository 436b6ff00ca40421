"""Does calibrating on the setup you run beat carrying a calibration to it? Runs of the 3-stage and GPipe setups.

    python benchmarks/calibrate_on_the_setup.py [--out DIR] [--passes 2] [--setups 3-stages,gpipe] [--first-seed 7]

The calibrate-and-validate benchmark predicts six setups the calibration did not run, and two of
them come out worst (see its report): 3 stages of a 6-layer model and the GPipe schedule, whose
runs are slower than the compute model carries the 4-stage 1F1B calibration to them.
`churnsim calibrate --set ...` can calibrate on the setup itself. For each setup and pass:

1. `churnsim calibrate --quick --set <the setup>` (its own calibration), just before the runs;
2. held-out real runs of the setup: methods none, checkfree and checkpoint, two seeds each
   (`churnsim real run --preset cpu-tiny --set <the setup> --set seed=S`, failures at cpu-tiny's rate);
3. `churnsim calibrate --quick` (the default 4-stage 1F1B suite), just after them;
4. `churnsim validate` of the runs against each: per method the median |relative error| of the total
   wall-clock, absolute and load-normalised, and the runs' steady steps over each prediction.

The two calibrations bracket the runs in time, so a drift of the machine during the pass does not
favour one of them. Results: benchmarks/results/calibrate-on-the-setup.json. A benchmark, not a
test: about 5 minutes per setup and pass on 2 cores; run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from calibrate_and_validate import OTHER_SETUPS
from report import add_report_option, report_if_asked

RESULTS_FILE = Path(__file__).parent / "results" / "calibrate-on-the-setup.json"
METHODS = ("none", "checkfree", "checkpoint")


def _churnsim(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "churnsim", *arguments], check=True, stdout=subprocess.DEVNULL)


def _set_flags(setup: str) -> list[str]:
    return [flag for path, value in OTHER_SETUPS[setup].items() for flag in ("--set", f"{path}={value}")]


def validation_figures(runs: Path, calibration: Path) -> dict:
    """Per method the median |relative error| of the total wall-clock (absolute, load-normalised) and
    the runs' steady steps over the calibration's prediction (`sim.validate.machine_speed`)."""
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.sim.checks.validate import load_held_out_records, machine_speed, median_absolute_error, validate_records

    loaded = resolve_calibration(str(calibration))
    report = validate_records(load_held_out_records([runs], loaded), loaded)
    errors = median_absolute_error(report.table)
    speed = machine_speed(report.table)
    return {
        "per_method": {
            row.method: {"absolute": row.median_absolute_relative_error, "load_normalised": row.median_load_normalised_absolute_relative_error, "runs": int(row.num_runs)}
            for row in errors.itertuples()
        },
        "steady_step_over_prediction": None if speed is None else speed.median_factor,
    }


def one_pass(out: Path, setup: str, seeds: tuple[int, int]) -> dict:
    flags = _set_flags(setup)
    started = time.perf_counter()
    own, default, runs = out / "own-setup.json", out / "default-setup.json", out / "runs"
    _churnsim("calibrate", "--quick", *flags, "--out", str(own))
    for seed in seeds:
        for method in METHODS:
            _churnsim("real", "run", "--preset", "cpu-tiny", "--method", method, *flags, "--set", f"seed={seed}", "--out", str(runs / f"{method}-s{seed}"))
    _churnsim("calibrate", "--quick", "--out", str(default))
    return {
        "setup": setup,
        "settings": OTHER_SETUPS[setup],
        "seeds": list(seeds),
        "own_setup_calibration": validation_figures(runs, own),
        "default_calibration": validation_figures(runs, default),
        "seconds": time.perf_counter() - started,
    }


def _print(result: dict) -> None:
    for arm in ("own_setup_calibration", "default_calibration"):
        figures = result[arm]
        methods = ", ".join(
            f"{method} {100 * values['absolute']:.1f} % / {100 * values['load_normalised']:.1f} %" for method, values in figures["per_method"].items()
        )
        print(f"  {result['setup']}, seeds {result['seeds']}, {arm.replace('_', ' ')}: {methods}; steps {figures['steady_step_over_prediction']:.2f}× the prediction")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("churnsim-benchmark-calibrate-on-the-setup"))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--setups", default="3-stages,gpipe", help=f"comma-separated, of {', '.join(OTHER_SETUPS)}")
    parser.add_argument("--first-seed", type=int, default=7)
    add_report_option(parser)
    arguments = parser.parse_args()
    setups = [setup for setup in arguments.setups.split(",") if setup]
    unknown = [setup for setup in setups if setup not in OTHER_SETUPS or not OTHER_SETUPS[setup]]
    if unknown or arguments.passes < 1:
        parser.error(f"--setups {unknown}: use setups with settings among {', '.join(name for name, settings in OTHER_SETUPS.items() if settings)}; --passes >= 1")
    results = []
    for index in range(arguments.passes):
        seeds = (arguments.first_seed + 10 * index, arguments.first_seed + 10 * index + 1)
        for setup in setups:
            print(f"pass {index}, {setup} ...", flush=True)
            result = one_pass(arguments.out / f"pass-{index}" / setup, setup, seeds)
            _print(result)
            results.append(result)
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps({
        "benchmark": "the same held-out runs validated against a calibration of their own setup (made before them) and the default one (after them)",
        # The settings that shape the result; --out is where this machine kept the runs, not part of it.
        "command": f"python benchmarks/calibrate_on_the_setup.py --passes {arguments.passes} --setups {','.join(setups)} --first-seed {arguments.first_seed}",
        "methods": list(METHODS),
        "passes": results,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS_FILE}")
    report_if_asked(arguments, "calibrate-on-the-setup", RESULTS_FILE)


if __name__ == "__main__":
    main()
