"""Two-agent validation: real runs on two torchrun agents of this machine, predicted by the simulator.

    python benchmarks/two_agent_validation.py [--out DIR] [--calibration FILE] [--iterations 40] [--methods checkfree,checkpoint] [--no-report]

1. `churnsim calibrate --quick` into OUT/calibration.json (or `--calibration FILE`): one calibration,
   whose suite includes a short hard-failure run, so it carries the hard-failure components
   (`Calibration.hard_failure_costs`: detection, the agent's restart, process start, rendezvous, the
   survivors' snapshot reload) and the per-method hard recovery.
2. Per failure mode (soft, hard) and method: the `cpu-tiny` scenario in 2 stages with a schedule of
   two failures (the last stage, then the first, at fractions of the run's predicted length), made
   into the torchrun line `churnsim real run --write-config` prints (c10d rendezvous, `--nnodes 2`),
   and run as printed by two agents ("node-a", "node-b"), each in a working directory of its own,
   no shared run directory, one node memory directory each machine would have (both here).
3. `churnsim validate` of every finished run against the one calibration: the run is charged its
   own failure mode's costs. Per run the total wall-clock's absolute and load-normalised error; the
   figures are the medians of their absolute values with a 95 % bootstrap interval, quartiles and
   range, per failure mode and per method; and the costs the runs measured (recoveries.csv: join,
   rendezvous, transfer, detection, the agents' restart, process start, the survivors' reload and
   restart) as medians with quartiles over every recovery, beside what the calibration charges.

Results: benchmarks/results/two-agent-validation.json and .csv (the validation table); a dated report
(benchmarks/report.py, unless --no-report). A benchmark, not a test: its numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from held_out_validation import _median_figures, _without_paths, calibration_to_validate_against, validate_with_cli  # noqa: E402
from report import add_report_option, report_if_asked  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS_FILE = REPOSITORY / "benchmarks" / "results" / "two-agent-validation.json"
TABLE_FILE = RESULTS_FILE.with_suffix(".csv")
BASE_PRESET = "cpu-tiny"
NUM_STAGES = 2
NODES = ("node-a", "node-b")
FAILURE_MODES = ("soft", "hard")
RUN_TIME_LIMIT_S = 300.0
FAILURE_FRACTIONS = ((0.3, NUM_STAGES - 1), (0.65, 0))
"""(fraction of the run's predicted length, stage) of each failure: a stage of each agent in turn."""
MEASURED_COSTS = (
    "join_s", "rendezvous_s", "transfer_s", "detection_s", "agent_restart_s", "process_start_s", "survivor_reload_s",
    "survivor_restart_s",
)  # fmt: skip
"""recoveries.csv columns summarised over every recovery of the finished runs."""


def plan_runs(methods: list[str], iterations: int) -> list[dict[str, object]]:
    """One run per failure mode and method: its id, mode, method and iterations."""
    if len(set(methods)) != len(methods) or not methods:
        raise ValueError(f"--methods {','.join(methods)!r}: name one or more methods, each once")
    return [
        {"run_id": f"{mode}-{method}", "failure_mode": mode, "method": method, "iterations": iterations}
        for mode in FAILURE_MODES
        for method in methods
    ]


def failure_rows(run_s: float) -> list[tuple[float, int]]:
    """(time_s, stage) of the schedule's failures over a run of about `run_s` seconds."""
    return [(round(fraction * run_s, 3), stage) for fraction, stage in FAILURE_FRACTIONS]


def write_schedule(path: Path, rows: list[tuple[float, int]]) -> None:
    lines = ["# churnsim failure schedule, schema_version 1", "time_s,iteration,stage,kind"]
    lines += [f"{time_s:.3f},,{stage},scheduled" for time_s, stage in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def scenario_settings(run: dict[str, object]) -> dict[str, object]:
    """The `--set` fields of a run's scenario (beside its churn schedule)."""
    return {
        "pipeline.num_stages": NUM_STAGES, "target.loss": None, "target.iterations": run["iterations"],
        "training.failure_mode": run["failure_mode"], "training.peer_timeout_s": 60.0,
    }  # fmt: skip


def write_config_command(scenario_path: Path, method: str, *, port: int) -> list[str]:
    """`churnsim real run --write-config`: writes the scenario and its token, prints the torchrun line."""
    return [
        sys.executable, "-m", "churnsim", "real", "run", str(scenario_path), "--method", method, "--out", "run",
        "--write-config", "scenario.json", "--nodes", str(len(NODES)), "--rendezvous-port", str(port),
    ]  # fmt: skip


def torchrun_line(printed: str) -> str:
    """The one torchrun line `--write-config` printed; ValueError when it printed none or several."""
    lines = [line.strip() for line in printed.splitlines() if "torchrun" in line and "--rdzv" in line]
    if len(lines) != 1:
        raise ValueError(f"--write-config printed {len(lines)} torchrun lines, expected one")
    return lines[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def agent_environment(directory: Path) -> dict[str, str]:
    """torchrun of this interpreter first on PATH, and the machines' node memory in `directory`."""
    shim = directory / "bin" / "torchrun"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run \"$@\"\n", encoding="utf-8")
    shim.chmod(0o755)
    memory = directory / "node-memory"
    memory.mkdir(exist_ok=True)
    return os.environ | {"PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "CHURNSIM_NODE_MEMORY_DIR": str(memory), "LOGLEVEL": "WARNING"}


def run_two_agents(command: str, files: list[Path], directory: Path, *, time_limit_s: float) -> tuple[str, float, Path | None]:
    """The torchrun `command` as printed, by one agent per node directory; (status, seconds, the record's directory)."""
    environment = agent_environment(directory)
    agents = []
    started = time.perf_counter()
    for node in NODES:
        node_directory = directory / node
        node_directory.mkdir(parents=True, exist_ok=True)
        for path in files:
            (node_directory / path.name).write_bytes(path.read_bytes())
        log = open(node_directory / "agent.log", "wb")
        agents.append(subprocess.Popen(["/bin/sh", "-c", command], cwd=node_directory, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))  # fmt: skip
    status = "finished"
    for agent in agents:
        try:
            code = agent.wait(timeout=max(1.0, time_limit_s - (time.perf_counter() - started)))
            if code != 0 and status == "finished":
                status = f"failed (an agent exited with {code})"
        except subprocess.TimeoutExpired:
            status = f"stopped at its time limit of {time_limit_s:.0f} s"
            break
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    records = [path for path in directory.glob("node-*/run") if (path / "manifest.json").exists()]
    return status, time.perf_counter() - started, (records[0] if status == "finished" and len(records) == 1 else None)


def predicted_iteration_s(scenario, calibration) -> float:
    """The calibration's healthy iteration of the scenario (used only to place the failures)."""
    from churnsim.calibration.apply import calibrated_compute
    from churnsim.sim.model.calibrated import iteration_predictor

    return iteration_predictor(link=calibration.link)(scenario.model, scenario.pipeline, calibrated_compute(scenario, calibration))


def measured_costs(recoveries: list) -> dict[str, dict[str, object]]:
    """Per cost of `MEASURED_COSTS` (and per failure mode): median, quartiles and count over every
    recovery that measured it; `recoveries` are recoveries.csv frames."""
    import pandas as pd

    frames = [frame for frame in recoveries if frame is not None and not frame.empty]
    if not frames:
        return {}
    table = pd.concat(frames, ignore_index=True)
    result: dict[str, dict[str, object]] = {}
    for mode, rows in table.groupby("failure_mode"):
        costs = {}
        for column in MEASURED_COSTS:
            values = pd.to_numeric(rows[column], errors="coerce").dropna() if column in rows.columns else pd.Series(dtype=float)
            if values.empty:
                continue
            quartiles = np.quantile(values, [0.25, 0.75])
            costs[column] = {"median_s": float(values.median()), "quartiles_s": [float(quartiles[0]), float(quartiles[1])], "recoveries": int(len(values))}
        result[str(mode)] = costs
    return result


def summarize(table, runs: list[dict]) -> dict[str, object]:
    """The figures from the validation table (fractions, not percent), overall and per mode and method."""
    wall = table[table["quantity"] == "total_wall_clock_s"].set_index("run_id")
    absolute = wall["relative_error"].abs().dropna()
    normalised = wall["load_normalised_relative_error"].abs().dropna()
    by_run = {run["run_id"]: run for run in runs}
    groups: dict[str, dict[str, object]] = {}
    for key in ("failure_mode", "method"):
        levels: dict[str, list[str]] = {}
        for run_id in absolute.index:
            levels.setdefault(str(by_run[run_id][key]), []).append(run_id)
        groups[key] = {
            level: {
                "runs": len(ids),
                "median_absolute_wall_clock_error": float(absolute.reindex(ids).median()),
                "median_absolute_load_normalised_error": float(normalised.reindex(ids).median()),
                "median_signed_wall_clock_error": float(wall["relative_error"].reindex(ids).median()),
            }
            for level, ids in sorted(levels.items())
        }
    return {
        "wall_clock": _median_figures(absolute.to_numpy()),
        "load_normalised_wall_clock": _median_figures(normalised.to_numpy()),
        "median_signed_wall_clock_error": float(wall["relative_error"].median()) if len(wall) else None,
        "by": groups,
    }


def charged_costs(calibration) -> dict[str, object]:
    """What the calibration charges a hard failure: its fitted components (None where it has none)."""
    costs = calibration.hard_failure_costs
    if costs is None:
        return {"hard_failure_costs": None, "note": "the calibration fitted no hard-failure components"}
    from churnsim.calibration.presets import preset

    scenario = preset(BASE_PRESET, {"pipeline.num_stages": NUM_STAGES}, methods=("checkpoint",))  # any method of 2 stages
    return {
        "hard_failure_costs": costs.model_dump(),
        "survivor_restart_s_charged_on_these_runs": costs.survivor_restart_s(
            scenario.model, scenario.pipeline, calibration.compute_model.shared_cores if calibration.compute_model is not None else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("two-agent-validation"), help="working directory (calibration, runs, validation)")
    parser.add_argument("--calibration", type=Path, help="validate against this calibration instead of making one with calibrate --quick")
    parser.add_argument("--iterations", type=int, default=40, help="iterations of each run")
    parser.add_argument("--methods", default="checkfree,checkpoint", help="comma-separated methods, each run under soft and hard failures")
    add_report_option(parser)
    arguments = parser.parse_args()

    from churnsim.calibration.base import save_model
    from churnsim.calibration.calibration_file import load_calibration
    from churnsim.calibration.churn import ScheduleChurn
    from churnsim.calibration.presets import preset
    from churnsim.calibration.run_record import read_recoveries
    from churnsim.real.calibration_suite import set_run_id

    plan = plan_runs(arguments.methods.split(","), arguments.iterations)
    started = time.perf_counter()
    out = arguments.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a", encoding="utf-8")
    calibration_path, calibrate_s = calibration_to_validate_against(arguments.calibration, out, log)
    calibration = load_calibration(str(calibration_path))
    runs, records, recoveries = [], [], []
    for run in plan:
        run_id, method = str(run["run_id"]), str(run["method"])
        scenario = preset(BASE_PRESET, scenario_settings(run), methods=(method,))
        iteration_s = predicted_iteration_s(scenario, calibration)
        inputs = out / "inputs" / run_id
        inputs.mkdir(parents=True, exist_ok=True)
        schedule_path = inputs / "failures.csv"
        write_schedule(schedule_path, failure_rows(arguments.iterations * iteration_s))
        base_path = inputs / "base.json"
        save_model(scenario.model_copy(update={"churn": ScheduleChurn(kind="schedule", path=str(schedule_path))}), base_path)
        printed = subprocess.run(write_config_command(base_path, method, port=free_port()), cwd=inputs, capture_output=True, text=True, timeout=300)
        if printed.returncode != 0:
            raise SystemExit(f"{run_id}: real run --write-config failed: {printed.stderr.strip()[-500:]}")
        command = torchrun_line(printed.stdout)
        files = [inputs / "scenario.json", inputs / "scenario.json.token"]
        status, seconds, record = run_two_agents(command, files, out / "runs" / run_id, time_limit_s=RUN_TIME_LIMIT_S)
        if record is not None:
            set_run_id(record, run_id)
            records.append(record)
            recoveries.append(read_recoveries(record))
        print(f"  {run_id}: {status}, {seconds:.0f} s", flush=True)
        runs.append({**run, "status": status, "seconds": seconds, "predicted_iteration_s": iteration_s, "torchrun": command})
    table, notes = validate_with_cli(calibration_path, records, out, log)
    result = {
        "command": "python benchmarks/two_agent_validation.py " + " ".join(_without_paths(sys.argv[1:])),
        "runs_planned": len(plan),
        "runs_finished": len(records),
        **summarize(table, [run for run in runs if run["status"] == "finished"]),
        "measured_costs_by_failure_mode": measured_costs(recoveries),
        "charged": charged_costs(calibration),
        "calibrate_s": calibrate_s,
        "total_s": time.perf_counter() - started,
        "machine": {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "load_average_after_runs_1_5_15_min": [round(value, 2) for value in os.getloadavg()],
        "validation_notes": notes,
        "runs": [{key: value for key, value in run.items() if key != "torchrun"} for run in runs],
    }
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2, default=float) + "\n", encoding="utf-8")
    table.to_csv(TABLE_FILE, index=False)
    figures = result["wall_clock"]
    if figures["runs"]:
        low, high = figures["absolute_ci95"]
        print(f"median |wall-clock error|: {100 * figures['absolute']:.1f} % [{100 * low:.1f}, {100 * high:.1f}] over {figures['runs']} runs")
    print(f"wrote {RESULTS_FILE} and {TABLE_FILE}")
    report_if_asked(arguments, "two-agent-validation", RESULTS_FILE)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
