"""Hard failures under an agent that restarts every worker: the simulator charges the survivors'
restart (`recovery.survivor_restart_s`, badput `survivor_restart_s`) before the method's recovery,
with the replacement's join delay running meanwhile; both engines alike (the random scenarios of
tests/sim/test_closed_form_equivalence.py draw it too)."""

from __future__ import annotations

import pytest

from churnsim.calibration.scenario import TrainingSpec
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.run import simulate_run

from sim_run_scenarios import CLOSED_FORM_ITERATION_S, failure, method, small_scenario

MODEL = IterationModel()
JOIN_DELAY_S = 30.0
RESTART_S = 5.0


def _scenario(survivor_restart_s: float, *, failure_mode: str = "hard", launch: str = "agent"):
    scenario = small_scenario(target_iterations=20, join_delay_s=JOIN_DELAY_S, restart_s=RESTART_S)
    return scenario.model_copy(
        update={
            "recovery": scenario.recovery.model_copy(update={"survivor_restart_s": survivor_restart_s}),
            "training": TrainingSpec(failure_mode=failure_mode, hard_failure_launch=launch),
        }
    )


def _run(scenario, name: str, *, reference_events: bool):
    # One failure in the middle of iteration 5 of stage 1 (an interior stage: CheckFree rebuilds it).
    failures = (failure(5.5 * CLOSED_FORM_ITERATION_S, 1),)
    return simulate_run(scenario, method(name), failures, iteration_model=MODEL, reference_events=reference_events)


@pytest.mark.parametrize("reference_events", (True, False))
@pytest.mark.parametrize("name", ("checkfree", "checkpoint"))
def test_a_survivors_restart_longer_than_the_join_delays_the_run_by_the_difference(name: str, reference_events: bool) -> None:
    without = _run(_scenario(0.0), name, reference_events=reference_events)
    longer = _run(_scenario(JOIN_DELAY_S + 12.0), name, reference_events=reference_events)
    assert without.badput["survivor_restart_s"] == 0.0
    assert longer.badput["survivor_restart_s"] == pytest.approx(JOIN_DELAY_S + 12.0, rel=1e-12)
    # The join delay ran during the survivors' restart: what the run waits in all grows by 12 s.
    assert longer.wall_clock_s - without.wall_clock_s == pytest.approx(12.0, rel=1e-9)
    assert longer.badput["recovery_downtime_s"] == pytest.approx(without.badput["recovery_downtime_s"] - JOIN_DELAY_S, rel=1e-9)
    # The survivors lose the iteration in flight, as before: half an iteration.
    assert longer.badput["lost_work_s"] == pytest.approx(without.badput["lost_work_s"], rel=1e-12)


@pytest.mark.parametrize("reference_events", (True, False))
def test_a_survivors_restart_within_the_join_delay_moves_time_between_categories_only(reference_events: bool) -> None:
    without = _run(_scenario(0.0), "checkfree", reference_events=reference_events)
    shorter = _run(_scenario(10.0), "checkfree", reference_events=reference_events)
    assert shorter.wall_clock_s == pytest.approx(without.wall_clock_s, rel=1e-12)
    assert shorter.badput["survivor_restart_s"] == pytest.approx(10.0, rel=1e-12)
    assert shorter.badput["recovery_downtime_s"] == pytest.approx(without.badput["recovery_downtime_s"] - 10.0, rel=1e-9)


@pytest.mark.parametrize("failure_mode, launch", (("soft", "agent"), ("hard", "in_process")))
def test_nothing_is_charged_for_soft_failures_or_survivors_that_keep_running(failure_mode: str, launch: str) -> None:
    scenario = _scenario(50.0, failure_mode=failure_mode, launch=launch)
    assert scenario.survivor_restart_charged_s == 0.0
    charged = _run(scenario, "checkfree", reference_events=True)
    plain = _run(_scenario(0.0), "checkfree", reference_events=True)
    assert charged.badput["survivor_restart_s"] == 0.0 and charged.wall_clock_s == plain.wall_clock_s


def test_a_failure_during_the_survivors_restart_restarts_them_again() -> None:
    scenario = _scenario(JOIN_DELAY_S + 12.0)
    first_s = 5.5 * CLOSED_FORM_ITERATION_S
    failures = (failure(first_s, 1), failure(first_s + 20.0, 2))
    results = [simulate_run(scenario, method("checkfree"), failures, iteration_model=MODEL, reference_events=flag) for flag in (True, False)]
    for result in results:
        # 20 s of the first restart, then a whole second one.
        assert result.badput["survivor_restart_s"] == pytest.approx(20.0 + JOIN_DELAY_S + 12.0, rel=1e-12)
    assert results[0].wall_clock_s == pytest.approx(results[1].wall_clock_s, rel=1e-12)


@pytest.mark.parametrize("reference_events", (True, False))
def test_a_replica_healed_from_a_survivor_costs_the_survivors_restart_too(reference_events: bool) -> None:
    # Under the agent every worker restarts on any death: a lost replica's heal waits for it as a
    # stage loss does, once per loss, and the heal's join delay runs meanwhile.
    from churnsim.calibration.failure_sampling import FailureEvent

    def data_parallel(survivor_restart_s: float):
        scenario = _scenario(survivor_restart_s)
        return scenario.model_copy(update={"pipeline": scenario.pipeline.model_copy(update={"data_parallel_degree": 2})})

    replica_losses = tuple(
        FailureEvent(time_s=time_s, stage=1, replica=1, kind="poisson")
        for time_s in (5.5 * CLOSED_FORM_ITERATION_S, 12.5 * CLOSED_FORM_ITERATION_S)
    )
    results = {
        restart_s: simulate_run(data_parallel(restart_s), method("checkfree"), replica_losses, iteration_model=MODEL, reference_events=reference_events)
        for restart_s in (0.0, 7.0)
    }
    assert [loss.handled_as for loss in results[7.0].failures] == ["replica_heal", "replica_heal"]
    assert results[0.0].badput["survivor_restart_s"] == 0.0
    assert results[7.0].badput["survivor_restart_s"] == pytest.approx(2 * 7.0, rel=1e-12)
    assert results[7.0].wall_clock_s > results[0.0].wall_clock_s
