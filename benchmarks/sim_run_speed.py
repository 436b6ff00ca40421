"""How fast is the chunked run model, and what does the two-level design buy?

For every method: one 100,000-iteration run of the CheckFree 500M geo preset at 16 %/h (same
failure path for all), timed in the chunked model; then the same run for `none` with the iteration
simulated per microbatch at every iteration (no cache), over a shorter run and extrapolated.
Target: at most 0.1 s per run in the chunked model. Prints a table; not part of the test run.

    python benchmarks/sim_run_speed.py [--iterations 100000] [--per-microbatch-iterations 2000] [--repeats 1]

With --repeats N each chunked run is timed N times and the fastest is shown (the machine is shared).
"""

from __future__ import annotations

import argparse
import time

from churnsim.calibration.methods import METHOD_NAMES
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import TargetSpec
from churnsim.sim.iteration import IterationModel
from churnsim.sim.pipeline_state import build_pipeline_state
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.sim.run import simulate_run


def scenario_with_iterations(num_iterations: int):
    scenario = preset("checkfree-500m-geo-16pct")
    # Give up at three times the failure-free time: a method that cannot converge (e.g. `random`)
    # would otherwise simulate years, and the failure path is sampled up to this horizon.
    failure_free_s = num_iterations * IterationModel().iteration_time_s(build_pipeline_state(scenario))
    return scenario.model_copy(update={"target": TargetSpec(iterations=num_iterations, max_wall_clock_s=3 * failure_free_s)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--per-microbatch-iterations", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=1)
    arguments = parser.parse_args()
    scenario = scenario_with_iterations(arguments.iterations)
    failures = failures_for_replication(scenario)
    by_name = {method.name: method for method in scenario.methods}
    print(f"{arguments.iterations} iterations of {scenario.name}, {len(failures)} failures sampled\n")
    print(f"{'method':18s} {'s/run':>8s} {'simulated it/s':>15s} {'reached':>8s}")
    for name in METHOD_NAMES:
        elapsed = float("inf")
        for _ in range(max(arguments.repeats, 1)):
            started = time.perf_counter()
            result = simulate_run(scenario, by_name[name], failures, iteration_model=IterationModel())
            elapsed = min(elapsed, time.perf_counter() - started)
        print(f"{name:18s} {elapsed:8.3f} {result.iterations_executed / elapsed:15.0f} {str(result.reached_target):>8s}")

    short = scenario_with_iterations(arguments.per_microbatch_iterations)
    short_failures = failures_for_replication(short)
    timings = {}
    for everywhere in (False, True):
        started = time.perf_counter()
        simulate_run(short, by_name["none"], short_failures, iteration_model=IterationModel(), per_microbatch_everywhere=everywhere)
        timings[everywhere] = time.perf_counter() - started
    per_iteration_s = timings[True] / arguments.per_microbatch_iterations
    print(
        f"\nnone, per microbatch everywhere: {per_iteration_s * 1e3:.2f} ms per iteration "
        f"⇒ {per_iteration_s * arguments.iterations:.0f} s per {arguments.iterations}-iteration run "
        f"(chunked: {timings[False]:.3f} s for {arguments.per_microbatch_iterations} iterations; "
        f"ratio {timings[True] / timings[False]:.0f}×)"
    )


if __name__ == "__main__":
    main()
