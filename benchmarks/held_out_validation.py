"""Held-out validation on setups drawn at random: a check nobody tunes the model to.

    python benchmarks/held_out_validation.py [--out DIR] [--seed 48] [--runs 28] [--calibration FILE] [--budget-minutes 16]
    python benchmarks/held_out_validation.py --draw-only   # print the drawn setups, run nothing

1. `churnsim calibrate --quick` into OUT/calibration.json (or `--calibration FILE`): one calibration,
   made once, with its speed reference (real/speed_probe.py).
2. `draw_setups`: `--runs` held-out setups drawn with `--seed` from the ranges of `FACTOR_LEVELS`
   (width ×0.5, ×1, ×2 of the calibrated model's; layers per stage; sequence length; stages;
   microbatches; schedule; failure mode soft or hard; failures per node-hour up to high rates) and a
   method each (one the pipeline can take). Each factor's levels are spread evenly over the runs and
   shuffled on their own (every level is drawn, at most once more than another), so every factor
   is covered and the combinations are random. Seeds are drawn too, away from the suite's.
3. Each setup is one `churnsim real run` of the `cpu-tiny` scenario with the drawn fields set, its
   length sized from the calibration's predicted healthy iteration (`iterations_for`: about
   `RUN_TRAINING_S` of training, from `MIN_ITERATIONS` to `MAX_ITERATIONS`), under a time limit; a
   run that does not finish (the limit, the replacement cap of hard failures) is listed, not
   validated. Runs start in the drawn order until `--budget-minutes` of runs have passed.
4. `churnsim validate` of every finished run against the one calibration; per run the total
   wall-clock's absolute and load-normalised error and the probe's slowdown since calibrating.
   The figures: the median |error| of both over every run with its 95 % bootstrap interval and its
   quartiles and range, per level of every factor, and the steady step over its prediction per
   level (the compute model's carry, the machine's speed included).

Targets (issue 48): median |load-normalised wall-clock error| at most 3 %, median |wall-clock error|
at most 10 %. Results: benchmarks/results/held-out-validation.json and the validation table
benchmarks/results/held-out-validation.csv; a dated report (benchmarks/report.py). A benchmark, not a
test: it takes tens of minutes and its numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_report_option, report_if_asked, write_report  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS_FILE = REPOSITORY / "benchmarks" / "results" / "held-out-validation.json"
TABLE_FILE = RESULTS_FILE.with_suffix(".csv")
BASE_PRESET = "cpu-tiny"
BASE_WIDTH = 64
"""cpu-tiny's hidden size: the width factors multiply it."""
BASE_HEADS = 4
FACTOR_LEVELS: dict[str, tuple] = {
    "width_factor": (0.5, 1.0, 2.0),
    "layers_per_stage": (1, 2),
    "sequence_length": (32, 64, 128),
    "num_stages": (2, 3, 4),
    "num_microbatches": (2, 4, 6),
    "schedule": ("1f1b", "gpipe"),
    "failure_mode": ("soft", "hard"),
    "failures_per_node_hour": (120.0, 360.0, 960.0),
}
"""The stated ranges every held-out setup is drawn from (the calibrated setup: width ×1, 1 layer per
stage, sequence 64, 4 stages, 4 microbatches, 1F1B)."""
METHODS = ("checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus", "copy", "uniform", "random")
"""Every real method that handles failures; checkfree_plus only where there are 4 stages."""
MIN_STAGES = {"checkfree_plus": 4}
RUN_TRAINING_S = 10.0
MIN_ITERATIONS = 20
MAX_ITERATIONS = 60
RUN_TIME_LIMIT_FLOOR_S = 60.0
RUN_TIME_LIMIT_FACTOR = 6.0
"""A run is stopped after max(floor, factor × its predicted no-failure time): at high rates a slow
setup can lose its progress to failures faster than it makes it."""
TARGETS = {"load-normalised wall-clock": 0.03, "wall-clock": 0.10}


@dataclass(frozen=True)
class HeldOutSetup:
    index: int
    seed: int
    method: str
    width_factor: float
    layers_per_stage: int
    sequence_length: int
    num_stages: int
    num_microbatches: int
    schedule: str
    failure_mode: str
    failures_per_node_hour: float

    @property
    def hidden_size(self) -> int:
        return int(BASE_WIDTH * self.width_factor)

    @property
    def run_id(self) -> str:
        return (
            f"h{self.index:02d}-{self.method}-{self.failure_mode}-d{self.hidden_size}-l{self.layers_per_stage * self.num_stages}"
            f"-seq{self.sequence_length}-{self.num_stages}st-{self.num_microbatches}mb-{self.schedule}-{self.failures_per_node_hour:g}ph"
        )

    def settings(self, iterations: int) -> dict[str, object]:
        """The scenario fields of `cpu-tiny` this run sets (`--set`)."""
        return {
            "model.hidden_size": self.hidden_size,
            "model.num_heads": BASE_HEADS,
            "model.num_layers": self.layers_per_stage * self.num_stages,
            "model.sequence_length": self.sequence_length,
            "pipeline.num_stages": self.num_stages,
            "pipeline.num_microbatches": self.num_microbatches,
            "pipeline.schedule": self.schedule,
            "training.failure_mode": self.failure_mode,
            "churn.failures_per_node_hour": self.failures_per_node_hour,
            "target.loss": None,
            "target.iterations": iterations,
            "seed": self.seed,
        }


def _spread_evenly(levels: tuple, count: int, rng: np.random.Generator) -> list:
    """`count` draws of `levels`, each level as often as the others (±1), in random order; which levels
    get the extra draws is random too."""
    order = list(rng.permutation(len(levels)))
    repeated = [levels[order[index % len(levels)]] for index in range(count)]
    return [repeated[index] for index in rng.permutation(count)]


def draw_setups(seed: int, count: int) -> list[HeldOutSetup]:
    """`count` held-out setups from `FACTOR_LEVELS`, reproducible from `seed` (module docstring)."""
    if count < max(len(levels) for levels in FACTOR_LEVELS.values()):
        raise ValueError(f"--runs {count}: draw at least {max(len(levels) for levels in FACTOR_LEVELS.values())} so every level of every factor is drawn")
    rng = np.random.default_rng(seed)
    columns = {factor: _spread_evenly(levels, count, rng) for factor, levels in FACTOR_LEVELS.items()}
    methods = _spread_evenly(METHODS, count, rng)
    # A method drawn for a pipeline too short for it trades places with one drawn for a pipeline of 4 stages.
    for index in range(count):
        if MIN_STAGES.get(methods[index], 1) > columns["num_stages"][index]:
            partners = [other for other in range(count) if columns["num_stages"][other] >= MIN_STAGES[methods[index]]
                        and MIN_STAGES.get(methods[other], 1) <= columns["num_stages"][index]]  # fmt: skip
            partner = int(rng.choice(partners))
            methods[index], methods[partner] = methods[partner], methods[index]
    return [
        HeldOutSetup(
            index=index,
            seed=int(rng.integers(10_000, 2**31)),  # the calibration suite's seeds are 0, 1, 2
            method=methods[index],
            **{factor: columns[factor][index] for factor in FACTOR_LEVELS},
        )
        for index in range(count)
    ]


def _scenario(setup: HeldOutSetup, iterations: int):
    from churnsim.calibration.presets import preset

    return preset(BASE_PRESET, setup.settings(iterations), methods=(setup.method,))


def predicted_iteration_s(setup: HeldOutSetup, calibration) -> float:
    """The calibration's healthy iteration of the setup (its compute model; used only to size the run)."""
    from churnsim.calibration.apply import calibrated_compute
    from churnsim.sim.model.calibrated import iteration_predictor

    scenario = _scenario(setup, MAX_ITERATIONS)
    return iteration_predictor(link=calibration.link)(scenario.model, scenario.pipeline, calibrated_compute(scenario, calibration))


def iterations_for(iteration_s: float) -> int:
    return int(min(MAX_ITERATIONS, max(MIN_ITERATIONS, round(RUN_TRAINING_S / iteration_s))))


def _set_arguments(settings: dict[str, object]) -> list[str]:
    arguments = []
    for field, value in settings.items():
        arguments += ["--set", f"{field}={'null' if value is None else value}"]
    return arguments


def _run(command: list[str], *, time_limit_s: float, log) -> tuple[str, float]:
    """Run `command` in its own process group; stopped (the whole group) past `time_limit_s`."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPOSITORY, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        returncode = process.wait(timeout=time_limit_s)
        status = "finished" if returncode == 0 else f"failed (exit code {returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = f"stopped at its time limit of {time_limit_s:.0f} s"
    return status, time.perf_counter() - started


def _median_figures(errors: np.ndarray) -> dict[str, object]:
    from churnsim.calibration.statistics import median_with_ci95

    if errors.size == 0:
        return {"absolute": math.nan, "runs": 0}
    median, low, high = median_with_ci95([errors])
    quartiles = np.quantile(errors, [0.25, 0.75])
    return {
        "absolute": float(median),
        "absolute_ci95": [float(low), float(high)],
        "quartiles": [float(quartiles[0]), float(quartiles[1])],
        "range": [float(errors.min()), float(errors.max())],
        "runs": int(errors.size),
    }


def summarize(table, setups: list[HeldOutSetup]) -> dict[str, object]:
    """The benchmark's figures from the validation table (fractions, not percent)."""
    by_id = {setup.run_id: setup for setup in setups}
    wall = table[table["quantity"] == "total_wall_clock_s"].set_index("run_id")
    steady = table[(table["quantity"] == "steady_iteration_s") & (table["predicted"] > 0)].set_index("run_id")
    steady_ratio = steady["measured"] / steady["predicted"]
    absolute = wall["relative_error"].abs().dropna()
    normalised = wall["load_normalised_relative_error"].abs().dropna()
    by_factor: dict[str, dict[str, object]] = {}
    for factor in (*FACTOR_LEVELS, "method"):
        levels: dict[str, object] = {}
        for run_id in wall.index:
            level = str(getattr(by_id[run_id], factor))
            levels.setdefault(level, []).append(run_id)
        figures = {}
        for level, run_ids in sorted(levels.items()):
            figures[level] = {
                "runs": len(run_ids),
                "median_absolute_wall_clock_error": float(absolute.reindex(run_ids).median()),
                "median_absolute_load_normalised_error": float(normalised.reindex(run_ids).median()),
                "median_steady_step_over_prediction": float(steady_ratio.reindex(run_ids).median()),
            }
        by_factor[factor] = figures
    slowdown = table["machine_slowdown_at_validation"].dropna() if "machine_slowdown_at_validation" in table else []
    time_to_target = table[table["quantity"] == "time_to_target_s"]["relative_error"].abs().dropna()
    pooled = {"load-normalised wall-clock": _median_figures(normalised.to_numpy()), "wall-clock": _median_figures(absolute.to_numpy())}
    verdicts = {}
    for name, limit in TARGETS.items():
        figures = pooled[name]
        if not figures["runs"]:
            verdicts[name] = "no runs"
        elif figures["absolute_ci95"][1] <= limit:
            verdicts[name] = "met"
        elif figures["absolute_ci95"][0] > limit:
            verdicts[name] = "missed"
        else:
            verdicts[name] = ("met by the median, not by its interval" if figures["absolute"] <= limit else "missed by the median, not by its interval")
    return {
        "targets": TARGETS,
        "pooled": pooled,
        "target_verdicts": verdicts,
        "median_signed_error": {
            "wall_clock": float(wall["relative_error"].median()),
            "load_normalised": float(wall["load_normalised_relative_error"].median()),
        },
        "time_to_target_median_absolute_error": _median_figures(time_to_target.to_numpy()),
        "steady_step_over_prediction": {"median": float(steady_ratio.median()), "range": [float(steady_ratio.min()), float(steady_ratio.max())]},
        "machine_slowdown_at_validation": float(slowdown.iloc[0]) if len(slowdown) else None,
        "by_factor": by_factor,
    }


def _without_paths(arguments: list[str]) -> list[str]:
    """The command's arguments with the working directory and calibration file named by their flag
    (an absolute path of the machine it ran on says nothing to a reader of the result)."""
    shown = list(arguments)
    for index, argument in enumerate(shown[:-1]):
        if argument in ("--out", "--calibration"):
            shown[index + 1] = "DIR" if argument == "--out" else "FILE"
    return shown


def calibration_to_validate_against(calibration_path: Path | None, out: Path, log) -> tuple[Path, float | None]:
    """The calibration file the benchmark validates against: `calibration_path` when given, else a
    `churnsim calibrate --quick` made now into OUT/calibration.json; with the seconds it took (None: given)."""
    if calibration_path is not None:
        return calibration_path, None
    calibration_path = out / "calibration.json"
    print(f"calibrate --quick into {calibration_path} ...", flush=True)
    status, calibrate_s = _run([sys.executable, "-m", "churnsim", "calibrate", "--quick", "--out", str(calibration_path.resolve()), "--overwrite"],
                               time_limit_s=1800, log=log)  # fmt: skip
    if status != "finished":
        raise SystemExit(f"calibrate --quick {status}; see {out / 'log.txt'}")
    print(f"  calibrated in {calibrate_s:.0f} s", flush=True)
    return calibration_path, calibrate_s


def validate_with_cli(calibration_path: Path, records: list[Path], out: Path, log) -> tuple[Any, list[str]]:
    """`churnsim validate` of `records` against the calibration into OUT/validation: its table and notes."""
    import pandas as pd

    validation = out / "validation"
    status, _ = _run([sys.executable, "-m", "churnsim", "validate", "--calibration", str(calibration_path.resolve()),
                      *map(str, (path.resolve() for path in records)), "--out", str(validation.resolve()), "--overwrite", "--no-figures"],
                     time_limit_s=1800, log=log)  # fmt: skip
    if status != "finished":
        raise SystemExit(f"validate {status}; see {out / 'log.txt'}")
    return pd.read_csv(validation / "validation.csv"), json.loads((validation / "manifest.json").read_text())["notes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("held-out-validation"), help="working directory (calibration, runs, validation)")
    parser.add_argument("--seed", type=int, default=48, help="seed of the draw")
    parser.add_argument("--runs", type=int, default=28, help="setups drawn")
    parser.add_argument("--calibration", type=Path, help="validate against this calibration instead of making one with calibrate --quick")
    parser.add_argument("--budget-minutes", type=float, default=16.0, help="start no held-out run after this many minutes of them")
    parser.add_argument("--draw-only", action="store_true", help="print the drawn setups and stop")
    parser.add_argument("--resummarize", action="store_true", help="the committed result's figures again from its validation table (no run)")
    add_report_option(parser)
    arguments = parser.parse_args()
    import pandas as pd

    if arguments.resummarize:
        result = json.loads(RESULTS_FILE.read_text(encoding="utf-8"))
        setups = draw_setups(result["seed"], result["runs_drawn"])
        kept = {key: value for key, value in result.items() if key not in ("runs", "validation_notes", "factor_levels")}
        kept.update(summarize(pd.read_csv(TABLE_FILE), setups))
        RESULTS_FILE.write_text(json.dumps(kept | {"validation_notes": result["validation_notes"], "runs": result["runs"]}, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS_FILE}")
        if arguments.report:
            # The measurement's own command, not this one: the runs are the same, only the figures are recomputed.
            command = f"{result['command']}   # figures recomputed from its validation table by --resummarize"
            print(f"wrote {write_report('held-out-validation', RESULTS_FILE, command=command)}")
        return
    setups = draw_setups(arguments.seed, arguments.runs)
    if arguments.draw_only:
        for setup in setups:
            print(setup.run_id, f"seed {setup.seed}")
        return

    from churnsim.calibration.calibration_file import load_calibration
    from churnsim.real.calibration_suite import set_run_id

    started = time.perf_counter()
    out = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", encoding="utf-8")
    calibration_path, calibrate_s = calibration_to_validate_against(arguments.calibration, out, log)
    calibration = load_calibration(str(calibration_path))
    runs = []
    runs_started = time.perf_counter()
    for setup in setups:
        if time.perf_counter() - runs_started > 60 * arguments.budget_minutes:
            runs.append({"run_id": setup.run_id, "status": "not started: the budget of runs was spent"})
            continue
        iteration_s = predicted_iteration_s(setup, calibration)
        iterations = iterations_for(iteration_s)
        limit_s = max(RUN_TIME_LIMIT_FLOOR_S, RUN_TIME_LIMIT_FACTOR * iterations * iteration_s)
        directory = out / "held-out" / setup.run_id
        command = [sys.executable, "-m", "churnsim", "real", "run", "--preset", BASE_PRESET, "--method", setup.method,
                   *_set_arguments(setup.settings(iterations)), "--out", str(directory.resolve()), "--overwrite"]  # fmt: skip
        status, seconds = _run(command, time_limit_s=limit_s, log=log)
        if status == "finished":
            set_run_id(directory, setup.run_id)  # the launcher draws a random run id; the table's rows are named by the setup
        print(f"  {setup.run_id}: {iterations} iterations, {status}, {seconds:.0f} s", flush=True)
        runs.append({"run_id": setup.run_id, "iterations": iterations, "predicted_iteration_s": iteration_s, "status": status, "seconds": seconds})
    finished = [out / "held-out" / run["run_id"] for run in runs if run["status"] == "finished"]
    table, notes = validate_with_cli(calibration_path, finished, out, log)
    result = {
        "command": "python benchmarks/held_out_validation.py " + " ".join(_without_paths(sys.argv[1:])),
        "seed": arguments.seed,
        "runs_drawn": len(setups),
        "runs_finished": len(finished),
        **summarize(table, setups),
        "calibrate_s": calibrate_s,
        "total_s": time.perf_counter() - started,
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        # Other work on the machine while the runs ran; a report written later shows the load at its own time.
        "load_average_after_runs_1_5_15_min": [round(value, 2) for value in os.getloadavg()],
        "validation_notes": notes,
        "runs": [dataclasses.asdict(setup) | run for setup, run in zip(setups, runs)],
    }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    table.to_csv(TABLE_FILE, index=False)
    for name, figures in result["pooled"].items():
        if figures["runs"]:
            low, high = figures["absolute_ci95"]
            print(f"median |{name} error|: {100 * figures['absolute']:.1f} % [{100 * low:.1f}, {100 * high:.1f}] over {figures['runs']} runs "
                  f"(target {100 * TARGETS[name]:.0f} %: {result['target_verdicts'][name]})")
    print(f"wrote {RESULTS_FILE} and {TABLE_FILE}")
    report_if_asked(arguments, "held-out-validation", RESULTS_FILE)


if __name__ == "__main__":
    main()
