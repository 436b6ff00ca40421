"""The closed-form engine (sim/model/closed_form/) gives the event model's results (sim/model/run.py `Run`).

Differential test: random scenarios (hypothesis; derandomized under CI=1, tests/conftest.py), every
recovery method and every churn model, both engines on the same failure path; every numeric field of
`RunResult` (time accounting included), every handled failure, trajectory point and timeline span,
and the policies' counters (checkpoints written, snapshots, rebuilds, refreshes) must agree to 1e-9
relative. The scenarios are small and fast-failing on purpose, so that failures strike during
checkpoint writes, reads, flushes, refreshes and recoveries, and transfers contend on links.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from churnsim.calibration.churn import BurstChurn, NoChurn, PoissonChurn, ScheduleChurn, StageHourlyChurn, TraceChurn, WeibullChurn
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import (
    ExplicitCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    StorageTier,
    TargetSpec,
    TrainingSpec,
    UniformNetwork,
)
from churnsim.sim.model.iteration import IterationModel
from churnsim.sim.model.results import BADPUT_CATEGORIES
from churnsim.sim.model.run import SimulatedRun, simulate_run_and_policy

RELATIVE = 1e-9
METHOD_NAMES = ("none", "checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus", "copy", "uniform", "random")
CHURN_KINDS = ("none", "stage_hourly", "poisson", "weibull", "burst", "trace", "schedule")
COUNTERS = ("num_snapshots", "num_durable", "num_fatal", "num_rebuilds", "num_edge_restores", "num_refreshes")
# Examples per churn model; raise it for a deeper search (e.g. CHURNSIM_EQUIVALENCE_EXAMPLES=300).
EXAMPLES = int(os.environ.get("CHURNSIM_EQUIVALENCE_EXAMPLES", "6"))


# ----------------------------------------------------------------------------- comparison
def _close(a: float, b: float) -> bool:
    if a == b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b), 1.0)


def _assert_same_run(reference: SimulatedRun, closed_form: SimulatedRun, where: str) -> None:
    ref, fast = reference.result, closed_form.result
    for field in ("method", "replication", "seed", "reached_target", "target_iterations", "iterations_executed"):
        assert getattr(ref, field) == getattr(fast, field), f"{where}: {field} {getattr(ref, field)!r} != {getattr(fast, field)!r}"
    for field in ("wall_clock_s", "progress_iterations", "healthy_iteration_time_s", "reference_iteration_time_s", "goodput_s"):
        assert _close(getattr(ref, field), getattr(fast, field)), f"{where}: {field} {getattr(ref, field)!r} != {getattr(fast, field)!r}"
    assert tuple(ref.badput) == tuple(fast.badput) == BADPUT_CATEGORIES
    for category in BADPUT_CATEGORIES:
        assert _close(ref.badput[category], fast.badput[category]), f"{where}: {category} {ref.badput[category]!r} != {fast.badput[category]!r}"
    assert ref.summary().keys() == fast.summary().keys()
    assert len(ref.failures) == len(fast.failures), f"{where}: {len(ref.failures)} != {len(fast.failures)} handled failures"
    for index, (a, b) in enumerate(zip(ref.failures, fast.failures)):
        assert (a.stage, a.replica, a.kind, a.handled_as, a.iteration) == (b.stage, b.replica, b.kind, b.handled_as, b.iteration) and _close(a.time_s, b.time_s), (
            f"{where}: handled failure {index}: {a} != {b}"
        )
    assert len(ref.trajectory) == len(fast.trajectory), f"{where}: {len(ref.trajectory)} != {len(fast.trajectory)} trajectory points"
    for index, (a, b) in enumerate(zip(ref.trajectory, fast.trajectory)):
        assert _close(a[0], b[0]) and _close(a[1], b[1]), f"{where}: trajectory point {index}: {a} != {b}"
    _assert_same_timeline(list(ref.timeline), list(fast.timeline), where)
    assert ref.notes == fast.notes, f"{where}: notes differ"
    _assert_same_counters(reference.policy, closed_form.policy, where)


def _assert_same_timeline(ref: list, fast: list, where: str) -> None:
    """Equal spans in the same order, except that spans ending at the same instant may come in any
    order (the event model orders them by when each event was scheduled; they mean the same)."""
    assert len(ref) == len(fast), f"{where}: {len(ref)} != {len(fast)} timeline events"
    index = 0
    while index < len(ref):
        end_s = ref[index].end_s
        stop = index + 1
        while stop < len(ref) and _close(ref[stop].end_s, end_s) and _close(fast[stop].end_s, end_s):
            stop += 1
        block_ref = sorted(ref[index:stop], key=_span_key)
        block_fast = sorted(fast[index:stop], key=_span_key)
        for a, b in zip(block_ref, block_fast):
            same = (a.name, a.category, a.stage, a.track) == (b.name, b.category, b.stage, b.track)
            assert same and _close(a.start_s, b.start_s) and _close(a.end_s, b.end_s), f"{where}: timeline event {index}: {a} != {b}"
        index = stop


def _span_key(event) -> tuple:
    return (event.name, event.category, event.stage, event.track or "", event.start_s)


def _assert_same_counters(reference, closed_form, where: str) -> None:
    for name in COUNTERS:
        if hasattr(reference, name):
            assert getattr(reference, name) == getattr(closed_form, name), f"{where}: {name}"
    for name in ("checkpointer", "edge_checkpointer"):
        ref, fast = getattr(reference, name, None), getattr(closed_form, name, None)
        if ref is not None:
            assert (ref.num_written, ref.has_checkpoint) == (fast.num_written, fast.has_checkpoint), f"{where}: {name} writes"
            assert _close(ref.committed_progress, fast.committed_progress), f"{where}: {name} committed progress"


def _run_both(scenario: Scenario, failures, where: str, *, expect_closed_form: bool = True) -> None:
    iteration_model = IterationModel()
    for method in scenario.methods:
        reference = simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model, reference_events=True)
        closed_form = simulate_run_and_policy(scenario, method, failures, iteration_model=iteration_model, reference_events=False)
        assert reference.engine == "event_model"
        if expect_closed_form:
            assert closed_form.engine == "closed_form", f"{where}, {method.name}: fell back to the event model"
        _assert_same_run(reference, closed_form, f"{where}, {method.name}")


# ----------------------------------------------------------------------------- random scenarios
NUM_STAGES = st.sampled_from((4, 5, 6))
SMALL_NUM_STAGES = st.sampled_from((1, 2, 3))  # CheckFree+ left out; every stage an edge, or one interior
POSITIVE = st.floats(min_value=0.05, max_value=3.0)


@st.composite
def methods(draw, num_stages: int) -> tuple:
    """Every method the pipeline takes, with knobs drawn so that periodic work is frequent and slow."""
    tier = st.sampled_from(("remote", "local_disk"))
    every = (
        method_from_name("none"),
        method_from_name(
            "checkpoint",
            interval_iterations=draw(st.integers(1, 12)),
            tier=draw(tier),
            rollback=draw(st.sampled_from(("all", "stage"))),
        ),
        method_from_name(
            "async_checkpoint",
            interval_iterations=draw(st.integers(1, 8)),
            host_buffer_bytes=draw(st.sampled_from((None, 1, 3_000_000, 30_000_000))),
            levels=draw(st.sampled_from((("local_disk", "remote"), ("remote",), ("host_memory", "local_disk", "remote")))),
            rollback=draw(st.sampled_from(("all", "stage"))),
        ),
        method_from_name("redundant", fallback_interval_iterations=draw(st.integers(1, 15)), fallback_tier=draw(tier)),
        method_from_name(
            "checkfree",
            edge_fallback=draw(st.sampled_from(("checkpoint", "copy", "random"))),
            edge_checkpoint_interval_iterations=draw(st.integers(1, 10)),
            edge_checkpoint_tier=draw(tier),
            edge_stages_reliable=draw(st.booleans()),
        ),
        method_from_name("checkfree_plus", replica_refresh_iterations=draw(st.integers(1, 10))),
        method_from_name("copy"),
        method_from_name("uniform"),
        method_from_name("random"),
    )
    return tuple(method for method in every if method.minimum_stages <= num_stages)


# Each tier's bandwidths times its own generic factor: two background completions (flush rounds of
# two levels) then never coincide to the bit, which only commensurate round numbers make happen and
# whose order the event model decides by SimPy's event queue (sim/model/closed_form/async_checkpoint.py).
GENERIC = {"host_memory": 1 + 1 / math.sqrt(13), "local_disk": 1 + 1 / math.sqrt(7), "remote": 1 + 1 / math.sqrt(11)}
GENERIC_DEADLINE = 1 + 1 / math.sqrt(17)


def _tiers(draw) -> tuple[StorageTier, ...]:
    remote_bandwidth = draw(st.sampled_from((2e5, 1e6, 5e6, 5e7, math.inf)))
    host, local, remote = GENERIC["host_memory"], GENERIC["local_disk"], GENERIC["remote"]
    return (
        StorageTier(
            name="host_memory",
            write_bandwidth_bytes_per_s=draw(st.sampled_from((1e6, 1e9))) * host,
            read_bandwidth_bytes_per_s=1e9 * host,
            survives_node_loss=False,
        ),
        StorageTier(
            name="local_disk",
            write_bandwidth_bytes_per_s=draw(st.sampled_from((3e5, 2e6, 1e8))) * local,
            read_bandwidth_bytes_per_s=draw(st.sampled_from((3e5, 2e6, 1e8))) * local,
            latency_s=draw(st.sampled_from((0.0, 0.02))),
            survives_node_loss=False,
        ),
        StorageTier(
            name="remote",
            write_bandwidth_bytes_per_s=remote_bandwidth * remote,
            read_bandwidth_bytes_per_s=draw(st.sampled_from((remote_bandwidth, 3e5, 4e6))) * remote,
            latency_s=draw(st.sampled_from((0.0, 0.1, 1.3))),
            survives_node_loss=True,
            shared=draw(st.booleans()),
        ),
    )


@st.composite
def scenarios(draw, churn_kind: str, stage_counts=NUM_STAGES) -> tuple[Scenario, str]:
    num_stages = draw(stage_counts)
    # Round hop times often: with the trace's whole-minute removals, failures then coincide with
    # chunk ends, restarts and takeovers, whose order both engines must fix alike (sim/model/run.py).
    forward_s = draw(st.one_of(st.sampled_from((0.5, 1.0, 2.0)), POSITIVE))
    iteration_estimate_s = (4 + num_stages) * 3 * forward_s
    target_iterations = draw(st.integers(20, 140))
    churn, schedule = _churn(draw, churn_kind, num_stages, iteration_estimate_s)
    scenario = Scenario(
        name="equivalence",
        model=ModelSpec(num_layers=num_stages * draw(st.integers(1, 2)), hidden_size=64, num_heads=4, vocab_size=draw(st.sampled_from((100, 3000))), sequence_length=16),
        pipeline=PipelineSpec(
            num_stages=num_stages,
            schedule=draw(st.sampled_from(("gpipe", "1f1b"))),
            microbatch_size=1,
            num_microbatches=draw(st.integers(1, 4)),
        ),
        compute=ExplicitCompute(block_forward_s=forward_s, block_backward_s=2 * forward_s, optimizer_step_s=draw(st.sampled_from((0.0, 0.3, 50.0)))),
        network=UniformNetwork(latency_s=draw(st.sampled_from((0.0, 0.003, 0.2))), bandwidth_bytes_per_s=draw(st.sampled_from((math.inf, 3e5, 5e7)))),
        storage=_tiers(draw),
        churn=churn,
        recovery=RecoverySpec(
            join_delay_s=draw(st.floats(0.0, 80.0)),
            restart_s=draw(st.floats(0.0, 40.0)),
            restart_s_by_method=draw(st.dictionaries(st.sampled_from(METHOD_NAMES), st.floats(0.0, 40.0), max_size=3)),
            survivor_restart_s=draw(st.one_of(st.just(0.0), st.floats(0.0, 30.0))),
        ),
        # Hard failures under an agent that restarts every worker charge the survivors' restart.
        training=TrainingSpec(
            failure_mode=draw(st.sampled_from(("soft", "hard"))), hard_failure_launch=draw(st.sampled_from(("agent", "in_process")))
        ),
        methods=draw(methods(num_stages)),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5)),
        target=TargetSpec(
            iterations=target_iterations,
            # Often a deadline inside the run: the wall-clock limit must stop both engines alike. Its
            # generic factor keeps it off the instants iterations end at: at an exact tie the event
            # model lets whichever SimPy scheduled first go first (sim/model/closed_form/engine.py).
            max_wall_clock_s=draw(st.sampled_from((0.4, 1.5, 6.0))) * GENERIC_DEADLINE * target_iterations * iteration_estimate_s,
        ),
        seed=draw(st.integers(0, 2**20)),
    )
    return scenario, schedule


def _churn(draw, kind: str, num_stages: int, iteration_s: float):
    # Failures every few iterations for the whole pipeline: recoveries, writes and reads overlap them.
    pipeline_gap_s = draw(st.floats(2.0, 25.0)) * iteration_s
    per_stage_hour = 3600.0 / (pipeline_gap_s * num_stages)
    if kind == "none":
        return NoChurn(kind="none"), ""
    if kind == "stage_hourly":
        return StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=min(0.999, -math.expm1(-per_stage_hour))), ""
    if kind == "poisson":
        return PoissonChurn(kind="poisson", failures_per_node_hour=per_stage_hour), ""
    if kind == "weibull":
        return WeibullChurn(kind="weibull", shape=draw(st.sampled_from((0.6, 1.0, 2.5))), mean_lifetime_s=pipeline_gap_s * num_stages), ""
    if kind == "burst":
        return BurstChurn(kind="burst", bursts_per_hour=3600.0 / pipeline_gap_s / 2), ""
    if kind == "trace":
        # Bamboo's p3 trace (removals at whole minutes, up to 6 at once), squeezed and looped.
        return TraceChurn(kind="trace", path="bamboo/p3-trace.csv", format="bamboo_csv", time_scale=draw(st.sampled_from((0.05, 0.2))), repeat=True), ""
    assert kind == "schedule"
    # Hand-written schedules: simultaneous failures, repeats of one stage, failures at time 0.
    times = draw(st.lists(st.floats(0.0, 40.0 * iteration_s), min_size=1, max_size=25))
    failures = []
    for time_s in times:
        failures.append(ScheduledFailure(time_s=time_s, stage=draw(st.integers(0, num_stages - 1))))
        if draw(st.booleans()):
            failures.append(ScheduledFailure(time_s=time_s, stage=draw(st.integers(0, num_stages - 1))))
    return NoChurn(kind="none"), FailureSchedule(failures=tuple(sorted(failures))).to_csv()  # churn set by the test


def _run_drawn_scenario(data, churn_kind: str, stage_counts=NUM_STAGES) -> None:
    """Both engines on a drawn scenario and one of its replications' failure paths."""
    scenario, schedule_csv = data.draw(scenarios(churn_kind, stage_counts))
    with tempfile.TemporaryDirectory() as directory:
        if churn_kind == "schedule":
            path = Path(directory) / "schedule.csv"
            path.write_text(schedule_csv, encoding="utf-8")
            scenario = scenario.model_copy(update={"churn": ScheduleChurn(kind="schedule", path=str(path))})
        failures = failures_for_replication(scenario, replication=data.draw(st.integers(0, 3)))
        where = f"{scenario.pipeline.num_stages} stages, {churn_kind} churn, {len(failures)} failures"
        # A shared first flush level with a backlog, or a level named twice, is left to the event model.
        _run_both(scenario, failures, where, expect_closed_form=False)


@pytest.mark.parametrize("churn_kind", CHURN_KINDS)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_scenarios_give_the_event_models_results(churn_kind: str, data) -> None:
    _run_drawn_scenario(data, churn_kind)


@pytest.mark.parametrize("churn_kind", ("stage_hourly", "burst", "schedule"))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_small_pipelines_give_the_event_models_results(churn_kind: str, data) -> None:
    """1–3 stages: every stage an edge, a lost set that is the whole pipeline (training restarts
    from iteration 0 when nothing trained is left), redundant computation with no replica of stage 0."""
    _run_drawn_scenario(data, churn_kind, SMALL_NUM_STAGES)


# ----------------------------------------------------------------------------- the benchmarks' scenarios
def test_paper_preset_matches_for_every_method() -> None:
    """`checkfree-500m-geo-16pct` (a shared WAN checkpoint tier, geo links), short and failure-dense."""
    scenario = preset("checkfree-500m-geo-33pct")
    scenario = scenario.model_copy(update={"target": TargetSpec(iterations=600, max_wall_clock_s=60 * 3600.0)})
    _run_both(scenario, failures_for_replication(scenario, replication=1), "checkfree-500m-geo-33pct")


@pytest.mark.parametrize("survivor_restart_s", (0.0, 7.0, 120.0))
def test_paper_preset_with_survivors_restart_matches_for_every_method(survivor_restart_s: float) -> None:
    """Hard failures under torchrun's agent: every stage loss first waits for the survivors' restart
    (shorter and longer than the join delay), failures striking during it start it again."""
    scenario = preset("checkfree-500m-geo-33pct")
    scenario = scenario.model_copy(
        update={
            "target": TargetSpec(iterations=600, max_wall_clock_s=60 * 3600.0),
            "recovery": scenario.recovery.model_copy(update={"survivor_restart_s": survivor_restart_s}),
            "training": TrainingSpec(failure_mode="hard"),
        }
    )
    assert scenario.survivor_restart_charged_s == survivor_restart_s
    failures = failures_for_replication(scenario, replication=1)
    _run_both(scenario, failures, f"survivors' restart {survivor_restart_s} s")
    if survivor_restart_s > 0:
        method = next(method for method in scenario.methods if not method.ignores_failures)
        result = simulate_run_and_policy(scenario, method, failures).result
        assert result.badput["survivor_restart_s"] > 0


def test_a_wait_that_never_ends_stops_at_the_deadline_in_both_engines() -> None:
    """A remote tier of 1e-300 B/s makes every checkpoint write and reload last forever (an infinite
    wait, past the last failure): the closed form used to fail an assertion there. A scenario file
    or `--set` with such a tier is now refused, so this one is built without validation
    (`model_copy`), as a library user can. Both engines stop such runs at the deadline; the
    no-failure run never touches that tier and still finishes."""
    scenario = preset("checkfree-500m-geo-33pct")
    slowest = len(scenario.storage) - 1
    storage = list(scenario.storage)
    storage[slowest] = storage[slowest].model_copy(update={"write_bandwidth_bytes_per_s": 1e-300, "read_bandwidth_bytes_per_s": 1e-300})
    scenario = scenario.model_copy(update={"storage": tuple(storage), "target": TargetSpec(iterations=600, max_wall_clock_s=60 * 3600.0)})
    failures = failures_for_replication(scenario, replication=1)
    _run_both(scenario, failures, "a tier that never finishes")
    reached = {method.name: simulate_run_and_policy(scenario, method, failures).result.reached_target for method in scenario.methods}
    assert not reached["checkpoint"] and reached["none"], reached


def test_a_host_buffer_of_countless_tiny_snapshots_gives_the_event_models_results() -> None:
    """1e-300 checkpoint bytes a parameter: the host buffer holds 10^300 snapshots by division, which
    the closed form's window could not take (OverflowError); both engines cap it alike."""
    from churnsim.sim.model.methods.async_checkpoint import MAX_HOST_BUFFER_SLOTS, AsyncCheckpointPolicy

    scenario = preset("datastates-30b-dp16", {"model.checkpoint_bytes_per_parameter": 1e-300})
    method = next(method for method in scenario.methods if method.name == "async_checkpoint")
    assert method.host_buffer_bytes is not None
    assert set(AsyncCheckpointPolicy(method, scenario).slots_per_stage) == {MAX_HOST_BUFFER_SLOTS}
    _run_both(scenario, failures_for_replication(scenario), "tiny snapshots")


def test_p3_trace_replay_matches_for_every_method() -> None:
    """The p3 trace replay of benchmarks/scenarios/spot-p3-trace-span.json, its first two hours."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios" / "spot-p3-trace-span.json"
    scenario = Scenario.model_validate_json(path.read_text(encoding="utf-8"))
    scenario = scenario.model_copy(update={"target": TargetSpec(iterations=10**9, max_wall_clock_s=2 * 3600.0)})
    _run_both(scenario, failures_for_replication(scenario), "spot-p3-trace-span")


def test_closed_form_is_used_for_the_usual_configurations() -> None:
    """The built-in methods run in closed form on the presets (no silent fallback to events)."""
    scenario = preset("checkfree-124m-geo-33pct")
    scenario = scenario.model_copy(update={"target": TargetSpec(iterations=300, max_wall_clock_s=30 * 3600.0)})
    failures = failures_for_replication(scenario)
    for method in scenario.methods:
        assert simulate_run_and_policy(scenario, method, failures).engine == "closed_form", method.name


def test_a_recovery_booked_in_one_step_is_booked_as_its_waits_one_by_one(monkeypatch) -> None:
    """`ClosedFormRun.recover_unstopped` (join delay, restart and transfers at once) books exactly what
    the step-by-step waits book: the same run, to the bit, with it and with it always declining."""
    from churnsim.sim.model.closed_form import COMPILED
    from churnsim.sim.model.closed_form.engine import ClosedFormRun

    if COMPILED:
        pytest.skip("a compiled class's methods cannot be replaced; the source build (editable install) runs this")

    scenario = preset("checkfree-500m-geo-33pct")
    # Replicas failing together (the paper's emulator): every failure is a stage loss, and recovers.
    pipeline = scenario.pipeline.model_copy(update={"replicas_fail_together": True})
    scenario = scenario.model_copy(update={"pipeline": pipeline, "target": TargetSpec(iterations=600, max_wall_clock_s=60 * 3600.0)})
    failures = failures_for_replication(scenario, replication=2)
    one_step = ClosedFormRun.recover_unstopped
    taken = []

    def counted(self, *arguments):
        booked = one_step(self, *arguments)
        taken.append(booked)
        return booked

    for method in scenario.methods:
        if method.name == "none":
            continue
        taken.clear()
        monkeypatch.setattr(ClosedFormRun, "recover_unstopped", counted)
        fused = simulate_run_and_policy(scenario, method, failures, iteration_model=IterationModel())
        assert fused.engine == "closed_form" and any(taken), method.name  # the one-step booking was used
        monkeypatch.setattr(ClosedFormRun, "recover_unstopped", lambda self, *arguments: False)
        stepwise = simulate_run_and_policy(scenario, method, failures, iteration_model=IterationModel())
        assert fused.result.wall_clock_s == stepwise.result.wall_clock_s, method.name
        assert tuple(fused.result.timeline) == tuple(stepwise.result.timeline), method.name
        _assert_same_run(stepwise, fused, f"{method.name}: one step against waits one by one")


# ----------------------------------------------------------------------------- transfers that meet
def _spans_named(run: SimulatedRun, prefix: str) -> list:
    return [event for event in run.result.timeline if event.name.startswith(prefix) and event.end_s > event.start_s]


def test_rebuild_transfers_that_join_background_transfers_give_the_event_models_results(tmp_path) -> None:
    """A rebuild's weight transfer on a link that a background transfer still occupies (CheckFree+'s
    replica refresh, redundant's replica copy): both slow each other, in both engines alike. Slow
    links, refreshes at every iteration, no join delay or restart, failures next to the refreshed
    links: the random scenarios reach this only now and then."""
    schedule = FailureSchedule(
        failures=tuple(ScheduledFailure(time_s=time_s, stage=stage) for time_s, stage in ((5.3, 1), (11.7, 2), (18.1, 1), (24.9, 0), (31.3, 3)))
    )
    path = tmp_path / "schedule.csv"
    path.write_text(schedule.to_csv(), encoding="utf-8")
    scenario = Scenario(
        name="transfers-meet",
        model=ModelSpec(num_layers=4, hidden_size=64, num_heads=4, vocab_size=3000, sequence_length=16),
        pipeline=PipelineSpec(num_stages=4, schedule="1f1b", microbatch_size=1, num_microbatches=2),
        compute=ExplicitCompute(block_forward_s=0.05, block_backward_s=0.1, optimizer_step_s=0.0),
        network=UniformNetwork(latency_s=0.003, bandwidth_bytes_per_s=3e5),
        storage=(
            StorageTier(name="local_disk", write_bandwidth_bytes_per_s=2e6 * GENERIC["local_disk"], read_bandwidth_bytes_per_s=2e6 * GENERIC["local_disk"], survives_node_loss=False),
            StorageTier(name="remote", write_bandwidth_bytes_per_s=1e6 * GENERIC["remote"], read_bandwidth_bytes_per_s=1e6 * GENERIC["remote"], survives_node_loss=True),
        ),
        churn=ScheduleChurn(kind="schedule", path=str(path)),
        recovery=RecoverySpec(join_delay_s=0.0, restart_s=0.0),
        methods=(method_from_name("checkfree_plus", replica_refresh_iterations=1), method_from_name("redundant", fallback_interval_iterations=5)),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5)),
        target=TargetSpec(iterations=40, max_wall_clock_s=3600.0),
    )
    failures = failures_for_replication(scenario)
    _run_both(scenario, failures, "transfers that meet")
    # The scenario does what it is for: a rebuild's transfers run while a refresh is on its links.
    checkfree_plus = simulate_run_and_policy(scenario, scenario.methods[0], failures)
    refreshes = _spans_named(checkfree_plus, "(de)embedding replica refresh")
    transfers = _spans_named(checkfree_plus, "weight transfer")
    assert transfers and any(r.start_s < t.end_s and t.start_s < r.end_s for r in refreshes for t in transfers)


# ----------------------------------------------------------------------------- data parallelism (D > 1)
@st.composite
def data_parallel_cases(draw) -> tuple[Scenario, tuple]:
    """A drawn scenario made a grid of S × D nodes (D = 2 or 3), with a hand-drawn path of node losses:
    lone replicas (heals), replicas of one stage close together (stage losses), repeats of a node,
    simultaneous losses; copies over a slow all-reduce link, under ZeRO-1 or not, either
    `while_replica_missing`, a batch model or none."""
    from churnsim.calibration.failure_sampling import FailureEvent

    scenario, _ = draw(scenarios("none"))
    num_stages = scenario.pipeline.num_stages
    degree = draw(st.sampled_from((2, 3)))
    pipeline = scenario.pipeline.model_copy(
        update={
            "data_parallel_degree": degree,
            "while_replica_missing": draw(st.sampled_from(("continue", "wait"))),
            "checkpoint_sharding": draw(st.sampled_from(("whole_stage", "data_parallel"))),
            "replicas_fail_together": draw(st.sampled_from((False, False, False, True))),
        }
    )
    network = scenario.network.model_copy(
        update={
            "allreduce_bandwidth_bytes_per_s": draw(st.sampled_from((math.inf, 4e5, 3e6))) * (1 + 1 / math.sqrt(19)),
            "allreduce_latency_s": draw(st.sampled_from((0.0, 0.01))),
        }
    )
    scenario = scenario.model_copy(update={"pipeline": pipeline, "network": network})
    if draw(st.booleans()):
        tokens = scenario.tokens_per_iteration
        convergence = scenario.convergence.model_copy(update={"baseline_tokens_per_iteration": float(tokens), "critical_batch_tokens": draw(st.sampled_from((0.5, 4.0))) * tokens})
        scenario = scenario.model_copy(update={"convergence": convergence})
    iteration_s = (4 + num_stages) * 3 * scenario.compute.block_forward_s
    events = []
    for _ in range(draw(st.integers(1, 14))):
        time_s = draw(st.floats(0.0, 40.0 * iteration_s))
        stage = draw(st.integers(0, num_stages - 1))
        replica = draw(st.integers(0, degree - 1))
        events.append(FailureEvent(time_s=time_s, stage=stage, replica=replica, kind="poisson"))
        follow = draw(st.sampled_from(("none", "none", "other_replica", "same_instant", "same_node", "whole_stage")))
        if follow == "whole_stage":  # every replica at once, as the sampler draws replicas failing together
            events += [FailureEvent(time_s=time_s, stage=stage, replica=other, kind="poisson") for other in range(degree) if other != replica]
        elif follow == "other_replica":  # within a heal's window, often: a stage loss
            gap_s = draw(st.floats(0.0, 2.0 * scenario.recovery.join_delay_s + 1.0))
            events.append(FailureEvent(time_s=time_s + gap_s, stage=stage, replica=(replica + 1) % degree, kind="poisson"))
        elif follow == "same_instant":
            events.append(FailureEvent(time_s=time_s, stage=draw(st.integers(0, num_stages - 1)), replica=draw(st.integers(0, degree - 1)), kind="poisson"))
        elif follow == "same_node":
            gap_s = draw(st.floats(0.0, 2.0 * scenario.recovery.join_delay_s + 1.0))
            events.append(FailureEvent(time_s=time_s + gap_s, stage=stage, replica=replica, kind="poisson"))
    return scenario, tuple(sorted(events))


@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=data_parallel_cases())
def test_data_parallel_runs_give_the_event_models_results(case) -> None:
    scenario, failures = case
    pipeline = scenario.pipeline
    where = (
        f"{pipeline.num_stages} stages × {pipeline.data_parallel_degree} replicas, {pipeline.while_replica_missing}, "
        f"{pipeline.checkpoint_sharding}, together={pipeline.replicas_fail_together}, {len(failures)} node losses"
    )
    _run_both(scenario, failures, where, expect_closed_form=False)


@pytest.mark.parametrize("while_replica_missing", ("continue", "wait"))
def test_paper_preset_with_node_failures_matches_for_every_method(while_replica_missing: str) -> None:
    """`checkfree-500m-geo-33pct` (12 stages × 4 replicas) with independent Poisson node failures:
    heals, pauses or smaller batches, and stage losses when a stage's replicas die within a heal."""
    import numpy as np

    from churnsim.calibration.failure_sampling import FailureEvent

    scenario = preset("checkfree-500m-geo-33pct")
    # The paper's presets lose whole stages (its emulator); this test wants each node on its own.
    pipeline = scenario.pipeline.model_copy(update={"while_replica_missing": while_replica_missing, "replicas_fail_together": False})
    recovery = scenario.recovery.model_copy(update={"join_delay_s": 1800.0})  # long heals: some stage losses
    scenario = scenario.model_copy(update={"pipeline": pipeline, "recovery": recovery, "target": TargetSpec(iterations=600, max_wall_clock_s=60 * 3600.0)})
    generator = np.random.default_rng(46)
    rate_per_s = 1.0 / 5000.0
    failures = []
    for stage in range(pipeline.num_stages):
        for replica in range(pipeline.data_parallel_degree):
            times = np.cumsum(generator.exponential(1.0 / rate_per_s, size=200))
            failures += [FailureEvent(time_s=float(t), stage=stage, replica=replica, kind="poisson") for t in times[times < 60 * 3600.0]]
    failures = tuple(sorted(failures))
    _run_both(scenario, failures, f"checkfree-500m-geo-33pct, node failures, {while_replica_missing}")
    result = simulate_run_and_policy(scenario, method_from_name("checkpoint"), failures).result
    handled = {failure.handled_as for failure in result.failures}
    assert "replica_heal" in handled and handled - {"replica_heal", "already_down"}, handled  # heals and stage losses both
