"""The run model against hand-computed runs, and its invariants for every method."""

from __future__ import annotations

import gc
import weakref

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from churnsim.calibration.churn import PoissonChurn
from churnsim.calibration.methods import METHOD_NAMES
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import FlopsCompute, TargetSpec
from churnsim.sim.model.closed_form import ClosedFormRun, twin_for
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.methods import POLICIES, build_policy
from churnsim.sim.model.pipeline_state import build_pipeline_state
from churnsim.sim.model.results import BADPUT_CATEGORIES
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.sim.model.run import simulate_run

from sim_run_scenarios import CLOSED_FORM_ITERATION_S, failure, method, small_scenario, tiers

MODEL = IterationModel()


def run(scenario, name, failures=(), **parameters):
    return simulate_run(scenario, method(name, **parameters), tuple(failures), iteration_model=MODEL)


def assert_accounting_adds_up(result):
    assert tuple(result.badput) == BADPUT_CATEGORIES
    total = result.goodput_s + sum(result.badput.values())
    assert total == pytest.approx(result.wall_clock_s, rel=1e-6)


def total_checkpoint_bytes(scenario):
    return sum(scenario.stage_parameters(s) for s in range(scenario.pipeline.num_stages)) * scenario.model.checkpoint_bytes_per_parameter


# ------------------------------------------------------------------ pipeline state
def test_registry_lists_exactly_the_method_names():
    assert set(POLICIES) == set(METHOD_NAMES)


def test_flops_pipeline_state_uses_two_and_four_flops_per_parameter_and_token():
    scenario = preset("checkfree-500m-geo-10pct")
    state = build_pipeline_state(scenario)
    compute = scenario.compute
    assert isinstance(compute, FlopsCompute)
    tokens = scenario.pipeline.microbatch_size * scenario.model.sequence_length
    rate = compute.peak_flops_per_s * compute.utilization
    block_parameters = scenario.layers_per_stage * scenario.model.parameters_per_layer
    assert state.block_forward_s[3] == pytest.approx(2 * block_parameters * tokens / rate)
    assert state.block_backward_s[3] == pytest.approx(4 * block_parameters * tokens / rate)
    assert state.head_forward_s == pytest.approx(2 * scenario.model.vocab_size * scenario.model.hidden_size * tokens / rate)
    assert state.gradient_bytes_per_stage[0] == scenario.stage_parameters(0) * scenario.model.weight_bytes_per_parameter
    assert state.link_bandwidth_bytes_per_s[0][1] > 0 and state.data_parallel_degree == 4


def test_explicit_pipeline_state_with_free_links_gives_the_closed_form_iteration():
    assert MODEL.iteration_time_s(build_pipeline_state(small_scenario())) == pytest.approx(CLOSED_FORM_ITERATION_S)


# ------------------------------------------------------------------ exact zero-failure runs
def test_none_without_failures_takes_iterations_times_iteration_time():
    result = run(small_scenario(target_iterations=100), "none")
    assert result.reached_target and result.progress_iterations == 100
    assert result.wall_clock_s == pytest.approx(100 * CLOSED_FORM_ITERATION_S, rel=1e-12)
    assert result.badput["bubble_s"] == pytest.approx(100 * CLOSED_FORM_ITERATION_S * 3 / 7)
    assert_accounting_adds_up(result)


def test_checkpoint_without_failures_adds_one_shared_tier_write_per_interval():
    scenario = small_scenario(target_iterations=100)
    # Shared tier: all stages share one link, so a write takes latency + total bytes / bandwidth.
    write_s = 0.1 + total_checkpoint_bytes(scenario) / 1e6
    result = run(scenario, "checkpoint", interval_iterations=10)
    num_checkpoints = 9  # after 10, 20, ..., 90 iterations; none at the target itself
    assert result.wall_clock_s == pytest.approx(100 * CLOSED_FORM_ITERATION_S + num_checkpoints * write_s, rel=1e-9)
    assert result.badput["checkpoint_stall_s"] == pytest.approx(num_checkpoints * write_s, rel=1e-9)
    assert_accounting_adds_up(result)


def test_checkpoint_without_failures_per_stage_tier_waits_for_the_largest_stage():
    scenario = small_scenario(target_iterations=95, storage=tiers(remote_shared=False))
    largest = max(scenario.stage_parameters(s) for s in range(4)) * scenario.model.checkpoint_bytes_per_parameter
    write_s = 0.1 + largest / 1e6
    result = run(scenario, "checkpoint", interval_iterations=10)
    assert result.wall_clock_s == pytest.approx(95 * CLOSED_FORM_ITERATION_S + 9 * write_s, rel=1e-9)


def test_checkpoint_rollback_loses_exactly_the_iterations_since_the_last_checkpoint():
    scenario = small_scenario(target_iterations=100)
    T = CLOSED_FORM_ITERATION_S
    write_s = 0.1 + total_checkpoint_bytes(scenario) / 1e6
    read_s = write_s  # same bandwidth and latency
    # 25 iterations and two checkpoints (after 10 and 20) done, then 5 s into iteration 26.
    failure_s = 25 * T + 2 * write_s + 5.0
    result = run(scenario, "checkpoint", [failure(failure_s, 2)], interval_iterations=10)
    assert [f.handled_as for f in result.failures] == ["rollback"]
    assert result.badput["lost_work_s"] == pytest.approx(5 * T + 5.0, rel=1e-9)
    assert result.badput["recovery_downtime_s"] == pytest.approx(30.0 + 5.0 + read_s, rel=1e-9)
    # 105 iterations executed; 9 completed checkpoints (after progress 10, 20, 30, ..., 90).
    expected = 105 * T + 5.0 + 9 * write_s + 30.0 + 5.0 + read_s
    assert result.wall_clock_s == pytest.approx(expected, rel=1e-9)
    assert result.iterations_executed == 105
    assert any(t == pytest.approx(failure_s) and p == 20.0 for t, p in result.trajectory)
    assert_accounting_adds_up(result)


@pytest.mark.parametrize("name", ["checkpoint", "async_checkpoint", "checkfree", "copy"])
def test_a_method_s_own_restart_time_replaces_the_scenario_s(name):
    scenario = small_scenario(target_iterations=60)
    measured = scenario.model_copy(update={"recovery": scenario.recovery.model_copy(update={"restart_s_by_method": {name: 12.0, "uniform": 1.0}})})
    failures = [failure(20.5 * CLOSED_FORM_ITERATION_S, 1)]
    for reference_events in (False, True):
        plain = simulate_run(scenario, method(name), tuple(failures), iteration_model=MODEL, reference_events=reference_events)
        with_own = simulate_run(measured, method(name), tuple(failures), iteration_model=MODEL, reference_events=reference_events)
        # The scenario restarts in 5 s; this method, measured, in 12 s.
        assert with_own.badput["recovery_downtime_s"] - plain.badput["recovery_downtime_s"] == pytest.approx(7.0, rel=1e-9)
        assert with_own.wall_clock_s - plain.wall_clock_s == pytest.approx(7.0, rel=1e-9)


def test_checkpoint_stage_rollback_keeps_progress_but_loses_the_stale_stage_share():
    scenario = small_scenario(target_iterations=100)
    T = CLOSED_FORM_ITERATION_S
    write_s = 0.1 + total_checkpoint_bytes(scenario) / 1e6
    failure_s = 25 * T + 2 * write_s + 5.0
    result = run(scenario, "checkpoint", [failure(failure_s, 2)], interval_iterations=10, rollback="stage")
    # Stage 2 is 5 iterations stale and holds 1/4 of the model: 5/4 iterations lost, plus the partial one.
    assert result.badput["lost_work_s"] == pytest.approx(5 / 4 * T + 5.0, rel=1e-9)
    assert_accounting_adds_up(result)


def test_checkpoint_on_a_tier_that_dies_with_the_node_restarts_from_scratch():
    scenario = small_scenario(target_iterations=100)
    T = CLOSED_FORM_ITERATION_S
    result = run(scenario, "checkpoint", [failure(25.5 * T + 10.0, 1)], interval_iterations=10, tier="local_disk")
    assert any(p == 0.0 for t, p in result.trajectory if t > 25 * T)


def test_wall_clock_limit_stops_a_run_that_cannot_reach_the_target():
    scenario = small_scenario(target_iterations=100, max_wall_clock_s=50 * CLOSED_FORM_ITERATION_S + 3.0)
    result = run(scenario, "none")
    assert not result.reached_target
    assert result.wall_clock_s == pytest.approx(scenario.target.max_wall_clock_s)
    assert result.progress_iterations == 50
    assert result.badput["lost_work_s"] == pytest.approx(3.0)
    assert_accounting_adds_up(result)


def test_none_records_failures_as_ignored_and_is_not_slowed():
    result = run(small_scenario(), "none", [failure(100.0, 1), failure(200.0, 0)])
    assert [f.handled_as for f in result.failures] == ["ignored", "ignored"]
    assert result.wall_clock_s == pytest.approx(100 * CLOSED_FORM_ITERATION_S)


def test_a_failure_of_a_stage_already_down_has_no_effect():
    scenario = small_scenario()
    once = run(scenario, "checkfree", [failure(500.0, 1)])
    twice = run(scenario, "checkfree", [failure(500.0, 1), failure(510.0, 1)])
    assert [f.handled_as for f in twice.failures] == ["rebuild_interior", "already_down"]
    assert twice.wall_clock_s == pytest.approx(once.wall_clock_s)


def test_per_microbatch_mode_gives_the_same_run_as_the_cached_two_level_model():
    scenario = small_scenario(target_iterations=30, link_bandwidth=1e5)
    failures = (failure(200.0, 2), failure(450.0, 0))
    for name in ("checkpoint", "redundant", "checkfree"):
        cached = simulate_run(scenario, method(name, **({"interval_iterations": 7} if name == "checkpoint" else {})), failures)
        slow = simulate_run(
            scenario, method(name, **({"interval_iterations": 7} if name == "checkpoint" else {})), failures, per_microbatch_everywhere=True
        )
        assert slow.wall_clock_s == pytest.approx(cached.wall_clock_s, rel=1e-9)
        assert slow.progress_iterations == cached.progress_iterations


def test_failure_paths_are_the_same_for_every_method_of_a_replication():
    scenario = small_scenario(churn=PoissonChurn(kind="poisson", failures_per_node_hour=2.0))
    first = failures_for_replication(scenario, replication=3, horizon_s=10_000.0)
    assert first == failures_for_replication(scenario, replication=3, horizon_s=10_000.0)
    assert first != failures_for_replication(scenario, replication=4, horizon_s=10_000.0)


# ------------------------------------------------------------------ properties, every method
INVARIANT_SCENARIO = small_scenario(target_iterations=60, link_bandwidth=2e5, storage=tiers(remote_bandwidth=2e6))
FAST = dict(checkpoint={"interval_iterations": 10}, async_checkpoint={"interval_iterations": 5},
            redundant={"fallback_interval_iterations": 10}, checkfree_plus={"replica_refresh_iterations": 10})

failure_lists = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=2500.0), st.integers(min_value=0, max_value=3)), max_size=8
)


AFTER_RECOVERY_S = 30.0 + 5.0 + 30.0  # join + restart + a margin for transfers and reads


def path(pairs):
    return tuple(sorted(failure(time_s, stage) for time_s, stage in pairs))


@pytest.mark.parametrize("name", METHOD_NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=failure_lists)
def test_time_never_runs_backwards_and_accounting_adds_up(name, pairs):
    result = simulate_run(INVARIANT_SCENARIO, method(name, **FAST.get(name, {})), path(pairs), iteration_model=MODEL)
    times = [time_s for time_s, _ in result.trajectory]
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert all(event.end_s >= event.start_s for event in result.timeline)
    assert all(progress >= 0 for _, progress in result.trajectory)
    assert result.reached_target
    assert_accounting_adds_up(result)


@pytest.mark.parametrize("name", METHOD_NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=failure_lists, extra_time_s=st.floats(min_value=0.0, max_value=1500.0), extra_stage=st.integers(0, 3))
def test_an_added_later_failure_never_makes_a_run_finish_sooner(name, pairs, extra_time_s, extra_stage):
    """Adding a failure after the last one of a path (and after its recovery) never shortens the run.

    Pathwise, other additions can legitimately shorten a run: an added earlier failure can absorb a
    later failure of the same stage while that stage is down, or (`redundant`) its restart can clear
    a degraded state that made a later failure fatal; a failure merged into a recovery in progress
    can change the plan to one with fewer bytes to move (CheckFree+: both stage 0 and its swap
    partner lost ⇒ random init, no transfer), whose larger setback is clamped at zero progress.
    """
    base = path(pairs)
    last_s = base[-1].time_s + AFTER_RECOVERY_S if base else 0.0
    method_config = method(name, **FAST.get(name, {}))
    before = simulate_run(INVARIANT_SCENARIO, method_config, base, iteration_model=MODEL)
    after = simulate_run(INVARIANT_SCENARIO, method_config, base + (failure(last_s + extra_time_s, extra_stage),), iteration_model=MODEL)
    assert after.wall_clock_s >= before.wall_clock_s - 1e-9 * before.wall_clock_s


def test_one_failure_never_makes_a_run_finish_sooner_for_any_method():
    for name in METHOD_NAMES:
        method_config = method(name, **FAST.get(name, {}))
        clean = simulate_run(INVARIANT_SCENARIO, method_config, (), iteration_model=MODEL)
        for stage in range(4):
            hit = simulate_run(INVARIANT_SCENARIO, method_config, (failure(333.0, stage),), iteration_model=MODEL)
            assert hit.wall_clock_s >= clean.wall_clock_s, (name, stage)


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_a_closed_form_run_is_freed_as_soon_as_it_ends(name):
    """Nothing keeps a finished run (and its records) alive until a collection: not the shared
    exception the engine raises for every interrupt (its traceback holds the frames of its last
    raise), nor a reference cycle through background work that never came (a redundant replacement).
    Watched through its policy, which the run holds: the compiled run takes no weak reference."""
    scenario = preset("checkfree-500m-geo-16pct", {"pipeline.replicas_fail_together": True}, methods=(name,))
    scenario = scenario.model_copy(update={"target": TargetSpec(iterations=3000, max_wall_clock_s=1e7)})
    policy = build_policy(scenario.methods[0], scenario)
    run = ClosedFormRun(
        scenario, policy, twin_for(policy, scenario), failures_for_replication(scenario),
        iteration_model=IterationModel(), healthy_state=policy.healthy_state(),
    )
    run.execute()
    if name == "checkpoint":  # a wait was interrupted: the shared exception was raised
        assert any("(interrupted)" in str(field) for field in run.timeline)
    freed = weakref.ref(policy)
    collector_was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting alone, not by a collection that happens to run
    try:
        del run, policy
        assert freed() is None
    finally:
        if collector_was_enabled:
            gc.enable()
