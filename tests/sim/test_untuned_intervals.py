"""An answer tries each method's checkpoint interval at a better value at every point with failures
(sim/studies/untuned_intervals.py): a blocking checkpoint at Daly's optimum where it is far from it, one
that blocks nothing by a halving/doubling search; where that is clearly better the point gets a
second answer with the tuned intervals, in `whatif`, `sweep` and `simulate` alike.

The scenario is test_analytic's: one stage, a 1 s iteration, δ = 10 s; at M = 2000 s between the
pipeline's failures Daly's interval is ~188 iterations.
"""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.methods import method_from_name
from churnsim.sim.studies.simulate import simulate_tables
from churnsim.sim.studies.sweep import build_tasks, run_sweep, sweep_verdict
from churnsim.sim.studies.untuned_intervals import UNTUNED_INTERVAL_RATIO, daly_reruns
from churnsim.sim.studies.whatif import WhatIfPlan, compute_whatif, rate_tasks

from test_analytic import CHECKPOINT_S, ITERATION_S, one_stage_scenario

MTBF_S = 2000.0
RATE = 1.0 - math.exp(-3600.0 / MTBF_S)  # per stage-hour, one stage: M = 2000 s
DALY = math.sqrt(2 * CHECKPOINT_S * MTBF_S) * (1 + math.sqrt(CHECKPOINT_S / (2 * MTBF_S)) / 3 + CHECKPOINT_S / (18 * MTBF_S)) - CHECKPOINT_S


def scenario_with(method):
    scenario = one_stage_scenario(mean_time_between_failures_s=MTBF_S, target_iterations=20_000)
    return scenario.model_copy(update={
        "target": scenario.target.model_copy(update={"max_wall_clock_s": 100_000.0}),
        "methods": (method,),
        "replications": 10,
    })


def checkpoint_every(interval_iterations: int):
    return scenario_with(method_from_name("checkpoint", interval_iterations=interval_iterations))


def whatif_plan(interval_iterations: int) -> WhatIfPlan:
    return WhatIfPlan(scenario=checkpoint_every(interval_iterations), failure_rates=(0.0, RATE), replications=10, interval_study_rate=None)


def configured_time(point, method: str = "checkpoint"):
    (standing,) = [s for s in point.standings if s.method == method]
    return standing.time_to_target_s


def test_whatif_runs_an_interval_five_times_dalys_at_dalys_and_answers_again_with_it():
    plan = whatif_plan(1000)
    result = compute_whatif(plan, workers=1)
    points = list({task.task.scenario.churn.failure_probability_per_stage_hour: task.task.scenario for task in rate_tasks(plan)}.values())
    (rerun,) = daly_reruns(points, result.sweep.runs)  # the failure-free rate has no Daly point
    assert rerun.point.churn.failure_probability_per_stage_hour == RATE and rerun.scenario_interval_iterations == 1000
    assert rerun.daly_interval_iterations == pytest.approx(DALY, rel=0.1)
    no_failures, failing = result.verdict.points
    assert no_failures.interval_reruns == () and no_failures.with_tuned_intervals is None
    (tuned,) = failing.interval_reruns
    assert (tuned.method, tuned.configured_interval_iterations, tuned.tuned_by) == ("checkpoint", 1000, "Daly's optimum")
    assert tuned.tuned_interval_iterations == rerun.daly_interval_iterations and tuned.fraction_reached == 1.0
    # The second answer: the same method at Daly's interval, faster than the configured one.
    again = failing.with_tuned_intervals
    assert again.winner == "checkpoint" and again.winner_time_to_target_s.mean == tuned.time_to_target_s.mean
    assert tuned.time_to_target_s.mean < configured_time(failing).ci95_low
    (note,) = [caveat for caveat in failing.caveats if "tuned here" in caveat]
    assert f"checkpoint's interval_iterations 1000 → {rerun.daly_interval_iterations} (Daly's optimum)" in note


def test_an_interval_near_dalys_is_kept():
    plan = whatif_plan(200)
    assert 200 / DALY < UNTUNED_INTERVAL_RATIO
    result = compute_whatif(plan, workers=1)
    points = [task.task.scenario for task in rate_tasks(plan)]
    assert daly_reruns(points, result.sweep.runs) == []
    assert all(point.with_tuned_intervals is None for point in result.verdict.points)


def test_a_lazy_checkpoint_is_searched_down_to_the_interval_its_flush_allows():
    # It blocks nothing, so it has no Daly point. Its flush to the one remote tier takes
    # CHECKPOINT_S = 10 iterations: shorter intervals lose less work per failure down to 10, and
    # below it the host buffer backs up and training waits. From 40: 20 and 80, then 10, then 5 (worse).
    lazy = method_from_name("async_checkpoint", interval_iterations=40, levels=("remote",))
    (point,) = simulate_tables(scenario_with(lazy)).verdict.points
    (tuned,) = point.interval_reruns
    assert tuned.tuned_by == "search" and tuned.intervals_tried == (5, 10, 20, 40, 80)
    assert tuned.tuned_interval_iterations == round(CHECKPOINT_S / ITERATION_S) == 10
    # 0.6 % faster: within the spread of the replications, but faster in the paired comparison.
    assert tuned.time_to_target_s.mean < configured_time(point, "async_checkpoint").mean
    (note,) = [caveat for caveat in point.caveats if "tuned here" in caveat]
    assert "async_checkpoint's interval_iterations 40 → 10 (the best of 5, 10, 20, 40, 80)" in note


def test_a_sweep_over_a_poisson_rate_tunes_each_point():
    # M = 2000 s and 8000 s: Daly's interval ~188 and ~390; the configured 40 is 1/4.7 and 1/9.8 of them.
    base = checkpoint_every(40)
    grid = [("churn.failures_per_node_hour", (3600.0 / MTBF_S, 3600.0 / (4 * MTBF_S)))]
    tasks = build_tasks(base, grid)
    result = run_sweep(tasks, workers=1)
    verdict = sweep_verdict(result, base, tasks=tasks, workers=1)
    assert len(verdict.points) == 2
    for point, mtbf_s in zip(verdict.points, (MTBF_S, 4 * MTBF_S)):
        (tuned,) = point.interval_reruns
        assert tuned.tuned_interval_iterations == pytest.approx(math.sqrt(2 * CHECKPOINT_S * mtbf_s), rel=0.15)
        assert tuned.time_to_target_s.mean < configured_time(point).ci95_low
        assert point.with_tuned_intervals.grid == point.grid
    # Without the tasks the answer is the configured methods' alone.
    assert all(point.with_tuned_intervals is None for point in sweep_verdict(result, base).points)


def test_a_sweep_of_the_interval_itself_is_not_tuned():
    base = checkpoint_every(40)
    tasks = build_tasks(base, [("methods.checkpoint.interval_iterations", (40, 1000))])
    result = run_sweep(tasks, workers=1)
    verdict = sweep_verdict(result, base, tasks=tasks, workers=1)
    assert all(point.interval_reruns == () for point in verdict.points)


def test_a_tuned_interval_that_reaches_the_target_more_often_is_taken():
    # A deadline of 24,000 s: Daly's interval reaches the target by ~22,400 s in every replication,
    # the configured 1000 in few of them.
    scenario = checkpoint_every(1000)
    scenario = scenario.model_copy(update={"target": scenario.target.model_copy(update={"max_wall_clock_s": 24_000.0})})
    (point,) = simulate_tables(scenario).verdict.points
    (standing,) = point.standings
    assert 0 < standing.fraction_reached < 1
    (tuned,) = point.interval_reruns
    assert tuned.fraction_reached == 1.0
    assert point.with_tuned_intervals.standings[0].fraction_reached == 1.0


def test_the_tuned_intervals_are_a_table_too():
    from churnsim.calibration.tables import TUNED_INTERVAL_COLUMNS
    from churnsim.sim.studies.verdict import tuned_intervals_table

    result = compute_whatif(whatif_plan(1000), workers=1)
    table = tuned_intervals_table(result.verdict)
    assert list(table.columns) == list(TUNED_INTERVAL_COLUMNS)
    (row,) = table.to_dict("records")
    (rerun,) = result.verdict.points[1].interval_reruns
    assert row["failure_probability_per_stage_hour"] == RATE and row["method"] == "checkpoint"
    assert (row["configured_interval_iterations"], row["tuned_interval_iterations"]) == (1000, rerun.tuned_interval_iterations)
    assert row["intervals_tried"] == " ".join(map(str, rerun.intervals_tried)) and row["time_to_target_mean_s"] == rerun.time_to_target_s.mean
