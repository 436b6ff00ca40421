"""The convergence lab on a deeper or wider model than cpu-tiny, trained as long as a time budget allows.

    python benchmarks/convergence_lab_larger_model.py --out DIR [--device cpu|cuda] [--budget-s 1800]
        [--seeds 0,1] [--layers 8 --dim 64 --stages 4 ...]
    python benchmarks/convergence_lab_larger_model.py --out DIR --combine DIR1 DIR2   # pool runs of other seeds

Why: on cpu-tiny (4 layers of width 64, one layer per stage, 1,000 iterations) the four interior
rebuilds cannot be told apart. The CheckFree paper's ordering (weighted average < copy < random
init) is claimed for stages of several layers of a model trained long enough for adjacent layers to
become similar. This runs the same lab (real/convergence_lab.py: paired forks of the no-failure run
of each seed, same batches) on such a model, as long as the budget allows.

1. probe: every worker process (one seed per process) trains the model for a fixed window, all at
   the same time; their slowest step rate sizes the run.
2. the baseline length N is the largest multiple of 100 (≤ --max-iterations) whose whole lab
   (2 baselines of N, the forks, the held-out evaluations) fits the budget at the probed rate. If
   not even --min-iterations fits, it stops there and says so.
3. the lab; each seed's raw tables are appended to DIR as soon as it finishes (rows-raw.csv,
   curve-raw.csv), then setbacks.csv (per rebuild) and result.json (settings, probe, summary table,
   paired differences). `--combine` pools the raw tables of earlier runs of the same model and
   length (other seeds) and refits them together: one baseline curve, the summary, the pairs.

A manual experiment, not a test; the defaults are the 8-layer run in the README
(`benchmarks/results/convergence-lab-8-layers/`). With --device cuda the workers take a host's GPUs
in turn: on one H100 three processes of a 12-layer, width-256 model sharing the GPU
took 104 ms per step each, as processes on one GPU take turns on it.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_report_option, report_if_asked  # noqa: E402

from churnsim.real.convergence_lab import LabPipeline, lab_data, lab_settings, measure_setbacks, settings_for_worker
from churnsim.real.model import ModelConfig

EVALS_PER_FORK = 3  # the lab's windows 5, 10 and W
PROBE_WINDOW_S = 12.0
WORKER_STARTUP_S = 15.0  # a lab process's start: imports, corpus, CUDA context


def _probe_worker(arguments: tuple) -> dict[str, float]:
    """Seconds per training step and per held-out evaluation of one process while all workers run together."""
    settings, start_at, seed = arguments
    torch.set_num_threads(1)
    data, batches = lab_data(settings)
    pipeline = LabPipeline(settings, seed=seed, swap_odd_microbatches=False)
    for iteration in range(3):  # warm-up: kernels, allocator
        pipeline.train_step(data, iteration)
    pipeline.held_out_loss(batches)
    while time.time() < start_at:
        time.sleep(0.01)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < PROBE_WINDOW_S:
        pipeline.train_step(data, 10 + steps)
        steps += 1
    step_s = (time.perf_counter() - started) / steps
    started = time.perf_counter()
    for _ in range(5):
        pipeline.held_out_loss(batches)
    return {"step_s": step_s, "eval_s": (time.perf_counter() - started) / 5, "steps": steps}


def probe(settings, workers: int) -> dict[str, float]:
    start_at = time.time() + 40.0  # every process past its start-up (CUDA context, corpus) before the window
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_probe_worker, [(settings_for_worker(settings, w), start_at, 1000 + w) for w in range(workers)]))
    return {"step_s": max(r["step_s"] for r in results), "eval_s": max(r["eval_s"] for r in results),
            "per_worker_step_s": [r["step_s"] for r in results]}


def lab_seconds(num_iterations: int, settings_for, rate: dict[str, float], num_rounds: int, startup_s: float) -> float:
    """Predicted wall time of the lab at the probed rate (module docstring, step 2)."""
    settings = settings_for(num_iterations)
    num_methods = len(settings.methods)
    num_baselines = len({m.swaps_odd_microbatches for m in settings.methods})
    num_forks = len(settings.failure_iterations) * 2 * num_methods
    steps = num_baselines * num_iterations + num_forks * settings.window_iterations
    evals = num_baselines * (num_iterations / settings.eval_every_iterations + len(settings.failure_iterations) * EVALS_PER_FORK) + num_forks * EVALS_PER_FORK
    return num_rounds * (steps * rate["step_s"] + evals * rate["eval_s"]) + startup_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--budget-s", type=float, default=1800.0, help="wall time for the lab itself (the probe comes on top)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--workers", type=int, default=0, help="processes (default: one per seed)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--failure-points", type=int, default=10)
    parser.add_argument("--min-iterations", type=int, default=300)
    parser.add_argument("--max-iterations", type=int, default=6000)
    parser.add_argument("--corpus-max-bytes", type=int, default=2_000_000)
    parser.add_argument("--combine", type=Path, nargs="+", default=None, help="pool these earlier runs' raw tables instead of running")
    add_report_option(parser)
    arguments = parser.parse_args()
    if arguments.combine:
        code = combine(arguments.combine, arguments.out)
        if code == 0:
            report_if_asked(arguments, "convergence-lab-larger-model", arguments.out / "result.json")
        return code
    if arguments.device == "cuda" and not torch.cuda.is_available():
        print("convergence_lab_larger_model: no CUDA device here; run it on a machine with a GPU or pass --device cpu", file=sys.stderr)
        return 2
    seeds = tuple(int(s) for s in arguments.seeds.split(","))
    workers = arguments.workers or len(seeds)
    out: Path = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    model = ModelConfig(vocab_size=256, dim=arguments.dim, num_heads=arguments.heads, num_layers=arguments.layers, seq_len=arguments.seq_len)

    def settings_for(num_iterations: int):
        return lab_settings(model, num_stages=arguments.stages, num_microbatches=arguments.microbatches,
                            microbatch_size=arguments.microbatch_size, num_iterations=num_iterations,
                            num_failure_points=arguments.failure_points, device=arguments.device,
                            corpus_max_bytes=arguments.corpus_max_bytes)

    started = time.perf_counter()
    rate = probe(settings_for(1000), workers)
    probe_s = time.perf_counter() - started
    print(f"probe ({workers} processes together): {1e3 * rate['step_s']:.1f} ms per step, {1e3 * rate['eval_s']:.1f} ms per evaluation", flush=True)
    num_rounds = math.ceil(len(seeds) / workers)
    num_iterations = arguments.min_iterations
    for candidate in range(arguments.min_iterations, arguments.max_iterations + 1, 100):
        if lab_seconds(candidate, settings_for, rate, num_rounds, WORKER_STARTUP_S) <= arguments.budget_s:
            num_iterations = candidate
    settings = settings_for(num_iterations)
    predicted_s = lab_seconds(num_iterations, settings_for, rate, num_rounds, WORKER_STARTUP_S)
    if predicted_s > arguments.budget_s:
        print(f"convergence_lab_larger_model: even {num_iterations} iterations need about {predicted_s:.0f} s at the probed rate, "
              f"over --budget-s {arguments.budget_s:.0f}; raise the budget, or use fewer failure points or a smaller model", file=sys.stderr)
        return 2
    print(f"lab: {len(seeds)} seeds × {num_iterations} iterations, {len(settings.failure_iterations)} failure points × "
          f"{len(settings.methods)} methods × 2 positions; predicted {predicted_s:.0f} s", flush=True)
    for name in ("rows-raw.csv", "curve-raw.csv"):
        (out / name).unlink(missing_ok=True)

    def keep(seed: int, rows: pd.DataFrame, curve: pd.DataFrame) -> None:
        for frame, name in ((rows, "rows-raw.csv"), (curve, "curve-raw.csv")):
            path = out / name
            frame.to_csv(path, mode="a", header=not path.exists(), index=False)
        print(f"  seed {seed} done at {time.perf_counter() - started:.0f} s", flush=True)

    lab_started = time.perf_counter()
    rows, curve, _ = measure_setbacks(settings, seeds, workers=workers, on_seed_done=keep)
    lab_s = time.perf_counter() - lab_started
    result = {
        "benchmark": "the convergence lab on a deeper or wider model than cpu-tiny, sized to a time budget",
        "command": "python benchmarks/convergence_lab_larger_model.py " + " ".join(sys.argv[1:]),
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                        "gpu": torch.cuda.get_device_name(0) if arguments.device == "cuda" else None},
        "model": {"num_layers": model.num_layers, "dim": model.dim, "num_heads": model.num_heads, "seq_len": model.seq_len},
        "pipeline": {"num_stages": settings.num_stages, "num_microbatches": settings.num_microbatches,
                     "microbatch_size": settings.microbatch_size, "learning_rate": settings.learning_rate},
        "seeds": list(seeds), "num_iterations": num_iterations, "failure_iterations": list(settings.failure_iterations),
        "window_iterations": settings.window_iterations, "methods": [m.name for m in settings.methods],
        "probe": rate, "probe_s": probe_s, "predicted_lab_s": predicted_s, "lab_s": lab_s,
    }
    write_result(out, result, rows, curve)
    report_if_asked(arguments, "convergence-lab-larger-model", out / "result.json")
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s (lab {lab_s:.0f} s, predicted {predicted_s:.0f} s)")
    return 0


def write_result(out: Path, result: dict, rows: pd.DataFrame, curve: pd.DataFrame) -> None:
    """setbacks.csv and result.json (the summary table and the paired differences), and print them."""
    from churnsim.calibration.fit_setbacks import methods_told_apart, setback_summary

    rows.to_csv(out / "setbacks.csv", index=False)
    summary = setback_summary(rows)
    told_apart = pd.concat([methods_told_apart(rows, position) for position in ("interior", "edge")], ignore_index=True)
    result = {
        **result,
        "baseline_final_held_out_loss": curve.sort_values("iteration").groupby(["seed", "swapped"], as_index=False)["held_out_loss"].last().to_dict(orient="records"),
        "summary": summary.to_dict(orient="records"),
        "paired_differences": told_apart.to_dict(orient="records"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    kept = summary[summary["window_iterations"] == summary["window_iterations"].max()]
    print(kept.to_string(index=False), flush=True)
    print(told_apart.to_string(index=False), flush=True)


def combine(directories: list[Path], out: Path) -> int:
    """`--combine`: the raw tables of runs of one model and length, refitted together."""
    from churnsim.real.convergence_lab import add_setbacks

    results = [json.loads((directory / "result.json").read_text()) for directory in directories]
    same = ("model", "pipeline", "num_iterations", "failure_iterations", "window_iterations", "methods")
    for directory, result in zip(directories[1:], results[1:]):
        differing = [key for key in same if result[key] != results[0][key]]
        if differing:
            print(f"convergence_lab_larger_model: {directory} differs from {directories[0]} in {', '.join(differing)}; combine runs of one setup", file=sys.stderr)
            return 2
    seeds = [seed for result in results for seed in result["seeds"]]
    if len(set(seeds)) != len(seeds):
        print(f"convergence_lab_larger_model: seeds {seeds} repeat across the runs; combine runs of distinct seeds", file=sys.stderr)
        return 2
    # Raw tables hold seeds in the order they finished; the pooled ones are in seed order.
    rows = pd.concat([pd.read_csv(directory / "rows-raw.csv") for directory in directories], ignore_index=True)
    rows = rows.sort_values("seed", kind="stable", ignore_index=True)
    curve = pd.concat([pd.read_csv(directory / "curve-raw.csv") for directory in directories], ignore_index=True)
    curve = curve.sort_values("seed", kind="stable", ignore_index=True)
    out.mkdir(parents=True, exist_ok=True)
    rows, _ = add_setbacks(rows, curve)
    rows.to_csv(out / "rows-raw.csv", index=False, columns=[c for c in rows.columns if c != "setback_iterations"])
    curve.to_csv(out / "curve-raw.csv", index=False)
    kept = {key: results[0][key] for key in ("benchmark", *same)}
    write_result(out, {**kept, "command": "python benchmarks/convergence_lab_larger_model.py " + " ".join(sys.argv[1:]), "seeds": seeds,
                       "combined_from": [{key: result.get(key) for key in ("command", "environment", "seeds", "probe", "lab_s")} for result in results]},
                 rows, curve)
    print(f"wrote {out}: {len(seeds)} seeds pooled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
