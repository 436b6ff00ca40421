"""How often the validation median's 95 % interval holds the true median, in a simulated benchmark.

    python benchmarks/bootstrap_coverage.py

Errors like the benchmark's (lognormal, true median 5 %) in 4 rounds of 8 runs, each round shifted
by a level of its own (its calibration, its spell of the machine), 150 times: the share of
intervals that hold 5 %, for the two-stage bootstrap the benchmark uses (rounds, then runs within
them; `median_with_ci95`) and for the runs resampled as if independent. Seeded: the same figures
every time. tests/calibration/test_statistics.py checks the first is at least 80 %.
"""

from __future__ import annotations

import numpy as np

from churnsim.calibration.statistics import median_with_ci95

TRUE_MEDIAN = 0.05
NUM_ROUNDS, RUNS_PER_ROUND, REPETITIONS, RESAMPLES = 4, 8, 150, 400
ROUND_LOG_SD, RUN_LOG_SD = 0.3, 0.5


def coverage(*, rounds_as_units: bool, seed: int = 11) -> float:
    generator = np.random.default_rng(seed)
    covered = 0
    for _ in range(REPETITIONS):
        rounds = [TRUE_MEDIAN * np.exp(ROUND_LOG_SD * generator.standard_normal() + RUN_LOG_SD * generator.standard_normal(RUNS_PER_ROUND))
                  for _ in range(NUM_ROUNDS)]
        groups = rounds if rounds_as_units else [np.concatenate(rounds)]
        _, low, high = median_with_ci95(groups, resamples=RESAMPLES)
        covered += low <= TRUE_MEDIAN <= high
    return covered / REPETITIONS


def main() -> None:
    print(f"{NUM_ROUNDS} rounds of {RUNS_PER_ROUND} runs, {REPETITIONS} repetitions: the 95 % interval holds the true median in")
    print(f"  {100 * coverage(rounds_as_units=True):.0f} % with rounds as the units (two-stage bootstrap)")
    print(f"  {100 * coverage(rounds_as_units=False):.0f} % with the runs resampled as if independent")


if __name__ == "__main__":
    main()
