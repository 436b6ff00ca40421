"""ProcessorSharingLink: hand-computed fluid processor-sharing cases and properties."""

from __future__ import annotations

import math

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from churnsim.calibration.errors import InputError
from churnsim.sim.model.links import ProcessorSharingLink


def run_flows(flows, *, bandwidth_bytes_per_s, latency_s=0.0):
    """Start each (arrival_s, num_bytes) flow at its arrival; return completion times and the link."""
    env = simpy.Environment()
    link = ProcessorSharingLink(env, bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)
    completions = [math.nan] * len(flows)

    def start(index, arrival_s, num_bytes):
        yield env.timeout(arrival_s)
        yield link.transfer(num_bytes)
        completions[index] = env.now

    for index, (arrival_s, num_bytes) in enumerate(flows):
        env.process(start(index, arrival_s, num_bytes))
    env.run()
    return completions, link


def test_reference_case_two_unit_flows_and_a_late_quarter_flow():
    completions, link = run_flows([(0.0, 1.0), (0.0, 1.0), (0.5, 0.25)], bandwidth_bytes_per_s=1.0)
    assert completions == pytest.approx([2.25, 2.25, 1.25], abs=1e-12)
    assert link.bytes_transferred == pytest.approx(2.25)
    assert link.busy_s == pytest.approx(2.25)
    assert link.num_transfers_completed == 3


def test_single_flow_takes_latency_plus_bytes_over_bandwidth_exactly():
    completions, _ = run_flows([(0.0, 3.0e6)], bandwidth_bytes_per_s=1.5e6, latency_s=0.125)
    assert completions == [0.125 + 2.0]


def test_equal_share_finishes_smallest_first_then_speeds_up_the_rest():
    # Three flows of 1, 2, 3 units: rate 1/3 each until t = 3, then 1/2 each.
    completions, _ = run_flows([(0.0, 1.0), (0.0, 2.0), (0.0, 3.0)], bandwidth_bytes_per_s=1.0)
    assert completions == pytest.approx([3.0, 5.0, 6.0], abs=1e-12)


def test_latency_delays_entry_but_does_not_consume_bandwidth():
    # Flow A enters the shared pool at 1.0, flow B at 1.5; A is alone for 0.5 s, then they share.
    completions, link = run_flows([(0.0, 1.0), (0.5, 1.0)], bandwidth_bytes_per_s=1.0, latency_s=1.0)
    assert completions == pytest.approx([2.5, 3.0], abs=1e-12)
    assert link.busy_s == pytest.approx(2.0)


def test_infinite_bandwidth_and_zero_bytes_cost_only_latency():
    completions, link = run_flows([(0.0, 5.0), (1.0, 7.0)], bandwidth_bytes_per_s=math.inf, latency_s=0.25)
    assert completions == [0.25, 1.25]
    assert link.bytes_transferred == 12.0
    completions, _ = run_flows([(2.0, 0.0)], bandwidth_bytes_per_s=10.0, latency_s=0.5)
    assert completions == [2.5]


def test_transfer_event_value_is_the_byte_count():
    env = simpy.Environment()
    link = ProcessorSharingLink(env, bandwidth_bytes_per_s=4.0)
    event = link.transfer(8.0)
    env.run()
    assert event.value == 8.0 and env.now == 2.0


@pytest.mark.parametrize(
    "arguments",
    [dict(bandwidth_bytes_per_s=0.0), dict(bandwidth_bytes_per_s=-1.0),
     dict(bandwidth_bytes_per_s=1.0, latency_s=-0.1), dict(bandwidth_bytes_per_s=math.nan)],
)
def test_invalid_link_parameters_raise_input_error(arguments):
    with pytest.raises(InputError):
        ProcessorSharingLink(simpy.Environment(), **arguments)


def test_negative_transfer_size_raises_input_error():
    link = ProcessorSharingLink(simpy.Environment(), bandwidth_bytes_per_s=1.0)
    with pytest.raises(InputError, match="num_bytes"):
        link.transfer(-1.0)


flows_strategy = st.lists(
    st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 1.0e3)), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None)
@given(
    flows=flows_strategy,
    bandwidth_bytes_per_s=st.floats(0.5, 1.0e3),
    latency_s=st.floats(0.0, 2.0),
)
def test_completions_never_precede_arrivals_and_link_never_beats_its_capacity(
    flows, bandwidth_bytes_per_s, latency_s
):
    completions, link = run_flows(flows, bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s)
    for (arrival_s, num_bytes), completion_s in zip(flows, completions):
        # Alone on the link is the fastest a flow can be.
        fastest_s = arrival_s + latency_s + num_bytes / bandwidth_bytes_per_s
        assert completion_s >= fastest_s - 1e-9 * max(1.0, fastest_s)
    total_bytes = sum(num_bytes for _, num_bytes in flows)
    assert total_bytes / bandwidth_bytes_per_s <= max(completions) + 1e-9 * max(1.0, max(completions))
    assert link.bytes_transferred == pytest.approx(total_bytes)
    assert link.num_active_flows == 0


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.floats(1.0e-3, 1.0e3), min_size=1, max_size=12), bandwidth=st.floats(0.5, 1.0e3))
def test_flows_started_together_finish_exactly_when_all_bytes_could_have_been_sent(sizes, bandwidth):
    # Processor sharing is work-conserving: the link is never idle while a flow is waiting.
    completions, link = run_flows([(0.0, size) for size in sizes], bandwidth_bytes_per_s=bandwidth)
    assert max(completions) == pytest.approx(sum(sizes) / bandwidth, rel=1e-9)
    assert link.busy_s == pytest.approx(max(completions), rel=1e-9)


def test_fifo_message_link_sends_messages_one_after_another():
    from churnsim.sim.model.links import FifoMessageLink

    env = simpy.Environment()
    link = FifoMessageLink(env, bandwidth_bytes_per_s=2.0, latency_s=0.5)
    arrivals = []
    for size in (2.0, 1.0):
        link.transfer(size).callbacks.append(lambda event, size=size: arrivals.append((size, env.now)))
    env.run()
    # First: 1 s on the wire + 0.5 s latency; second leaves at 1.0, takes 0.5 s, arrives at 2.0.
    assert arrivals == [(2.0, 1.5), (1.0, 2.0)]
    assert link.bytes_transferred == 3.0 and link.busy_s == 1.5
