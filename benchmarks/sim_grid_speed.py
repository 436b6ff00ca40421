"""How long does the paper grid take: 3 model sizes × 5 failure rates × 9 methods × 30 replications?

The grid `churnsim whatif` runs for each of the CheckFree paper's three setups (`checkfree-124m-geo`,
`checkfree-500m-geo`, `checkfree-1.5b-geo`): every failure rate of `WHATIF_FAILURE_RATES` (0, 5, 10,
16, 33 %/h per stage), every method, 30 replications with common random numbers, built with
`whatif.rate_tasks` and run by `sweep.run_sweep` on a local process pool of 2 workers (the two
cores of the machine the target is set for). Timed in closed form and in the event model
(CHURNSIM_REFERENCE_EVENTS=1, inherited by the workers) in the same round, repeated until two
rounds agree within 20 %; both runs tables must be equal. Target (issue 11): at most 60 s in closed
form. Also records the CPU seconds the workers used (`cpu_s`): unlike the wall clock, they do not
grow when other work shares the two cores. Writes benchmarks/results/sim-grid-speed.json.

    python benchmarks/sim_grid_speed.py [--replications 30] [--workers 2] [--max-rounds 3] [--skip-reference]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

from churnsim.calibration.presets import preset  # noqa: E402
from churnsim.sim.model.run import REFERENCE_EVENTS_VARIABLE  # noqa: E402
from churnsim.sim.studies.sweep import run_sweep  # noqa: E402
from churnsim.sim.studies.whatif import WHATIF_FAILURE_RATES, WhatIfPlan, rate_tasks  # noqa: E402

TARGET_S = 60.0
SIZES = ("checkfree-124m-geo-10pct", "checkfree-500m-geo-10pct", "checkfree-1.5b-geo-10pct")


def grid_tasks(replications: int) -> list:
    tasks = []
    for name in SIZES:
        tasks += rate_tasks(WhatIfPlan(scenario=preset(name), failure_rates=WHATIF_FAILURE_RATES, replications=replications))
    return tasks


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_grid(tasks, workers: int, *, reference: bool):
    """The sweep's result and the CPU seconds its worker processes used (all of them, ended)."""
    previous = os.environ.get(REFERENCE_EVENTS_VARIABLE)
    os.environ[REFERENCE_EVENTS_VARIABLE] = "1" if reference else "0"
    before = children_cpu_s()
    try:
        result = run_sweep(tasks, workers=workers)
        return result, children_cpu_s() - before
    finally:
        if previous is None:
            os.environ.pop(REFERENCE_EVENTS_VARIABLE, None)
        else:
            os.environ[REFERENCE_EVENTS_VARIABLE] = previous


def same_runs(a, b) -> bool:
    numeric = [column for column in a.runs.columns if a.runs[column].dtype.kind == "f"]
    others = [column for column in a.runs.columns if column not in numeric]
    if not a.runs[others].equals(b.runs[others]):
        return False
    return bool(np.allclose(a.runs[numeric].to_numpy(), b.runs[numeric].to_numpy(), rtol=1e-9, atol=0.0, equal_nan=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-rounds", type=int, default=3)
    parser.add_argument("--skip-reference", action="store_true", help="Time the closed form only (no ratio).")
    add_report_option(parser)
    arguments = parser.parse_args()
    tasks = grid_tasks(arguments.replications)
    num_runs = sum(len(task.task.methods) for task in tasks)
    print(f"paper grid: {len(SIZES)} sizes × {len(WHATIF_FAILURE_RATES)} rates × 9 methods × {arguments.replications} replications "
          f"= {num_runs} runs in {len(tasks)} tasks, {arguments.workers} workers")
    checks = []
    worker_cpu_s: dict[str, list[float]] = {"closed_form": [], "event_model": []}

    def one_round() -> dict:
        fast_wall, _, (fast, fast_workers_cpu) = timed(lambda: run_grid(tasks, arguments.workers, reference=False))
        worker_cpu_s["closed_form"].append(fast_workers_cpu)
        print(f"  closed form: {fast_wall:.1f} s ({fast_workers_cpu:.1f} CPU s in the workers)")
        result = {"closed_form": (fast_wall, fast_workers_cpu)}
        if not arguments.skip_reference:
            ref_wall, _, (reference, ref_workers_cpu) = timed(lambda: run_grid(tasks, arguments.workers, reference=True))
            worker_cpu_s["event_model"].append(ref_workers_cpu)
            print(f"  event model: {ref_wall:.1f} s ({ref_workers_cpu:.1f} CPU s in the workers)")
            checks.append(same_runs(fast, reference))
            result["event_model"] = (ref_wall, ref_workers_cpu)
        return result

    timings = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds)
    fast_s = timings["closed_form"].agreed_s
    payload = {
        "benchmark": f"paper grid ({num_runs} runs) with run_sweep on {arguments.workers} local workers",
        "sizes": list(SIZES),
        "failure_rates": list(WHATIF_FAILURE_RATES),
        "replications": arguments.replications,
        "closed_form": timings["closed_form"].summary(),
        "target_s": TARGET_S,
        "meets_target": fast_s <= TARGET_S,
        "runs_tables_equal_to_1e-9": all(checks) if checks else None,
        "note": "cpu_s are the worker processes' CPU seconds (all workers together): on an idle machine the "
        "wall clock is about cpu_s / workers plus the pool's start; wall_s above it means other work took the cores",
    }
    line = f"closed form {fast_s:.1f} s (target {TARGET_S:.0f} s: {'met' if fast_s <= TARGET_S else 'NOT met'})"
    if "event_model" in timings:
        reference_s = timings["event_model"].agreed_s
        payload["event_model"] = timings["event_model"].summary()
        payload["speed_up"] = round(reference_s / fast_s, 2)
        line += f", event model {reference_s:.1f} s, speed-up {reference_s / fast_s:.1f}×, runs equal: {all(checks)}"
    print(line)
    # A closed-form-only timing goes to a file of its own, so the one with the ratio is kept.
    name = "sim-grid-speed-closed-form-only" if arguments.skip_reference else "sim-grid-speed"
    print(f"wrote {write_result(name, payload, report=arguments.report)}")


if __name__ == "__main__":
    main()
