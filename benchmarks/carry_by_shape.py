"""Which pipeline shapes does the compute model carry to badly on shared cores, and is it the scheduler?

The calibrate-and-validate benchmark's 3-stage setup (6 layers in 3 stages) runs about 13 % slower
than the compute model carries to it from the calibrated setup (4 layers in 4 stages). This one
separates the two things that setup changes: the number of stage processes sharing the cores, and
the layers per stage. It runs no-failure real runs of `cpu-tiny` (method `none`, no churn) in six
shapes, stages × layers per stage: 4 × 1 (the calibrated shape, the reference), 3 × 1, 5 × 1,
3 × 2, 4 × 2 and 5 × 2, interleaved and rotated each round, and validates them against a
calibration (`churnsim validate`). Per run it reports the carry, the run's steady step over the
predicted one divided by the same ratio of the reference run of its round (the machine's speed of
the moment cancels: `sim.validate.steady_step_carry`), and where /proc exists, the stage
processes' scheduler counters (`/proc/<pid>/sched`: migrations between cores and involuntary
context switches, per second of their CPU time). Appends an entry to
benchmarks/results/carry-by-shape.json. A benchmark, not a test: about 4 minutes of real runs;
run nothing else beside it.

With `--fresh-calibration` it first runs `churnsim calibrate --quick` (about 2 minutes) and fits
the same calibration runs again without the suite's double-depth shape (`churnsim calibrate
--runs`, which then has no shared-core term: calibration/compute_cost.py), and validates every run
against both: the term's effect, paired on the same runs, apart from how one calibration's noise
moves every shape.

    python benchmarks/carry_by_shape.py [--rounds 3] [--calibration cpu-tiny] [--steps 80]
    python benchmarks/carry_by_shape.py --fresh-calibration [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import RESULTS_DIRECTORY, machine  # noqa: E402
from report import add_report_option, report_if_asked  # noqa: E402

RESULTS_FILE = RESULTS_DIRECTORY / "carry-by-shape.json"
SHAPES = {"4x1": (4, 1), "3x1": (3, 1), "5x1": (5, 1), "3x2": (3, 2), "4x2": (4, 2), "5x2": (5, 2)}
"""Name → (stages, layers per stage); the first is the calibrated shape, every round's reference."""
REFERENCE = "4x1"
SAMPLE_INTERVAL_S = 0.2


def _scheduler_counters(pid: str) -> dict[str, float] | None:
    counters = {}
    try:
        with open(f"/proc/{pid}/sched") as file:
            for line in file:
                key, _, value = line.partition(":")
                try:
                    counters[key.strip()] = float(value)
                except ValueError:
                    continue  # the header line
    except OSError:
        return None
    return counters


def _stage_process_ids() -> list[str]:
    """The stage processes of a local launch: children of its fork server (the same command line)."""
    def command_line(pid: str) -> str:
        try:
            with open(f"/proc/{pid}/cmdline") as file:
                return file.read()
        except OSError:
            return ""

    stages = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if "forkserver" not in command_line(pid):
            continue
        try:
            with open(f"/proc/{pid}/stat") as file:
                parent = file.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if "forkserver" in command_line(parent):
            stages.append(pid)
    return stages


class _SchedulerSampler:
    """The last scheduler counters seen of every stage process, sampled while a run goes on."""

    def __init__(self) -> None:
        self.last: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for pid in _stage_process_ids():
                counters = _scheduler_counters(pid)
                if counters is not None:
                    self.last[pid] = counters
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> "_SchedulerSampler":
        if Path("/proc/self/sched").exists():
            self._thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _total(self, key: str) -> float:
        return sum(counters.get(key, 0.0) for counters in self.last.values())

    def per_cpu_second(self) -> dict[str, float] | None:
        cpu_s = self._total("se.sum_exec_runtime") / 1000.0  # the kernel counts it in milliseconds
        if not cpu_s > 0:
            return None
        return {
            "stage_processes": len(self.last),
            "cpu_s": round(cpu_s, 2),
            "migrations_per_cpu_s": round(self._total("se.nr_migrations") / cpu_s, 1),
            "involuntary_switches_per_cpu_s": round(self._total("nr_involuntary_switches") / cpu_s, 1),
        }


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def _run(directory: Path, shape: str, round_index: int, steps: int) -> dict:
    stages, layers_per_stage = SHAPES[shape]
    out = directory / f"{shape}-r{round_index}"
    with _SchedulerSampler() as sampler:
        _churnsim(
            "real", "run", "--preset", "cpu-tiny", "--method", "none",
            "--set", "churn.failures_per_node_hour=0", "--set", "target.loss=null", "--set", f"target.iterations={steps}",
            "--set", f"model.num_layers={stages * layers_per_stage}", "--set", f"pipeline.num_stages={stages}",
            "--set", f"seed={7 + round_index}", "--out", str(out),
            failure=f"{shape}, round {round_index}: the real run failed",
        )  # fmt: skip
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    return {"shape": shape, "round": round_index, "run_id": run_id, "scheduler": sampler.per_cpu_second()}


def _steady_over_predicted(directory: Path, calibration: str) -> dict[str, float]:
    """run id → the run's median steady step over the calibration's prediction for it (the validator
    in this process, as `churnsim validate` runs it)."""
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.sim.checks.validate import load_held_out_records, validate_records

    loaded = resolve_calibration(calibration)
    table = validate_records(load_held_out_records(sorted(directory.glob("*-r*")), loaded), loaded).table
    steady = table[(table["quantity"] == "steady_iteration_s") & (table["predicted"] > 0)]
    return dict(zip(steady["run_id"], steady["measured"] / steady["predicted"]))


def _fresh_calibrations(directory: Path) -> dict[str, str]:
    """`churnsim calibrate --quick` into `directory`, and the same runs fitted without the suite's
    double-depth shape: label → calibration file."""
    directory.mkdir()
    with_term, runs = directory / "quick.json", directory / "quick-runs"
    _churnsim("calibrate", "--quick", "--out", str(with_term), "--runs-out", str(runs))
    deeper = [shape for shape in runs.glob("fit-shape-*-layers") if shape.is_dir()]
    if not deeper:
        sys.exit("--fresh-calibration: the quick suite ran no double-depth shape (a core for every stage process?)")
    without_runs = directory / "quick-runs-without-double-depth"
    shutil.copytree(runs, without_runs, ignore=shutil.ignore_patterns(*(shape.name for shape in deeper)))
    without_term = directory / "quick-without-double-depth.json"
    _churnsim("calibrate", "--runs", str(without_runs), "--out", str(without_term))
    return {"fresh calibrate --quick": str(with_term), "the same runs without the double-depth shape": str(without_term)}


def _churnsim(*arguments: str, failure: str = "") -> None:
    """`churnsim ARGUMENTS` in a child process, quiet; on failure the benchmark stops with its last line."""
    finished = subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True)
    if finished.returncode != 0:
        sys.exit(f"{failure or f'churnsim {arguments[0]} failed'}: {_last_line(finished.stderr)}")


def _by_shape(runs: list[dict], over_predicted: dict[str, float]) -> dict[str, dict]:
    """Per shape, the carry of its runs against one calibration's predictions, with the scheduler counters."""
    reference = {run["round"]: over_predicted[run["run_id"]] for run in runs if run["shape"] == REFERENCE}
    by_shape = {}
    for shape in SHAPES:
        mine = sorted((run for run in runs if run["shape"] == shape), key=lambda run: run["round"])
        scheduler = [run["scheduler"] for run in mine if run["scheduler"]]
        carries = [round(over_predicted[run["run_id"]] / reference[run["round"]], 4) for run in mine]
        by_shape[shape] = {
            "stages": SHAPES[shape][0],
            "layers_per_stage": SHAPES[shape][1],
            "carry_median": round(statistics.median(carries), 3),
            "carry_by_round": carries,
            "migrations_per_cpu_s_median": statistics.median(s["migrations_per_cpu_s"] for s in scheduler) if scheduler else None,
            "involuntary_switches_per_cpu_s_median": statistics.median(s["involuntary_switches_per_cpu_s"] for s in scheduler) if scheduler else None,
        }
    return by_shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calibration", default="cpu-tiny", help="a calibration file or built-in name")
    parser.add_argument("--fresh-calibration", action="store_true",
                        help="calibrate --quick first, and validate against it and against its runs fitted without the double-depth shape")
    parser.add_argument("--steps", type=int, default=80)
    add_report_option(parser)
    arguments = parser.parse_args()
    started = time.time()
    names = list(SHAPES)
    with tempfile.TemporaryDirectory(prefix="churnsim-carry-by-shape-") as temporary:
        directory = Path(temporary) / "runs"
        directory.mkdir()
        # Beside the runs' directory, not in it: the calibration runs are no held-out runs.
        fresh = Path(temporary) / "calibration"
        calibrations = _fresh_calibrations(fresh) if arguments.fresh_calibration else {arguments.calibration: arguments.calibration}
        runs = []
        for round_index in range(arguments.rounds):
            # Rotated each round, so that no shape always runs first or after the same neighbour.
            for shape in names[round_index % len(names):] + names[: round_index % len(names)]:
                runs.append(_run(directory, shape, round_index, arguments.steps))
                print(json.dumps(runs[-1]), flush=True)
        by_calibration = {label: _by_shape(runs, _steady_over_predicted(directory, path)) for label, path in calibrations.items()}
    for label, by_shape in by_calibration.items():
        print(f"against {label}:")
        for shape, figures in by_shape.items():
            print(f"  {shape}: carry {figures['carry_median']:.3f} (rounds {figures['carry_by_round']}), "
                  f"migrations {figures['migrations_per_cpu_s_median']} and involuntary switches "
                  f"{figures['involuntary_switches_per_cpu_s_median']} per CPU-second")  # fmt: skip
    first = next(iter(by_calibration))
    entry = {
        "minutes": round((time.time() - started) / 60, 1),
        "machine": machine(),
        "calibration": first,
        "steps": arguments.steps,
        "rounds": arguments.rounds,
        "by_shape": by_calibration[first],
        **({"by_shape_against": by_calibration} if arguments.fresh_calibration else {}),
        "runs": runs,
    }
    history = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else []
    RESULTS_FILE.write_text(json.dumps([*history, entry], indent=1) + "\n")
    print(f"appended to {RESULTS_FILE}")
    report_if_asked(arguments, "carry-by-shape", RESULTS_FILE)


if __name__ == "__main__":
    main()
