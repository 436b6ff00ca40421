"""`recommend` (sim/studies/recommend.py) on the Young/Daly scenario of test_analytic.py, and `churnsim recommend --json`.

Only the `checkpoint` method, one stage with a 1 s iteration, δ = 10 s, Poisson failures with
M = 2000 s: Young's interval is 200 iterations, Daly's 193, and the simulated optimum lies near them
(test_analytic.py). `recommend` must report Young/Daly from δ and M it reads off the runs and pick,
on its grid around Daly's interval, the grid point nearest that optimum.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest

from churnsim.calibration.base import strict_json_loads
from churnsim.calibration.churn import WeibullChurn
from churnsim.calibration.methods import method_from_name
from churnsim.recommend_report import recommendation_lines
from churnsim.sim.studies.recommend import Candidate, Recommendation, interval_beyond_edge, recommend
from churnsim.sim.studies.verdict import Estimate, cannot_be_told_apart

from test_analytic import CHECKPOINT_S, ITERATION_S, one_stage_scenario

MTBF_S = 2000.0


def young_daly_scenario(target_iterations: int):
    """test_analytic's scenario with a failure horizon of 100 000 s (its 1e9 s deadline would sample ~500 000 failures)."""
    scenario = one_stage_scenario(mean_time_between_failures_s=MTBF_S, target_iterations=target_iterations)
    return scenario.model_copy(update={"target": scenario.target.model_copy(update={"max_wall_clock_s": 100_000.0})})


def test_recommend_picks_the_grid_interval_at_the_young_daly_optimum():
    young = math.sqrt(2 * CHECKPOINT_S * MTBF_S)
    daly = young * (1 + math.sqrt(CHECKPOINT_S / (2 * MTBF_S)) / 3 + CHECKPOINT_S / (18 * MTBF_S)) - CHECKPOINT_S
    scenario = young_daly_scenario(20_000)
    result = recommend(scenario, replications=30, interval_grid_factors=(0.5, 1.0, 2.0), setback_scales=(), rate_factors=(), workers=1)
    (study,) = result.interval_studies
    assert study.mean_time_between_failures_s == pytest.approx(MTBF_S)
    assert study.checkpoint_cost_s == pytest.approx(CHECKPOINT_S, rel=0.05)
    assert study.young_interval_iterations == pytest.approx(young, rel=0.05)
    assert study.daly_interval_iterations == pytest.approx(daly, rel=0.05)
    intervals = [candidate.knobs["interval_iterations"] for candidate in study.grid]
    assert len(intervals) >= 4 and min(intervals) < 0.6 * young and max(intervals) > 1.8 * young
    # The simulated optimum is ~190-200 s: of the grid, only the points at Young's and Daly's are near it.
    assert abs(study.best_interval_iterations - young) <= 0.1 * young
    assert study.fitted_optimum_iterations == pytest.approx(young, rel=0.30)
    assert study.fitted_optimum_iterations == pytest.approx(daly, rel=0.30)
    means = {c.knobs["interval_iterations"]: c.time_to_target_s.mean for c in study.grid}
    assert means[study.best_interval_iterations] == min(means.values())
    assert result.winner == "checkpoint"
    assert result.winner_knobs == {"interval_iterations": study.best_interval_iterations}
    assert result.winner_time_to_target_s.ci95_low <= result.winner_time_to_target_s.mean <= result.winner_time_to_target_s.ci95_high
    assert result.robustness == ()


def test_an_interval_grid_grows_past_the_edge_the_best_point_lies_on():
    # The lazy asynchronous checkpoint blocks nothing (no δ, so no Young/Daly point): its grid is
    # 20, 40, 80 around the scenario's 40. Its flush to the one remote tier takes CHECKPOINT_S = 10
    # iterations, so shorter intervals lose less work per failure down to 10 and below it the host
    # buffer backs up and training waits: the grid must grow below its edge to 10, then to 5 (worse), and stop.
    scenario = young_daly_scenario(20_000)
    lazy = method_from_name("async_checkpoint", interval_iterations=40, levels=("remote",))
    result = recommend(scenario.model_copy(update={"methods": (lazy,)}), replications=10, setback_scales=(), rate_factors=(), workers=1)
    (study,) = result.interval_studies
    assert study.young_interval_iterations is None and study.daly_interval_iterations is None
    means = {c.knobs["interval_iterations"]: c.time_to_target_s.mean for c in study.grid}
    assert sorted(means) == [5, 10, 20, 40, 80]
    assert study.grid_extensions == 2
    assert study.best_interval_iterations == round(CHECKPOINT_S / ITERATION_S) == 10
    assert means[5] > means[10] < means[20]
    assert result.winner_knobs == {"interval_iterations": 10}
    assert not any("edge of the grid" in caveat for caveat in result.caveats)


@pytest.mark.parametrize(
    ("grid", "best", "iterations_executed", "beyond"),
    [
        ([5, 10, 20], 10, 1000, None),  # neighbours on both sides
        ([5, 10, 20], 5, 1000, 2),  # half the smallest
        ([1, 2, 5], 1, 1000, None),  # nothing below one iteration
        ([5, 10, 20], 20, 1000, 40),  # twice the largest
        ([5, 10, 20], 20, 20, None),  # a run of 20 iterations takes no checkpoint at 40
        ([7], 7, 1000, None),  # a single point has no edge to grow past
    ],
)
def test_the_interval_past_the_grid_edge(grid, best, iterations_executed, beyond):
    assert interval_beyond_edge(grid, best, iterations_executed) == beyond


def test_recommend_json_is_strict_and_names_the_robustness_cases(tmp_path):
    scenario = young_daly_scenario(2_000)
    (tmp_path / "scenario.json").write_text(scenario.model_dump_json(indent=2))
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "recommend", "scenario.json", "--replications", "2", "--workers", "1", "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    answer = strict_json_loads(result.stdout)  # the whole of stdout, nothing else
    assert answer["command"] == "recommend"
    assert answer["winner"] == "checkpoint"
    assert set(answer["winner_knobs"]) == {"interval_iterations"}
    assert answer["interval_studies"][0]["young_interval_iterations"] == pytest.approx(200, rel=0.05)
    assert [(case["uncertain_input"], case["factor"]) for case in answer["robustness"]] == [("failure_rate", 0.5), ("failure_rate", 2.0)]
    assert all(case["winner_changes"] is False for case in answer["robustness"])


def test_recommend_takes_set_overrides_of_the_scenario(tmp_path):
    # Failures four times as rare: Young's interval √(2δM) doubles.
    (tmp_path / "scenario.json").write_text(young_daly_scenario(2_000).model_dump_json(indent=2))
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "recommend", "scenario.json", "--set", f"churn.failures_per_node_hour={3600.0 / (4 * MTBF_S)}",
         "--replications", "2", "--workers", "1", "--json"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    answer = strict_json_loads(result.stdout)
    assert "churn.failures_per_node_hour=" in answer["scenario"]
    assert answer["interval_studies"][0]["young_interval_iterations"] == pytest.approx(400, rel=0.05)


def test_the_api_recommends_for_a_scenario():
    from churnsim import api

    result = api.recommend(young_daly_scenario(2_000), replications=2)
    assert result.winner == "checkpoint" and "interval_iterations" in result.winner_knobs


def test_recommend_refuses_bad_replications_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "recommend", "--preset", "checkfree-500m-geo-10pct", "--replications", "0"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 2
    assert "--replications 0" in result.stderr


def test_redundant_computations_fallback_interval_is_studied_without_young_and_daly():
    # Its fallback checkpoints are read only after two adjacent losses: the pipeline's M between
    # failures is not theirs, so the grid is around the scenario's interval, with no Young/Daly point.
    from churnsim.calibration.presets import preset

    scenario = preset("checkfree-124m-geo-33pct")
    redundant = method_from_name("redundant", fallback_interval_iterations=100)
    result = recommend(scenario.model_copy(update={"methods": (redundant,)}), replications=3, setback_scales=(), rate_factors=(), workers=1)
    (study,) = result.interval_studies
    assert study.method == "redundant" and study.interval_field == "fallback_interval_iterations"
    assert study.young_interval_iterations is None and study.daly_interval_iterations is None
    intervals = [candidate.knobs["fallback_interval_iterations"] for candidate in study.grid]
    assert {50, 100, 200} <= set(intervals)
    assert result.winner == "redundant" and result.winner_knobs == {"fallback_interval_iterations": study.best_interval_iterations}


@pytest.mark.parametrize("churn_kind", ["poisson", "weibull"])
def test_at_a_scaled_failure_rate_the_checkpoint_interval_is_tuned_again_by_dalys_rule(churn_kind):
    # Four times the failures: M = 500 s, Daly's interval ~91 against the ~190 kept from the base
    # rate; the case runs it at Daly's too and keeps the better of the two. Weibull lifetimes of
    # shape 1 are the same exponential ones: their rate is scaled through the mean lifetime.
    scenario = young_daly_scenario(20_000)
    if churn_kind == "weibull":
        scenario = scenario.model_copy(update={"churn": WeibullChurn(kind="weibull", shape=1.0, mean_lifetime_s=MTBF_S)})
    result = recommend(scenario, replications=10, setback_scales=(), rate_factors=(4.0,), workers=1)
    (case,) = result.robustness
    assert case.winner == "checkpoint" and case.note is not None
    assert case.note.startswith("checkpoint at interval_iterations = ") and case.note.endswith("tuned at this rate")
    retuned = int(case.note.split("= ")[1].split(",")[0])
    assert retuned == pytest.approx(math.sqrt(2 * CHECKPOINT_S * MTBF_S / 4) - CHECKPOINT_S, rel=0.15)


def test_a_candidate_that_missed_the_target_is_shown_by_its_lower_bound_and_is_not_tied_past_it():
    hour = 3600.0
    winner = Candidate(method="redundant", knobs={}, fraction_reached=1.0, time_to_target_s=Estimate(mean=230 * hour, ci95_low=225 * hour, ci95_high=234 * hour))
    # Its two runs that reached the target give a wide optimistic interval over the winner's; the
    # run stopped at the limit puts its mean past 600 h.
    partial = Candidate(
        method="checkfree", knobs={"edge_fallback": "checkpoint"}, fraction_reached=2 / 3,
        time_to_target_s=Estimate(mean=557 * hour, ci95_low=-232 * hour, ci95_high=1347 * hour), time_to_target_at_least_s=611.5 * hour,
    )  # fmt: skip
    assert winner.time_to_target_s.overlaps(partial.time_to_target_s) and not cannot_be_told_apart(winner, partial)
    assert cannot_be_told_apart(winner, dataclasses.replace(partial, time_to_target_at_least_s=233 * hour))
    recommendation = Recommendation(
        scenario="s", replications=3, winner="redundant", winner_knobs={}, winner_time_to_target_s=winner.time_to_target_s,
        cannot_be_told_apart_from=(), best_per_method=(winner, partial), interval_studies=(), edge_fallbacks=(partial,), robustness=(),
    )  # fmt: skip
    lines = recommendation_lines(recommendation)
    assert "  checkfree (edge_fallback = checkpoint): ≥ 611.5 (reached in 67%: 557.0 [-232.0, 1347.0] over those)" in lines
    assert "edge_fallback: checkpoint ≥ 611.5 (reached in 67%: 557.0 [-232.0, 1347.0] over those)" in lines
