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


class _Flow:
    __slots__ = ("num_bytes", "remaining_bytes", "done")

    def __init__(self, num_bytes: float, done: simpy.Event) -> None:
        self.num_bytes = num_bytes
        self.remaining_bytes = num_bytes
        self.done = done


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
        if not bandwidth_bytes_per_s > 0:  # also rejects NaN
            raise InputError(
                f"link {name!r}: bandwidth_bytes_per_s = {bandwidth_bytes_per_s} must be > 0; "
                "use math.inf for a link that costs only latency"
            )
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise InputError(f"link {name!r}: latency_s = {latency_s} must be finite and >= 0")
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
        if not (num_bytes >= 0 and math.isfinite(num_bytes)):
            raise InputError(f"link {self.name!r}: num_bytes = {num_bytes} must be finite and >= 0")
        env = self.env
        if num_bytes == 0 or self.bandwidth_bytes_per_s == math.inf:
            arrival = env.timeout(self.latency_s, value=num_bytes)
            arrival.callbacks.append(partial(self._count_instant, num_bytes))
            return arrival
        done = env.event()
        if self.latency_s > 0:
            env.timeout(self.latency_s).callbacks.append(partial(self._admit_after_latency, num_bytes, done))
        else:
            self._admit(num_bytes, done)
        return done

    def _count_instant(self, num_bytes: float, _event: simpy.Event) -> None:
        self.bytes_transferred += num_bytes
        self.num_transfers_completed += 1

    def _admit_after_latency(self, num_bytes: float, done: simpy.Event, _event: simpy.Event) -> None:
        self._admit(num_bytes, done)

    def _admit(self, num_bytes: float, done: simpy.Event) -> None:
        self._advance()
        self._flows.append(_Flow(num_bytes, done))
        self._arm_wakeup()

    def _advance(self) -> None:
        """Move every active flow forward to now at the rate it had since the last change."""
        now = self.env.now
        elapsed_s = now - self._last_update_s
        self._last_update_s = now
        if elapsed_s <= 0 or not self._flows:
            return
        self.busy_s += elapsed_s
        sent_per_flow = elapsed_s * self.bandwidth_bytes_per_s / len(self._flows)
        for flow in self._flows:
            flow.remaining_bytes -= sent_per_flow

    def _arm_wakeup(self) -> None:
        self._wakeup_generation += 1
        if not self._flows:
            return
        smallest = min(flow.remaining_bytes for flow in self._flows)
        delay_s = max(smallest, 0.0) * len(self._flows) / self.bandwidth_bytes_per_s
        wakeup = self.env.timeout(delay_s)
        wakeup.callbacks.append(partial(self._on_wakeup, self._wakeup_generation))

    def _on_wakeup(self, generation: int, _event: simpy.Event) -> None:
        if generation != self._wakeup_generation:
            return  # armed before a later arrival or departure changed the rates
        self._advance()
        smallest = min(flow.remaining_bytes for flow in self._flows)
        finished: list[_Flow] = []
        still_active: list[_Flow] = []
        for flow in self._flows:
            # The flow this wake-up was armed for always finishes, so drift cannot stall the link.
            if flow.remaining_bytes <= max(smallest, COMPLETION_TOLERANCE * flow.num_bytes):
                finished.append(flow)
            else:
                still_active.append(flow)
        self._flows = still_active
        for flow in finished:
            self.bytes_transferred += flow.num_bytes
            self.num_transfers_completed += 1
            flow.done.succeed(flow.num_bytes)
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
        if not bandwidth_bytes_per_s > 0:
            raise InputError(f"link {name!r}: bandwidth_bytes_per_s = {bandwidth_bytes_per_s} must be > 0")
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise InputError(f"link {name!r}: latency_s = {latency_s} must be finite and >= 0")
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
