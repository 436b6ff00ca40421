"""Data parallelism in the simulator (sim/model/replicas.py): heals from a surviving replica, pauses
and smaller batches while nodes are missing, stage losses handed to the method as at D = 1.

Failure paths are written by hand (FailureEvent with a replica), in both engines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from churnsim.calibration.churn import NoChurn
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve, iteration_worth
from churnsim.calibration.failure_sampling import FailureEvent
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.replica_rule import stage_loss_rate_per_s
from churnsim.calibration.scenario import (
    ExplicitCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    StorageTier,
    TargetSpec,
    UniformNetwork,
)
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.pipeline_state import build_pipeline_state
from churnsim.sim.model.run import simulate_run, simulate_run_and_policy

JOIN_DELAY_S = 37.0
ALLREDUCE_BANDWIDTH = 2e6
ALLREDUCE_LATENCY_S = 0.013
TARGET = 200


def _scenario(degree: int, *, mode: str = "continue", batch_model: bool = False, sharding: str = "whole_stage", allreduce_free: bool = False,
              together: bool = False, num_stages: int = 4, target: int = TARGET, deadline_s: float = 10**6, methods=("checkpoint",),
              join_delay_s: float = JOIN_DELAY_S) -> Scenario:
    model = ModelSpec(num_layers=num_stages, hidden_size=64, num_heads=4, vocab_size=3000, sequence_length=16)
    pipeline = PipelineSpec(num_stages=num_stages, schedule="1f1b", microbatch_size=1, num_microbatches=2, data_parallel_degree=degree,
                            while_replica_missing=mode, checkpoint_sharding=sharding, replicas_fail_together=together)
    tokens = model.sequence_length * pipeline.microbatch_size * pipeline.num_microbatches * degree
    convergence = ConvergenceSpec(
        baseline=PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5),
        **({"baseline_tokens_per_iteration": float(tokens), "critical_batch_tokens": 3.0 * tokens} if batch_model else {}),
    )
    return Scenario(
        name="data-parallel",
        model=model,
        pipeline=pipeline,
        compute=ExplicitCompute(block_forward_s=1.0, block_backward_s=2.0, optimizer_step_s=0.0),
        network=UniformNetwork(
            latency_s=0.003, bandwidth_bytes_per_s=3e5,
            allreduce_bandwidth_bytes_per_s=math.inf if allreduce_free else ALLREDUCE_BANDWIDTH,
            allreduce_latency_s=0.0 if allreduce_free else ALLREDUCE_LATENCY_S,
        ),
        storage=(StorageTier(name="remote", write_bandwidth_bytes_per_s=1e6, read_bandwidth_bytes_per_s=1.5e6, latency_s=0.2, survives_node_loss=True),),
        churn=NoChurn(kind="none"),
        recovery=RecoverySpec(join_delay_s=join_delay_s, restart_s=5.0),
        methods=tuple(method_from_name(name, **({"interval_iterations": 10**6} if name == "checkpoint" else {})) for name in methods),
        convergence=convergence,
        target=TargetSpec(iterations=target, max_wall_clock_s=deadline_s),
    )


def _iteration_s(scenario: Scenario) -> float:
    return IterationModel().iteration_time_s(build_pipeline_state(scenario))


def _loss(time_s: float, stage: int, replica: int) -> FailureEvent:
    return FailureEvent(time_s=time_s, stage=stage, replica=replica, kind="poisson")


def _both(scenario, method, failures):
    reference = simulate_run_and_policy(scenario, method, failures, reference_events=True)
    closed_form = simulate_run_and_policy(scenario, method, failures)
    assert closed_form.engine == "closed_form"
    assert closed_form.result.wall_clock_s == pytest.approx(reference.result.wall_clock_s, rel=1e-9)
    assert closed_form.result.badput == pytest.approx(reference.result.badput, rel=1e-9, abs=1e-9)
    return reference.result, closed_form.result


def _copy_s(scenario: Scenario, stage: int) -> float:
    """A heal's copy: weights and optimizer state (whole stage) over the all-reduce link, one latency."""
    stage_bytes = scenario.stage_parameters(stage) * scenario.model.checkpoint_bytes_per_parameter
    return ALLREDUCE_LATENCY_S + stage_bytes / ALLREDUCE_BANDWIDTH


# ----------------------------------------------------------------------------- a replica loss
def test_a_replica_loss_under_wait_pauses_for_the_join_and_the_copy_exactly():
    scenario = _scenario(2, mode="wait")
    method = scenario.methods[0]
    iteration_s = _iteration_s(scenario)
    failure_s = 10.5 * iteration_s  # in the middle of iteration 11: that half is lost
    for result in _both(scenario, method, (_loss(failure_s, 1, 1),)):
        pause_s = JOIN_DELAY_S + _copy_s(scenario, 1)
        assert result.reached_target
        assert result.wall_clock_s == pytest.approx(TARGET * iteration_s + 0.5 * iteration_s + pause_s, rel=1e-12)
        assert result.badput["replica_heal_s"] == pytest.approx(pause_s, rel=1e-12)
        assert result.badput["lost_work_s"] == pytest.approx(0.5 * iteration_s, rel=1e-9)
        assert result.badput["recovery_downtime_s"] == 0.0 and result.badput["convergence_setback_s"] == 0.0
        assert [(f.stage, f.replica, f.handled_as) for f in result.failures] == [(1, 1, "replica_heal")]
        heals = [event for event in result.timeline if event.name == "replica heal"]
        assert [(h.stage, h.track, h.start_s) for h in heals] == [(1, "stage 1 replica 1", failure_s)]
        assert heals[0].end_s == pytest.approx(failure_s + pause_s, rel=1e-12)


@pytest.mark.parametrize("batch_model", (False, True))
def test_a_replica_loss_under_continue_trains_at_the_batch_models_share(batch_model):
    degree = 4
    scenario = _scenario(degree, mode="continue", batch_model=batch_model)
    method = scenario.methods[0]
    iteration_s = _iteration_s(scenario)
    failure_s = 10.5 * iteration_s
    heal_s = JOIN_DELAY_S + _copy_s(scenario, 2)
    # Three of four replica pipelines train: 3/4 of the global batch. Under the batch model
    # (McCandlish et al.: S(B) = S_min (1 + B_noise / B)) an iteration is worth S(B) / S(3B/4) of a full
    # one; with no batch named, its small-batch limit 3/4.
    tokens = scenario.tokens_per_iteration
    worth = iteration_worth(0.75 * tokens, reference_tokens=tokens, critical_tokens=3.0 * tokens) if batch_model else 0.75
    assert 0.5 < worth < 1.0
    for result in _both(scenario, method, (_loss(failure_s, 2, 3),)):
        # Up to the loss: 10 iterations (the 11th lost); during the heal, heal_s · worth / T of them;
        # then full speed for the rest.
        expected_s = failure_s + heal_s + (TARGET - 10 - heal_s * worth / iteration_s) * iteration_s
        assert result.wall_clock_s == pytest.approx(expected_s, rel=1e-12)
        assert result.badput["replica_heal_s"] == pytest.approx(heal_s * (1.0 - worth), rel=1e-9)
        shrunk = [event for event in result.timeline if event.name == "training with fewer replicas"]
        assert shrunk and shrunk[0].start_s == pytest.approx(failure_s) and shrunk[-1].end_s == pytest.approx(failure_s + heal_s, rel=1e-12)


def test_a_heal_whose_source_dies_copies_again_from_the_next_survivor():
    scenario = _scenario(3, mode="wait")
    method = scenario.methods[0]
    iteration_s = _iteration_s(scenario)
    copy_s = _copy_s(scenario, 0)
    first_s = 5.25 * iteration_s
    # Replica 0 heals from replica 1, which dies once replica 0's node has joined: the copy starts again
    # from replica 2, and replica 1 heals from it too.
    second_s = first_s + JOIN_DELAY_S + 0.5 * copy_s
    for result in _both(scenario, method, (_loss(first_s, 0, 0), _loss(second_s, 0, 1))):
        assert [f.handled_as for f in result.failures] == ["replica_heal", "replica_heal"]
        ends = {event.track: event.end_s for event in result.timeline if event.name == "replica heal"}
        assert ends["stage 0 replica 0"] == pytest.approx(second_s + copy_s, rel=1e-12)
        assert ends["stage 0 replica 1"] == pytest.approx(second_s + JOIN_DELAY_S + copy_s, rel=1e-12)
        assert result.badput["replica_heal_s"] == pytest.approx(second_s + JOIN_DELAY_S + copy_s - first_s, rel=1e-9)


def test_zero1_heals_copy_weights_and_read_the_shard_or_pay_a_setback():
    from churnsim.sim.model.replicas import REINITIALISED_SHARD_SETBACK_ITERATIONS

    scenario = _scenario(2, mode="wait", sharding="data_parallel", methods=("checkpoint", "checkfree"))
    checkpoint, checkfree = scenario.methods
    iteration_s = _iteration_s(scenario)
    failure_s = 10.5 * iteration_s
    weights_s = ALLREDUCE_LATENCY_S + scenario.stage_parameters(1) * scenario.model.weight_bytes_per_parameter / ALLREDUCE_BANDWIDTH
    shard_s = 0.2 + scenario.stage_parameters(1) * scenario.model.checkpoint_bytes_per_parameter / 2 / 1.5e6
    for result in _both(scenario, checkpoint, (_loss(failure_s, 1, 1),)):  # the shard from the checkpoint tier
        assert result.badput["replica_heal_s"] == pytest.approx(JOIN_DELAY_S + max(weights_s, shard_s), rel=1e-12)
        assert result.badput["convergence_setback_s"] == 0.0
    for result in _both(scenario, checkfree, (_loss(failure_s, 1, 1),)):  # the shard restarts: a setback
        assert result.badput["replica_heal_s"] == pytest.approx(JOIN_DELAY_S + weights_s, rel=1e-12)
        assert result.badput["convergence_setback_s"] == pytest.approx(REINITIALISED_SHARD_SETBACK_ITERATIONS * result.healthy_iteration_time_s)
        assert any("ZeRO-1" in note and "uncalibrated" in note for note in result.notes)


# ----------------------------------------------------------------------------- a stage loss
@pytest.mark.parametrize("join_delay_s", (JOIN_DELAY_S, 0.0))
@pytest.mark.parametrize("name", ("checkpoint", "checkfree", "redundant", "copy"))
def test_a_stage_loss_at_d2_is_handled_as_the_same_loss_at_d1(name, join_delay_s):
    """With free all-reduces the D = 2 pipeline times its iterations as the D = 1 one; when the replicas
    fail together (one event per replica, as the sampler draws them) every loss is one stage loss, and
    the run is the D = 1 run to the bit, with no join delay too."""
    failures_d1 = (_loss(30.3, 1, 0), _loss(95.0, 2, 0), _loss(96.5, 1, 0))
    failures_d2 = tuple(_loss(f.time_s, f.stage, replica) for f in failures_d1 for replica in (0, 1))
    single = _scenario(1, allreduce_free=True, methods=(name,), join_delay_s=join_delay_s)
    together = _scenario(2, allreduce_free=True, together=True, methods=(name,), join_delay_s=join_delay_s)
    assert _iteration_s(single) == _iteration_s(together)
    one = simulate_run(single, single.methods[0], failures_d1)
    two_reference, two = _both(together, together.methods[0], failures_d2)
    assert two.wall_clock_s == one.wall_clock_s and two.badput == one.badput and tuple(two.trajectory) == tuple(one.trajectory)
    handled_d2 = [f for f in two.failures if f.replica == 0]
    assert [(f.stage, f.handled_as, f.time_s) for f in handled_d2] == [(f.stage, f.handled_as, f.time_s) for f in one.failures]
    assert {f.handled_as for f in two.failures if f.replica == 1} == {"already_down"}  # the same node loss, its other half
    if join_delay_s == 0:
        return  # with free copies a heal takes no time: no second loss falls within it
    # Independent failures: the first replica's loss heals, the second's (within the heal) is the stage loss.
    apart = _scenario(2, allreduce_free=True, methods=(name,), join_delay_s=join_delay_s)
    _, result = _both(apart, apart.methods[0], (_loss(30.3, 1, 0), _loss(31.3, 1, 1)))
    assert [f.handled_as for f in result.failures][0] == "replica_heal"
    assert result.failures[1].handled_as == one.failures[0].handled_as
    assert any(event.name == "replica heal (abandoned)" for event in result.timeline)


def test_one_replica_is_the_pipeline_of_before():
    """D = 1: every loss goes to the policy, nothing is paused or shrunk, no heal is recorded."""
    scenario = _scenario(1, methods=("checkpoint", "checkfree"))
    failures = (_loss(30.3, 1, 0), _loss(95.0, 2, 0))
    for method in scenario.methods:
        for result in _both(scenario, method, failures):
            assert result.badput["replica_heal_s"] == 0.0
            assert all(f.handled_as != "replica_heal" and f.replica == 0 for f in result.failures)


# ----------------------------------------------------------------------------- a stage's loss rate
def test_stage_losses_of_poisson_node_failures_come_at_the_closed_form_rate():
    """Poisson node failures at λ per node, heals of a fixed window h (the join; free copies): the
    simulated stage losses over a long run match `stage_loss_rate_per_s` = D λ (1 − p) p^(D−1),
    p = λh / (1 + λh). Tolerance 6 %: about 3 standard deviations of the ~2,800 expected losses'
    Poisson count (1.9 %) plus the rule's own approximation (a stage loss replaces all replicas at
    once, which the formula ignores; of order p here)."""
    degree, num_stages = 2, 2
    heal_window_s = JOIN_DELAY_S
    rate_per_s = 0.07 / heal_window_s  # λh = 0.07: p ≈ 0.065, a stage loss ≈ 6 % of node losses
    horizon_s = 6.0e6
    generator = np.random.default_rng(20261203)
    failures = []
    for stage in range(num_stages):
        for replica in range(degree):
            gaps = generator.exponential(1.0 / rate_per_s, size=int(rate_per_s * horizon_s * 1.3) + 100)
            times = np.cumsum(gaps)
            failures += [_loss(float(time_s), stage, replica) for time_s in times[times < horizon_s]]
    scenario = _scenario(degree, allreduce_free=True, num_stages=num_stages, target=10**9, deadline_s=horizon_s, methods=("redundant",))
    result = simulate_run(scenario, scenario.methods[0], tuple(failures))
    stage_losses = sum(1 for f in result.failures if f.handled_as not in ("replica_heal", "already_down", "ignored"))
    expected = num_stages * horizon_s * stage_loss_rate_per_s(rate_per_s, data_parallel_degree=degree, heal_window_s=heal_window_s)
    assert expected > 2500
    assert stage_losses == pytest.approx(expected, rel=0.06)


def test_under_continue_the_group_pauses_only_while_no_replica_pipeline_is_complete():
    """D = 2, `continue`: replica 0 loses stage 1, then replica 1 loses stage 2 five seconds later. No
    replica pipeline is complete until stage 1's heal ends: training pauses until then, and trains at
    half the batch (no batch model named: the share is 1/2) until stage 2's heal ends."""
    scenario = _scenario(2, mode="continue")
    method = scenario.methods[0]
    iteration_s = _iteration_s(scenario)
    assert iteration_s > 10.0  # the 5 s at half the batch complete no iteration
    heal_s = JOIN_DELAY_S + _copy_s(scenario, 1)
    assert _copy_s(scenario, 2) == _copy_s(scenario, 1)
    first_s = 10.5 * iteration_s
    second_s = first_s + 5.0
    for result in _both(scenario, method, (_loss(first_s, 1, 0), _loss(second_s, 2, 1))):
        # 10 iterations by the first loss; 5 s at half the batch lost to the second; paused until
        # first_s + heal_s; 5 s at half the batch; then full speed.
        expected_s = first_s + heal_s + 5.0 + (TARGET - 10 - 0.5 * 5.0 / iteration_s) * iteration_s
        assert result.wall_clock_s == pytest.approx(expected_s, rel=1e-12)
        assert result.badput["replica_heal_s"] == pytest.approx((heal_s - 5.0) + 2 * 5.0 * 0.5, rel=1e-9)
        assert result.badput["lost_work_s"] == pytest.approx(0.5 * iteration_s + 0.5 * 5.0, rel=1e-9)
        pauses = [event for event in result.timeline if event.name == "waiting for replica heals"]
        assert [(p.start_s, p.end_s) for p in pauses] == [(pytest.approx(second_s), pytest.approx(first_s + heal_s, rel=1e-12))]
