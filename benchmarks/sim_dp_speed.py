"""How fast is one long run with data parallelism: does its cost grow with the failures, not with S × D?

For every method: one 100,000-iteration run of the `datacenter-llama3` preset (16 stages) with
data-parallel degree D = 1, 8 and 128, in the closed-form engine (the default), repeated until two
rounds agree within 20 % (benchmarks/speed_common.py). Failures are node failures, drawn here with
numpy as a Poisson process over the S × D nodes (the preset's sampler draws stage failures until the
node sampler lands): at the preset's per-node rate (1.6e-4 per node-hour, Llama 3) and at 100 times
it, so that D = 128 meets thousands of node losses. Each row says how many node losses the run met
and how many were heals and stage losses. The first round is also simulated in the event model,
untimed, and must give the same wall-clock. Prints a table and writes
benchmarks/results/sim-dp-speed.json and its dated report; not part of the test run.

    python benchmarks/sim_dp_speed.py [--iterations 100000] [--degrees 1 8 128] [--max-rounds 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

from churnsim.calibration.failure_sampling import FailureEvent  # noqa: E402
from churnsim.calibration.methods import METHOD_NAMES  # noqa: E402
from churnsim.calibration.presets import preset  # noqa: E402
from churnsim.calibration.scenario import TargetSpec  # noqa: E402
from churnsim.sim.model.iteration import IterationModel  # noqa: E402
from churnsim.sim.model.pipeline_state import build_pipeline_state  # noqa: E402
from churnsim.sim.model.run import simulate_run_and_policy  # noqa: E402

PRESET = "datacenter-llama3"
NODE_RATE_PER_HOUR = 1.6e-4
"""Llama 3's interruptions per node-hour (the preset's own per-node figure)."""
RATE_FACTORS = (1.0, 100.0)


def scenario_with(num_iterations: int, degree: int):
    scenario = preset(PRESET, {"pipeline.data_parallel_degree": degree})
    failure_free_s = num_iterations * IterationModel().iteration_time_s(build_pipeline_state(scenario))
    return scenario.model_copy(update={"target": TargetSpec(iterations=num_iterations, max_wall_clock_s=3 * failure_free_s)})


def node_failures(scenario, rate_per_node_hour: float, seed: int) -> tuple[FailureEvent, ...]:
    """A Poisson process of node losses over the S × D grid up to the deadline (uniform times and nodes
    for the count the grid's total rate gives)."""
    pipeline = scenario.pipeline
    horizon_s = scenario.target.max_wall_clock_s
    nodes = pipeline.num_stages * pipeline.data_parallel_degree
    generator = np.random.default_rng(seed)
    count = generator.poisson(rate_per_node_hour / 3600.0 * nodes * horizon_s)
    times = np.sort(generator.uniform(0.0, horizon_s, size=count))
    stages = generator.integers(0, pipeline.num_stages, size=count)
    replicas = generator.integers(0, pipeline.data_parallel_degree, size=count)
    return tuple(
        FailureEvent(time_s=float(time_s), stage=int(stage), replica=int(replica), kind="poisson")
        for time_s, stage, replica in zip(times, stages, replicas)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 8, 128])
    parser.add_argument("--max-rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=46)
    add_report_option(parser)
    arguments = parser.parse_args()
    rows = []
    print(f"{arguments.iterations} iterations of {PRESET} (16 stages), closed form\n")
    print(f"{'rate ×':>6s} {'D':>4s} {'method':18s} {'s/run':>8s} {'spread':>15s} {'losses':>7s} {'heals':>6s} {'stage':>6s} {'engine':>12s} {'reached':>8s}")
    for factor in RATE_FACTORS:
        for degree in arguments.degrees:
            scenario = scenario_with(arguments.iterations, degree)
            failures = node_failures(scenario, NODE_RATE_PER_HOUR * factor, arguments.seed)
            by_name = {method.name: method for method in scenario.methods}
            for name in METHOD_NAMES:
                method = by_name[name]
                iteration_model = IterationModel()
                simulate_run_and_policy(scenario, method, failures[:20], iteration_model=iteration_model)  # warm the iteration cache
                outcome: dict = {}

                def one_round() -> dict:
                    wall_s, cpu_s, run = timed(lambda: simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model))
                    if not outcome:
                        reference = simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model, reference_events=True)
                        assert abs(reference.result.wall_clock_s - run.result.wall_clock_s) <= 1e-9 * reference.result.wall_clock_s, name
                        handled = [failure.handled_as for failure in run.result.failures]
                        outcome.update(
                            engine=run.engine,
                            reached=run.result.reached_target,
                            node_losses=len(handled),
                            heals=handled.count("replica_heal"),
                            stage_losses=sum(1 for label in handled if label not in ("replica_heal", "already_down", "ignored")),
                            replica_heal_s=round(run.result.badput["replica_heal_s"], 3),
                            wall_clock_s=round(run.result.wall_clock_s, 3),
                        )
                    return {"closed_form": (wall_s, cpu_s)}

                timing = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds)["closed_form"]
                rows.append({"rate_factor": factor, "data_parallel_degree": degree, "method": name, **outcome, "closed_form": timing.summary()})
                spread = f"[{min(timing.wall_s):.3f}–{max(timing.wall_s):.3f}]"
                print(
                    f"{factor:6g} {degree:4d} {name:18s} {timing.agreed_s:8.3f} {spread:>15s} {outcome['node_losses']:7d} {outcome['heals']:6d} "
                    f"{outcome['stage_losses']:6d} {outcome['engine']:>12s} {str(outcome['reached']):>8s}"
                )
    path = write_result(
        "sim-dp-speed",
        {
            "benchmark": f"one {arguments.iterations}-iteration run of {PRESET} per method at D = {arguments.degrees}, Poisson node failures "
                         f"at {NODE_RATE_PER_HOUR} per node-hour × {list(RATE_FACTORS)}, closed form",
            "runs": rows,
        },
        report=arguments.report,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
