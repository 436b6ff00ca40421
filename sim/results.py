"""What one simulated run returns: the numbers every table, figure and run record is built from."""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from churnsim.calibration.tables import TIME_CATEGORIES

# Where wall-clock time goes: goodput_s + sum(badput) == wall_clock_s for every run (definitions in
# calibration/tables.py and sim/accounting.py).
BADPUT_CATEGORIES: tuple[str, ...] = TIME_CATEGORIES[1:]


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """A span (end_s > start_s) or an instant (end_s == start_s) of a simulated run, for the timeline."""

    name: str
    category: str  # "train", "checkpoint", "flush", "recovery", "degraded", "failure"
    stage: int  # -1 for the whole pipeline
    start_s: float
    end_s: float
    track: str | None = None
    """The timeline track it belongs on (a storage tier, a link); None: its stage's, or the pipeline's."""


@dataclass(frozen=True, kw_only=True)
class HandledFailure:
    time_s: float
    stage: int
    kind: str  # cause from the churn model, e.g. "preemption"
    handled_as: str  # what the method did, e.g. "rebuild_interior", "rollback", "degraded", "ignored"
    iteration: int  # progress (iterations) when it struck


@dataclass(frozen=True, kw_only=True)
class RunResult:
    method: str
    replication: int
    seed: int
    reached_target: bool
    wall_clock_s: float
    """Time at which the target was reached, or the time the run gave up (target.max_wall_clock_s)."""
    target_iterations: int
    progress_iterations: float
    """Effective progress at the end (iterations of the no-failure run)."""
    iterations_executed: int
    healthy_iteration_time_s: float
    reference_iteration_time_s: float
    """Iteration time of the same pipeline without any method (the `none` method's)."""
    goodput_s: float
    badput: dict[str, float]
    failures: tuple[HandledFailure, ...]
    trajectory: tuple[tuple[float, float], ...]
    """(time_s, progress_iterations) points; progress is linear between consecutive points."""
    timeline: tuple[TimelineEvent, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> dict[str, float | int | str | bool | None]:
        """The run's numbers as flat fields: a run record's manifest summary and a row of runs.csv."""
        summary: dict[str, float | int | str | bool | None] = {
            "reached_target": self.reached_target,
            "wall_clock_s": self.wall_clock_s,
            "time_to_target_s": self.wall_clock_s if self.reached_target else math.nan,
            "target_iterations": self.target_iterations,
            "progress_iterations": self.progress_iterations,
            "iterations_executed": self.iterations_executed,
            "healthy_iteration_time_s": self.healthy_iteration_time_s,
            "num_failures": len(self.failures),
            "goodput_s": self.goodput_s,
        }
        summary.update({category: self.badput[category] for category in BADPUT_CATEGORIES})
        return summary
