"""Closed forms the simulator is checked against and plotted beside (reference/checkpointing.md §6).

M = mean time between failures of the whole pipeline, δ = checkpoint cost (blocked time),
R = restart cost, τ = compute time between checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def pipeline_iteration_time_s(num_stages: int, num_microbatches: int, forward_s: float, backward_s: float) -> float:
    """GPipe and 1F1B with uniform stages and free links: (M + S − 1)(t_f + t_b) (arXiv 2104.04473)."""
    return (num_microbatches + num_stages - 1) * (forward_s + backward_s)


def young_interval_s(checkpoint_cost_s: float, mean_time_between_failures_s: float) -> float:
    """Young's optimum τ = √(2δM) (CACM 17(9), 1974, doi 10.1145/361147.361115)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mean_time_between_failures_s)


def daly_interval_s(checkpoint_cost_s: float, mean_time_between_failures_s: float) -> float:
    """Daly's higher-order optimum (FGCS 22(3), 2006, doi 10.1016/j.future.2004.11.016).

    τ = √(2δM)·[1 + ⅓√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else τ = M.
    """
    delta, mtbf = checkpoint_cost_s, mean_time_between_failures_s
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


@dataclass(frozen=True, kw_only=True)
class IntervalOptimum:
    """Young's and Daly's checkpoint intervals in iterations, from simulated runs of one method."""

    checkpoint_cost_s: float | None
    """δ: blocked seconds per checkpoint, the median over runs of stall / checkpoints taken."""
    iteration_s: float | None
    """The runs' median failure-free iteration."""
    young_interval_iterations: float | None
    daly_interval_iterations: float | None
    """None without a positive δ, an iteration time or failures."""


def interval_optimum_from_runs(runs: Any, interval_iterations: Any, mean_time_between_failures_s: float | None) -> IntervalOptimum:
    """Young's and Daly's intervals for the runs (a runs.csv frame) of a method that checkpointed
    every `interval_iterations` (a number, or a column beside the runs), M the whole pipeline's."""

    def finite(value: float) -> float | None:
        return float(value) if math.isfinite(value) else None

    if len(runs) == 0:
        return IntervalOptimum(checkpoint_cost_s=None, iteration_s=None, young_interval_iterations=None, daly_interval_iterations=None)
    # Checkpoints taken: one per interval of progress kept. Iterations executed would count the
    # iterations re-run after a rollback, which wrote no new checkpoint, and understate δ.
    taken = (runs["progress_iterations"] / interval_iterations).clip(lower=1)
    delta_s = finite((runs["checkpoint_stall_s"] / taken).median())
    iteration_s = finite(runs["healthy_iteration_time_s"].median())
    young = daly = None
    if delta_s and iteration_s and mean_time_between_failures_s:
        young = young_interval_s(delta_s, mean_time_between_failures_s) / iteration_s
        daly = daly_interval_s(delta_s, mean_time_between_failures_s) / iteration_s
    return IntervalOptimum(checkpoint_cost_s=delta_s, iteration_s=iteration_s, young_interval_iterations=young, daly_interval_iterations=daly)


def first_order_ettr(*, checkpoint_cost_s: float, interval_s: float, failure_rate_per_s: float, restart_s: float) -> float:
    """Effective training time ratio ≈ 1 − δ/τ − Λ(R + τ/2), valid for Λ(τ + R) ≪ 1.

    (Kokolis et al., HPCA'25, arXiv 2410.21680; first-order form as in reference/simulators.md §2.)
    """
    return 1.0 - checkpoint_cost_s / interval_s - failure_rate_per_s * (restart_s + interval_s / 2.0)
