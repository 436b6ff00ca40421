"""`whatif` under a scenario's own churn: a churn model other than the per-stage hourly probability is
asked at multiples of its own rate, not replaced (sim/studies/whatif.py `whatif_plan`)."""

from __future__ import annotations

import pytest

from churnsim import api
from churnsim.calibration.churn import ScheduleChurn
from churnsim.calibration.presets import PRESETS, preset
from churnsim.sim.studies.whatif import OWN_CHURN_FACTORS, QUICK_FAILURE_RATES, RATE_SETTING, WHATIF_FAILURE_RATES, whatif_plan


def test_the_plan_keeps_a_churn_with_a_rate_and_replaces_the_hourly_one_or_one_without_a_rate():
    tiny = whatif_plan(preset("cpu-tiny"))  # Poisson, 240 failures per node-hour
    assert tiny.rate_setting == "churn.failures_per_node_hour" and not tiny.replaces_churn
    assert tiny.failure_rates == (0.0, *(240.0 * factor for factor in OWN_CHURN_FACTORS))
    assert tiny.interval_study_rate == 240.0 and tiny.grid_columns == ("churn.failures_per_node_hour",)
    trace = whatif_plan(preset("spot-p3-trace"), quick=True)
    assert trace.rate_setting == "churn.time_scale" and trace.failure_rates == (1.0, 0.25) and trace.replications == 3
    paper = whatif_plan(preset("checkfree-500m-geo-10pct"))
    assert (paper.rate_setting, paper.failure_rates, paper.interval_study_rate) == (RATE_SETTING, WHATIF_FAILURE_RATES, 0.10)
    given = whatif_plan(preset("cpu-tiny"), failure_rates=(0.0, 0.33))
    assert given.replaces_churn and given.failure_rates == (0.0, 0.33)
    schedule = preset("cpu-tiny").model_copy(update={"churn": ScheduleChurn(kind="schedule", path="failures.csv")})
    assert whatif_plan(schedule, quick=True).failure_rates == QUICK_FAILURE_RATES  # a fixed schedule has no rate to scale
    idle = preset("cpu-tiny").model_copy(update={"churn": preset("cpu-tiny").churn.model_copy(update={"failures_per_node_hour": 0.0})})
    assert whatif_plan(idle, quick=True).replaces_churn  # nor has a rate of 0


def test_given_replications_win_over_the_quick_default():
    # --quick --replications 7 used to run 3 replications without a word.
    paper = preset("checkfree-500m-geo-10pct")
    assert whatif_plan(paper).replications == 10 and whatif_plan(paper, quick=True).replications == 3
    assert whatif_plan(paper, quick=True, replications=7).replications == 7


@pytest.fixture(scope="module")
def tiny_whatif():
    return api.whatif("cpu-tiny", methods=["none", "checkpoint", "checkfree"], replications=2, interval_study=False, calibration="cpu-tiny")


def test_the_answer_has_one_point_per_multiple_of_the_scenarios_own_rate(tiny_whatif):
    points = tiny_whatif.verdict.points
    assert [point.grid for point in points] == [{"churn.failures_per_node_hour": rate} for rate in (0.0, 120.0, 240.0, 480.0, 960.0)]
    assert all(point.failure_probability_per_stage_hour is None for point in points)
    assert not any(note.startswith("the rates replace") for note in tiny_whatif.notes)
    summary = tiny_whatif.summary
    assert set(summary["churn.failures_per_node_hour"]) == {0.0, 120.0, 240.0, 480.0, 960.0}
    assert summary.groupby("churn.failures_per_node_hour").size().eq(3).all()  # one row per method and rate


def test_the_runs_see_failures_in_proportion_to_the_rate(tiny_whatif):
    runs = tiny_whatif.runs[tiny_whatif.runs["method"] == "checkpoint"]
    failures = runs.groupby("churn.failures_per_node_hour")["num_failures"].mean()
    assert failures.loc[0.0] == 0
    # More failures at a higher rate, over runs of about the same length (2 replications each).
    assert failures.loc[960.0] > failures.loc[480.0] > failures.loc[120.0] > 0


def test_the_interval_study_varies_the_scenarios_own_checkpoint_configuration():
    # `churnsim whatif --preset datastates-7b` failed with a traceback: the study took the default
    # checkpoint configuration, whose 'remote' tier the preset's storage (Lustre) does not have.
    from churnsim.sim.studies.whatif import interval_study_configs, interval_tasks

    plan = whatif_plan(preset("datastates-7b"), quick=True)
    configs = {config.name: config for config in interval_study_configs(plan)}
    assert configs["checkpoint"].tier == "lustre_torch_save"
    tasks = interval_tasks(plan)
    assert {task.settings["interval_iterations"] for task in tasks} == set(plan.intervals)
    assert all(task.task.scenario.methods[0].name in configs for task in tasks)
    # A method the scenario does not list is studied in its default configuration where that fits.
    only_sync = preset("checkfree-500m-geo-10pct")
    only_sync = only_sync.model_copy(update={"methods": tuple(m for m in only_sync.methods if m.name != "async_checkpoint")})
    assert [config.name for config in interval_study_configs(whatif_plan(only_sync, quick=True))] == ["checkpoint", "async_checkpoint"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_whatif_builds_its_tasks(name):
    # Building the tasks validates every scenario the what-if will run; the four DataStates presets
    # used to fail here, in the interval study, with a traceback.
    from churnsim.sim.studies.whatif import interval_tasks, rate_tasks

    plan = whatif_plan(preset(name), quick=True)
    assert rate_tasks(plan) and (plan.interval_study_rate is None or interval_tasks(plan))
