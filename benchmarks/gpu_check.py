"""The GPU paths end to end on a machine with several GPUs, within 8 minutes of GPU time.

A manual check for whenever a GPU machine is at hand (CI has none; CI runs its CPU dry run,
`--device cpu`, gloo and tiny sizes). Each part is independent, so one failure does not hide the
others; each reports its figures (a JSON line on stdout as it ends, all of them in one JSON file):

1. environment:     torch, CUDA and NCCL versions, the GPUs.
2. point_to_point:  one process per GPU (two on CPU), each sending a tensor to the next around a
                    ring with the Communicator's isend/recv (NCCL between GPUs, gloo on CPU);
                    the values are checked and the bytes per second reported. The same processes
                    time matrix products with the SpanRecorder (CUDA events on GPUs) and with
                    host timing around a device synchronisation, and report both.
3. calibrate:       `churnsim calibrate --quick --device cuda` on the check's scenario (4 stages;
                    a GPU each where the machine has 4, else sharing them over gloo), given what
                    the budget leaves after HELD_OUT_RESERVE_S (at least half of it). The dry run
                    fits `calibrate --runs` on one short no-failure run instead (the suite takes
                    minutes on a CPU).
4. held_out:        real runs held out from the calibration: a no-failure twin (`none`), then each
                    method of --methods (the headline methods, CheckFree+ among them, by default)
                    with hard failures: the scenario's failure schedule kills stage
                    processes (an interior stage at 30 % and an edge stage at 60 % of the twin's
                    training time), and replacements join.
5. validate:        `churnsim validate` of the held-out runs against the calibration.

Every command runs with a timeout taken from one budget (`--budget-s`, 480 s by default); a part
that the budget no longer allows is reported as skipped.

Usage: python benchmarks/gpu_check.py [--device cuda|cpu] [--work-dir DIR] [--out FILE] [--no-report]
Writes WORK_DIR/gpu-check.json (or --out) and, on CUDA unless --no-report, the dated report
benchmarks/reports/<date>-gpu-check.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_report_option, report_if_asked  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent
NUM_STAGES = 4  # CheckFree+ needs 4 stages (its swap partners)
RING_TENSOR_BYTES = {"cuda": 64 << 20, "cpu": 1 << 20}
RING_REPEATS = 5
# (stage, fraction of the twin's training time): an interior stage, then an edge stage.
KILLS = ((1, 0.3), (3, 0.6))
SIZES = {
    # model and run lengths per device: the dry run is as small as runs allow
    "cuda": {"model.num_layers": 8, "model.hidden_size": 256, "iterations": 300, "calibration_iterations": None},
    "cpu": {"model.num_layers": 4, "model.hidden_size": 64, "iterations": 40, "calibration_iterations": 30},
}
CALIBRATION_SEED = 100
METHODS = ("none", "checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus")
"""The headline methods; the rebuild ablations (copy, uniform, random) with --methods, time allowing."""
HELD_OUT_SEED = 7
HELD_OUT_RESERVE_S = 180.0
"""Seconds of the budget the calibration leaves to the held-out runs and the validation (at least half)."""

RESULTS: dict[str, dict] = {}
"""part -> its figures; `held_out` -> method -> the run's figures."""


def report(part: str, key: str | None = None, **values: object) -> None:
    if key is None:
        RESULTS.setdefault(part, {}).update(values)
    else:
        RESULTS.setdefault(part, {})[key] = values
    print(json.dumps({"part": part, **({"key": key} if key else {}), **values}), flush=True)


def failed_parts(results: dict) -> list[str]:
    """Parts (and held-out runs) that raised or whose command exited non-zero."""
    failed = ["held_out"] if "error" in results.get("held_out", {}) else []
    for part, values in results.items():
        entries = values.items() if part == "held_out" else [("", values)]
        for key, entry in entries:
            if isinstance(entry, dict) and ("error" in entry or entry.get("exit_code") not in (None, 0)):
                failed.append(f"{part} {key}".strip())
    return failed


class Budget:
    """One budget of seconds for every command of the check."""

    def __init__(self, seconds: float) -> None:
        self.deadline_s = time.perf_counter() + seconds

    def left_s(self) -> float:
        return self.deadline_s - time.perf_counter()

    def timeout_s(self, at_most_s: float) -> float:
        left_s = self.left_s()
        if left_s < 5:
            raise BudgetSpent(f"the budget is spent ({left_s:.0f} s left)")
        return min(at_most_s, left_s)


class BudgetSpent(RuntimeError):
    pass


def churnsim(arguments: list[str], *, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`churnsim ARGS` of this checkout, in `cwd`."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), environment.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "churnsim.cli", *arguments], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s, env=environment)  # fmt: skip


def nccl_version() -> str:
    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (2.18.1 = 21801) before
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def tail(text: str, characters: int = 1500) -> str:
    return text[-characters:]


# -- 2. point to point -------------------------------------------------------------------------------------


def _ring_worker(rank: int, world_size: int, device: str, port: int, tensor_bytes: int, answers) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    from churnsim.real.distributed import destroy_process_group, init_process_group
    from churnsim.real.spans import SpanRecorder

    communicator = init_process_group(rank=rank, world_size=world_size, device=device, timeout_s=120,
                                      master_addr="127.0.0.1", master_port=port)  # fmt: skip
    try:
        import torch.distributed as dist

        on = communicator.device
        synchronize = (lambda: torch.cuda.synchronize(on)) if on.type == "cuda" else (lambda: None)
        numel = tensor_bytes // 4
        spans = SpanRecorder(rank=rank, stage=rank, device=on)
        spans.restart_clock()
        mine = torch.full((numel,), float(rank + 1), device=on)
        received_ok = True
        seconds: list[float] = []
        for repeat in range(RING_REPEATS + 1):  # the first round warms up
            communicator.barrier()
            synchronize()
            start_s = time.perf_counter()
            spans.step = repeat
            # NCCL runs a pair's operations in issue order on one stream: with two ranks, both
            # sending first would wait for each other, so odd ranks receive first.
            if rank % 2:
                with spans.span("receive"):
                    theirs = communicator.recv((numel,), torch.float32, (rank - 1) % world_size, tag=repeat)
            with spans.span("send"):
                work = communicator.isend(mine, (rank + 1) % world_size, tag=repeat)
            if not rank % 2:
                with spans.span("receive"):
                    theirs = communicator.recv((numel,), torch.float32, (rank - 1) % world_size, tag=repeat)
            communicator.wait(work)
            synchronize()
            if repeat:
                seconds.append(time.perf_counter() - start_s)
            expected = float((rank - 1) % world_size + 1)
            received_ok = received_ok and bool(torch.all(theirs == expected).item())
        # Matrix products timed by the span recorder and by the host around a device synchronisation.
        operand = torch.randn(1024 if on.type == "cuda" else 128, 1024 if on.type == "cuda" else 128, device=on)
        host_seconds: list[float] = []
        for repeat in range(RING_REPEATS):
            synchronize()
            start_s = time.perf_counter()
            spans.step = RING_REPEATS + 1 + repeat
            with spans.span("forward"):
                product = operand
                for _ in range(20):
                    product = (product @ operand).clamp_(-1, 1)
            synchronize()
            host_seconds.append(time.perf_counter() - start_s)
        rows = spans.rows
        span_seconds = {kind: [row["end_s"] - row["start_s"] for row in rows if row["kind"] == kind] for kind in ("receive", "forward")}
        answers.put({
            "rank": rank, "backend": dist.get_backend(), "device": str(on), "wire_device": str(communicator.wire_device),
            "received_ok": received_ok, "ring_round_s": statistics.median(seconds),
            "bytes_per_s": tensor_bytes / statistics.median(seconds),
            "span_timing": "cuda events" if on.type == "cuda" else "host clock",
            "forward_span_s": statistics.median(span_seconds["forward"]), "forward_host_s": statistics.median(host_seconds),
            "receive_span_s": statistics.median(span_seconds["receive"]),
            "spans_ordered": all(row["start_s"] <= row["end_s"] for row in rows),
        })  # fmt: skip
    finally:
        destroy_process_group()


def part_point_to_point(device: str, budget: Budget) -> None:
    import torch.multiprocessing as multiprocessing

    from churnsim.real.distributed import find_free_port

    world_size = torch.cuda.device_count() if device == "cuda" else 2
    if world_size < 2:
        report("point_to_point", skipped="one GPU: point-to-point NCCL needs two")
        return
    context = multiprocessing.get_context("spawn")
    answers = context.SimpleQueue()
    port = find_free_port()
    processes = [context.Process(target=_ring_worker, args=(rank, world_size, device, port, RING_TENSOR_BYTES[device], answers))
                 for rank in range(world_size)]  # fmt: skip
    for process in processes:
        process.start()
    deadline_s = time.perf_counter() + budget.timeout_s(120)
    for process in processes:
        process.join(max(0.0, deadline_s - time.perf_counter()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    ranks = []
    while not answers.empty():
        ranks.append(answers.get())
    ranks.sort(key=lambda answer: answer["rank"])
    per_rank = {key: [answer[key] for answer in ranks] for key in ("bytes_per_s", "forward_span_s", "forward_host_s", "receive_span_s")}
    report("point_to_point", world_size=world_size, tensor_bytes=RING_TENSOR_BYTES[device],
           exit_codes=[process.exitcode for process in processes],
           all_received=len(ranks) == world_size and all(answer["received_ok"] for answer in ranks),
           backend=sorted({answer["backend"] for answer in ranks}), wire_device=sorted({answer["wire_device"] for answer in ranks}),
           span_timing=sorted({answer["span_timing"] for answer in ranks}),
           spans_ordered=len(ranks) == world_size and all(answer["spans_ordered"] for answer in ranks), **per_rank)  # fmt: skip


# -- 3. to 5. calibrate, held-out runs, validate ------------------------------------------------------------


def scenario_for(device: str, work: Path, budget: Budget) -> dict:
    """The check's scenario: cpu-tiny's methods on a model sized for the device, in 4 stages."""
    shown = churnsim(["presets", "--show", "cpu-tiny"], cwd=work, timeout_s=budget.timeout_s(60))
    if shown.returncode != 0:
        raise RuntimeError(f"churnsim presets --show cpu-tiny failed: {tail(shown.stderr)}")
    scenario = json.loads(shown.stdout)
    sizes = SIZES[device]
    scenario["model"]["num_layers"] = sizes["model.num_layers"]
    scenario["model"]["hidden_size"] = sizes["model.hidden_size"]
    scenario["pipeline"]["num_stages"] = NUM_STAGES
    scenario["training"]["device"] = device
    scenario["target"] = {"loss": None, "iterations": sizes["iterations"], "max_wall_clock_s": 3600.0}
    scenario["churn"] = {"kind": "none"}
    return scenario


def write_scenario(scenario: dict, path: Path, **changes: object) -> Path:
    copy = json.loads(json.dumps(scenario))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        where = copy
        for parent in parents:
            where = where[parent]
        where[leaf] = value
    path.write_text(json.dumps(copy, indent=1))
    return path


def real_run(scenario_path: Path, method: str, out: Path, *, cwd: Path, budget: Budget) -> dict:
    """One `churnsim real run`: exit code, wall seconds, and what its record says."""
    start_s = time.perf_counter()
    finished = churnsim(["real", "run", str(scenario_path), "--method", method, "--out", str(out)], cwd=cwd,
                        timeout_s=budget.timeout_s(240))  # fmt: skip
    outcome: dict = {"method": method, "exit_code": finished.returncode, "wall_s": round(time.perf_counter() - start_s, 2)}
    if finished.returncode != 0:
        outcome["stderr_tail"] = tail(finished.stderr)
        return outcome
    metrics = list(csv.DictReader((out / "metrics.csv").open()))
    evaluated = [float(row["eval_loss"]) for row in metrics if row["eval_loss"]]
    outcome["iterations"] = len(metrics)
    outcome["training_s"] = float(metrics[-1]["wall_time_s"]) if metrics else None
    outcome["final_eval_loss"] = evaluated[-1] if evaluated else None
    outcome["final_loss_finite"] = bool(evaluated) and math.isfinite(evaluated[-1])
    recoveries_path = out / "recoveries.csv"
    recoveries = list(csv.DictReader(recoveries_path.open())) if recoveries_path.is_file() else []
    hard = [row for row in recoveries if row.get("failure_mode") == "hard"]
    outcome["hard_recoveries"] = len(hard)
    for column in ("join_s", "rendezvous_s", "transfer_s", "load_s", "rebuild_s", "recovery_s"):
        values = [float(row[column]) for row in hard if row.get(column) not in (None, "")]
        if values:
            outcome[f"median_{column}"] = statistics.median(values)
    return outcome


def part_calibrate(device: str, scenario: dict, work: Path, methods: list[str], budget: Budget) -> Path | None:
    calibration = work / "calibration.json"
    start_s = time.perf_counter()
    if device == "cuda":
        scenario_path = write_scenario(scenario, work / "calibration-scenario.json")
        command = ["calibrate", "--quick", "--scenario", str(scenario_path), "--device", "cuda",
                   "--out", str(calibration), "--runs-out", str(work / "calibration-runs"),
                   *[word for method in methods if method != "none" for word in ("--method", method)]]  # fmt: skip
        how = "calibrate --quick --device cuda (the suite)"
    else:
        runs = work / "calibration-runs"
        runs.mkdir()
        path = write_scenario(scenario, work / "calibration-scenario.json", seed=CALIBRATION_SEED,
                              target__iterations=SIZES[device]["calibration_iterations"])  # fmt: skip
        outcome = real_run(path, "none", runs / "none", cwd=work, budget=budget)
        if outcome["exit_code"] != 0:
            report("calibrate", how="dry run", error="the calibration run failed", run=outcome)
            return None
        command = ["calibrate", "--runs", str(runs), "--device", "cpu", "--out", str(calibration)]
        how = "calibrate --runs on one no-failure run (dry run)"
    # The held-out runs and the validation must still fit after it.
    finished = churnsim(command, cwd=work, timeout_s=budget.timeout_s(max(budget.left_s() / 2, budget.left_s() - HELD_OUT_RESERVE_S)))
    report("calibrate", how=how, exit_code=finished.returncode, wall_s=round(time.perf_counter() - start_s, 2),
           **({} if finished.returncode == 0 else {"stderr_tail": tail(finished.stderr)}))  # fmt: skip
    return calibration if finished.returncode == 0 else None


def part_held_out(device: str, scenario: dict, work: Path, methods: list[str], budget: Budget) -> Path:
    runs = work / "held-out"
    runs.mkdir()
    twin_path = write_scenario(scenario, work / "held-out-none.json", seed=HELD_OUT_SEED)
    twin = real_run(twin_path, "none", runs / "none", cwd=work, budget=budget)
    report("held_out", "none", **twin)
    if twin["exit_code"] != 0 or not twin.get("training_s"):
        raise RuntimeError("the no-failure twin failed; no kill schedule to place")
    kills = [(round(fraction * twin["training_s"], 3), stage) for stage, fraction in KILLS]
    (work / "kills.csv").write_text(
        "# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind\n"
        + "".join(f"{time_s},,{stage},scheduled\n" for time_s, stage in kills)
    )
    hard_path = write_scenario(scenario, work / "held-out-hard.json", seed=HELD_OUT_SEED, churn={"kind": "schedule", "path": "kills.csv"},
                               training__failure_mode="hard", training__join_delay_s=0.5)  # fmt: skip
    report("kill_schedule", kills=[{"time_s": time_s, "stage": stage} for time_s, stage in kills])
    for method in methods:
        if method == "none":
            continue
        try:
            report("held_out", method, failure_mode="hard", **real_run(hard_path, method, runs / method, cwd=work, budget=budget))
        except (BudgetSpent, subprocess.TimeoutExpired) as error:
            report("held_out", method, method=method, skipped=str(error))
    return runs


def part_validate(calibration: Path, runs: Path, work: Path, budget: Budget) -> None:
    out = work / "validation"
    finished = churnsim(["validate", "--calibration", str(calibration), str(runs), "--out", str(out), "--no-figures"], cwd=work,
                        timeout_s=budget.timeout_s(120))  # fmt: skip
    rows = list(csv.DictReader((out / "validation.csv").open())) if (out / "validation.csv").is_file() else []
    relative_error: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["relative_error"] not in ("", None):
            relative_error.setdefault(row["method"], {})[row["quantity"]] = float(row["relative_error"])
    report("validate", exit_code=finished.returncode, num_rows=len(rows), relative_error=relative_error,
           **({} if finished.returncode == 0 else {"stderr_tail": tail(finished.stderr)}))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run (gloo, tiny sizes)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for every command together")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"default: {' '.join(METHODS)}")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the runs here (default: a temporary directory, removed)")
    parser.add_argument("--out", type=Path, default=None, help="the parts' figures as JSON (default: WORK_DIR/gpu-check.json)")
    add_report_option(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a machine with GPUs, or --device cpu for the dry run", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    work = args.work_dir if args.work_dir is not None else Path(tempfile.mkdtemp(prefix="churnsim-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        print(f"gpu_check: --work-dir {work} is not empty; name a new or empty directory", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    from churnsim.real.distributed import backend_for

    report("environment", device=args.device, torch=torch.__version__, cuda=torch.version.cuda, gpus=gpus,
           gpu=torch.cuda.get_device_name(0) if gpus else None,
           nccl=nccl_version() if gpus else None, cpus=os.cpu_count(),
           real_run_backend=backend_for(args.device, ranks_on_host=NUM_STAGES, gpus_on_host=max(gpus, 1)),
           stages=NUM_STAGES)  # fmt: skip
    state: dict = {}

    def scenario() -> None:
        state["scenario"] = scenario_for(args.device, work, budget)

    parts = [
        ("point_to_point", lambda: part_point_to_point(args.device, budget)),
        ("scenario", scenario),
        ("calibrate", lambda: state.update(calibration=part_calibrate(args.device, state["scenario"], work, args.methods, budget))),
        ("held_out", lambda: state.update(runs=part_held_out(args.device, state["scenario"], work, args.methods, budget))),
        ("validate", lambda: part_validate(state["calibration"], state["runs"], work, budget)
         if state.get("calibration") and state.get("runs") else report("validate", skipped="no calibration or no held-out runs")),
    ]  # fmt: skip
    out = args.out if args.out is not None else work / "gpu-check.json"
    try:
        for name, function in parts:
            try:
                function()
            except BudgetSpent as error:
                report(name, skipped=str(error))
            except Exception as error:  # a manual check: show every part's failure, go on
                report(name, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
    finally:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(RESULTS, indent=1) + "\n")
        print(f"wrote {out}")
        # The dry run's report only where its results are kept (--out): CI's dry runs write none.
        if args.device == "cuda" or args.out is not None:
            report_if_asked(args, "gpu-check", out, variant="" if args.device == "cuda" else "cpu-dry-run")
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    failed = failed_parts(RESULTS)
    if failed:
        print(f"gpu_check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
