"""Dated benchmark reports: `benchmarks/reports/<YYYY-MM-DD>-<benchmark-name>.md` from a result JSON.

Every benchmark that writes a result file calls `write_report` right after it (each script's
`--no-report` turns it off). A report says what the benchmark measures, the command that produced
it, the machine, the commit (and whether the tree had uncommitted changes), the date, the results
with the spread the result file holds (intervals, min–max, repetitions) and each target, met or not.

Reports of results committed earlier are written from the file itself, with the date and commit
it records, or else those of the commit that last changed its content (`--commit REV` names it
where a later edit of the file, such as a path inside it, came after):

    python benchmarks/report.py benchmarks/results/sim-run-speed.json --benchmark sim-run-speed
    python benchmarks/report.py --all     # a report for every committed result named in COMMITTED_RESULTS
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS_DIRECTORY = Path(__file__).resolve().parent
REPOSITORY = BENCHMARKS_DIRECTORY.parent
REPORTS_DIRECTORY = BENCHMARKS_DIRECTORY / "reports"
RESULTS_DIRECTORY = BENCHMARKS_DIRECTORY / "results"
MAX_TABLE_ROWS = 160
"""A report's results table stops here and points at the result file for the rest."""
MAX_LISTED_ENTRIES = 12
"""A list of records longer than this (per-run rows) is counted in the table, not spelled out."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its script, what it measures (one paragraph), its usual command and its target."""

    name: str
    script: str
    measures: str
    command: str
    target: str = "none set: the benchmark reports a figure, it does not pass or fail"


BENCHMARKS = {benchmark.name: benchmark for benchmark in (
    Benchmark(
        "sim-dp-speed", "sim_dp_speed.py",
        "Seconds per simulated run with data parallelism: one 100,000-iteration run of the datacenter-llama3 preset "
        "(16 stages) per method at data-parallel degree D = 1, 8 and 128, with Poisson node failures over the S × D "
        "nodes at the Llama 3 per-node rate and at 100 times it, in the closed-form engine, repeated until two rounds "
        "agree within 20 %; the event model must give the same wall-clock. Each row counts the node losses, heals and "
        "stage losses, so that the cost is seen to follow the failures rather than S × D.",
        "python benchmarks/sim_dp_speed.py"),
    Benchmark(
        "sim-run-speed", "sim_run_speed.py",
        "Seconds per simulated run: one 100,000-iteration run of the CheckFree 500M geo preset at 16 %/h per stage "
        "(the same failure path for every method), in the closed-form engine and in the event model in the same "
        "round, repeated until two rounds agree within 20 %; both engines must give the same result. Also the cost "
        "of simulating every microbatch of every iteration, extrapolated from a shorter run.",
        "python benchmarks/sim_run_speed.py", "at most 0.1 s per run for every method, in closed form"),
    Benchmark(
        "sim-trace-speed", "sim_trace_speed.py",
        "Seconds per run of a replay of Bamboo's whole AWS p3 spot trace (12-stage GPT-1.5B, 167 preemptions), per "
        "method, in closed form and in the event model in the same round, repeated until two rounds agree within "
        "20 %; the failure path's sampling is timed separately.",
        "python benchmarks/sim_trace_speed.py", "at most 0.08 s per run for every method, in process"),
    Benchmark(
        "sim-grid-speed", "sim_grid_speed.py",
        "Wall-clock seconds of the paper grid `churnsim whatif` runs (3 model sizes × 5 failure rates × 9 methods × "
        "30 replications) with `run_sweep` on a local pool of 2 workers, in closed form and in the event model; "
        "also the workers' CPU seconds, which do not grow when other work shares the cores.",
        "python benchmarks/sim_grid_speed.py", "at most 60 s in closed form"),
    Benchmark(
        "sim-aire-speed", "sim_aire_speed.py",
        "Seconds per replication of an AIReSim-sized study (a 70B-class model in 16 stages × 256 replicas, 256 days "
        "of compute, synchronous checkpoints): a lazily sampled failure path, the setback draws and the "
        "`checkpoint` run, in closed form and in the event model in the same round.",
        "python benchmarks/sim_aire_speed.py", "at most 0.65 s per replication"),
    Benchmark(
        "import-speed", "import_speed.py",
        "Fresh-interpreter wall clock of `churnsim simulate --help`, of importing the simulator, of an empty "
        "interpreter (for scale) and of a script's first simulated run, repeated until two runs agree within 20 %; "
        "also the ten heaviest imports of `churnsim.sim.model.run`.",
        "python benchmarks/import_speed.py", "at most 0.3 s for the help and for each import"),
    Benchmark(
        "calibrate-and-validate", "calibrate_and_validate.py",
        "End to end on one machine: `churnsim calibrate --quick`, then rounds of held-out real runs (every method on "
        "the calibrated setup, and six setups the calibration did not run), each validated against the prediction "
        "(`churnsim validate`). Per group, the median |relative error| of the total wall-clock (absolute and "
        "normalised for the machine's load) and of the time to target, with a 95 % interval from a two-stage "
        "bootstrap over rounds and runs, and the spread of the rounds' medians.",
        "python benchmarks/calibrate_and_validate.py --recalibrate-each-round",
        "median |wall-clock error| at most 5 % on the calibrated setup and 10 % on the other setups; time to "
        "target within 10 %"),
    Benchmark(
        "calibrate-and-validate-pooled", "calibrate_and_validate.py",
        "The calibrate-and-validate benchmark's figures pooled over several of its runs (their committed validation "
        "tables): the same medians, intervals and round spreads over every round of the runs pooled, which runs "
        "are listed under `pooled_over`.",
        "python benchmarks/calibrate_and_validate.py --resummarize --pool DIR [--pool DIR ...]",
        "as calibrate-and-validate: at most 5 % calibrated setup, 10 % other setups, 10 % time to target"),
    Benchmark(
        "calibrate-on-the-setup", "calibrate_on_the_setup.py",
        "Whether calibrating on the setup you run beats carrying the default calibration to it: held-out runs of "
        "the 3-stage and GPipe setups validated against a calibration made on the setup itself just before them "
        "and against the default 4-stage 1F1B calibration made just after them, per method the median "
        "|relative error| of the total wall-clock and the runs' steady step over each prediction.",
        "python benchmarks/calibrate_on_the_setup.py --passes 2 --setups 3-stages,gpipe"),
    Benchmark(
        "held-out-validation", "held_out_validation.py",
        "Validation on setups nobody tuned to: one `churnsim calibrate --quick`, then held-out real runs whose setups are "
        "drawn at random with a seed from stated ranges (width ×0.5 to ×2, layers per stage, sequence length, stages, "
        "microbatches, schedule, soft or hard failures, failure rates up to 960 per node-hour, a method each), each "
        "validated against that one calibration (`churnsim validate`). The median |relative error| of the total "
        "wall-clock, absolute and load-normalised, with a 95 % bootstrap interval, quartiles and range, the same per "
        "level of every factor, and the machine's slowdown since calibrating from the speed probe.",
        "python benchmarks/held_out_validation.py",
        "median |load-normalised wall-clock error| at most 3 %, median |wall-clock error| at most 10 %"),
    Benchmark(
        "data-parallel-validation", "data_parallel_validation.py",
        "Validation of data-parallel runs: one `churnsim calibrate --quick` (its suite's 2 × 2 run measures the "
        "all-reduce and the replica heal), then real runs of the tiny model in 2 × 2 and 4 × 2 grids (stages × "
        "replicas) under failure schedules of replica losses (healed from a surviving replica) and of a stage loss "
        "(both replicas of a stage at once: the method's recovery), each validated against that calibration. The "
        "median |relative error| of the total wall-clock with a 95 % bootstrap interval, quartiles and range, per "
        "grid, schedule and method, and how the runs handled their failures.",
        "python benchmarks/data_parallel_validation.py",
        "median |wall-clock error| at most 10 %"),
    Benchmark(
        "two-agent-validation", "two_agent_validation.py",
        "Validation of runs on two torchrun agents of one machine: one `churnsim calibrate --quick` (its suite's "
        "hard-failure run measures the components of a hard failure under the agent), then real runs of the tiny "
        "model in 2 stages, one per agent, launched with the torchrun line `churnsim real run --write-config` prints, "
        "under soft and hard failures for two methods, each validated against that calibration with its own failure "
        "mode's costs. The median |relative error| of the total wall-clock with a 95 % bootstrap interval, quartiles "
        "and range, per failure mode and method, and the join, rendezvous, transfer, detection, restart and reload "
        "costs the runs measured beside those the calibration charges.",
        "python benchmarks/two_agent_validation.py"),
    Benchmark(
        "carry-by-shape", "carry_by_shape.py",
        "How well the compute model carries a calibration to other pipeline shapes on shared cores: no-failure "
        "real runs of six shapes (stages × layers per stage), interleaved each round; per shape its steady step "
        "over the prediction relative to the calibrated shape's in the same round (the carry), and the stage "
        "processes' migrations and involuntary context switches per CPU second.",
        "python benchmarks/carry_by_shape.py --fresh-calibration"),
    Benchmark(
        "identical-runs-spread", "identical_runs_spread.py",
        "How much identical no-failure real runs of `cpu-tiny` differ in speed on one machine, and whether a "
        "fixed one-thread probe timed before each run sees it: per run the probe and the median steady step.",
        "python benchmarks/identical_runs_spread.py"),
    Benchmark(
        "loss-curve-extrapolation", "loss_curve_extrapolation.py",
        "How far a baseline loss curve fitted on two short no-failure runs carries to longer runs, for three "
        "bounds of the curve's exponent: whether each long run's time-to-target goal lies above the fitted floor, "
        "how late the curve reaches it, and each long run fitted on its own first 100 iterations. No timing: the "
        "same figures every run.",
        "python benchmarks/loss_curve_extrapolation.py"),
    Benchmark(
        "convergence-lab-larger-model", "convergence_lab_larger_model.py",
        "The convergence lab (paired forks of each seed's no-failure run, the same batches) on a deeper model than "
        "`cpu-tiny` (8 layers in 4 stages), trained as long as a time budget allows: per rebuild method the "
        "setback in iterations after a stage is lost, and the paired differences between methods.",
        "python benchmarks/convergence_lab_larger_model.py --out DIR"),
    Benchmark(
        "cuda-paths", "cuda_paths.py",
        "The CUDA code paths on a machine with a GPU: the lazy async checkpoint engine's page-locked host pool, "
        "how much of its GPU-to-host copy hides behind compute, NCCL collectives, and `churnsim real run` per "
        "method on the GPU.",
        "python benchmarks/cuda_paths.py --out FILE"),
    Benchmark(
        "gpu-check", "gpu_check.py",
        "The GPU paths end to end on a machine with several GPUs: point-to-point messages around a ring of one "
        "process per GPU (NCCL) with the span recorder's CUDA-event timing beside host timing, `churnsim calibrate "
        "--quick --device cuda`, a no-failure twin and every method with stage processes killed (hard failures), "
        "and `churnsim validate` of those runs. Its dry run (`--device cpu`) runs the same parts on gloo with tiny "
        "sizes and calibrates from one short no-failure run instead of the suite (so its validation errors of recovery costs are not the calibration's).",
        "python benchmarks/gpu_check.py --out FILE"),
    Benchmark(
        "checkpoint-flush-throughput", "checkpoint_flush_throughput.py",
        "Flush throughput of the lazy async checkpoint engine against a plain write + fsync and the synchronous "
        "engine, writing the same state to the same disk (median of the repeats), with and without back-pressure "
        "from a small host pool.",
        "python benchmarks/checkpoint_flush_throughput.py"),
)}


# ---------------------------------------------------------------------------------------------------
# What the report says about where it was measured


def _git(*arguments: str) -> str:
    try:
        completed = subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True, check=False)
    except OSError:
        return ""
    return completed.stdout.strip() if completed.returncode == 0 else ""


def this_commit() -> dict:
    """The checked-out commit and whether the tree differs from it (untracked files count; the
    benchmarks' own outputs in results/ and reports/ do not: a benchmark writes them before its report)."""
    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results", ":(exclude)benchmarks/reports")
    return {"commit": commit or "unknown (not a git checkout)", "dirty": bool(changes) if commit else None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def this_machine() -> dict:
    """The machine this process runs on, for a report written right after a measurement."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "load_average_1_5_15_min": [round(value, 2) for value in load] if load else None,
    }


def recorded_machine(result: object) -> dict | None:
    """What a result file records of its machine: its `machine` or `environment` entry, wherever first found."""
    if isinstance(result, dict):
        for key in ("machine", "environment"):
            if isinstance(result.get(key), dict):
                return result[key]
        if result.get("part") == "environment":
            return {key: value for key, value in result.items() if key != "part"}
        values = list(result.values())
    elif isinstance(result, list):
        values = result
    else:
        return None
    for value in values:
        found = recorded_machine(value)
        if found:
            return found
    return None


def recorded_date(result: object) -> str | None:
    """The date (YYYY-MM-DD) a result file records of its measurement (`measured_at`), if any."""
    machine = recorded_machine(result) or {}
    for source in (machine, result if isinstance(result, dict) else {}):
        stamp = source.get("measured_at")
        if isinstance(stamp, str) and len(stamp) >= 10:
            try:
                return datetime.date.fromisoformat(stamp[:10]).isoformat()
            except ValueError:
                pass
    return None


# ---------------------------------------------------------------------------------------------------
# The results table


def _number(value: float) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    return f"{value:.4g}"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _spread_of_list(values: list) -> str:
    if len(values) <= 4:
        return ", ".join(_number(value) for value in values)
    return f"median {_number(statistics.median(values))} (min–max {_number(min(values))}–{_number(max(values))}, {len(values)} values)"


def _is_timing(value: dict) -> bool:
    return isinstance(value.get("wall_s"), list) and "median_s" in value


def _timing(value: dict) -> str:
    repetitions = len(value["wall_s"])
    text = f"{_number(value.get('agreed_s', value['median_s']))} s (min–max {_number(value['min_s'])}–{_number(value['max_s'])}, {repetitions} repetitions"
    if value.get("last_two_agree_within_20_percent") is False:
        text += ", the last two did not agree within 20 %"
    return text + ")"


_TARGET_KEYS = {"target_s", "meets_target", "targets", "target_verdicts"}
_DESCRIPTIVE_KEYS = {"machine", "environment", "benchmark", "command", "note"}


def _label(entry: dict, index: int) -> str:
    for key in ("setup", "part", "method", "round", "name"):
        if key in entry and not isinstance(entry[key], (dict, list)):
            return f"{key} {entry[key]}"
    return f"#{index}"


def table_rows(result: object, path: str = "") -> list[tuple[str, str]]:
    """(quantity, value with its spread) for every figure a result holds, by its path in the file.

    A number beside `<name>_ci95` is shown with its interval and beside `<name>_round_spread` (or
    `_spread_<name>`) with that range; a timing (`wall_s`, `median_s`, ...) as the figure the benchmark
    uses with its min–max and repetitions; a list of numbers as its values, or its median and range."""
    rows: list[tuple[str, str]] = []
    if isinstance(result, dict):
        if _is_timing(result):
            return [(path, _timing(result))]
        keys = list(result)
        for key in keys:
            value = result[key]
            name = f"{path} / {key}" if path else str(key)
            if key in _TARGET_KEYS or key in _DESCRIPTIVE_KEYS and not path or key == "part":
                continue
            if key.endswith(("_ci95", "_round_spread")) or key.startswith("spread_"):
                continue
            if _is_number(value):
                text = _number(value)
                interval = result.get(f"{key}_ci95")
                if isinstance(interval, list) and len(interval) == 2:
                    text += f" [{_number(interval[0])}, {_number(interval[1])}] (95 % interval)"
                spread = result.get(f"{key}_round_spread") or result.get(f"spread_{key}")
                if isinstance(spread, list) and len(spread) == 2:
                    text += f"; rounds {_number(spread[0])}–{_number(spread[1])}"
                rows.append((name, text))
            elif key == "ci95" and isinstance(value, list) and len(value) == 2:
                rows.append((name, f"[{_number(value[0])}, {_number(value[1])}] (95 % interval)"))
            else:
                rows.extend(table_rows(value, name))
    elif isinstance(result, list):
        if result and all(_is_number(value) for value in result):
            rows.append((path, _spread_of_list(result)))
        elif result and all(isinstance(value, dict) for value in result):
            if len(result) > MAX_LISTED_ENTRIES:
                rows.append((path, f"{len(result)} entries (in the result file)"))
            else:
                for index, entry in enumerate(result):
                    rows.extend(table_rows(entry, f"{path} / {_label(entry, index)}" if path else _label(entry, index)))
        elif result:
            rows.append((path, ", ".join(_number(value) if _is_number(value) else str(value) for value in result)))
    elif result is not None:
        rows.append((path, _number(result)))
    return rows


# ---------------------------------------------------------------------------------------------------
# Targets


def target_rows(result: object, path: str = "") -> list[tuple[str, str, str, str]]:
    """(what, target, measured, met / not met) for every target a result file records."""
    rows: list[tuple[str, str, str, str]] = []
    if isinstance(result, dict):
        if result.get("target_s") is not None and "meets_target" in result:
            timing = result.get("closed_form", result)
            measured = _timing(timing) if _is_timing(timing) else _number(timing.get("agreed_s", timing.get("median_s", "")))
            rows.append((path or "the benchmark", f"≤ {_number(result['target_s'])} s", measured,
                         "met" if result["meets_target"] else "not met"))
        if isinstance(result.get("targets"), dict):
            verdicts = result.get("target_verdicts") or {}
            pooled = result.get("pooled") or {}
            # Relative errors, as fractions in the file: shown in percent.
            for group, limit in result["targets"].items():
                figures = pooled.get(group, {})
                measured = f"{_number(100 * figures['absolute'])} %" if "absolute" in figures else "not measured"
                if isinstance(figures.get("absolute_ci95"), list):
                    low, high = figures["absolute_ci95"]
                    measured += f" [{_number(100 * low)}, {_number(100 * high)}] (95 % interval)"
                rows.append((f"{path + ' / ' if path else ''}{group}: median |relative error|", f"≤ {_number(100 * limit)} %", measured,
                             verdicts.get(group, "not judged")))
        for key, value in result.items():
            if key not in _TARGET_KEYS and isinstance(value, (dict, list)):
                rows.extend(target_rows(value, f"{path} / {key}" if path else str(key)))
    elif isinstance(result, list):
        for index, entry in enumerate(result):
            if isinstance(entry, dict):
                rows.extend(target_rows(entry, f"{path} / {_label(entry, index)}" if path else _label(entry, index)))
    return rows


# ---------------------------------------------------------------------------------------------------
# The report


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _machine_lines(machine: dict | None, *, recorded: bool) -> list[str]:
    if not machine:
        return ["The result file records no machine."]
    lines = [] if not recorded else ["As the result file records it (what it does not record is not known):", ""]
    lines += [f"- {key.replace('_', ' ')}: {_cell(value if not isinstance(value, list) else ', '.join(map(str, value)))}"
              for key, value in machine.items() if key not in ("measured_at", "git_head")]
    return lines


def render(benchmark: Benchmark, result: object, *, command: str, date: str, machine: dict | None, machine_recorded: bool,
           commit: dict, result_file: str) -> str:
    """The report's Markdown."""
    lines = [f"# {benchmark.name}, {date}", "", benchmark.measures, ""]
    if isinstance(result, dict) and isinstance(result.get("benchmark"), str):
        lines += [f"The result file describes this measurement as: {_cell(result['benchmark'])}.", ""]
    if isinstance(result, dict) and isinstance(result.get("note"), str):
        lines += [f"Note recorded with the result: {_cell(result['note'])}", ""]
    lines += ["## Command", "", "```text", command, "```", "",
              f"Script: `benchmarks/{benchmark.script}`. Result file: `{result_file}`.", "",
              "## Machine", "", *_machine_lines(machine, recorded=machine_recorded), "",
              "## Commit and date", "",
              f"- commit: `{commit['commit']}`" + ("" if commit.get("dirty") is None else
                                                   " (the tree had uncommitted changes)" if commit["dirty"] else " (clean tree)"),
              *([f"- {commit['note']}"] if commit.get("note") else []),
              f"- date: {date}", ""]
    targets = target_rows(result)
    lines += ["## Targets", ""]
    if targets:
        lines += ["| what | target | measured | verdict |", "|---|---|---|---|"]
        lines += [f"| {_cell(what)} | {_cell(target)} | {_cell(measured)} | {verdict} |" for what, target, measured, verdict in targets]
    else:
        lines += [f"Target: {benchmark.target}."]
    rows = table_rows(result)
    lines += ["", "## Results", "",
              "Every figure of the result file, by its place in the file; spreads as the file holds them "
              "(95 % intervals, min–max over repetitions or rounds, the number of repetitions).", "",
              "| quantity | value |", "|---|---|"]
    lines += [f"| {_cell(name) or '(value)'} | {_cell(value)} |" for name, value in rows[:MAX_TABLE_ROWS]]
    if len(rows) > MAX_TABLE_ROWS:
        lines += ["", f"{len(rows) - MAX_TABLE_ROWS} more figures are in the result file."]
    return "\n".join(lines) + "\n"


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPOSITORY).as_posix()
    except ValueError:
        return path.name


def invoked_command() -> str:
    """How this process was started, as a command line relative to the repository."""
    script = Path(sys.argv[0])
    return shlex.join(["python", _relative(script) if script.suffix == ".py" else str(script), *sys.argv[1:]])


def write_report(name: str, result_file: Path, *, command: str | None = None, variant: str = "",
                 reports_directory: Path = REPORTS_DIRECTORY) -> Path:
    """The report of a measurement just made on this machine, from its result file (JSON, or JSON lines)."""
    benchmark = BENCHMARKS[name]
    result = latest_entry(read_result(result_file))
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    # What the benchmark itself recorded beyond this (the closed-form engine's build, a GPU) is kept.
    covered = {"python", "processor", "cpu_count", "cpus", "load_average_1_5_15_min", "git_head", "measured_at", "torch"}
    recorded = {key: value for key, value in (recorded_machine(result) or {}).items() if key not in covered}
    text = render(benchmark, result, command=command or invoked_command(), date=date, machine={**this_machine(), **recorded},
                  machine_recorded=False, commit=this_commit(), result_file=_relative(result_file))
    return _write(reports_directory / f"{date}-{name}{'-' + variant if variant else ''}.md", text)


def write_committed_report(name: str, result_file: Path, *, reports_directory: Path = REPORTS_DIRECTORY,
                           variant: str = "", measured_in: str | None = None) -> Path:
    """The report of a result committed earlier: its date, machine and commit as it records them, or as
    git does (the commit that last changed the file, and its date)."""
    benchmark = BENCHMARKS[name]
    result = read_result(result_file)
    entry = latest_entry(result)
    relative = _relative(result_file)
    # The commit that last changed the file's content (renames of the file not counted), or the one given.
    last_commit = (_git("show", "-s", "--format=%H %cs", measured_in) if measured_in else
                   _git("log", "-1", "--follow", "--diff-filter=AM", "--format=%H %cs", "--", relative)).split()
    recorded_head = (recorded_machine(entry) or {}).get("git_head")
    date = recorded_date(entry) or (last_commit[1] if last_commit else datetime.date.today().isoformat())
    commit = {"commit": recorded_head or (last_commit[0] if last_commit else "unknown"), "dirty": None,
              "note": ("the commit recorded by the measurement; whether its tree was clean was not recorded" if recorded_head else
                       "the commit that added this measurement to the result file; the commit measured and whether its tree was "
                       "clean were not recorded")}
    command = entry.get("command") if isinstance(entry, dict) and isinstance(entry.get("command"), str) else benchmark.command
    if isinstance(result, list) and entry is not result:
        command += f"   # the latest of the {len(result)} entries the result file appends"
    text = render(benchmark, entry, command=command, date=date, machine=recorded_machine(entry), machine_recorded=True,
                  commit=commit, result_file=relative)
    suffix = f"-{variant}" if variant else ""
    return _write(reports_directory / f"{date}-{name}{suffix}.md", text)


def latest_entry(result: object) -> object:
    """The measurement a result file holds: its last entry where the benchmark appends one per call
    (a list of records), the whole file otherwise (JSON lines of parts of one measurement too)."""
    if isinstance(result, list) and result and isinstance(result[-1], dict) and "part" not in result[-1]:
        return result[-1]
    return result


def read_result(result_file: Path) -> object:
    text = result_file.read_text(encoding="utf-8")
    if result_file.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def add_report_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-report", dest="report", action="store_false",
                        help="write no dated report into benchmarks/reports/ after the result file")


def report_if_asked(arguments: argparse.Namespace, name: str, result_file: Path, *, variant: str = "") -> None:
    """After a benchmark wrote `result_file`: its dated report, unless `--no-report`."""
    if getattr(arguments, "report", True):
        print(f"wrote {write_report(name, result_file, variant=variant)}")


COMMITTED_RESULTS = (
    # (benchmark, result file under benchmarks/results/, variant of the report's name)
    ("sim-run-speed", "sim-run-speed.json", ""),
    ("sim-trace-speed", "sim-trace-speed.json", ""),
    ("sim-grid-speed", "sim-grid-speed.json", ""),
    ("sim-grid-speed", "sim-grid-speed-closed-form-only.json", "closed-form-only"),
    ("sim-aire-speed", "sim-aire-speed.json", ""),
    ("import-speed", "import-speed.json", ""),
    ("calibrate-and-validate", "calibrate-and-validate.json", ""),
    ("calibrate-and-validate", "calibrate-and-validate-h100-host-all-setups/calibrate-and-validate.json", "h100-host"),
    ("calibrate-and-validate", "calibrate-and-validate-h200-host-again/calibrate-and-validate.json", "h200-host"),
    ("calibrate-and-validate-pooled", "calibrate-and-validate-pooled.json", ""),
    ("calibrate-and-validate-pooled", "calibrate-and-validate-pooled-shared-core-term.json", "shared-core-term"),
    ("calibrate-and-validate-pooled", "calibrate-and-validate-pooled-seeds-400-and-500.json", "seeds-400-and-500"),
    ("calibrate-on-the-setup", "calibrate-on-the-setup.json", ""),
    ("carry-by-shape", "carry-by-shape.json", ""),
    ("identical-runs-spread", "identical-runs-spread.json", ""),
    ("identical-runs-spread", "identical-runs-spread-h100-host.json", "h100-host"),
    ("loss-curve-extrapolation", "loss-curve-extrapolation.json", ""),
    ("convergence-lab-larger-model", "convergence-lab-8-layers-1600/result.json", ""),
    ("cuda-paths", "cuda-paths-h200.jsonl", "h200"),
    ("cuda-paths", "cuda-paths-h100.jsonl", "h100"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result_file", type=Path, nargs="?", help="a committed result file (JSON, or JSON lines)")
    parser.add_argument("--benchmark", choices=sorted(BENCHMARKS), help="which benchmark wrote it")
    parser.add_argument("--variant", default="", help="appended to the report's name (another machine, another pool)")
    parser.add_argument("--commit", default=None, metavar="REV",
                        help="the commit that added this measurement, where a later edit of the file (a path in it) came after")
    parser.add_argument("--all", action="store_true", help="a report for every result in COMMITTED_RESULTS that has none yet")
    arguments = parser.parse_args()
    if arguments.all:
        for name, relative, variant in COMMITTED_RESULTS:
            # A report once written stays: git's date of the file moves with later edits of it.
            existing = sorted(REPORTS_DIRECTORY.glob(f"????-??-??-{name}{'-' + variant if variant else ''}.md"))
            path = existing[-1] if existing else write_committed_report(name, RESULTS_DIRECTORY / relative, variant=variant)
            print(("kept " if existing else "") + str(path.relative_to(REPOSITORY)))
        return
    if arguments.result_file is None or arguments.benchmark is None:
        parser.error("give a result file and --benchmark NAME, or --all")
    if not arguments.result_file.is_file():
        parser.error(f"{arguments.result_file}: no such result file")
    try:
        path = write_committed_report(arguments.benchmark, arguments.result_file, variant=arguments.variant,
                                      measured_in=arguments.commit)
    except json.JSONDecodeError as error:
        parser.error(f"{arguments.result_file}: not JSON ({error.msg}, line {error.lineno}); give the file the benchmark wrote")
    print(path.relative_to(REPOSITORY))


if __name__ == "__main__":
    main()
