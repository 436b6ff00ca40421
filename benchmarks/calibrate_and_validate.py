"""End to end on this machine: calibrate --quick, held-out real runs, validate; print the error table.

    python benchmarks/calibrate_and_validate.py [--out DIR] [--rates 120,360] [--seeds 100,101]

1. `churnsim calibrate --quick` into OUT/cpu-tiny.json (fit runs in OUT/calibration-runs): the
   procedure that makes the built-in calibration cpu-tiny, so the table validates that file;
2. held-out real runs of every method of the `cpu-tiny` preset, with seeds the calibration never
   saw, at each failure rate (failures per node-hour of the preset's Poisson churn): each run
   injects the failure path `churnsim simulate` samples for the same scenario, into OUT/held-out;
3. `churnsim validate` of the held-out runs into OUT/validation, then the median absolute relative
   error of predicted total wall-clock per method (target: <= 5 %).

A benchmark, not a test: it takes several minutes and its numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def _churnsim(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "churnsim", *arguments], check=True)


def held_out_runs(out: Path, rates: tuple[float, ...], seeds: tuple[int, ...]) -> list[Path]:
    from churnsim.calibration.presets import preset
    from churnsim.calibration.scenario_overrides import apply_settings
    from churnsim.real.calibration_suite import SuiteRun, run_suite
    from churnsim.real.scenario_run import training_config

    base = preset("cpu-tiny")
    plan = []
    for rate in rates:
        for index, method in enumerate(base.methods):
            seed = seeds[index % len(seeds)]
            scenario = apply_settings(base, {"churn.failures_per_node_hour": rate, "seed": seed}).only_method(method.name)
            plan.append(
                SuiteRun(
                    run_id=f"held-out-{method.name}-{rate:g}-per-hour-s{seed}",
                    purpose="held_out",
                    config=training_config(scenario, scenario.methods[0]),
                    scenario=scenario,
                )
            )
    print(f"{len(plan)} held-out runs ...", flush=True)
    return run_suite(plan, out, on_run_done=lambda run, seconds: print(f"  {run.run_id}: {seconds:.1f} s", flush=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("churnsim-benchmark-calibration"))
    parser.add_argument("--rates", default="120,360", help="failures per node-hour of the cpu-tiny preset's Poisson churn")
    parser.add_argument("--seeds", default="100,101", help="seeds of the held-out runs (never the calibration's)")
    parser.add_argument("--calibration", type=Path, default=None, help="reuse this calibration instead of running calibrate --quick")
    arguments = parser.parse_args()
    out: Path = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    rates = tuple(float(value) for value in arguments.rates.split(","))
    seeds = tuple(int(value) for value in arguments.seeds.split(","))

    calibration = arguments.calibration
    if calibration is None:
        calibration = out / "cpu-tiny.json"
        started = time.perf_counter()
        _churnsim("calibrate", "--quick", "--out", str(calibration), "--runs-out", str(out / "calibration-runs"))
        print(f"calibrate --quick took {time.perf_counter() - started:.0f} s", flush=True)
    started = time.perf_counter()
    held_out_runs(out / "held-out", rates, seeds)
    print(f"held-out runs took {time.perf_counter() - started:.0f} s", flush=True)
    _churnsim("validate", "--calibration", str(calibration), str(out / "held-out"), "--out", str(out / "validation"))

    import pandas as pd

    from churnsim.sim.validate import median_absolute_error

    table = pd.read_csv(out / "validation" / "validation.csv")
    for quantity in ("total_wall_clock_s", "mean_iteration_s", "time_to_target_s"):
        errors = median_absolute_error(table, quantity)
        print(f"\nmedian |relative error| of {quantity} per method:")
        print(errors.to_string(index=False, float_format=lambda value: f"{value:.3f}"))


if __name__ == "__main__":
    main()
