"""Per-iteration cost of `checkpoint` and `async_checkpoint` against `none` in real pipeline runs (CPU).

Runs the tiny model (`--stages` processes, `--iterations` iterations, no failures) with `none` and
with both checkpoint methods at every interval of `--intervals`, all in one process group and in
one run, `--repeats` times in rotating order; reports medians:

- iteration_ratio:  mean iteration time / that of `none` (iterations after `--warmup`, the last one
                    excluded because it also runs the held-out evaluation);
- blocked per save: training time blocked per checkpoint on the slowest stage (spans "save": the
                    whole synchronous write, or for the lazy engine the save() call plus the wait
                    before the next optimizer step);
- stall_fraction:   blocked time / wall time;
- cpu_ratio:        CPU time (user + system, all threads, summed over ranks) of the whole run / that
                    of `none`. On a shared or oversubscribed machine wall time swings with other
                    load; CPU time shows what the background work itself costs (kernel threads
                    such as the file system journal are not counted).

Writes `--out` as a CSV with the columns of `calibration.tables.INTERVAL_COLUMNS` (source "real",
time-to-target and Young/Daly columns NaN), so `churnsim plot` can draw it beside simulated
intervals. Checkpoints are written to a temporary directory on the system temp disk.

Usage: python benchmarks/real_checkpoint_overhead.py --out real_intervals.csv
       [--stages 4] [--iterations 40] [--intervals 1 5 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import resource
import tempfile
from pathlib import Path

import pandas as pd

from churnsim.calibration.methods import method_from_name
from churnsim.calibration.tables import INTERVAL_COLUMNS
from churnsim.real.distributed import Communicator
from churnsim.real.launch import run_distributed
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.trainer import TrainingConfig, train_stage


def _configs(arguments: argparse.Namespace) -> list[tuple[str, int | None]]:
    cases: list[tuple[str, int | None]] = [("none", None)]
    for method in ("checkpoint", "async_checkpoint"):
        cases += [(method, interval) for interval in arguments.intervals]
    return cases


def _training_config(method: str, interval: int | None, arguments: argparse.Namespace) -> TrainingConfig:
    parameters = {"interval_iterations": interval} if interval is not None else {}
    return TrainingConfig(
        model=MODEL_PRESETS["tiny"],
        num_stages=arguments.stages,
        num_microbatches=arguments.microbatches,
        microbatch_size=2,
        num_iterations=arguments.iterations,
        seed=0,
        method=method_from_name(method, **parameters),
        corpus_max_bytes=500_000,
        timeout_s=120,
    )


def _worker(communicator: Communicator, arguments: argparse.Namespace, root: str) -> list[dict]:
    """Every case `repeats` times, the order rotated per repeat so drift does not favour one case."""
    cases = _configs(arguments)
    # Warm-up, discarded: the first run pays for loading the corpus and first-touch allocations.
    train_stage(_training_config("none", None, arguments), communicator)
    measurements = []
    for repeat in range(arguments.repeats):
        rotated = cases[repeat % len(cases) :] + cases[: repeat % len(cases)]
        for method, interval in rotated:
            run_dir = Path(root) / f"{method}-{interval}-{repeat}"
            usage_before = resource.getrusage(resource.RUSAGE_SELF)
            result = train_stage(_training_config(method, interval, arguments), communicator, run_dir=run_dir)
            usage_after = resource.getrusage(resource.RUSAGE_SELF)
            cpu_s = (usage_after.ru_utime + usage_after.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
            blocked_s = sum(span["end_s"] - span["start_s"] for span in result.spans if span["kind"] == "save")
            measurements.append(
                {
                    "method": method,
                    "interval": interval,
                    "repeat": repeat,
                    "end_s": [row["end_s"] for row in result.iteration_rows],
                    "blocked_s": blocked_s,
                    "cpu_s": cpu_s,
                }
            )
    return measurements


def summarise(per_rank: list[list[dict]], arguments: argparse.Namespace) -> pd.DataFrame:
    rows = []
    for index in range(len(per_rank[0])):
        runs = [rank[index] for rank in per_rank]
        # A step ends when its slowest rank ends; blocked time is that of the slowest stage.
        end_s = [max(values) for values in zip(*(run["end_s"] for run in runs))]
        measured = end_s[arguments.warmup : len(end_s) - 1]
        iteration_s = (measured[-1] - measured[0]) / (len(measured) - 1)
        interval = runs[0]["interval"]
        num_saves = arguments.iterations // interval if interval else 0
        blocked_s = max(run["blocked_s"] for run in runs)
        rows.append(
            {
                "method": runs[0]["method"],
                "interval_iterations": interval,
                "repeat": runs[0]["repeat"],
                "iteration_s": iteration_s,
                "wall_s": end_s[-1],
                "blocked_s": blocked_s,
                "blocked_per_save_s": blocked_s / num_saves if num_saves else 0.0,
                "cpu_s": sum(run["cpu_s"] for run in runs),
            }
        )
    frame = pd.DataFrame(rows)
    medians = (
        frame.groupby(["method", "interval_iterations"], dropna=False)[["iteration_s", "wall_s", "blocked_s", "blocked_per_save_s", "cpu_s"]]
        .median()
        .reset_index()
    )
    reference_s = float(medians.loc[medians["method"] == "none", "iteration_s"].iloc[0])
    medians["iteration_ratio"] = medians["iteration_s"] / reference_s
    medians["stall_fraction"] = medians["blocked_s"] / medians["wall_s"]
    medians["cpu_ratio"] = medians["cpu_s"] / float(medians.loc[medians["method"] == "none", "cpu_s"].iloc[0])
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="CSV with calibration.tables.INTERVAL_COLUMNS")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 5, 10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the timing")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="churnsim-overhead-") as root:
        per_rank = run_distributed(_worker, arguments.stages, arguments, root, timeout_s=300)
    medians = summarise(per_rank, arguments)
    print(f"tiny model, {arguments.stages} stages, {arguments.iterations} iterations, median of {arguments.repeats}:")
    print(f"{'method':<18}{'K':>4}{'iteration ms':>14}{'× none':>9}{'blocked/save ms':>17}{'stall':>8}{'cpu × none':>12}")
    for row in medians.itertuples():
        interval = "-" if pd.isna(row.interval_iterations) else int(row.interval_iterations)
        print(
            f"{row.method:<18}{interval:>4}{row.iteration_s * 1e3:>14.1f}{row.iteration_ratio:>9.3f}"
            f"{row.blocked_per_save_s * 1e3:>17.2f}{row.stall_fraction:>8.3f}{row.cpu_ratio:>12.3f}"
        )
    table = medians[medians["method"] != "none"].assign(
        source="real",
        interval_iterations=lambda frame: frame["interval_iterations"].astype(int),
        time_to_target_mean_s=math.nan,
        time_to_target_ci95_low_s=math.nan,
        time_to_target_ci95_high_s=math.nan,
        young_interval_iterations=math.nan,
        daly_interval_iterations=math.nan,
    )
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    table.loc[:, list(INTERVAL_COLUMNS)].to_csv(arguments.out, index=False)
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
