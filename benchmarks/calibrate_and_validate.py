"""End to end on this machine: calibrate --quick, held-out real runs, validate; print the error table.

    python benchmarks/calibrate_and_validate.py [--out DIR] [--rates 0.1,0.33] [--seeds 100,101]

1. `churnsim calibrate --quick` into OUT/cpu-tiny.json (fit runs in OUT/calibration-runs): the
   procedure that makes the built-in calibration cpu-tiny, so the table validates that file;
2. held-out real runs of every method real runs implement, with seeds the calibration never saw,
   at each failure rate: failures sampled by the real-run sampler (real/failure_sources.py: an
   hourly per-stage probability scaled through a nominal 60 s iteration), into OUT/held-out;
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
    from churnsim.real.calibration_suite import SuiteRun, quick_settings, registered_methods, run_suite, training_config
    from churnsim.real.failure_sources import sample_failures

    settings = quick_settings()
    plan = []
    for rate in rates:
        for index, method in enumerate(registered_methods()):
            seed = seeds[index % len(seeds)]
            failures = sample_failures(
                rate, num_stages=4, num_iterations=settings.num_iterations, seed=seed * 1000 + round(rate * 100)
            )
            plan.append(
                SuiteRun(
                    run_id=f"held-out-{method}-{round(rate * 100)}pct-s{seed}",
                    purpose="held_out",
                    config=training_config(settings, method=method, seed=seed, failures=failures),
                    failure_rate_per_stage_hour=rate,
                )
            )
    print(f"{len(plan)} held-out runs ...", flush=True)
    return run_suite(plan, out, on_run_done=lambda run, seconds: print(f"  {run.run_id}: {len(run.config.failures)} failures, {seconds:.1f} s", flush=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("churnsim-benchmark-calibration"))
    parser.add_argument("--rates", default="0.1,0.33", help="failure probabilities per stage-hour")
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
