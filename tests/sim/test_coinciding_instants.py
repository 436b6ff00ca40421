"""Instants that coincide exactly: a failure at the instant something else ends comes first, in both
engines (sim/model/run.py, "Coinciding instants"), and training is labelled by the state it ran in.

Trace replays remove nodes at whole minutes; with round hop times failures land exactly on
takeovers, replica arrivals and chunk ends. These pin the order the differential test
(test_closed_form_equivalence.py) only meets by chance.
"""

from __future__ import annotations

import pytest

from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.methods.base import stage_weight_bytes
from churnsim.sim.model.run import simulate_run_and_policy

from sim_run_scenarios import failure, method, small_scenario, tiers

MODEL = IterationModel()
# A power of two, so that every transfer's end is exact in binary and a failure can be put on it.
LINK_BYTES_PER_S = 2.0**14
JOIN_DELAY_S = 30.0
RESTART_S = 5.0
FIRST_FAILURE_S = 300.0
READY_S = FIRST_FAILURE_S + JOIN_DELAY_S + RESTART_S


def _both_engines(scenario, name: str, failures):
    """The event model's result and the closed form's, for one method on one failure path."""
    return tuple(
        simulate_run_and_policy(scenario, method(name), tuple(failures), iteration_model=MODEL, reference_events=reference).result
        for reference in (True, False)
    )


def _scenario_with_a_deeper_third_stage():
    """Five stages, the third of two layers: a replacement of stage 1 takes over (stage 1's weights)
    before its replica of stage 2 (twice the bytes) arrives."""
    scenario = small_scenario(num_stages=5, link_bandwidth=LINK_BYTES_PER_S, join_delay_s=JOIN_DELAY_S, restart_s=RESTART_S)
    return scenario.model_copy(
        update={
            "model": scenario.model.model_copy(update={"num_layers": 6}),
            "pipeline": scenario.pipeline.model_copy(update={"layers_per_stage": (1, 1, 2, 1, 1)}),
        }
    )


def test_a_failure_at_the_instant_a_replacement_takes_over_finds_it_not_taken_over():
    scenario = _scenario_with_a_deeper_third_stage()
    takeover_s = READY_S + stage_weight_bytes(scenario, 1) / LINK_BYTES_PER_S
    for result in _both_engines(scenario, "redundant", [failure(FIRST_FAILURE_S, 1), failure(takeover_s, 1)]):
        assert [(f.time_s, f.handled_as) for f in result.failures] == [(FIRST_FAILURE_S, "degraded"), (takeover_s, "replacement_lost")]
        # The second replacement starts over from the second failure: node 0 runs stage 1 until then.
        degraded = [(event.start_s, event.end_s) for event in result.timeline if event.name == "stage 1 run by node 0"]
        assert degraded == [(takeover_s, pytest.approx(takeover_s + JOIN_DELAY_S + RESTART_S + stage_weight_bytes(scenario, 1) / LINK_BYTES_PER_S))]


def test_a_replica_arriving_as_its_stage_fails_has_not_arrived():
    scenario = _scenario_with_a_deeper_third_stage()
    takeover_s = READY_S + stage_weight_bytes(scenario, 1) / LINK_BYTES_PER_S
    replica_s = READY_S + stage_weight_bytes(scenario, 2) / LINK_BYTES_PER_S
    assert takeover_s < replica_s
    arrives_first, arrives_at_once = (
        _both_engines(scenario, "redundant", [failure(FIRST_FAILURE_S, 1), failure(time_s, 2)])
        for time_s in (replica_s + 1.0, replica_s)
    )
    for result in arrives_first:  # the replica is there: node 1 takes stage 2 over
        assert [f.handled_as for f in result.failures] == ["degraded", "degraded"]
    for result in arrives_at_once:  # nobody holds stage 2 yet: back to the checkpoint
        assert [f.handled_as for f in result.failures] == ["degraded", "fatal_restart"]


def test_training_stopped_by_a_takeover_is_labelled_by_the_state_it_ran_in():
    scenario = _scenario_with_a_deeper_third_stage()
    takeover_s = READY_S + stage_weight_bytes(scenario, 1) / LINK_BYTES_PER_S
    for result in _both_engines(scenario, "redundant", [failure(FIRST_FAILURE_S, 1)]):
        training = [(event.name, event.start_s, event.end_s) for event in result.timeline if event.category in ("train", "degraded") and event.stage == -1]
        # The chunk the failure interrupted ran degraded until the takeover stopped it, healthy after.
        degraded = [(start_s, end_s) for name, start_s, end_s in training if name == "degraded training"]
        assert degraded == [(FIRST_FAILURE_S, takeover_s)]
        assert any(name == "train" and start_s == takeover_s for name, start_s, _ in training)


def test_a_checkpoint_becoming_durable_as_a_failure_strikes_is_not_the_restore_point():
    # A remote tier at a power-of-two bandwidth; checkpoint 2 (10 iterations) reaches it mid-run.
    scenario = small_scenario(storage=tiers(remote_bandwidth=2.0**16), target_iterations=40)
    lazy = method("async_checkpoint", interval_iterations=5)
    no_failure = simulate_run_and_policy(scenario, lazy, (), iteration_model=MODEL).result
    (durable_s,) = [event.end_s for event in no_failure.timeline if event.name == "checkpoint 2 durable at remote"]
    for failure_s, restored in ((durable_s + 1.0, 10.0), (durable_s, 5.0)):
        for reference in (True, False):
            result = simulate_run_and_policy(scenario, lazy, (failure(failure_s, 1),), iteration_model=MODEL, reference_events=reference).result
            after = [progress for time_s, progress in result.trajectory if time_s == failure_s]
            assert after[-1] == restored, (failure_s - durable_s, reference)
