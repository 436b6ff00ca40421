"""Closed forms the simulator is checked against and plotted beside (reference/checkpointing.md §6).

M = mean time between failures of the whole pipeline, δ = checkpoint cost (blocked time),
R = restart cost, τ = compute time between checkpoints.
"""

from __future__ import annotations

import math


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


def first_order_ettr(*, checkpoint_cost_s: float, interval_s: float, failure_rate_per_s: float, restart_s: float) -> float:
    """Effective training time ratio ≈ 1 − δ/τ − Λ(R + τ/2), valid for Λ(τ + R) ≪ 1.

    (Kokolis et al., HPCA'25, arXiv 2410.21680; first-order form as in reference/simulators.md §2.)
    """
    return 1.0 - checkpoint_cost_s / interval_s - failure_rate_per_s * (restart_s + interval_s / 2.0)
