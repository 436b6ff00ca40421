"""Time accounting over many runs: every badput category is ≥ 0 and goodput + badput = wall-clock."""

from __future__ import annotations

import pytest

from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.calibration.presets import preset
from churnsim.sim.model.accounting import Ledger, split_time
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.results import BADPUT_CATEGORIES
from churnsim.sim.model.run import simulate_run

MODEL = IterationModel()
REPLICATIONS = range(6)


def geo_scenario(rate: float):
    """The WAN testbed, where a stage run by its predecessor's node can skip a slow link."""
    scenario = preset("checkfree-500m-geo-10pct", {"pipeline.replicas_fail_together": True})  # every failure a stage loss
    return scenario.model_copy(update={"churn": StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=rate)})


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_category_is_non_negative_and_they_add_up_to_the_wall_clock(method):
    scenario = geo_scenario(0.33)
    for replication in REPLICATIONS:
        failures = failures_for_replication(scenario, replication=replication)
        result = simulate_run(scenario, method_from_name(method), failures, replication=replication, iteration_model=MODEL)
        assert tuple(result.badput) == BADPUT_CATEGORIES
        for category, seconds in {"goodput_s": result.goodput_s, **result.badput}.items():
            assert seconds >= -1e-6 * result.wall_clock_s, f"{method} r{replication}: {category} = {seconds} s"
        total_s = result.goodput_s + sum(result.badput.values())
        assert total_s == pytest.approx(result.wall_clock_s, rel=1e-9), f"{method} r{replication}"


def test_redundant_runs_on_the_wan_testbed_train_degraded_and_book_less_communication():
    # The case that once gave a negative degraded_slowdown_s: the runs above must include it.
    scenario = geo_scenario(0.33)
    reference = simulate_run(scenario, method_from_name("none"), (), iteration_model=MODEL)
    saw_degraded_training = False
    for replication in REPLICATIONS:
        failures = failures_for_replication(scenario, replication=replication)
        result = simulate_run(scenario, method_from_name("redundant"), failures, replication=replication, iteration_model=MODEL)
        degraded = [event for event in result.timeline if event.category == "degraded" and event.name == "degraded training"]
        saw_degraded_training |= bool(degraded)
        # The saving is communication not waited for: it is below the no-failure run's per useful iteration.
        per_iteration_s = result.badput["communication_s"] / result.progress_iterations
        assert per_iteration_s <= reference.badput["communication_s"] / reference.progress_iterations + 1e-9
    assert saw_degraded_training


def split(bookings, *, progress, compute_only_s, bubble_fraction, wall_clock_s):
    """split_time of a run that trained `bookings` ((seconds, iteration time) pairs), healthy at 10 s."""
    ledger = Ledger()
    ledger.iterations_executed = progress
    for seconds, iteration_time_s in bookings:
        ledger.book_training(seconds, iteration_time_s)
    return split_time(
        ledger,
        progress_iterations=progress,
        healthy_iteration_time_s=10.0,
        reference_iteration_time_s=10.0,
        compute_only_iteration_time_s=compute_only_s,
        compute_only_bubble_fraction=bubble_fraction,
        wall_clock_s=wall_clock_s,
    )


def test_a_state_faster_than_healthy_lowers_communication_and_books_no_slowdown():
    # 8 iterations healthy, 2 in a state 4 s faster.
    goodput_s, badput = split([(8 * 10.0, 10.0), (2 * 6.0, 6.0)], progress=10, compute_only_s=2.0, bubble_fraction=0.5, wall_clock_s=92.0)
    assert goodput_s == pytest.approx(10.0)
    assert badput["bubble_s"] == pytest.approx(10.0)
    assert badput["degraded_slowdown_s"] == 0.0
    assert badput["communication_s"] == pytest.approx(10 * 8.0 - 2 * 4.0)


def test_a_state_slower_than_healthy_is_degraded_slowdown():
    goodput_s, badput = split([(2 * 10.0, 10.0), (2 * 15.0, 15.0)], progress=4, compute_only_s=10.0, bubble_fraction=0.0, wall_clock_s=50.0)
    assert goodput_s == pytest.approx(40.0)
    assert badput["degraded_slowdown_s"] == pytest.approx(10.0)
    assert badput["communication_s"] == pytest.approx(0.0)


def test_links_that_make_an_iteration_faster_on_shared_cores_take_the_saving_off_the_bubble():
    # Compute alone 10.5 s an iteration (half bubble), with links 10 s: the links reordered who
    # waited for a core. Communication is 0, the 0.5 s an iteration comes off the bubble.
    goodput_s, badput = split([(4 * 10.0, 10.0)], progress=4, compute_only_s=10.5, bubble_fraction=0.5, wall_clock_s=40.0)
    assert goodput_s == pytest.approx(21.0)
    assert badput["communication_s"] == 0.0
    assert badput["bubble_s"] == pytest.approx(21.0 - 4 * 0.5)
    assert goodput_s + sum(badput.values()) == pytest.approx(40.0)


def test_a_method_route_faster_than_the_plain_pipeline_on_shared_cores_books_no_negative_overhead():
    """cpu-tiny with a 0.5 s embedding backward: CheckFree+'s swapped route ran 5 ms an iteration
    faster than the plain pipeline, and the run failed an assertion of this module."""
    scenario = preset("cpu-tiny")
    compute = scenario.compute.model_copy(update={"embedding_backward_s": 0.5})
    scenario = scenario.model_copy(update={"compute": compute})
    result = simulate_run(scenario, method_from_name("checkfree_plus"), (), iteration_model=MODEL)
    assert min(result.goodput_s, *result.badput.values()) >= 0.0
    assert result.goodput_s + sum(result.badput.values()) == pytest.approx(result.wall_clock_s, rel=1e-9)
