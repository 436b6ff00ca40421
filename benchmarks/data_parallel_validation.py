"""Data-parallel validation: real S × D runs with replica losses and stage losses, predicted by the simulator.

    python benchmarks/data_parallel_validation.py [--out DIR] [--calibration FILE] [--iterations 50] [--methods checkpoint,checkfree] [--no-report]

1. `churnsim calibrate --quick` into OUT/calibration.json (or `--calibration FILE`): one calibration,
   whose suite includes a 2 × 2 data-parallel run with replica heals, so it carries the all-reduce
   and the heal (`Calibration.allreduce`, `Calibration.replica_heal`).
2. Real runs of the `cpu-tiny` scenario in 2 × 2 and 4 × 2 grids (stages × replicas), each under
   `--methods`, with a failure schedule of soft node failures: `replica-losses` (two replicas of
   different stages, each healed from its surviving replica) and `stage-loss` (one replica loss,
   then both replicas of stage 0 at once: the method's own recovery). The schedule's times are
   fractions of the run's length, sized from the calibration's predicted healthy iteration.
3. `churnsim validate` of every finished run against the one calibration: per run the total
   wall-clock's absolute and load-normalised error; the figures are the medians of their absolute
   values over every run with a 95 % bootstrap interval, quartiles and range, and the same per grid
   and per schedule, and which `handled_as` outcomes the runs had.

Target (issue 46): median |wall-clock error| at most 10 %. Results:
benchmarks/results/data-parallel-validation.json and .csv (the validation table); a dated report
(benchmarks/report.py, unless --no-report). A benchmark, not a test: its numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from held_out_validation import _median_figures, _run, _without_paths, calibration_to_validate_against, validate_with_cli  # noqa: E402
from report import add_report_option, report_if_asked  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS_FILE = REPOSITORY / "benchmarks" / "results" / "data-parallel-validation.json"
TABLE_FILE = RESULTS_FILE.with_suffix(".csv")
BASE_PRESET = "cpu-tiny"
GRIDS: dict[str, tuple[int, int]] = {"2x2": (2, 2), "4x2": (4, 2)}
"""Grid name: (stages, replicas)."""
SCHEDULES = ("replica-losses", "stage-loss")
TARGET_WALL_CLOCK = 0.10
RUN_TIME_LIMIT_S = 300.0


def failure_rows(schedule: str, num_stages: int, run_s: float) -> list[tuple[float, int, int]]:
    """(time_s, stage, replica) of a schedule's node failures over a run of about `run_s` seconds."""
    if schedule == "replica-losses":
        return [(0.3 * run_s, 0, 1), (0.6 * run_s, num_stages - 1, 0)]
    if schedule == "stage-loss":
        return [(0.3 * run_s, num_stages - 1, 1), (0.6 * run_s, 0, 0), (0.6 * run_s, 0, 1)]
    raise ValueError(f"unknown schedule {schedule!r}")


def write_schedule(path: Path, rows: list[tuple[float, int, int]]) -> None:
    lines = ["# churnsim failure schedule, schema_version 1", "time_s,iteration,stage,kind,replica"]
    lines += [f"{time_s:.3f},,{stage},scheduled,{replica}" for time_s, stage, replica in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def grid_scenario(num_stages: int, degree: int, iterations: int, method: str):
    """`cpu-tiny` in `num_stages` × `degree`, stopping after `iterations`, with one method."""
    from churnsim.calibration.presets import preset

    # Real runs wait for every heal (the replicas pause at the iteration boundary): the prediction must too.
    settings = {"pipeline.num_stages": num_stages, "pipeline.data_parallel_degree": degree, "pipeline.while_replica_missing": "wait",
                "target.loss": None, "target.iterations": iterations}  # fmt: skip
    return preset(BASE_PRESET, settings, methods=(method,))


def predicted_iteration_s(scenario, calibration) -> float:
    """The calibration's healthy iteration of a grid (used only to place the failures)."""
    from churnsim.calibration.apply import calibrated_compute
    from churnsim.sim.model.calibrated import iteration_predictor

    return iteration_predictor(link=calibration.link)(scenario.model, scenario.pipeline, calibrated_compute(scenario, calibration))


def summarize(table, runs: list[dict]) -> dict[str, object]:
    """The figures from the validation table (fractions, not percent)."""
    wall = table[table["quantity"] == "total_wall_clock_s"].set_index("run_id")
    absolute = wall["relative_error"].abs().dropna()
    normalised = wall["load_normalised_relative_error"].abs().dropna()
    by_run = {run["run_id"]: run for run in runs}
    groups: dict[str, dict[str, object]] = {}
    for key in ("grid", "schedule", "method"):
        levels: dict[str, list[str]] = {}
        for run_id in absolute.index:
            levels.setdefault(str(by_run[run_id][key]), []).append(run_id)
        groups[key] = {
            level: {
                "runs": len(ids),
                "median_absolute_wall_clock_error": float(absolute.reindex(ids).median()),
                "median_absolute_load_normalised_error": float(normalised.reindex(ids).median()),
            }
            for level, ids in sorted(levels.items())
        }
    wall_figures = _median_figures(absolute.to_numpy())
    if not wall_figures["runs"]:
        verdict = "no runs"
    elif wall_figures["absolute_ci95"][1] <= TARGET_WALL_CLOCK:
        verdict = "met"
    elif wall_figures["absolute_ci95"][0] > TARGET_WALL_CLOCK:
        verdict = "missed"
    else:
        verdict = "met by the median, not by its interval" if wall_figures["absolute"] <= TARGET_WALL_CLOCK else "missed by the median, not by its interval"
    return {
        "target_median_absolute_wall_clock_error": TARGET_WALL_CLOCK,
        "wall_clock": wall_figures,
        "load_normalised_wall_clock": _median_figures(normalised.to_numpy()),
        "target_verdict": verdict,
        "median_signed_wall_clock_error": float(wall["relative_error"].median()) if len(wall) else None,
        "by": groups,
    }


def handled_as_of(directory: Path) -> list[str]:
    """The `handled_as` of every failure a real run recorded (recoveries.csv)."""
    import pandas as pd

    path = directory / "recoveries.csv"
    if not path.is_file():
        return []
    frame = pd.read_csv(path)
    return [str(value) for value in frame.get("handled_as", pd.Series(dtype=object)).dropna()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data-parallel-validation"), help="working directory (calibration, runs, validation)")
    parser.add_argument("--calibration", type=Path, help="validate against this calibration instead of making one with calibrate --quick")
    parser.add_argument("--iterations", type=int, default=50, help="iterations of each run")
    parser.add_argument("--methods", default="checkpoint,checkfree", help="comma-separated methods, each run in every grid and schedule")
    add_report_option(parser)
    arguments = parser.parse_args()

    from churnsim.calibration.base import save_model
    from churnsim.calibration.calibration_file import load_calibration
    from churnsim.calibration.churn import ScheduleChurn
    from churnsim.real.calibration_suite import set_run_id

    started = time.perf_counter()
    out = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", encoding="utf-8")
    calibration_path, calibrate_s = calibration_to_validate_against(arguments.calibration, out, log)
    calibration = load_calibration(str(calibration_path))
    runs = []
    for grid, (num_stages, degree) in GRIDS.items():
        for schedule in SCHEDULES:
            for method in arguments.methods.split(","):
                scenario = grid_scenario(num_stages, degree, arguments.iterations, method)
                iteration_s = predicted_iteration_s(scenario, calibration)
                run_id = f"{grid}-{schedule}-{method}"
                directory = out / "runs" / run_id
                inputs = out / "inputs"
                inputs.mkdir(parents=True, exist_ok=True)
                schedule_path = inputs / f"{run_id}-failures.csv"
                write_schedule(schedule_path, failure_rows(schedule, num_stages, arguments.iterations * iteration_s))
                scenario_path = inputs / f"{run_id}.json"
                save_model(scenario.model_copy(update={"churn": ScheduleChurn(kind="schedule", path=str(schedule_path.resolve()))}), scenario_path)
                command = [sys.executable, "-m", "churnsim", "real", "run", str(scenario_path.resolve()), "--method", method,
                           "--out", str(directory.resolve()), "--overwrite"]  # fmt: skip
                status, seconds = _run(command, time_limit_s=RUN_TIME_LIMIT_S, log=log)
                if status == "finished":
                    set_run_id(directory, run_id)
                handled = handled_as_of(directory) if status == "finished" else []
                print(f"  {run_id}: {status}, {seconds:.0f} s, handled as {handled}", flush=True)
                runs.append({"run_id": run_id, "grid": grid, "schedule": schedule, "method": method, "status": status, "seconds": seconds,
                             "predicted_iteration_s": iteration_s, "handled_as": handled})  # fmt: skip
    finished = [out / "runs" / run["run_id"] for run in runs if run["status"] == "finished"]
    table, notes = validate_with_cli(calibration_path, finished, out, log)
    result = {
        "command": "python benchmarks/data_parallel_validation.py " + " ".join(_without_paths(sys.argv[1:])),
        "runs_planned": len(runs),
        "runs_finished": len(finished),
        **summarize(table, [run for run in runs if run["status"] == "finished"]),
        "calibration_allreduce": calibration.allreduce.model_dump() if calibration.allreduce is not None else None,
        "calibration_replica_heal": calibration.replica_heal.model_dump() if calibration.replica_heal is not None else None,
        "calibrate_s": calibrate_s,
        "total_s": time.perf_counter() - started,
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "load_average_after_runs_1_5_15_min": [round(value, 2) for value in os.getloadavg()],
        "validation_notes": notes,
        "runs": runs,
    }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2, default=float) + "\n", encoding="utf-8")
    table.to_csv(TABLE_FILE, index=False)
    figures = result["wall_clock"]
    if figures["runs"]:
        low, high = figures["absolute_ci95"]
        print(f"median |wall-clock error|: {100 * figures['absolute']:.1f} % [{100 * low:.1f}, {100 * high:.1f}] over {figures['runs']} runs "
              f"(target {100 * TARGET_WALL_CLOCK:.0f} %: {result['target_verdict']})")
    print(f"wrote {RESULTS_FILE} and {TABLE_FILE}")
    report_if_asked(arguments, "data-parallel-validation", RESULTS_FILE)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
