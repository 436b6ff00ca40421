"""At a large data-parallel degree the verdict says when stage losses are too rare to tell the
stage-loss methods apart; the data-parallel degree is a sweepable axis."""

from __future__ import annotations

import pytest

from churnsim import api
from churnsim.calibration.presets import preset
from churnsim.calibration.replica_rule import stage_loss_rate_per_s
from churnsim.sim.studies.simulate import simulate_tables
from churnsim.sim.studies.verdict import (
    STAGE_LOSSES_TO_TELL_METHODS_APART,
    expected_stage_losses,
    heal_window_estimate_s,
    node_failure_rate_per_s,
    rare_stage_loss_note,
)

DEGREE = "pipeline.data_parallel_degree"
METHODS = ("none", "checkpoint", "checkfree")
SENTENCE = "too few for the stage-loss methods"


def tiny(data_parallel_degree: int, **settings: object):
    """cpu-tiny (4 stages, a failure per node every 15 s, a run of seconds) at `data_parallel_degree`."""
    return preset("cpu-tiny", {DEGREE: data_parallel_degree, "replications": 2, **settings}, methods=METHODS)


def rare_notes(notes) -> list[str]:
    return [note for note in notes if SENTENCE in note]


def test_the_verdict_says_stage_losses_are_too_rare_at_128_replicas_and_not_at_one():
    one, many = simulate_tables(tiny(1)), simulate_tables(tiny(128))
    assert rare_notes(one.verdict.caveats) == []
    (note,) = rare_notes(many.verdict.caveats)
    assert note.startswith("with 128 data-parallel replicas") and "an estimate" in note
    assert len([sentence for sentence in note.split(". ") if sentence]) == 1


def test_replicas_failing_together_lose_a_stage_at_every_failure():
    scenario = tiny(128, **{"pipeline.replicas_fail_together": True})
    assert rare_stage_loss_note(scenario) is None
    stage_losses, _ = expected_stage_losses(scenario)
    assert stage_losses >= STAGE_LOSSES_TO_TELL_METHODS_APART


def test_no_sentence_without_failures_or_with_stage_losses_common():
    assert rare_stage_loss_note(tiny(128, **{"churn.failures_per_node_hour": 0.0})) is None
    # Two replicas, a failure per node every 1.5 s and heals of half a second: both are often down at once.
    common = tiny(2, **{"churn.failures_per_node_hour": 2400.0, "recovery.join_delay_s": 0.5})
    assert expected_stage_losses(common)[0] >= STAGE_LOSSES_TO_TELL_METHODS_APART
    assert rare_stage_loss_note(common) is None


def test_no_estimate_where_a_heal_lasts_about_as_long_as_the_run():
    # A node lost early stays missing for the rest of a run of seconds: the long-run rate would be far too low.
    slow_heal = tiny(128, **{"recovery.join_delay_s": 86_400.0})
    assert expected_stage_losses(slow_heal) is None
    assert rare_stage_loss_note(slow_heal) is None


def test_the_expected_stage_losses_follow_the_replica_rule():
    scenario = tiny(4)
    stage_losses, node_failures = expected_stage_losses(scenario)
    rate = node_failure_rate_per_s(scenario)
    per_stage = stage_loss_rate_per_s(rate, data_parallel_degree=4, heal_window_s=heal_window_estimate_s(scenario))
    # Both are counted over the same run: their ratio is the rule's, whatever the run's length.
    assert stage_losses / node_failures == pytest.approx(per_stage * 4 / (rate * 4 * 4), rel=1e-9)
    assert heal_window_estimate_s(scenario) > scenario.recovery.join_delay_s  # the copy takes time too


def test_a_churn_without_a_per_node_rate_gets_no_estimate():
    scenario = preset("spot-p3-trace", {DEGREE: 64})
    assert node_failure_rate_per_s(scenario) is None
    assert rare_stage_loss_note(scenario) is None


def test_the_data_parallel_degree_is_a_sweep_axis():
    results = api.sweep(tiny(1), {DEGREE: [1, 2, 4, 8]}, replications=2)
    assert sorted(results.summary[DEGREE].unique()) == [1, 2, 4, 8]
    assert sorted(point.grid[DEGREE] for point in results.verdict.points) == [1, 2, 4, 8]
    rare = rare_notes(results.verdict.caveats)
    # Said for each grid point it holds at, named by the point; never for one replica.
    assert rare and all(note.startswith(f"{DEGREE} = ") for note in rare)
    assert not any(note.startswith(f"{DEGREE} = 1:") for note in rare)
    assert any(note.startswith(f"{DEGREE} = 8:") for note in rare)


def test_whatif_takes_a_data_parallel_degree_and_names_the_rates_where_stage_losses_are_rare():
    results = api.whatif(tiny(1), settings={DEGREE: 8}, methods=list(METHODS), replications=2, interval_study=False)
    assert len(results.verdict.points) >= 2  # one per rate asked
    rare = rare_notes(results.verdict.caveats)
    assert rare and all(note.startswith("at ") and "with 8 data-parallel replicas" in note for note in rare)


def test_one_nodes_failure_rate_under_each_memoryless_or_renewal_churn():
    hour_s = 3600.0
    assert node_failure_rate_per_s(tiny(2)) == pytest.approx(240 / hour_s)
    hourly = tiny(2, churn={"kind": "stage_hourly", "failure_probability_per_stage_hour": 0.1})
    assert node_failure_rate_per_s(hourly) * hour_s == pytest.approx(0.10536, rel=1e-4)  # −ln(0.9)
    weibull = tiny(2, churn={"kind": "weibull", "shape": 0.7, "mean_lifetime_s": 50.0})
    assert node_failure_rate_per_s(weibull) == pytest.approx(1 / 50.0)
