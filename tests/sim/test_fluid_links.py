"""The closed-form engine's links (sim/model/closed_form/fluid_links.py) time transfers as the event model's
`ProcessorSharingLink` does: a group on an idle link to the bit, a busy period to rounding."""

from __future__ import annotations

import math

import simpy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from churnsim.sim.model.closed_form.transfers import IdleDuration
from churnsim.sim.model.closed_form.fluid_links import FlowBatch, FluidLink, processor_sharing_end_s
from churnsim.sim.model.links import ProcessorSharingLink

BANDWIDTHS = st.sampled_from((7.0, 1e6, 62.5e6, 3.3e9))
LATENCIES = st.sampled_from((0.0, 1e-5, 0.1))
SIZES = st.floats(min_value=1.0, max_value=1e9)


@settings(max_examples=200, deadline=None)
@given(
    bandwidth=BANDWIDTHS,
    latency=LATENCIES,
    base=SIZES,
    shapes=st.lists(st.sampled_from((1.0, 1.3, 0.7, 1 + 1e-10, 1 + 3e-10, 1 - 5e-10)), min_size=1, max_size=12),
    start_s=st.floats(min_value=0.0, max_value=1e7),
)
def test_a_group_on_an_idle_link_ends_at_the_event_models_instant(bandwidth, latency, base, shapes, start_s) -> None:
    sizes = [base * shape for shape in shapes]  # equal sizes, and sizes within the completion tolerance
    env = simpy.Environment()
    link = ProcessorSharingLink(env, bandwidth_bytes_per_s=bandwidth, latency_s=latency)

    def transfer():
        yield env.timeout(start_s)
        yield simpy.AllOf(env, link.transfer_many(sizes))

    env.run(env.process(transfer()))
    admit_s = start_s + latency if latency > 0 else start_s
    assert processor_sharing_end_s(admit_s, sizes, bandwidth) == env.now


@settings(max_examples=200, deadline=None)
@given(
    bandwidth=st.sampled_from((1e6, 62.5e6)),
    latency=LATENCIES,
    batches=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=50.0), st.lists(st.floats(min_value=1e5, max_value=1e8), min_size=1, max_size=4)),
        min_size=1,
        max_size=6,
    ),
)
def test_batches_sharing_a_busy_link_end_as_in_the_event_model(bandwidth, latency, batches) -> None:
    _check_busy_link(bandwidth, latency, batches, exact=True)


def _check_busy_link(bandwidth: float, latency: float, batches, *, exact: bool) -> None:
    batches = sorted(batches, key=lambda batch: batch[0])
    env = simpy.Environment()
    link = ProcessorSharingLink(env, bandwidth_bytes_per_s=bandwidth, latency_s=latency)
    ends: dict[int, float] = {}

    def transfer(index: int, start_s: float, sizes: list[float]):
        yield env.timeout(start_s)
        yield simpy.AllOf(env, link.transfer_many(sizes))
        ends[index] = env.now

    for index, (start_s, sizes) in enumerate(batches):
        env.process(transfer(index, start_s, sizes))
    env.run()
    fluid = FluidLink(bandwidth_bytes_per_s=bandwidth, latency_s=latency)
    added: list[FlowBatch] = []
    for start_s, sizes in batches:
        batch = FlowBatch(start_s + latency if latency > 0 else start_s, tuple(sizes), None, fluid)
        fluid.add(batch, watched=list(added))  # every earlier batch re-timed, as if something waited for each
        added.append(batch)
    for index, batch in enumerate(added):
        if exact:  # a few classes: the event model's replay, to the bit
            assert batch.end_s == ends[index], (index, batch.end_s, ends[index])
        else:
            assert math.isclose(batch.end_s, ends[index], rel_tol=1e-9), (index, batch.end_s, ends[index])


@settings(max_examples=60, deadline=None)
@given(
    bandwidth=st.sampled_from((1e6, 62.5e6)),
    latency=LATENCIES,
    batches=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=20.0), st.lists(st.floats(min_value=1e5, max_value=1e8), min_size=2, max_size=3)),
        min_size=15,
        max_size=30,
    ),
)
def test_a_crowded_link_switches_to_virtual_time_and_still_agrees(bandwidth, latency, batches) -> None:
    """More active classes than `EXACT_CLASS_LIMIT` (abandoned transfers piling up): to rounding."""
    _check_busy_link(bandwidth, latency, batches, exact=False)


@settings(max_examples=30, deadline=None)
@given(
    bandwidth=st.sampled_from((1e6, 62.5e6)),
    batches=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=5.0), st.lists(st.floats(min_value=1e6, max_value=1e8), min_size=1, max_size=2)),
        min_size=40,
        max_size=60,
    ),
)
def test_many_watched_batches_are_retimed_in_one_pass_as_one_by_one_and_as_the_event_model(bandwidth, batches) -> None:
    """In virtual service time every watched batch's end comes from one pass over the classes: it
    agrees with the end summed for each batch on its own, to rounding, and with the event model."""
    _check_busy_link(bandwidth, 0.0, batches, exact=False)
    fluid = FluidLink(bandwidth_bytes_per_s=bandwidth, latency_s=0.0)
    added: list[FlowBatch] = []
    for start_s, sizes in sorted(batches, key=lambda batch: batch[0]):
        batch = FlowBatch(start_s, tuple(sizes), None, fluid)
        fluid.add(batch, watched=list(added))
        added.append(batch)
    active = [batch for batch in added if fluid._left.get(id(batch), 0) > 0]
    # What this test is about needs many classes and many batches still on the link; identical
    # batches (one class) are the crowded-link test's business.
    assume(fluid._mode == "virtual" and len(active) > 16)

    def one_by_one_s(batch: FlowBatch) -> float:
        top = fluid._top[id(batch)]
        work = sum(count * (min(level, top) - fluid._virtual) for level, _, count, _ in fluid._levels)
        return fluid._last_s + max(work, 0.0) / bandwidth

    assert all(math.isclose(a, one_by_one_s(b), rel_tol=1e-12) for a, b in zip(fluid._virtual_ends_s(active), active))


@settings(max_examples=150, deadline=None)
@given(
    latency=LATENCIES,
    groups=st.lists(
        st.tuples(st.sampled_from((7.0, 1e6, 62.5e6, math.inf)), st.lists(st.sampled_from((0.0, 1.0, 1.3, 0.7, 2.9)), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    base=SIZES,
    start_s=st.floats(min_value=0.0, max_value=1e7),
)
def test_idle_duration_ends_transfers_on_idle_links_as_the_event_model(latency, groups, base, start_s) -> None:
    """`IdleDuration` (worked out once, then added to each start) against the event model's links:
    one flow per link to the bit, several flows on one link within a few units in the last place."""
    env = simpy.Environment()
    event_links, requests = [], []
    for bandwidth, shapes in groups:
        event_link = ProcessorSharingLink(env, bandwidth_bytes_per_s=bandwidth, latency_s=latency)
        fluid_link = FluidLink(bandwidth_bytes_per_s=bandwidth, latency_s=latency)
        event_links.append((event_link, [base * shape for shape in shapes]))
        requests += [(fluid_link, base * shape) for shape in shapes]

    def transfer():
        yield env.timeout(start_s)
        yield simpy.AllOf(env, [event for link, sizes in event_links for event in link.transfer_many(sizes)])

    env.run(env.process(transfer()))
    end_s = IdleDuration.of_requests(requests).end_s(start_s)
    one_flow_per_link = all(sum(1 for shape in shapes if shape > 0) <= 1 for _, shapes in groups)
    if one_flow_per_link:
        assert end_s == env.now
    else:
        assert math.isclose(end_s, env.now, rel_tol=1e-14, abs_tol=1e-12)
