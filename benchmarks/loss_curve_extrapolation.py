"""How far does a baseline loss curve fitted on short runs carry, with and without its exponent's bound?

Reads the committed losses of no-failure `cpu-tiny` runs (tests/calibration/data/
cpu-tiny-no-failure-losses.csv: the two 100-iteration runs of `calibrate --quick` and eight
320-iteration runs) and, for each exponent bound (10, the fit before the bound; 1; 0.76, the bound
now: `calibration.fit_convergence.MAXIMUM_CURVE_EXPONENT`):
- the curve fitted on the two short runs: floor, exponent, r², and for each long run whether its
  own time-to-target goal lies above that floor and, if so, how many iterations later than the run
  the curve's trailing mean reaches it (`sim.validate.progress_for_smoothed_loss`);
- each long run fitted on its own first 100 iterations: its trailing-mean loss at iteration 319
  against the run's.
Also each long run fitted freely on its whole length. No timing: the same numbers every run.
Writes benchmarks/results/loss-curve-extrapolation.json.

    python benchmarks/loss_curve_extrapolation.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import RESULTS_DIRECTORY  # noqa: E402
from report import add_report_option, report_if_asked  # noqa: E402

from churnsim.calibration.fit_convergence import MAXIMUM_CURVE_EXPONENT, fit_baseline_curve  # noqa: E402
from churnsim.sim.checks.validate import SMOOTHING_ITERATIONS, progress_for_smoothed_loss, reached_own_goal, smoothed_loss  # noqa: E402

LOSSES_FILE = Path(__file__).resolve().parent.parent / "tests" / "calibration" / "data" / "cpu-tiny-no-failure-losses.csv"
RESULTS_FILE = RESULTS_DIRECTORY / "loss-curve-extrapolation.json"
SHORT_RUNS = ("fit-none-s0", "fit-none-s1")
BOUNDS = (10.0, 1.0, MAXIMUM_CURVE_EXPONENT)
SHORT_ITERATIONS = 100
LAST_ITERATION = 319


def _rounded(value: float) -> float:
    return round(float(value), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_report_option(parser)
    arguments = parser.parse_args()
    frame = pd.read_csv(LOSSES_FILE)
    runs = {str(run_id): rows.drop(columns="run_id").reset_index(drop=True) for run_id, rows in frame.groupby("run_id")}
    long_runs = {run_id: metrics for run_id, metrics in runs.items() if run_id not in SHORT_RUNS}
    result: dict = {"benchmark": "loss_curve_extrapolation", "losses": str(LOSSES_FILE.relative_to(LOSSES_FILE.parents[3])), "bounds": {}}
    result["long_runs_fitted_freely"] = {
        run_id: _rounded(fit_baseline_curve(metrics, maximum_exponent=10.0).exponent) for run_id, metrics in long_runs.items()
    }
    for bound in BOUNDS:
        curve = fit_baseline_curve([runs[run_id] for run_id in SHORT_RUNS], maximum_exponent=bound)
        lateness = {}
        for run_id, metrics in long_runs.items():
            goal, measured = reached_own_goal(metrics)
            lateness[run_id] = None if goal <= curve.floor_loss else _rounded(progress_for_smoothed_loss(curve, goal) / measured - 1)
        too_high = {}
        for run_id, metrics in long_runs.items():
            own = fit_baseline_curve(metrics.head(SHORT_ITERATIONS), maximum_exponent=bound)
            curve_mean = np.mean([own.loss(float(LAST_ITERATION - back)) for back in range(SMOOTHING_ITERATIONS)])
            too_high[run_id] = _rounded(curve_mean - smoothed_loss(metrics).iloc[LAST_ITERATION])
        reached = [value for value in lateness.values() if value is not None]
        result["bounds"][str(bound)] = {
            "short_runs_curve": {"floor_loss": _rounded(curve.floor_loss), "exponent": _rounded(curve.exponent), "r_squared": _rounded(curve.r_squared or 0.0)},
            "goal_reached_later_than_the_run": lateness,
            "goals_above_the_floor": f"{len(reached)} of {len(lateness)}",
            "median_lateness": _rounded(np.median(reached)) if reached else None,
            "own_first_100_loss_at_319_too_high_by": too_high,
            "median_too_high_by": _rounded(np.median(list(too_high.values()))),
        }
        summary = result["bounds"][str(bound)]
        print(
            f"exponent at most {bound:g}: short runs' curve floor {summary['short_runs_curve']['floor_loss']}, exponent "
            f"{summary['short_runs_curve']['exponent']}, r² {summary['short_runs_curve']['r_squared']}; long runs' goals above its floor "
            f"{summary['goals_above_the_floor']}, reached a median {summary['median_lateness']} later; each run's first 100 "
            f"iterations put iteration 319 a median {summary['median_too_high_by']} too high"
        )
    exponents = result["long_runs_fitted_freely"].values()
    print(f"long runs fitted freely on their whole length: exponents {min(exponents)}–{max(exponents)}")
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS_FILE}")
    report_if_asked(arguments, "loss-curve-extrapolation", RESULTS_FILE)


if __name__ == "__main__":
    main()
