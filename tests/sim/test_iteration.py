"""The per-microbatch iteration model against hand-computed traces and closed forms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import churnsim.sim.model.iteration as iteration_module
from churnsim.calibration.errors import InputError
from churnsim.calibration.pipeline_schedule import StageOperation
from churnsim.sim.model.iteration import IterationModel, PipelineState, simulate_iteration

COMPUTE_KINDS = ("forward", "backward", "redundant_forward", "optimizer")


def trace(result, kinds=None):
    return [
        (span.stage, span.kind, span.microbatch, span.start_s, span.end_s)
        for span in result.spans
        if kinds is None or span.kind in kinds
    ]


def uniform(**fields):
    defaults = dict(num_stages=2, num_microbatches=1, schedule="gpipe", forward_s=1.0, backward_s=2.0)
    return PipelineState.uniform(**(defaults | fields))


def test_gpipe_two_stages_two_microbatches_exact_trace():
    result = simulate_iteration(uniform(num_microbatches=2))
    assert trace(result) == [
        (0, "forward", 0, 0.0, 1.0),
        (0, "forward", 1, 1.0, 2.0),
        (1, "forward", 0, 1.0, 2.0),
        (1, "forward", 1, 2.0, 3.0),
        (1, "backward", 0, 3.0, 5.0),
        (0, "backward", 0, 5.0, 7.0),
        (1, "backward", 1, 5.0, 7.0),
        (0, "backward", 1, 7.0, 9.0),
    ]
    assert result.time_s == 9.0
    assert result.busy_s == (6.0, 6.0)
    assert result.bubble_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 7, 16])
def test_uniform_iteration_equals_closed_form(schedule, num_stages, num_microbatches):
    forward_s, backward_s = 0.7, 1.9
    result = simulate_iteration(
        uniform(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                forward_s=forward_s, backward_s=backward_s)
    )
    closed_form_s = (num_microbatches + num_stages - 1) * (forward_s + backward_s)
    assert result.time_s == pytest.approx(closed_form_s, abs=1e-9)
    expected_bubble = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert result.bubble_fraction == pytest.approx(expected_bubble, abs=1e-9)


def test_hop_compute_includes_embedding_on_first_stage_and_head_on_last():
    state = uniform(embedding_forward_s=0.5, embedding_backward_s=0.25, head_forward_s=0.125,
                    head_backward_s=1.0)
    assert trace(simulate_iteration(state)) == [
        (0, "forward", 0, 0.0, 1.5),
        (1, "forward", 0, 1.5, 2.625),
        (1, "backward", 0, 2.625, 5.625),
        (0, "backward", 0, 5.625, 7.875),
    ]


def test_communication_adds_latency_plus_bytes_over_bandwidth_each_way():
    # One activation forward and one gradient back, each 0.5 s latency + 2 B / 4 B/s.
    state = uniform(link_latency_s=0.5, link_bandwidth_bytes_per_s=4.0, activation_bytes=2.0)
    result = simulate_iteration(state)
    assert result.time_s == pytest.approx(2 * (1.0 + 2.0) + 2 * (0.5 + 0.5))
    assert trace(result, ("send",)) == [(0, "send", 0, 1.0, 2.0), (1, "send", 0, 5.0, 6.0)]


def test_two_transfers_on_one_ordered_pair_queue_one_after_the_other():
    # Stage 0 forwards take no time, so both activations are sent at t = 0 over the 1 B/s link; the
    # pair's messages go one after another: the first arrives at 1.0, the second at 2.0.
    state = PipelineState(
        num_stages=2, num_microbatches=2, schedule="gpipe", block_forward_s=(0.0, 1.0),
        block_backward_s=(0.0, 1.0), activation_bytes=1.0,
        link_bandwidth_bytes_per_s=((math.inf, 1.0), (1.0, math.inf)),
    )
    result = simulate_iteration(state)
    assert trace(result, ("send",))[:2] == [(0, "send", 0, 0.0, 1.0), (0, "send", 1, 0.0, 2.0)]
    assert trace(result, ("forward",))[2:4] == [(1, "forward", 0, 1.0, 2.0), (1, "forward", 1, 2.0, 3.0)]


@pytest.mark.parametrize(
    "schedule, num_stages, num_microbatches",
    [(schedule, num_stages, num_microbatches)
     for schedule in ("gpipe", "1f1b")
     for num_stages, num_microbatches in ((4, 4), (4, 9), (5, 4), (5, 11), (7, 15), (8, 4), (8, 17))],
)
def test_swapped_routes_finish_and_cost_more_on_slow_links(schedule, num_stages, num_microbatches):
    fields = dict(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
                  link_latency_s=0.5, link_bandwidth_bytes_per_s=1.0e6, activation_bytes=1.0e6)
    in_order = simulate_iteration(uniform(**fields))
    swapped = simulate_iteration(uniform(swap_odd_microbatches=True, **fields))
    assert swapped.time_s > in_order.time_s
    forwards = [span for span in swapped.spans if span.kind == "forward"]
    # Odd microbatches visit stage 0 twice (embedding, then blocks after stage 1).
    assert sum(1 for span in forwards if span.stage == 0 and span.microbatch == 1) == 2


def test_redundant_forward_is_free_when_it_fits_in_a_bubble():
    # Stage 0 idles from 1 to 4 waiting for stage 1; the replica's forward (1 s) runs at [1, 2].
    plain = simulate_iteration(uniform())
    redundant = simulate_iteration(uniform(redundant_forward=True))
    assert redundant.time_s == plain.time_s == 6.0
    assert trace(redundant, ("redundant_forward",)) == [(0, "redundant_forward", 0, 1.0, 2.0)]
    assert trace(redundant, ("forward", "backward")) == trace(plain, ("forward", "backward"))


def test_redundant_forward_yields_to_regular_work_and_delays_only_the_optimizer_step():
    # GPipe, S = 2, M = 4: stage 0 idles only in [4, 7]; 3 of its 4 redundant seconds fit there,
    # are preempted by the backward of microbatch 0 at 7, and the last second runs after 15.
    plain = simulate_iteration(uniform(num_microbatches=4))
    redundant = simulate_iteration(uniform(num_microbatches=4, redundant_forward=True))
    assert plain.time_s == 15.0 and redundant.time_s == 16.0
    assert trace(redundant, ("redundant_forward",)) == [
        (0, "redundant_forward", 0, 4.0, 5.0),
        (0, "redundant_forward", 1, 5.0, 6.0),
        (0, "redundant_forward", 2, 6.0, 7.0),
        (0, "redundant_forward", 3, 15.0, 16.0),
    ]
    assert trace(redundant, ("forward", "backward")) == trace(plain, ("forward", "backward"))
    assert redundant.busy_s == (plain.busy_s[0] + 4.0, plain.busy_s[1])


stage_seconds = st.lists(st.floats(0.0, 3.0), min_size=2, max_size=6)


@settings(max_examples=40, deadline=None)
@given(
    forward=stage_seconds, backward=stage_seconds, num_microbatches=st.integers(1, 6),
    schedule=st.sampled_from(["gpipe", "1f1b"]), latency_s=st.floats(0.0, 1.0),
    head_forward_s=st.floats(0.0, 1.0),
)
def test_redundant_forward_never_shortens_the_iteration(
    forward, backward, num_microbatches, schedule, latency_s, head_forward_s
):
    num_stages = min(len(forward), len(backward))
    fields = dict(
        num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
        block_forward_s=tuple(forward[:num_stages]), block_backward_s=tuple(backward[:num_stages]),
        head_forward_s=head_forward_s, activation_bytes=1.0,
        link_latency_s=((latency_s,) * num_stages,) * num_stages,
        link_bandwidth_bytes_per_s=((2.0,) * num_stages,) * num_stages,
    )
    plain = simulate_iteration(PipelineState(**fields))
    redundant = simulate_iteration(PipelineState(redundant_forward=True, **fields))
    assert redundant.time_s >= plain.time_s - 1e-9
    # Regular work is never delayed by redundant work.
    assert trace(redundant, ("forward", "backward", "send")) == trace(plain, ("forward", "backward", "send"))
    assert_node_compute_never_overlaps(redundant, tuple(range(num_stages)))


def assert_node_compute_never_overlaps(result, node_of_stage):
    by_node: dict[int, list] = {}
    for span in result.spans:
        assert 0.0 <= span.start_s <= span.end_s <= result.time_s + 1e-9
        if span.kind in COMPUTE_KINDS:
            by_node.setdefault(node_of_stage[span.stage], []).append((span.start_s, span.end_s))
    for intervals in by_node.values():
        intervals.sort()
        for (_, end_s), (next_start_s, _) in zip(intervals, intervals[1:]):
            assert next_start_s >= end_s - 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_degraded_node_running_two_stages_is_slower_and_talks_to_itself_for_free(schedule):
    fields = dict(num_stages=4, num_microbatches=4, schedule=schedule, link_latency_s=0.25,
                  activation_bytes=1.0, link_bandwidth_bytes_per_s=4.0)
    healthy = simulate_iteration(uniform(**fields))
    nodes = (0, 1, 1, 2)
    degraded = simulate_iteration(uniform(node_of_stage=nodes, **fields))
    assert degraded.time_s > healthy.time_s
    assert_node_compute_never_overlaps(degraded, nodes)
    # Stages 1 and 2 share node 1: between them nothing is sent, so each sends only the other way.
    def sends_by(result, stage):
        return sum(1 for span in result.spans if span.kind == "send" and span.stage == stage)

    assert [sends_by(healthy, stage) for stage in (1, 2)] == [8, 8]
    assert [sends_by(degraded, stage) for stage in (1, 2)] == [4, 4]


def test_ring_allreduce_and_optimizer_step_follow_the_last_backward():
    degree, gradient_bytes, bandwidth, latency_s = 4, 8.0, 2.0, 0.1
    expected_allreduce_s = 2 * (degree - 1) / degree * gradient_bytes / bandwidth + 2 * (degree - 1) * latency_s
    plain = simulate_iteration(uniform())
    state = uniform(data_parallel_degree=degree, gradient_bytes_per_stage=(gradient_bytes, gradient_bytes),
                    allreduce_bandwidth_bytes_per_s=bandwidth, allreduce_latency_s=latency_s,
                    optimizer_step_s=0.5)
    result = simulate_iteration(state)
    allreduces = [span for span in result.spans if span.kind == "allreduce"]
    assert [span.stage for span in allreduces] == [1, 0]
    for span in allreduces:
        assert span.end_s - span.start_s == pytest.approx(expected_allreduce_s, abs=1e-12)
    assert result.time_s == pytest.approx(plain.time_s + expected_allreduce_s + 0.5, abs=1e-12)
    assert trace(result, ("optimizer",))[-1][1:3] == ("optimizer", -1)


def test_allreduce_costs_nothing_without_data_parallelism():
    state = uniform(gradient_bytes_per_stage=(1.0e9, 1.0e9), allreduce_bandwidth_bytes_per_s=1.0,
                    allreduce_latency_s=1.0)
    assert simulate_iteration(state).time_s == simulate_iteration(uniform()).time_s


def test_model_caches_results_of_equal_states():
    model = IterationModel()
    first = model.iteration_time_s(uniform(num_microbatches=3))
    # Built separately, lists instead of tuples: still the same state.
    equal_state = PipelineState(num_stages=2, num_microbatches=3, schedule="gpipe",
                                block_forward_s=[1.0, 1.0], block_backward_s=[2, 2])
    assert model.iteration_time_s(equal_state) == first
    assert (model.num_cache_hits, model.num_cache_misses) == (1, 1)
    model.result(uniform(num_microbatches=4))
    assert (model.num_cache_hits, model.num_cache_misses) == (1, 2)


def test_deadlock_raises_and_names_the_stuck_stage_and_operation(monkeypatch):
    # Stage 0 insists on its backward before its forward: neither stage can ever proceed.
    backward_first = (
        (StageOperation(direction="backward", microbatch=0, hop_index=0),
         StageOperation(direction="forward", microbatch=0, hop_index=0)),
        (StageOperation(direction="forward", microbatch=0, hop_index=1),
         StageOperation(direction="backward", microbatch=0, hop_index=1)),
    )
    monkeypatch.setattr(iteration_module, "_operation_orders", lambda *arguments: backward_first)
    with pytest.raises(RuntimeError, match=r"stage 0 at .*backward.*stage 1 at .*forward"):
        simulate_iteration(uniform())


@pytest.mark.parametrize(
    "fields, field_name",
    [(dict(block_forward_s=(1.0,)), "block_forward_s"),
     (dict(schedule="zigzag"), "schedule"),
     (dict(node_of_stage=(0,)), "node_of_stage"),
     (dict(link_bandwidth_bytes_per_s=((1.0, 0.0), (1.0, 1.0))), "link_bandwidth_bytes_per_s"),
     (dict(data_parallel_degree=0), "data_parallel_degree"),
     # Transfers that would outlast 31.7 years (at 1e-300 B/s an iteration took inf s).
     (dict(activation_bytes=1e6, link_bandwidth_bytes_per_s=((1.0, 1e-300), (1.0, 1.0))), r"slowest link \(1e-300 B/s\)"),
     (dict(data_parallel_degree=2, gradient_bytes_per_stage=(1e6, 1e6), allreduce_bandwidth_bytes_per_s=1e-300), r"all-reduce's bandwidth \(1e-300 B/s\)")],
)
def test_invalid_states_raise_input_error_naming_the_field(fields, field_name):
    base = dict(num_stages=2, num_microbatches=2, schedule="gpipe", block_forward_s=(1.0, 1.0),
                block_backward_s=(2.0, 2.0))
    with pytest.raises(InputError, match=field_name):
        PipelineState(**(base | fields))


@settings(max_examples=40, deadline=None)
@given(
    forward=stage_seconds, backward=stage_seconds, num_microbatches=st.integers(1, 6),
    schedule=st.sampled_from(["gpipe", "1f1b"]), data=st.data(),
)
def test_any_stage_to_node_mapping_finishes_without_overlapping_compute(
    forward, backward, num_microbatches, schedule, data
):
    num_stages = min(len(forward), len(backward))
    nodes = tuple(data.draw(st.lists(st.integers(0, num_stages - 1), min_size=num_stages, max_size=num_stages)))
    state = PipelineState(
        num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule,
        block_forward_s=tuple(forward[:num_stages]), block_backward_s=tuple(backward[:num_stages]),
        node_of_stage=nodes, activation_bytes=1.0,
        link_latency_s=((0.1,) * (max(nodes) + 1),) * (max(nodes) + 1),
        link_bandwidth_bytes_per_s=((3.0,) * (max(nodes) + 1),) * (max(nodes) + 1),
    )
    result = simulate_iteration(state)
    assert_node_compute_never_overlaps(result, nodes)
    node_busy_s: dict[int, float] = {}
    for stage, busy_s in enumerate(result.busy_s):
        node_busy_s[nodes[stage]] = node_busy_s.get(nodes[stage], 0.0) + busy_s
    assert result.time_s >= max(node_busy_s.values()) - 1e-9
    expected_busy_s = [num_microbatches * (forward[s] + backward[s]) for s in range(num_stages)]
    assert list(result.busy_s) == pytest.approx(expected_busy_s)
