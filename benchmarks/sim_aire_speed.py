"""How fast is one replication of an AIReSim-sized study (4,096 nodes, 256 days of compute)?

Scenario `benchmarks/scenarios/aire-equiv.json`: a 70B-class model in 16 stages × 256 data-parallel
replicas, the Llama 3 per-node interruption rate, 20 min restarts, synchronous checkpoints every 200
iterations, trained for 256 days of failure-free compute. One replication is what a sweep does for
it (`sim.replicate.run_replication`: a lazily sampled failure path, the replication's setback draws,
the `checkpoint` run), timed in closed form and in the event model (CHURNSIM_REFERENCE_EVENTS=1) in
the same round, repeated until two rounds agree within 20 %; both must give the same runs. Target
(issue 11): at most 0.65 s per replication (AIReSim takes 13 s per replication of its default
configuration on the machine the target was set on). Writes benchmarks/results/sim-aire-speed.json.

    python benchmarks/sim_aire_speed.py [--replications 3] [--max-rounds 6]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

from churnsim.calibration.scenario import Scenario  # noqa: E402
from churnsim.sim.studies.replicate import ReplicationTask, run_replication  # noqa: E402
from churnsim.sim.model.run import REFERENCE_EVENTS_VARIABLE  # noqa: E402

TARGET_S = 0.65
SCENARIO = Path(__file__).resolve().parent / "scenarios" / "aire-equiv.json"


def replicate(scenario: Scenario, replication: int, *, reference: bool):
    os.environ[REFERENCE_EVENTS_VARIABLE] = "1" if reference else "0"
    try:
        return run_replication(ReplicationTask(scenario=scenario, replication=replication, methods=scenario.methods))
    finally:
        os.environ.pop(REFERENCE_EVENTS_VARIABLE, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=6)
    add_report_option(parser)
    arguments = parser.parse_args()
    scenario = Scenario.model_validate_json(SCENARIO.read_text(encoding="utf-8"))
    replicate(scenario, 0, reference=False)  # warm the imports and caches
    details = {}

    def one_round() -> dict:
        fast_total = fast_cpu = ref_total = ref_cpu = 0.0
        for replication in range(arguments.replications):
            wall, cpu, fast = timed(lambda: replicate(scenario, replication, reference=False))
            fast_total, fast_cpu = fast_total + wall, fast_cpu + cpu
            wall, cpu, reference = timed(lambda: replicate(scenario, replication, reference=True))
            ref_total, ref_cpu = ref_total + wall, ref_cpu + cpu
            for a, b in zip(fast, reference):
                assert abs(a.wall_clock_s - b.wall_clock_s) <= 1e-9 * b.wall_clock_s and a.iterations_executed == b.iterations_executed
            details[replication] = {"failures": len(fast[0].failures), "wall_clock_days": round(fast[0].wall_clock_s / 86400, 2)}
        count = arguments.replications
        return {"closed_form": (fast_total / count, fast_cpu / count), "event_model": (ref_total / count, ref_cpu / count)}

    timings = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds)
    fast_s, reference_s = timings["closed_form"].agreed_s, timings["event_model"].agreed_s
    print(
        f"{scenario.name}, {arguments.replications} replications ({details}):\n"
        f"closed form {fast_s:.3f} s per replication [{min(timings['closed_form'].wall_s):.3f}–{max(timings['closed_form'].wall_s):.3f}], "
        f"event model {reference_s:.3f} s, speed-up {reference_s / fast_s:.1f}× "
        f"(target {TARGET_S} s: {'met' if fast_s <= TARGET_S else 'NOT met'})"
    )
    path = write_result(
        "sim-aire-speed",
        {
            "benchmark": "one replication (run_replication: sampling + checkpoint run) of aire-equiv.json",
            "replications_per_round": arguments.replications,
            "replications": details,
            "closed_form": timings["closed_form"].summary(),
            "event_model": timings["event_model"].summary(),
            "speed_up": round(reference_s / fast_s, 2),
            "target_s": TARGET_S,
            "meets_target": fast_s <= TARGET_S,
        },
        report=arguments.report,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
