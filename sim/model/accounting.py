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
- lost_work_s = (iterations rolled back + the fraction of an iteration a failure, or the
  wall-clock limit, interrupted) · T_h: a failure destroys the iteration in flight. A stale stage
  reloaded under `rollback = "stage"` is booked here too (see `sim/model/methods/checkpointing.py`).
- recovery_downtime_s: waits while training is stopped by a recovery (join delay, restart, checkpoint
  reads, weight transfers).
- survivor_restart_s: hard failures launched under an agent that restarts every worker
  (`training.hard_failure_launch = "agent"`, `Scenario.survivor_restart_charged_s`): waits while the
  surviving stages' processes restart and reload their state, before the method's recovery. The work
  they lose is the iteration in flight, booked to lost_work_s as on every failure (their snapshot is
  taken after every update).
- degraded_slowdown_s = Σ over the pipeline states X slower than healthy (T_X > T_h) of
  (time trained in X) · (1 − T_h / T_X): the extra time of iterations run in a degraded state (one
  node running two stages); 0 for runs that never degrade.
- convergence_setback_s = (iterations of progress removed by rebuild setbacks) · T_h.
- replica_heal_s: data parallelism (sim/model/replicas.py): waits while no replica pipeline could
  train because nodes were healing from a surviving replica, plus, for the time trained with k of D
  replica pipelines, the share of it their smaller batch did not deliver: (time) · (1 − w), w being
  what one such iteration is worth of a full one. That time's remaining w is booked as training.

A degraded state can also be *faster* than the healthy one: when the node of stage s − 1 runs stage
s too, the link between them is no longer crossed, and on a WAN testbed that link can cost more
than the doubled compute (checkfree-500m-geo: stage 7 run by node 6 takes 34 s an iteration
against 44 s). That saving, Σ over the faster states of (time trained in X) · (T_h / T_X − 1), is
communication the run did not wait for, so it is taken off communication_s (priced at the healthy
pipeline's links for every useful iteration); were it ever larger, the rest comes off lost_work_s,
method_overhead_s, whose iterations were priced at T_h too, and then bubble_s. Booking it as a negative
slowdown, as this module once did, gave runs of `redundant` a degraded_slowdown_s down to −1,288 s.
Where stage processes share cores, T_ref < T_c or T_h < T_ref can happen too (links or a method's
route reorder who waits for a core); that saving is booked the same way.

Every category is ≥ 0, and since the work trained (N + the interrupted fraction) equals
P + rolled back + set back + the interrupted fraction, goodput_s + Σ badput == wall_clock_s holds
exactly up to floating-point rounding; `split_time` asserts both to a relative 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import results

WAIT_CATEGORIES: tuple[str, ...] = ("checkpoint_stall_s", "recovery_downtime_s", "method_overhead_s", "replica_heal_s", "survivor_restart_s")
"""Categories a wait (time with no training) can be charged to."""

RELATIVE_TOLERANCE = 1e-6


@dataclass(kw_only=True)
class Ledger:
    """Running totals booked while the run is simulated."""

    waits_s: dict[str, float] = field(default_factory=lambda: {name: 0.0 for name in WAIT_CATEGORIES})
    training_s_by_iteration_time: dict[float, float] = field(default_factory=dict)
    """Time spent inside training chunks, by the iteration time of the pipeline state it ran in."""
    interrupted_iterations: float = 0.0
    """Fractions of iterations that a failure or the deadline interrupted (never completed)."""
    rolled_back_iterations: float = 0.0
    setback_iterations: float = 0.0
    iterations_executed: int = 0
    replica_shortfall_s: float = 0.0
    """Training time with fewer replica pipelines that their smaller batch did not deliver (module docstring)."""

    def charge_wait(self, category: str, seconds: float) -> None:
        assert category in self.waits_s, f"unknown wait category {category!r}"
        self.waits_s[category] += seconds

    def book_training(self, seconds: float, iteration_time_s: float) -> None:
        """`seconds` of training in a pipeline state whose iteration takes `iteration_time_s`."""
        by_time = self.training_s_by_iteration_time
        by_time[iteration_time_s] = by_time.get(iteration_time_s, 0.0) + seconds

    def book_training_with_fewer_replicas(self, seconds: float, iteration_time_s: float, batch_share: float) -> None:
        """`seconds` of training whose iterations were each worth `batch_share` of a full one."""
        delivered_s = seconds * batch_share
        self.book_training(delivered_s, iteration_time_s)
        self.replica_shortfall_s += seconds - delivered_s

    @property
    def training_s(self) -> float:
        return sum(self.training_s_by_iteration_time.values())


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
    healthy_s = healthy_iteration_time_s
    useful_compute_s = progress * compute_only_iteration_time_s
    goodput_s = useful_compute_s * (1.0 - compute_only_bubble_fraction)
    # Time trained in each state against the same work at the healthy iteration time.
    slower_s = faster_saving_s = 0.0
    for iteration_time_s, seconds in ledger.training_s_by_iteration_time.items():
        difference_s = seconds * (1.0 - healthy_s / iteration_time_s)
        if difference_s > 0:
            slower_s += difference_s
        else:
            faster_saving_s -= difference_s
    badput = {
        "bubble_s": useful_compute_s * compute_only_bubble_fraction,
        "communication_s": progress * (reference_iteration_time_s - compute_only_iteration_time_s),
        "method_overhead_s": progress * (healthy_s - reference_iteration_time_s) + ledger.waits_s["method_overhead_s"],
        "checkpoint_stall_s": ledger.waits_s["checkpoint_stall_s"],
        "lost_work_s": (ledger.rolled_back_iterations + ledger.interrupted_iterations) * healthy_s,
        "recovery_downtime_s": ledger.waits_s["recovery_downtime_s"],
        "survivor_restart_s": ledger.waits_s["survivor_restart_s"],
        "degraded_slowdown_s": slower_s,
        "convergence_setback_s": ledger.setback_iterations * healthy_s,
        "replica_heal_s": ledger.waits_s["replica_heal_s"] + ledger.replica_shortfall_s,
    }
    # Under shared cores (compute.shared_cores) the links, or a method's own route, can make an
    # iteration faster than the pipeline without them: they change which stage waits for a core
    # (cpu-tiny with a 0.5 s embedding: its links 47 µs an iteration, CheckFree+'s swapped route
    # 5 ms). Such a saving is booked as a faster state's is.
    saving_s = faster_saving_s
    for category in ("communication_s", "method_overhead_s"):
        if badput[category] < 0:
            saving_s -= badput[category]
            badput[category] = 0.0
    for category in ("communication_s", "lost_work_s", "method_overhead_s", "bubble_s"):
        taken_s = min(saving_s, badput[category])
        badput[category] -= taken_s
        saving_s -= taken_s
    tolerance_s = RELATIVE_TOLERANCE * max(wall_clock_s, 1.0)
    assert saving_s <= tolerance_s, f"time accounting: {saving_s} s saved by faster states left unbooked"
    assert min(goodput_s, *badput.values()) >= -tolerance_s, f"time accounting: a negative category in {badput}"
    assert tuple(badput) == results.BADPUT_CATEGORIES
    total_s = goodput_s + sum(badput.values())
    assert abs(total_s - wall_clock_s) <= tolerance_s, (
        f"time accounting does not add up: goodput + badput = {total_s} s, wall-clock {wall_clock_s} s"
    )
    return goodput_s, badput
