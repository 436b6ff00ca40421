"""A fluid processor-sharing link for SimPy: concurrent transfers share the bandwidth equally.

Every active flow receives bandwidth / n bytes per second while n flows are active. On each arrival
and departure the link advances every flow by elapsed × rate, recomputes the rates and arms a single
wake-up at the earliest completion; a wake-up armed before the last change is ignored (SimPy cannot
cancel a timeout, so stale ones carry a generation number). A transfer first waits the link's
latency, which does not consume bandwidth, then enters the shared pool. This is the SimGrid-style
fluid model named in the reference sheet (simulators.md §3, pattern 3); it is used for pipeline
links, storage tiers, checkpoint flushes and recovery downloads alike, and knows nothing of them.

Approximation: a flow counts as finished when its remaining bytes fall below a relative tolerance
of `COMPLETION_TOLERANCE` of its size, which absorbs floating-point drift from repeated updates.
"""

from __future__ import annotations

import math
from functools import partial

import simpy

from churnsim.calibration.errors import InputError

COMPLETION_TOLERANCE = 1e-9


def relayed_event(env: simpy.Environment) -> tuple[simpy.Event, simpy.Event]:
    """(first, final): succeeding `first` succeeds `final` when `first` is processed.

    Stands in for a block of events that are all scheduled at one instant and one after another and
    are waited for together (`AllOf`): the condition fires when the last of the block is processed,
    so the pair reaches the waiter at the same instant and in the same order relative to every other
    event, with two events instead of the block plus the condition.
    """
    first, final = env.event(), env.event()
    first.callbacks.append(lambda _event: final.succeed())
    return first, final


class _Group:
    """Transfers waited for together: `first` is succeeded when the last of them has arrived."""

    __slots__ = ("num_pending", "first")

    def __init__(self, num_pending: int, first: simpy.Event) -> None:
        self.num_pending = num_pending
        self.first = first


def _check_link_parameters(name: str, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    if not bandwidth_bytes_per_s > 0:  # also rejects NaN
        raise InputError(
            f"link {name!r}: bandwidth_bytes_per_s = {bandwidth_bytes_per_s} must be > 0; "
            "use math.inf for a link that costs only latency"
        )
    if not (latency_s >= 0 and math.isfinite(latency_s)):
        raise InputError(f"link {name!r}: latency_s = {latency_s} must be finite and >= 0")


class _Flow:
    __slots__ = ("num_bytes", "remaining_bytes", "done", "group", "tolerance_bytes")

    def __init__(self, num_bytes: float, done: simpy.Event | None, group: _Group | None) -> None:
        self.num_bytes = num_bytes
        self.remaining_bytes = num_bytes
        self.done = done
        self.group = group
        self.tolerance_bytes = COMPLETION_TOLERANCE * num_bytes


def start_transfers(requests) -> list[simpy.Event]:
    """Start `requests` ((link, bytes) pairs) in order; `[link.transfer(n) for link, n in requests]`.

    Consecutive requests on one link start as one batch (`ProcessorSharingLink.transfer_many`).
    """
    events: list[simpy.Event] = []
    for link, sizes in _consecutive_by_link(requests):
        events.extend(link.transfer_many(sizes))
    return events


def all_transfers_done(env: simpy.Environment, requests) -> simpy.Event:
    """An event to wait for that fires exactly as `AllOf(env, start_transfers(requests))` would.

    Same instant and same order relative to other events (see `relayed_event`), but the transfers
    carry no completion event each: the last one to arrive relays to the returned event. Requests
    that are not plain processor-sharing flows (zero bytes, an infinite bandwidth) use the `AllOf`.
    """
    requests = list(requests)
    if not requests or not all(
        type(link) is ProcessorSharingLink and link.bandwidth_bytes_per_s != math.inf and num_bytes > 0
        for link, num_bytes in requests
    ):
        return simpy.AllOf(env, start_transfers(requests))
    first, final = relayed_event(env)
    group = _Group(len(requests), first)
    for link, sizes in _consecutive_by_link(requests):
        link._start_group(sizes, group)
    return final


def _consecutive_by_link(requests):
    link, sizes = None, []
    for next_link, num_bytes in requests:
        if next_link is not link:
            if sizes:
                yield link, sizes
            link, sizes = next_link, []
        sizes.append(num_bytes)
    if sizes:
        yield link, sizes


class ProcessorSharingLink:
    """One direction of a network link or one storage tier, shared equally by concurrent transfers.

    `bytes_transferred` counts the bytes of completed transfers; `busy_s` is the time during which
    at least one flow was transmitting (latency excluded); `num_active_flows` the flows now sharing.
    """

    def __init__(
        self,
        env: simpy.Environment,
        *,
        bandwidth_bytes_per_s: float,
        latency_s: float = 0.0,
        name: str = "",
    ) -> None:
        _check_link_parameters(name, bandwidth_bytes_per_s, latency_s)
        self.env = env
        self.name = name
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self.latency_s = float(latency_s)
        self.bytes_transferred = 0.0
        self.busy_s = 0.0
        self.num_transfers_completed = 0
        self._flows: list[_Flow] = []
        self._last_update_s = env.now
        self._wakeup_generation = 0

    @property
    def num_active_flows(self) -> int:
        return len(self._flows)

    def transfer(self, num_bytes: float) -> simpy.Event:
        """An event that fires (value: `num_bytes`) once `num_bytes` have arrived at the far end."""
        return self.transfer_many((num_bytes,))[0]

    def transfer_many(self, sizes) -> list[simpy.Event]:
        """`[self.transfer(n) for n in sizes]`, started together: same completion times and event order.

        Cheaper than one call per transfer: transfers that start together share one latency timer
        and one rate update (the intermediate wake-ups the separate calls would arm are stale anyway).
        """
        sizes = tuple(sizes)
        for num_bytes in sizes:
            if not (num_bytes >= 0 and math.isfinite(num_bytes)):
                raise InputError(f"link {self.name!r}: num_bytes = {num_bytes} must be finite and >= 0")
        env = self.env
        events: list[simpy.Event] = []
        batch: list[tuple[float, simpy.Event]] = []
        instant = self.bandwidth_bytes_per_s == math.inf
        for num_bytes in sizes:
            if num_bytes == 0 or instant:
                self._start_batch(batch)  # keeps the order of timers created at this instant
                batch = []
                arrival = env.timeout(self.latency_s, value=num_bytes)
                arrival.callbacks.append(partial(self._count_instant, num_bytes))
                events.append(arrival)
                continue
            done = env.event()
            batch.append((num_bytes, done, None))
            events.append(done)
        self._start_batch(batch)
        return events

    def _start_group(self, sizes, group: _Group) -> None:
        for num_bytes in sizes:
            if not (num_bytes > 0 and math.isfinite(num_bytes)):
                raise InputError(f"link {self.name!r}: num_bytes = {num_bytes} must be finite and > 0 in a group")
        self._start_batch([(num_bytes, None, group) for num_bytes in sizes])

    def _start_batch(self, batch: list[tuple]) -> None:
        if not batch:
            return
        if self.latency_s > 0:
            self.env.timeout(self.latency_s).callbacks.append(partial(self._admit_after_latency, batch))
        else:
            self._admit(batch)

    def _count_instant(self, num_bytes: float, _event: simpy.Event) -> None:
        self.bytes_transferred += num_bytes
        self.num_transfers_completed += 1

    def _admit_after_latency(self, batch: list[tuple], _event: simpy.Event) -> None:
        self._admit(batch)

    def _admit(self, batch: list[tuple]) -> None:
        """Admit (bytes, completion event or None, group or None) flows into the shared pool."""
        self._advance()
        flows = self._flows
        for num_bytes, done, group in batch:
            flows.append(_Flow(num_bytes, done, group))
        self._arm_wakeup()

    def _advance(self) -> None:
        """Move every active flow forward to now at the rate it had since the last change."""
        now = self.env.now
        elapsed_s = now - self._last_update_s
        self._last_update_s = now
        flows = self._flows
        if elapsed_s <= 0 or not flows:
            return
        self.busy_s += elapsed_s
        sent_per_flow = elapsed_s * self.bandwidth_bytes_per_s / len(flows)
        for flow in flows:
            flow.remaining_bytes -= sent_per_flow

    def _smallest_remaining_bytes(self) -> float:
        flows = self._flows
        if len(flows) == 1:
            return flows[0].remaining_bytes
        return min([flow.remaining_bytes for flow in flows])

    def _arm_wakeup(self) -> None:
        self._wakeup_generation += 1
        if not self._flows:
            return
        smallest = self._smallest_remaining_bytes()
        delay_s = max(smallest, 0.0) * len(self._flows) / self.bandwidth_bytes_per_s
        wakeup = self.env.timeout(delay_s)
        wakeup.callbacks.append(partial(self._on_wakeup, self._wakeup_generation))

    def _on_wakeup(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._wakeup_generation:
            return  # armed before a later arrival or departure changed the rates
        self._advance()
        smallest = self._smallest_remaining_bytes()
        finished: list[_Flow] = []
        still_active: list[_Flow] = []
        for flow in self._flows:
            # The flow this wake-up was armed for always finishes, so drift cannot stall the link.
            remaining = flow.remaining_bytes
            if remaining <= smallest or remaining <= flow.tolerance_bytes:
                finished.append(flow)
            else:
                still_active.append(flow)
        self._flows = still_active
        for flow in finished:
            self.bytes_transferred += flow.num_bytes
            self.num_transfers_completed += 1
            if flow.done is not None:
                flow.done.succeed(flow.num_bytes)
            else:
                group = flow.group
                group.num_pending -= 1
                if group.num_pending == 0:
                    group.first.succeed()  # where the AllOf's last completion event would be scheduled
        self._arm_wakeup()


class FifoMessageLink:
    """One direction of a point-to-point connection that sends whole messages one after another.

    A message starts transmitting when the previous one has left (bytes / bandwidth each) and
    arrives `latency_s` after its last byte left. This is how a pipeline stage's activations and
    gradients travel: one communicator per pair of stages serialises its sends (gloo and NCCL
    point-to-point), so microbatches queue rather than share the wire, and an early microbatch is
    not slowed down by later ones as it would be on a processor-sharing link.
    """

    def __init__(self, env: simpy.Environment, *, bandwidth_bytes_per_s: float, latency_s: float = 0.0, name: str = "") -> None:
        _check_link_parameters(name, bandwidth_bytes_per_s, latency_s)
        self.env = env
        self.name = name
        self.bandwidth_bytes_per_s = float(bandwidth_bytes_per_s)
        self.latency_s = float(latency_s)
        self.bytes_transferred = 0.0
        self.busy_s = 0.0
        self.num_transfers_completed = 0
        self._free_at_s = 0.0

    def transfer(self, num_bytes: float) -> simpy.Event:
        """An event that fires (value: `num_bytes`) when the message has arrived."""
        if not (num_bytes >= 0 and math.isfinite(num_bytes)):
            raise InputError(f"link {self.name!r}: num_bytes = {num_bytes} must be finite and >= 0")
        start_s = max(self.env.now, self._free_at_s)
        transmission_s = num_bytes / self.bandwidth_bytes_per_s
        self._free_at_s = start_s + transmission_s
        self.busy_s += transmission_s
        self.bytes_transferred += num_bytes
        self.num_transfers_completed += 1
        return self.env.timeout(self._free_at_s + self.latency_s - self.env.now, value=num_bytes)
