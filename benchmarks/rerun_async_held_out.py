"""Run the validation benchmark's async_checkpoint held-out runs again with the current code and
validate them with the calibrations of the benchmark's own rounds.

    python benchmarks/rerun_async_held_out.py --benchmark-out DIR [--out DIR] [--first-seed 100]

DIR is the `--out` of an earlier `benchmarks/calibrate_and_validate.py --recalibrate-each-round`
run (its round-N/cpu-tiny.json are read). Each round's async_checkpoint run and its seed's
no-failure twin run again with the same seeds, setup and failure times, so a change of the real
engine can be judged on the runs that showed the problem, against the same predictions. Writes
OUT/round-N (run records), OUT/validation-N and prints the errors beside the earlier ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from calibrate_and_validate import round_plan, round_seeds, validate_runs  # noqa: E402

QUANTITIES = ("total_wall_clock_s", "time_to_target_s")


def _errors(table: pd.DataFrame) -> str:
    rows = table[table["run_id"].str.contains("async_checkpoint") & table["quantity"].isin(QUANTITIES)]
    return ", ".join(
        f"{row.quantity} {100 * row.relative_error:+.1f} % ({100 * row.load_normalised_relative_error:+.1f} % load-normalised)"
        for row in rows.itertuples()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmark-out", type=Path, required=True, help="the --out of an earlier calibrate_and_validate.py run")
    parser.add_argument("--out", type=Path, default=Path("churnsim-async-rerun"))
    parser.add_argument("--first-seed", type=int, default=100, help="the earlier run's --first-seed")
    arguments = parser.parse_args()
    from churnsim.real.calibration_suite import run_suite

    round_index = 0
    while (calibration := arguments.benchmark_out / f"round-{round_index}" / "cpu-tiny.json").is_file():
        plan = round_plan(round_index, round_seeds(arguments.first_seed, round_index), other_setups=False)
        chosen = [run for run in plan if "-async_checkpoint-" in run.run_id]
        seed = chosen[0].run_id.rsplit("-s", 1)[1]
        chosen += [run for run in plan if run.run_id.endswith(f"-none-twin-s{seed}")]
        held_out = arguments.out / f"round-{round_index}"
        run_suite(chosen, held_out, on_run_done=lambda run, seconds: print(f"  {run.run_id}: {seconds:.1f} s", flush=True))
        table = validate_runs(held_out, calibration, arguments.out / f"validation-{round_index}")
        earlier = arguments.benchmark_out / f"round-{round_index}" / "validation" / "validation.csv"
        print(f"round {round_index}: now {_errors(table)}")
        if earlier.is_file():
            print(f"round {round_index}: earlier {_errors(pd.read_csv(earlier))}")
        round_index += 1
    if round_index == 0:
        parser.error(f"--benchmark-out {arguments.benchmark_out}: no round-0/cpu-tiny.json; give the --out of a --recalibrate-each-round run")


if __name__ == "__main__":
    main()
