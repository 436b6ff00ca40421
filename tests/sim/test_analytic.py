"""Synchronous checkpointing in the run model against the classic analytic results.

A one-stage pipeline with a 1 s iteration, a checkpoint write of δ = 10 s, a restart of
R = join 20 s + read 10 s = 30 s, and Poisson failures with mean time between failures M:
- Young (CACM 17(9), 1974): the best interval is τ = √(2δM); Daly (FGCS 22(3), 2006), higher order:
  τ = √(2δM)·[1 + ⅓·√(δ/(2M)) + δ/(18M)] − δ. Simulated: with M = 2000 s (Young τ = 200 s), 40
  replications with common random numbers per interval; the optimum of a fit W(K) = a + b/K + c·K
  to the mean wall-clock lies within ±30 % of both formulas, and the cost at the Young interval is
  within 1 % of the best simulated interval's.
- First-order ETTR (Kokolis et al., arXiv 2410.21680; form from reference/simulators.md §2):
  ETTR ≈ 1 − δ/τ − Λ(R + τ/2) for Λτ ≪ 1. Simulated with M = 20000 s (Λτ ≈ 0.03), 30 replications:
  the simulated ETTR (useful time / wall-clock) differs from the formula by at most 10 % of the
  formula's badput share 1 − ETTR.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from churnsim.calibration.churn import PoissonChurn
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.scenario import (
    ExplicitCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    StorageTier,
    TargetSpec,
    UniformNetwork,
)
from churnsim.sim.model.iteration import IterationModel
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.sim.model.run import simulate_run

CHECKPOINT_S = 10.0
JOIN_S = 20.0
RESTART_S = JOIN_S + CHECKPOINT_S  # the read takes as long as the write
ITERATION_S = 1.0
MODEL = IterationModel()


def one_stage_scenario(*, mean_time_between_failures_s: float, target_iterations: int) -> Scenario:
    model = ModelSpec(num_layers=1, hidden_size=64, num_heads=4, vocab_size=100, sequence_length=16)
    bandwidth = model.num_parameters * model.checkpoint_bytes_per_parameter / CHECKPOINT_S
    return Scenario(
        name="young-daly",
        model=model,
        pipeline=PipelineSpec(num_stages=1, schedule="gpipe", microbatch_size=1, num_microbatches=1),
        compute=ExplicitCompute(block_forward_s=0.4 * ITERATION_S, block_backward_s=0.6 * ITERATION_S),
        network=UniformNetwork(latency_s=0.0, bandwidth_bytes_per_s=1e9),
        storage=(StorageTier(name="remote", write_bandwidth_bytes_per_s=bandwidth, read_bandwidth_bytes_per_s=bandwidth, survives_node_loss=True),),
        churn=PoissonChurn(kind="poisson", failures_per_node_hour=3600.0 / mean_time_between_failures_s),
        recovery=RecoverySpec(join_delay_s=JOIN_S, restart_s=0.0),
        methods=(method_from_name("checkpoint"),),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5)),
        target=TargetSpec(iterations=target_iterations, max_wall_clock_s=1e9),
        seed=7,
    )


def mean_wall_clock_s(scenario: Scenario, intervals: list[int], replications: int, horizon_s: float) -> np.ndarray:
    walls = np.zeros((len(intervals), replications))
    for replication in range(replications):
        failures = failures_for_replication(scenario, replication=replication, horizon_s=horizon_s)
        for row, interval in enumerate(intervals):
            config = method_from_name("checkpoint", interval_iterations=interval)
            walls[row, replication] = simulate_run(scenario, config, failures, iteration_model=MODEL).wall_clock_s
    return walls.mean(axis=1)


def test_simulated_best_checkpoint_interval_is_near_young_and_daly():
    mtbf_s = 2000.0
    young_s = math.sqrt(2 * CHECKPOINT_S * mtbf_s)
    daly_s = young_s * (1 + math.sqrt(CHECKPOINT_S / (2 * mtbf_s)) / 3 + CHECKPOINT_S / (18 * mtbf_s)) - CHECKPOINT_S
    scenario = one_stage_scenario(mean_time_between_failures_s=mtbf_s, target_iterations=50_000)
    intervals = [100, 130, 160, 200, 250, 310, 400]
    walls = mean_wall_clock_s(scenario, intervals, replications=40, horizon_s=200_000.0)
    design = np.column_stack([np.ones(len(intervals)), 1.0 / np.array(intervals), np.array(intervals)])
    _, inverse_coefficient, linear_coefficient = np.linalg.lstsq(design, walls, rcond=None)[0]
    simulated_best_s = math.sqrt(inverse_coefficient / linear_coefficient) * ITERATION_S
    assert simulated_best_s == pytest.approx(young_s, rel=0.30)
    assert simulated_best_s == pytest.approx(daly_s, rel=0.30)
    at_young = walls[intervals.index(round(young_s / ITERATION_S))]
    assert at_young <= 1.01 * walls.min()


@pytest.mark.parametrize("interval_iterations", [632, 300])
def test_simulated_ettr_matches_the_first_order_formula(interval_iterations):
    mtbf_s = 20_000.0
    target = 400_000
    scenario = one_stage_scenario(mean_time_between_failures_s=mtbf_s, target_iterations=target)
    tau_s = interval_iterations * ITERATION_S
    formula = 1 - CHECKPOINT_S / tau_s - (RESTART_S + tau_s / 2) / mtbf_s
    ettr = []
    for replication in range(30):
        failures = failures_for_replication(scenario, replication=replication, horizon_s=1e6)
        config = method_from_name("checkpoint", interval_iterations=interval_iterations)
        result = simulate_run(scenario, config, failures, iteration_model=MODEL)
        ettr.append(target * ITERATION_S / result.wall_clock_s)
    assert np.mean(ettr) == pytest.approx(formula, abs=0.1 * (1 - formula))
