"""How fast is one long run, in closed form and in the event model, and what does the two-level design buy?

For every method: one 100,000-iteration run of the CheckFree 500M geo preset at 16 %/h (same
failure path for all), timed in the closed-form engine (the default) and in the event model
(`reference_events=True`) in the same round, repeated until two rounds agree within 20 %
(benchmarks/speed_common.py); both must give the same result. Target (issue 11): at most 0.1 s per
run for every method in closed form. Then the same run for `none` with the iteration simulated per
microbatch at every iteration (no cache), over a shorter run and extrapolated. Prints a table and
writes benchmarks/results/sim-run-speed.json; not part of the test run. A regular install times the
compiled engine, an editable one its source (setup.py); `write_result` prints and records which.

    python benchmarks/sim_run_speed.py [--iterations 100000] [--per-microbatch-iterations 2000] [--max-rounds 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

from churnsim.calibration.failure_sampling import failures_for_replication  # noqa: E402
from churnsim.calibration.methods import METHOD_NAMES  # noqa: E402
from churnsim.calibration.presets import preset  # noqa: E402
from churnsim.calibration.scenario import TargetSpec  # noqa: E402
from churnsim.sim.model.iteration import IterationModel  # noqa: E402
from churnsim.sim.model.pipeline_state import build_pipeline_state  # noqa: E402
from churnsim.sim.model.run import simulate_run, simulate_run_and_policy  # noqa: E402

TARGET_S = 0.1
PRESET = "checkfree-500m-geo-16pct"


def scenario_with_iterations(num_iterations: int):
    scenario = preset(PRESET)
    # Give up at three times the failure-free time: a method that cannot converge (e.g. `random`)
    # would otherwise simulate years, and the failure path is sampled up to this horizon.
    failure_free_s = num_iterations * IterationModel().iteration_time_s(build_pipeline_state(scenario))
    return scenario.model_copy(update={"target": TargetSpec(iterations=num_iterations, max_wall_clock_s=3 * failure_free_s)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--per-microbatch-iterations", type=int, default=2_000)
    parser.add_argument("--max-rounds", type=int, default=6)
    add_report_option(parser)
    arguments = parser.parse_args()
    scenario = scenario_with_iterations(arguments.iterations)
    failures = failures_for_replication(scenario)
    by_name = {method.name: method for method in scenario.methods}
    print(f"{arguments.iterations} iterations of {scenario.name}, {len(failures)} failures sampled\n")
    print(f"{'method':18s} {'closed form s/run':>18s} {'event model s/run':>18s} {'speed-up':>9s} {'engine':>12s} {'reached':>8s} {'≤ 0.1 s':>8s}")
    rows = {}
    for name in METHOD_NAMES:
        method = by_name[name]
        iteration_model = IterationModel()
        simulate_run(scenario, method, failures[:20], iteration_model=iteration_model)  # warm the iteration cache
        outcome = {}

        def one_round() -> dict:
            fast_wall, fast_cpu, fast = timed(lambda: simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model))
            ref_wall, ref_cpu, reference = timed(
                lambda: simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model, reference_events=True)
            )
            assert abs(fast.result.wall_clock_s - reference.result.wall_clock_s) <= 1e-9 * reference.result.wall_clock_s
            assert fast.result.iterations_executed == reference.result.iterations_executed
            outcome.update(engine=fast.engine, reached=fast.result.reached_target, executed=fast.result.iterations_executed,
                           failures=len(fast.result.failures))
            return {"closed_form": (fast_wall, fast_cpu), "event_model": (ref_wall, ref_cpu)}

        timings = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds)
        fast_s, reference_s = timings["closed_form"].agreed_s, timings["event_model"].agreed_s
        rows[name] = {
            **outcome,
            "closed_form": timings["closed_form"].summary(),
            "event_model": timings["event_model"].summary(),
            "speed_up": round(reference_s / fast_s, 2),
            "target_s": TARGET_S,
            "meets_target": fast_s <= TARGET_S,
        }
        spread = f"[{min(timings['closed_form'].wall_s):.3f}–{max(timings['closed_form'].wall_s):.3f}]"
        print(
            f"{name:18s} {fast_s:7.3f} {spread:>10s} {reference_s:18.3f} {reference_s / fast_s:8.1f}× {outcome['engine']:>12s} "
            f"{str(outcome['reached']):>8s} {'yes' if fast_s <= TARGET_S else 'NO':>8s}"
        )

    short = scenario_with_iterations(arguments.per_microbatch_iterations)
    short_failures = failures_for_replication(short)
    chunked_s, _, _ = timed(lambda: simulate_run(short, by_name["none"], short_failures, iteration_model=IterationModel(), reference_events=True))
    everywhere_s, _, _ = timed(
        lambda: simulate_run(short, by_name["none"], short_failures, iteration_model=IterationModel(), per_microbatch_everywhere=True)
    )
    per_iteration_s = everywhere_s / arguments.per_microbatch_iterations
    print(
        f"\nnone, per microbatch everywhere: {per_iteration_s * 1e3:.2f} ms per iteration "
        f"⇒ {per_iteration_s * arguments.iterations:.0f} s per {arguments.iterations}-iteration run "
        f"(chunked event model: {chunked_s:.3f} s for {arguments.per_microbatch_iterations} iterations; "
        f"ratio {everywhere_s / chunked_s:.0f}×)"
    )
    path = write_result(
        "sim-run-speed",
        {
            "benchmark": f"one {arguments.iterations}-iteration run of {PRESET} per method (same failure path), closed form vs event model",
            "num_failures_sampled": len(failures),
            "methods": rows,
            "per_microbatch_everywhere_ms_per_iteration": round(per_iteration_s * 1e3, 4),
        },
        report=arguments.report,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
