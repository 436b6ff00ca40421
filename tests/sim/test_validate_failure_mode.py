"""Recovery costs per failure mode: the fit reads a hard failure's join, process start and rendezvous
apart from a soft failure's reset in place, and the validator charges a run its own mode. Synthetic
real-run records of the built-in calibration's setup, no torch."""

from __future__ import annotations

import pytest
from real_run_records import CALIBRATION, FAILURES, JOIN_DELAY_S, PROCESS_START_S, RENDEZVOUS_S, SOFT_JOIN_S, TRANSFER_S
from real_run_records import real_record as _record

from churnsim.calibration.apply import apply_calibration, recovery_for_failure_mode
from churnsim.calibration.fit_timing import fit_recovery_times
from churnsim.calibration.presets import cpu_tiny
from churnsim.calibration.run_record import record_failure_mode
from churnsim.calibration.scenario import RecoverySpec, TrainingSpec
from churnsim.sim.checks.validate import validate_record

HARD_TABLE = fit_recovery_times([_record("fit-hard", hard=True)], failure_mode="hard")
WITH_HARD = CALIBRATION.model_copy(update={"hard_failure_recovery": HARD_TABLE})


def test_a_run_s_failure_mode_is_read_from_its_settings_else_from_its_spans():
    assert record_failure_mode(_record("a", hard=True)) == "hard"
    assert record_failure_mode(_record("b", hard=True, say_mode=False)) == "hard"  # the rendezvous says so
    assert record_failure_mode(_record("c", hard=False, say_mode=False)) == "soft"
    assert record_failure_mode(_record("d", hard=False)) == "soft"


def test_the_fit_reads_hard_failures_join_process_start_and_rendezvous_apart_from_soft_ones():
    records = [_record("hard", hard=True), _record("soft", hard=False)]
    hard = fit_recovery_times(records, failure_mode="hard")["checkfree"]
    soft = fit_recovery_times(records, failure_mode="soft")["checkfree"]
    assert hard.num_samples == soft.num_samples == len(FAILURES)
    assert hard.join_s == pytest.approx(JOIN_DELAY_S + PROCESS_START_S)
    assert hard.process_start_s == pytest.approx(PROCESS_START_S)
    assert hard.rendezvous_s == pytest.approx(RENDEZVOUS_S)
    assert soft.join_s == pytest.approx(SOFT_JOIN_S) and soft.rendezvous_s == 0.0 and soft.process_start_s == 0.0
    for times in (hard, soft):
        assert times.transfer_s == pytest.approx(TRANSFER_S) and times.unrecorded_s == pytest.approx(0.0, abs=1e-9)
    # A record that does not say its join delay has no process start to give: only the whole join.
    unsaid = fit_recovery_times([_record("unsaid", hard=True, say_mode=False)], failure_mode="hard")["checkfree"]
    assert unsaid.process_start_s == 0.0 and unsaid.join_s == pytest.approx(JOIN_DELAY_S + PROCESS_START_S)


def test_a_hard_failure_scenario_is_charged_its_join_delay_the_process_start_and_the_rendezvous():
    soft = recovery_for_failure_mode(RecoverySpec(join_delay_s=30.0, restart_s=6.6), WITH_HARD, "soft", 30.0)
    hard = recovery_for_failure_mode(RecoverySpec(join_delay_s=30.0, restart_s=6.6), WITH_HARD, "hard", 30.0)
    assert hard.join_delay_s == pytest.approx(30.0 + PROCESS_START_S)
    assert hard.restart_s_for("checkfree") == pytest.approx(RENDEZVOUS_S)
    assert soft.join_delay_s < 0.01 and soft.restart_s_for("checkfree") == pytest.approx(CALIBRATION.recovery["checkfree"].unrecorded_s)
    # Methods measured only under soft failures keep their soft restart.
    assert hard.restart_s_for("checkpoint") == soft.restart_s_for("checkpoint")
    scenario = cpu_tiny()
    scenario = scenario.model_copy(update={"training": TrainingSpec(failure_mode="hard", join_delay_s=2.0)})
    assert apply_calibration(scenario, WITH_HARD, mode="full").recovery.join_delay_s == pytest.approx(2.0 + PROCESS_START_S)


def _predicted_wall_s(record, calibration):
    validation = validate_record(record, calibration)
    rows = validation.rows.set_index("quantity")
    return float(rows.loc["total_wall_clock_s", "predicted"]), validation.notes


def test_hard_failure_spans_in_a_run_record_change_its_prediction_by_what_they_cost():
    soft_s, _ = _predicted_wall_s(_record("held-out", hard=False), WITH_HARD)
    hard_s, notes = _predicted_wall_s(_record("held-out", hard=True), WITH_HARD)
    spans_only_s, _ = _predicted_wall_s(_record("held-out", hard=True, say_mode=False), WITH_HARD)
    # Per failure: the join from the run's configured delay plus the measured process start, against
    # the soft reset; the rendezvous (+ its unrecorded rest) against the soft restart.
    soft_recovery, hard_recovery = CALIBRATION.recovery, HARD_TABLE["checkfree"]
    soft_join_s = recovery_for_failure_mode(RecoverySpec(), CALIBRATION, "soft").join_delay_s
    per_failure_s = (JOIN_DELAY_S + hard_recovery.process_start_s - soft_join_s) + (
        hard_recovery.rendezvous_s + hard_recovery.unrecorded_s - soft_recovery["checkfree"].unrecorded_s
    )
    assert hard_s - soft_s == pytest.approx(len(FAILURES) * per_failure_s, rel=0.1)
    # Without its join delay the record is charged the measured join whole: the same here.
    assert spans_only_s == pytest.approx(hard_s, rel=1e-3)
    assert not any("soft-failure prices" in note for note in notes)


def test_a_calibration_without_hard_failures_charges_soft_prices_and_says_so():
    hard_s, notes = _predicted_wall_s(_record("held-out", hard=True), CALIBRATION)
    soft_s, _ = _predicted_wall_s(_record("held-out", hard=False), CALIBRATION)
    assert hard_s == pytest.approx(soft_s, rel=1e-9)
    assert any("charged at soft-failure prices" in note and "calibrate with hard-failure runs" in note for note in notes)


@pytest.mark.parametrize("cap", [2, 64])
def test_a_run_that_reached_its_launcher_s_replacement_cap_is_said_to_have(cap):
    scenario = cpu_tiny()
    scenario = scenario.model_copy(update={"recovery": scenario.recovery.model_copy(update={"max_replacements": cap})})
    _, notes = _predicted_wall_s(_record("capped", hard=True, scenario=scenario), WITH_HARD)
    said = [note for note in notes if "recovery.max_replacements" in note]
    assert said == ([f"run 'capped' had {len(FAILURES)} hard failures, as many as its launcher replaces (recovery.max_replacements 2): "
                     "a real run ends there, the simulator's replay does not"] if cap <= len(FAILURES) else [])  # fmt: skip


def _agent_costs(process_start_s: float):
    """Hard-failure components fitted from a recoveries.csv under torchrun's agent (one stage lost per row)."""
    import json

    import pandas as pd

    from churnsim.calibration.hard_failure_costs import agent_recovery_points, fit_hard_failure_costs

    rows = [
        {
            "failure_mode": "hard", "failed_stages": json.dumps([stage]), "degraded": False, "rendezvous_s": RENDEZVOUS_S,
            "transfer_s": TRANSFER_S, "network_bytes": 1e5, "detection_s": 0.05, "agent_restart_s": 0.2,
            "process_start_s": process_start_s + 0.01, "survivor_reload_s": 0.01, "survivor_reload_bytes": 1e6,
            "survivor_restart_s": 0.2 + process_start_s + 0.01,
        }
        for stage in (1, 2, 1)
    ]  # fmt: skip
    # Measured on the calibrated setup: its processes shared its cores.
    return fit_hard_failure_costs(
        [agent_recovery_points(pd.DataFrame(rows), CALIBRATION.model, CALIBRATION.pipeline, CALIBRATION.compute_model.shared_cores)]
    )


def test_the_survivors_restart_fitted_from_agent_recoveries_changes_a_hard_run_s_prediction_by_what_it_costs():
    held_out = _record("held-out", hard=True)
    before_s, _ = _predicted_wall_s(held_out, WITH_HARD)
    costs = _agent_costs(process_start_s=1.5)
    with_costs = WITH_HARD.model_copy(update={"hard_failure_costs": costs})
    after_s, notes = _predicted_wall_s(held_out, with_costs)
    survivors_s = costs.survivor_restart_s(CALIBRATION.model, CALIBRATION.pipeline, CALIBRATION.compute_model.shared_cores)
    assert survivors_s == pytest.approx(0.05 + 0.2 + 1.5 + costs.survivor_reload.seconds_for(1.0), abs=0.02)
    # The replacement's join (configured delay + process start) runs during the survivors' restart.
    per_failure_s = survivors_s - (JOIN_DELAY_S + HARD_TABLE["checkfree"].process_start_s)
    assert after_s - before_s == pytest.approx(len(FAILURES) * per_failure_s, rel=0.05)
    # Slower process starts in the calibration's records: a slower prediction of the same run.
    slower_s, _ = _predicted_wall_s(held_out, WITH_HARD.model_copy(update={"hard_failure_costs": _agent_costs(process_start_s=3.0)}))
    assert slower_s - after_s == pytest.approx(len(FAILURES) * 1.5, rel=0.05)
    # A soft run is charged no survivors' restart whatever the calibration holds.
    soft = _record("held-out", hard=False)
    assert _predicted_wall_s(soft, with_costs)[0] == pytest.approx(_predicted_wall_s(soft, WITH_HARD)[0], rel=1e-12)
    assert not any("survivors' restart" in note for note in notes)


def test_a_calibration_with_hard_failures_but_no_agent_components_says_the_survivors_restart_is_not_charged():
    _, notes = _predicted_wall_s(_record("held-out", hard=True), WITH_HARD)
    assert any("survivors' restart under torchrun's agent is not charged" in note for note in notes)


def test_a_failure_that_fell_due_during_an_earlier_one_s_restart_is_replayed_after_it():
    """Under torchrun's agent a kill scheduled during another kill's restart fires at the same step,
    seconds later: the replay places it after the first recovery, where it costs its own restart."""
    import dataclasses

    from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
    from churnsim.sim.model.calibrated import failure_rounds

    base = _record("same-step", hard=True, failures=((10, 1),))
    first_s = base.failures.failures[0].time_s

    def with_failures(*times_and_stages):
        failures = tuple(ScheduledFailure(time_s=time_s, iteration=10, stage=stage, kind="stage_failure") for time_s, stage in times_and_stages)
        return dataclasses.replace(base, failures=FailureSchedule(failures=failures))

    apart = with_failures((first_s, 1), (first_s + 5.0, 2))
    together = with_failures((first_s, 1), (first_s, 2))
    assert [len(group) for group in failure_rounds(list(apart.failures.failures), 0.075)] == [1, 1]
    assert [len(group) for group in failure_rounds(list(together.failures.failures), 0.075)] == [2]
    calibration = WITH_HARD.model_copy(update={"hard_failure_costs": _agent_costs(process_start_s=1.5)})
    survivors_s = calibration.hard_failure_costs.survivor_restart_s(CALIBRATION.model, CALIBRATION.pipeline, CALIBRATION.compute_model.shared_cores)
    apart_s, _ = _predicted_wall_s(apart, calibration)
    together_s, _ = _predicted_wall_s(together, calibration)
    assert apart_s - together_s == pytest.approx(survivors_s, rel=0.1)
