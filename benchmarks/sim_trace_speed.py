"""How fast is a replay of Bamboo's whole p3 spot trace, per run and method, in process?

Scenario `benchmarks/scenarios/spot-p3-trace-span.json` (12-stage GPT-1.5B on V100 spot nodes, the
11.4 h Bamboo AWS p3 trace, 167 preemptions, runs until the trace's end): for each of its
replications, the failure path is sampled once (timed separately) and every method is simulated on
it, in closed form and in the event model (`reference_events=True`) in the same round, repeated
until two rounds agree within 20 %; both must give the same results. Target (issue 11): at most
0.08 s per run for every method, in process (Bamboo's own simulator takes 0.23–0.25 s for the same
replay on the machine the target was set on). Writes benchmarks/results/sim-trace-speed.json.

    python benchmarks/sim_trace_speed.py [--replications 10] [--max-rounds 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

from churnsim.calibration.failure_sampling import failures_for_replication  # noqa: E402
from churnsim.calibration.scenario import Scenario  # noqa: E402
from churnsim.sim.model.iteration import IterationModel  # noqa: E402
from churnsim.sim.model.run import simulate_run_and_policy  # noqa: E402

TARGET_S = 0.08
SCENARIO = Path(__file__).resolve().parent / "scenarios" / "spot-p3-trace-span.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replications", type=int, default=None, help="Default: the scenario's own (10).")
    parser.add_argument("--max-rounds", type=int, default=6)
    add_report_option(parser)
    arguments = parser.parse_args()
    scenario = Scenario.model_validate_json(SCENARIO.read_text(encoding="utf-8"))
    replications = arguments.replications or scenario.replications
    sampling_wall_s, _, paths = timed(lambda: [failures_for_replication(scenario, replication=r) for r in range(replications)])
    print(f"{scenario.name}: {replications} replications, {sum(map(len, paths)) / replications:.0f} stage failures each "
          f"(sampled in {sampling_wall_s / replications * 1e3:.1f} ms per replication), until {scenario.target.max_wall_clock_s:.0f} s\n")
    print(f"{'method':18s} {'closed form s/run':>24s} {'event model s/run':>18s} {'speed-up':>9s} {'≤ 0.08 s':>9s}")
    rows = {}
    for method in scenario.methods:
        iteration_model = IterationModel()
        simulate_run_and_policy(scenario, method, paths[0][:5], iteration_model=iteration_model)  # warm the iteration cache
        engines = set()

        def one_round() -> dict:
            fast_total = fast_cpu = ref_total = ref_cpu = 0.0
            for failures in paths:
                wall, cpu, fast = timed(lambda: simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model))
                fast_total, fast_cpu = fast_total + wall, fast_cpu + cpu
                wall, cpu, reference = timed(
                    lambda: simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model, reference_events=True)
                )
                ref_total, ref_cpu = ref_total + wall, ref_cpu + cpu
                assert abs(fast.result.goodput_s - reference.result.goodput_s) <= 1e-9 * max(reference.result.goodput_s, 1.0)
                assert fast.result.iterations_executed == reference.result.iterations_executed
                engines.add(fast.engine)
            return {
                "closed_form": (fast_total / len(paths), fast_cpu / len(paths)),
                "event_model": (ref_total / len(paths), ref_cpu / len(paths)),
            }

        timings = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds)
        fast_s, reference_s = timings["closed_form"].agreed_s, timings["event_model"].agreed_s
        rows[method.name] = {
            "closed_form": timings["closed_form"].summary(),
            "event_model": timings["event_model"].summary(),
            "speed_up": round(reference_s / fast_s, 2),
            "engines": sorted(engines),
            "target_s": TARGET_S,
            "meets_target": fast_s <= TARGET_S,
        }
        spread = f"[{min(timings['closed_form'].wall_s):.4f}–{max(timings['closed_form'].wall_s):.4f}]"
        print(f"{method.name:18s} {fast_s:7.4f} {spread:>16s} {reference_s:18.4f} {reference_s / fast_s:8.1f}× {'yes' if fast_s <= TARGET_S else 'NO':>9s}")
    path = write_result(
        "sim-trace-speed",
        {
            "benchmark": "whole p3-trace replay (spot-p3-trace-span.json), seconds per run per method, in process",
            "replications": replications,
            "sampling_s_per_replication": round(sampling_wall_s / replications, 6),
            "methods": rows,
        },
        report=arguments.report,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
