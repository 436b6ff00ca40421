"""`whatif` reruns a blocking checkpoint whose interval is far from Daly's optimum at a rate, at
Daly's interval, and says in that rate's caveats what tuning it changes (sim/whatif.py).

The scenario is test_analytic's: one stage, a 1 s iteration, δ = 10 s. At 83.5 %/h per stage the
pipeline's mean time between failures is M = 2000 s, Daly's interval ~188 iterations.
"""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.sim.whatif import UNTUNED_INTERVAL_RATIO, WhatIfPlan, compute_whatif, daly_reruns

from test_analytic import CHECKPOINT_S, one_stage_scenario

MTBF_S = 2000.0
RATE = 1.0 - math.exp(-3600.0 / MTBF_S)  # per stage-hour, one stage: M = 2000 s


def plan_with_interval(interval_iterations: int) -> WhatIfPlan:
    scenario = one_stage_scenario(mean_time_between_failures_s=MTBF_S, target_iterations=20_000)
    scenario = scenario.model_copy(update={"target": scenario.target.model_copy(update={"max_wall_clock_s": 100_000.0})})
    checkpoint = method_from_name("checkpoint", interval_iterations=interval_iterations)
    return WhatIfPlan(scenario=scenario, failure_rates=(0.0, RATE), methods=(checkpoint,), replications=10, interval_study_rate=None)


def test_an_interval_five_times_dalys_is_rerun_at_dalys_and_the_caveat_says_what_it_gains():
    daly = math.sqrt(2 * CHECKPOINT_S * MTBF_S) * (1 + math.sqrt(CHECKPOINT_S / (2 * MTBF_S)) / 3 + CHECKPOINT_S / (18 * MTBF_S)) - CHECKPOINT_S
    plan = plan_with_interval(1000)
    result = compute_whatif(plan, workers=1)
    (rerun,) = daly_reruns(plan, result.sweep.runs)  # the failure-free rate has no Daly point
    assert rerun.rate == RATE and rerun.scenario_interval_iterations == 1000
    assert rerun.daly_interval_iterations == pytest.approx(daly, rel=0.1)
    no_failures, failing = result.verdict.points
    assert not any("Daly" in caveat for caveat in no_failures.caveats)
    (note,) = [caveat for caveat in failing.caveats if "Daly" in caveat]
    assert f"interval_iterations 1000 is {1000 / rerun.daly_interval_iterations:.1f}× Daly's optimum" in note
    # Tuned, it is faster than the scenario's own interval (which the table still reports).
    tuned_hours = float(note.split("reaches the target in ")[1].split(" ")[0])
    (standing,) = [s for s in failing.standings if s.method == "checkpoint"]
    assert tuned_hours * 3600 < standing.time_to_target_s.ci95_low


def test_an_interval_near_dalys_is_not_rerun():
    plan = plan_with_interval(200)
    result = compute_whatif(plan, workers=1)
    assert daly_reruns(plan, result.sweep.runs) == []
    assert not any("Daly" in caveat for point in result.verdict.points for caveat in point.caveats)
    assert 200 / 188 < UNTUNED_INTERVAL_RATIO
