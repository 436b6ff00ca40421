"""How much do identical real runs on this machine differ in speed, and does a probe beforehand see it?

Runs `--runs` identical no-failure real runs of `cpu-tiny` back to back (`churnsim real run`, method
`none`, no churn, `--steps` steps, extra `--set` settings as given). Before each it times a fixed
one-thread probe (60 products of two 256 × 256 matrices, best of three). For every run: the probe
and the median steady step (`calibration.fit_timing.steady_iteration_times_s`: the steps that
calibration and validation time), and the median of each half of those steps. It answers whether the absolute validation error of issue 9
can be below the machine's own run-to-run noise, and whether a measurement before a run could
correct for it. With CHURNSIM_PIN_STAGES=1 each stage process runs on a core of its own, and the
entry says so. Appends to benchmarks/results/identical-runs-spread.json (one entry per call). A
benchmark, not a test: minutes of real runs; run nothing else beside it.

    python benchmarks/identical_runs_spread.py [--runs 10] [--steps 120] [--set pipeline.num_stages=2 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import RESULTS_DIRECTORY, machine  # noqa: E402
from report import add_report_option, report_if_asked  # noqa: E402

from churnsim.calibration.fit_timing import steady_iteration_times_s  # noqa: E402
from churnsim.calibration.run_record import read_run_record  # noqa: E402
from churnsim.real.cpu_placement import pinning_requested  # noqa: E402

RESULTS_FILE = RESULTS_DIRECTORY / "identical-runs-spread.json"


def probe_s() -> float:
    import torch

    torch.set_num_threads(1)
    matrix = torch.randn(256, 256)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(60):
            matrix @ matrix
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE")
    add_report_option(parser)
    arguments = parser.parse_args()
    settings = [f"target.iterations={arguments.steps}", "target.loss=null", "churn.failures_per_node_hour=0", *arguments.settings]
    rows = []
    for index in range(arguments.runs):
        probe = probe_s()
        with tempfile.TemporaryDirectory() as directory:
            run_directory = Path(directory) / "run"
            command = [sys.executable, "-m", "churnsim", "real", "run", "--preset", "cpu-tiny", "--method", "none", "--out", str(run_directory)]
            for setting in settings:
                command += ["--set", setting]
            subprocess.run(command, check=True, capture_output=True)
            steps = steady_iteration_times_s(read_run_record(run_directory)).tolist()  # as calibration and validation take them
        half = len(steps) // 2
        row = {
            "probe_s": probe,
            "median_step_s": statistics.median(steps),
            "first_half_median_step_s": statistics.median(steps[:half]),
            "second_half_median_step_s": statistics.median(steps[half:]),
        }
        rows.append(row)
        print(f"run {index}: probe {1000 * probe:.1f} ms, median step {1000 * row['median_step_s']:.1f} ms "
              f"(halves {1000 * row['first_half_median_step_s']:.1f} / {1000 * row['second_half_median_step_s']:.1f})", flush=True)
    medians = [row["median_step_s"] for row in rows]
    typical = statistics.median(medians)
    summary = {
        "settings": settings,
        "stage_processes_pinned": pinning_requested(),  # CHURNSIM_PIN_STAGES=1 (real/cpu_placement.py)
        "runs": rows,
        "median_step_range_s": [min(medians), max(medians)],
        "median_run_from_typical": statistics.median(abs(value / typical - 1) for value in medians),
        "probe_range_s": [min(row["probe_s"] for row in rows), max(row["probe_s"] for row in rows)],
        "machine": machine(),
    }
    print(f"median steps {1000 * min(medians):.1f}–{1000 * max(medians):.1f} ms; a run {100 * summary['median_run_from_typical']:.1f} % "
          f"from the typical one (median); probe {1000 * summary['probe_range_s'][0]:.1f}–{1000 * summary['probe_range_s'][1]:.1f} ms")
    earlier = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else []
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps([*earlier, summary], indent=2) + "\n")
    print(f"wrote {RESULTS_FILE}")
    report_if_asked(arguments, "identical-runs-spread", RESULTS_FILE)


if __name__ == "__main__":
    main()
