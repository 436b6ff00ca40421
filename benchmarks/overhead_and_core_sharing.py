"""The figures of README "How the compute model works" (overhead fit, core sharing), from committed tables.

    python benchmarks/overhead_and_core_sharing.py

One `calibrate --quick` (2 cores) was refitted four ways from the same 13 calibration
runs, and the same 30 no-failure runs (6 each of the calibrated setup, 3 and 6 stages, 6
microbatches and GPipe; seed 100, run right after it) were validated against each:
`before` (the overhead fitted with a zero as 1e-9 by relative errors), `fixed` (the fit as it is
now), and two placements of stage processes on the cores that were tried and not kept (their code
as diffs beside the tables): `stage-fixed-on-core` (stage s on core s mod 2, never moved) and
`home-core` (on that core unless a core would idle). The tables are in
benchmarks/results/overhead-fit-and-core-sharing/; the runs themselves are not committed (150 MB).
This prints, per variant, each setup's median steady step over the prediction and median
|wall-clock error|, and the latter over the 24 runs of the setups the calibration did not run; then
the 3-stage runs' median steady step over the prediction (the twin and the three methods) in each round of the first two
benchmark runs (benchmarks/calibrate_and_validate.py, committed tables).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

TABLES = Path(__file__).parent / "results" / "overhead-fit-and-core-sharing"
VARIANTS = ("before", "fixed", "stage-fixed-on-core", "home-core")
EARLIER_BENCHMARK_RUNS = ("calibrate-and-validate-runs/2026-11-27-43fdab7", "calibrate-and-validate-runs/2026-11-27-1c65ef9")


def main() -> None:
    for variant in VARIANTS:
        table = pd.read_csv(TABLES / f"validation-{variant}.csv")
        table["setup"] = table["run_id"].str.extract(r"^r0-(.*)-none-twin")[0]
        steady = table[table["quantity"] == "steady_iteration_s"]
        factor = (steady["measured"] / steady["predicted"]).groupby(steady["setup"]).median()
        wall = table[table["quantity"] == "total_wall_clock_s"]
        error = wall["relative_error"].abs().groupby(wall["setup"]).median()
        others = wall.loc[wall["setup"] != "calibrated", "relative_error"].abs().median()
        print(f"{variant}: uncalibrated setups' median |wall-clock error| {100 * others:.1f} % over {int((wall['setup'] != 'calibrated').sum())} runs")
        for setup in factor.index:
            print(f"  {setup:16s} steady step {factor[setup]:.3f}× predicted, |wall-clock error| {100 * error[setup]:.1f} %")
    factors = []
    for run in EARLIER_BENCHMARK_RUNS:
        for path in sorted((TABLES.parent / run).glob("calibrate-and-validate-round-*.csv")):
            table = pd.read_csv(path)
            runs = table[(table["quantity"] == "steady_iteration_s") & table["run_id"].str.contains("-3-stages-")]
            factors.append(float((runs["measured"] / runs["predicted"]).median()))
    print("3 stages in the first two benchmark runs, median steady step over the prediction per round: " + ", ".join(f"{f:.2f}×" for f in factors))


if __name__ == "__main__":
    main()
