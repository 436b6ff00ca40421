"""How much work a what-if, a sweep or a recommendation asks for, checked before any of it starts.

Each command counts its simulated runs (replications × rates or grid points × methods, plus the
studies it adds) from the plan alone, before building a task, and `calibration.input_limits.check_work`
prices them; `--max-work CORE_HOURS` raises the limit. The counts of the studies a recommendation
adds are upper estimates (its interval grids may stop growing early).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

MAX_WORK_HELP = "Refuse to start when the estimated work exceeds this many core-hours (default 1)."

RECOMMEND_RUNS_PER_METHOD = 20
"""Variants a recommendation runs per method at most: its knobs, an interval grid of about six points
grown up to four times, and four robustness cases with their interval re-tuning."""


def _methods(scenario: Any) -> int:
    return max(1, len(scenario.methods))


def check_whatif_work(plan: Any, *, max_work: Optional[float]) -> None:
    """Refuse a what-if whose rates × replications × methods (plus the interval study) is too much
    work, from its plan alone (making the scenario of each of thousands of rates takes minutes)."""
    from churnsim.calibration.input_limits import check_work, seconds_per_run
    from churnsim.sim.studies.whatif import interval_study_configs

    methods = max(1, len(plan.chosen_methods()))
    runs = len(plan.failure_rates) * plan.replications * methods
    if plan.interval_study_rate is not None:
        runs += len(plan.intervals) * len(interval_study_configs(plan)) * plan.replications
    what = f"{len(plan.failure_rates):,} rate(s) × {plan.replications:,} replications × {methods} method(s), with the interval study,"
    check_work(runs, seconds_per_run(plan.scenario), what=what, max_work_core_hours=max_work)


def check_sweep_work(base: Any, grid: Sequence[tuple[str, Sequence[Any]]], *, max_work: Optional[float]) -> None:
    """Refuse a sweep whose grid points × replications × methods is too much work, before any point is made."""
    from churnsim.calibration.input_limits import check_work, seconds_per_run

    points = math.prod(len(values) for _, values in grid) if grid else 1
    runs = points * base.replications * _methods(base)
    what = f"{points:,} grid point(s) × {base.replications:,} replications × {_methods(base)} method(s)"
    check_work(runs, seconds_per_run(base), what=what, max_work_core_hours=max_work)


def check_recommend_work(scenario: Any, *, max_work: Optional[float]) -> None:
    """Refuse a recommendation whose methods × variants × replications is too much work."""
    from churnsim.calibration.input_limits import check_work, seconds_per_run

    runs = scenario.replications * _methods(scenario) * RECOMMEND_RUNS_PER_METHOD
    what = f"{scenario.replications:,} replications × {_methods(scenario)} method(s) × up to {RECOMMEND_RUNS_PER_METHOD} variants each"
    check_work(runs, seconds_per_run(scenario), what=what, max_work_core_hours=max_work)
