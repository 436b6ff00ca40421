"""An answer reruns a blocking checkpoint whose interval is far from Daly's optimum at a point, at
Daly's interval, and says in that point's caveats what tuning it changes (sim/untuned_intervals.py),
in `whatif` and in `sweep` alike.

The scenario is test_analytic's: one stage, a 1 s iteration, δ = 10 s; at M = 2000 s between the
pipeline's failures Daly's interval is ~188 iterations.
"""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.sim.sweep import build_tasks, run_sweep, sweep_verdict
from churnsim.sim.untuned_intervals import UNTUNED_INTERVAL_RATIO, daly_reruns
from churnsim.sim.whatif import WhatIfPlan, compute_whatif, rate_tasks

from test_analytic import CHECKPOINT_S, one_stage_scenario

MTBF_S = 2000.0
RATE = 1.0 - math.exp(-3600.0 / MTBF_S)  # per stage-hour, one stage: M = 2000 s
DALY = math.sqrt(2 * CHECKPOINT_S * MTBF_S) * (1 + math.sqrt(CHECKPOINT_S / (2 * MTBF_S)) / 3 + CHECKPOINT_S / (18 * MTBF_S)) - CHECKPOINT_S


def scenario_with_interval(interval_iterations: int):
    scenario = one_stage_scenario(mean_time_between_failures_s=MTBF_S, target_iterations=20_000)
    return scenario.model_copy(update={
        "target": scenario.target.model_copy(update={"max_wall_clock_s": 100_000.0}),
        "methods": (method_from_name("checkpoint", interval_iterations=interval_iterations),),
        "replications": 10,
    })


def whatif_plan(interval_iterations: int) -> WhatIfPlan:
    return WhatIfPlan(scenario=scenario_with_interval(interval_iterations), failure_rates=(0.0, RATE), replications=10, interval_study_rate=None)


def daly_note(caveats) -> str:
    (note,) = [caveat for caveat in caveats if "Daly" in caveat]
    return note


def tuned_seconds(note: str) -> float:
    return 3600 * float(note.split("reaches the target in ")[1].split(" ")[0])


def test_whatif_reruns_an_interval_five_times_dalys_at_dalys_and_says_what_it_gains():
    plan = whatif_plan(1000)
    result = compute_whatif(plan, workers=1)
    points = list({task.task.scenario.churn.failure_probability_per_stage_hour: task.task.scenario for task in rate_tasks(plan)}.values())
    (rerun,) = daly_reruns(points, result.sweep.runs)  # the failure-free rate has no Daly point
    assert rerun.point.churn.failure_probability_per_stage_hour == RATE and rerun.scenario_interval_iterations == 1000
    assert rerun.daly_interval_iterations == pytest.approx(DALY, rel=0.1)
    no_failures, failing = result.verdict.points
    assert not any("Daly" in caveat for caveat in no_failures.caveats)
    note = daly_note(failing.caveats)
    assert f"interval_iterations 1000 is {1000 / rerun.daly_interval_iterations:.1f}× Daly's optimum" in note
    # Tuned, it beats the configured interval, which the table still reports.
    (standing,) = [s for s in failing.standings if s.method == "checkpoint"]
    assert tuned_seconds(note) < standing.time_to_target_s.ci95_low
    # The same, structured, for --json.
    (structured,) = failing.interval_reruns
    assert (structured.method, structured.configured_interval_iterations) == ("checkpoint", 1000)
    assert structured.daly_interval_iterations == rerun.daly_interval_iterations and structured.fraction_reached == 1.0
    assert structured.time_to_target_s.mean < standing.time_to_target_s.ci95_low
    assert structured.winner_speedup is None  # checkpoint is the only method, the winner
    assert no_failures.interval_reruns == ()


def test_an_interval_near_dalys_is_not_rerun():
    plan = whatif_plan(200)
    assert 200 / DALY < UNTUNED_INTERVAL_RATIO
    result = compute_whatif(plan, workers=1)
    points = [task.task.scenario for task in rate_tasks(plan)]
    assert daly_reruns(points, result.sweep.runs) == []
    assert not any("Daly" in caveat for point in result.verdict.points for caveat in point.caveats)


def test_a_sweep_over_a_poisson_rate_reruns_each_point_off_dalys():
    # M = 2000 s and 8000 s: Daly's interval ~188 and ~390; the configured 40 is 1/4.7 and 1/9.8 of them.
    base = scenario_with_interval(40)
    grid = [("churn.failures_per_node_hour", (3600.0 / MTBF_S, 3600.0 / (4 * MTBF_S)))]
    tasks = build_tasks(base, grid)
    result = run_sweep(tasks, workers=1)
    verdict = sweep_verdict(result, base, tasks=tasks, workers=1)
    reruns = daly_reruns(list({task.task.scenario.name: task.task.scenario for task in tasks}.values()), result.runs)
    assert len(verdict.points) == len(reruns) == 2
    for point, rerun, mtbf_s in zip(verdict.points, reruns, (MTBF_S, 4 * MTBF_S)):
        assert rerun.point.name == point.scenario
        assert rerun.daly_interval_iterations == pytest.approx(math.sqrt(2 * CHECKPOINT_S * mtbf_s), rel=0.15)
        note = daly_note(point.caveats)
        assert f"interval_iterations 40 is 1/{rerun.daly_interval_iterations / 40:.1f} of Daly's optimum here: at {rerun.daly_interval_iterations} " in note
        (standing,) = [s for s in point.standings if s.method == "checkpoint"]
        assert tuned_seconds(note) < standing.time_to_target_s.ci95_low
    # Without the tasks the answer is the configured methods' alone.
    assert not any("Daly" in caveat for point in sweep_verdict(result, base).points for caveat in point.caveats)


def test_simulate_reruns_it_too():
    from churnsim.sim.simulate import simulate_tables

    (point,) = simulate_tables(scenario_with_interval(1000)).verdict.points
    (standing,) = point.standings
    assert tuned_seconds(daly_note(point.caveats)) < standing.time_to_target_s.ci95_low


def test_a_sweep_of_the_interval_itself_is_not_rerun():
    base = scenario_with_interval(40)
    tasks = build_tasks(base, [("methods.checkpoint.interval_iterations", (40, 1000))])
    result = run_sweep(tasks, workers=1)
    verdict = sweep_verdict(result, base, tasks=tasks, workers=1)
    assert not any("Daly" in caveat for point in verdict.points for caveat in point.caveats)


def test_a_rerun_that_reaches_the_target_more_often_says_so():
    # A deadline of 24,000 s: Daly's interval reaches the target by ~22,400 s in every replication,
    # the configured 1000 in few of them; the note gives the share beside the optimistic mean.
    from churnsim.sim.simulate import simulate_tables

    scenario = scenario_with_interval(1000)
    scenario = scenario.model_copy(update={"target": scenario.target.model_copy(update={"max_wall_clock_s": 24_000.0})})
    (point,) = simulate_tables(scenario).verdict.points
    (standing,) = point.standings
    assert 0 < standing.fraction_reached < 1
    note = daly_note(point.caveats)
    assert f"not {standing.time_to_target_s.mean / 3600:.1f} h in {standing.fraction_reached:.0%} of replications" in note
    rerun_part = note.split("reaches the target in ")[1].split(", not ")[0]
    assert rerun_part.endswith("]") and "of replications" not in rerun_part  # the rerun reached it every time
