"""Where a simulated run's wall-clock time goes: goodput plus the badput categories of `BADPUT_CATEGORIES`.

The run model books every second of simulated time exactly once while it happens, either as
training (a chunk of iterations) or as a wait charged to a category; at the end the training time is
split into the categories below. With

    P      effective progress at the end (iterations of the no-failure run),
    N      iterations executed (whole iterations that completed, including ones later rolled back),
    T_ref  iteration time of the plain pipeline (the `none` method's state),
    T_c    iteration time of the same pipeline with free links (compute only), b_c its bubble fraction,
    T_h    iteration time of this method's healthy pipeline state,

the categories are:

- goodput_s = P · T_c · (1 − b_c): the stages' compute of the useful iterations.
- bubble_s = P · T_c · b_c: pipeline fill and drain of the useful iterations (stages idle even
  with free links).
- communication_s = P · (T_ref − T_c): what links (activations, gradients, all-reduce) add to the
  useful iterations.
- method_overhead_s = P · (T_h − T_ref) + waits charged to it (a CheckFree+ replica refresh that
  was not finished by the next refresh): the steady-state cost of the method.
- checkpoint_stall_s: waits while training is blocked by checkpoint writes, unhidden snapshot copies
  and full host buffers.
- lost_work_s = (iterations rolled back) · T_h + the time spent on iterations a failure (or the
  wall-clock limit) interrupted: a failure destroys the iteration in flight. A stale stage reloaded
  under `rollback = "stage"` is booked here too (see `sim/methods/checkpointing.py`).
- recovery_downtime_s: waits while training is stopped by a recovery (join delay, restart, checkpoint
  reads, weight transfers).
- degraded_slowdown_s = (time of the completed iterations) − N · T_h: the extra time of iterations run
  in a degraded state (one node running two stages); 0 up to rounding for runs that never degrade.
- convergence_setback_s = (iterations of progress removed by rebuild setbacks) · T_h.

Since N = P + rolled back + set back, goodput_s + Σ badput == wall_clock_s holds exactly up to
floating-point rounding; `split_time` asserts it to a relative 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .results import BADPUT_CATEGORIES

WAIT_CATEGORIES: tuple[str, ...] = ("checkpoint_stall_s", "recovery_downtime_s", "method_overhead_s")
"""Categories a wait (time with no training) can be charged to."""

RELATIVE_TOLERANCE = 1e-6


@dataclass(kw_only=True)
class Ledger:
    """Running totals booked while the run is simulated."""

    waits_s: dict[str, float] = field(default_factory=lambda: {name: 0.0 for name in WAIT_CATEGORIES})
    training_s: float = 0.0
    """All time spent inside training chunks."""
    interrupted_iteration_s: float = 0.0
    """Part of `training_s` spent on iterations that never completed."""
    rolled_back_iterations: float = 0.0
    setback_iterations: float = 0.0
    iterations_executed: int = 0

    def charge_wait(self, category: str, seconds: float) -> None:
        assert category in self.waits_s, f"unknown wait category {category!r}"
        self.waits_s[category] += seconds


def split_time(
    ledger: Ledger,
    *,
    progress_iterations: float,
    healthy_iteration_time_s: float,
    reference_iteration_time_s: float,
    compute_only_iteration_time_s: float,
    compute_only_bubble_fraction: float,
    wall_clock_s: float,
) -> tuple[float, dict[str, float]]:
    """(goodput_s, badput) for a finished run; the identity goodput + Σ badput = wall-clock is asserted."""
    progress = progress_iterations
    useful_compute_s = progress * compute_only_iteration_time_s
    completed_iterations_s = ledger.training_s - ledger.interrupted_iteration_s
    goodput_s = useful_compute_s * (1.0 - compute_only_bubble_fraction)
    badput = {
        "bubble_s": useful_compute_s * compute_only_bubble_fraction,
        "communication_s": progress * (reference_iteration_time_s - compute_only_iteration_time_s),
        "method_overhead_s": progress * (healthy_iteration_time_s - reference_iteration_time_s)
        + ledger.waits_s["method_overhead_s"],
        "checkpoint_stall_s": ledger.waits_s["checkpoint_stall_s"],
        "lost_work_s": ledger.rolled_back_iterations * healthy_iteration_time_s + ledger.interrupted_iteration_s,
        "recovery_downtime_s": ledger.waits_s["recovery_downtime_s"],
        "degraded_slowdown_s": completed_iterations_s - ledger.iterations_executed * healthy_iteration_time_s,
        "convergence_setback_s": ledger.setback_iterations * healthy_iteration_time_s,
    }
    assert tuple(badput) == BADPUT_CATEGORIES
    total_s = goodput_s + sum(badput.values())
    assert abs(total_s - wall_clock_s) <= RELATIVE_TOLERANCE * max(wall_clock_s, 1.0), (
        f"time accounting does not add up: goodput + badput = {total_s} s, wall-clock {wall_clock_s} s"
    )
    return goodput_s, badput
