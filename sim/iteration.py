"""Per-microbatch SimPy model of one pipeline-parallel training iteration.

Each stage performs `stage_operation_order(...)` (GPipe or 1F1B, optionally with CheckFree+ swapped
routes) strictly in order. An operation waits for its input (forward: the previous hop's activation;
backward: the next hop's gradient; the head hop's backward needs none), then for the compute of the
node the stage runs on; every node computes one thing at a time, in request order. Activations and
gradients (`activation_bytes` each) travel over one FIFO message link per ordered node pair
(`FifoMessageLink`: a pair's sends queue one after another, as on one gloo/NCCL communicator); a
transfer between two stages on one node is free.
After its last backward a stage all-reduces its gradients over its data-parallel ring and then runs
its optimizer step. For uniform stages and free links the result equals (M + S − 1)(t_f + t_b).

Redundant forward (Bamboo, Thorpe et al., NSDI'23): stage s also runs the forward of its successor
s + 1 (blocks, plus the head when s + 1 is the last stage) for every microbatch. Rule chosen here:
the redundant forward of microbatch m becomes ready when stage s has finished its own forward of m
(the successor's input is stage s's output, so it needs no transfer); it runs only while its node
has no regular work ready, is preempted the instant regular work becomes ready and resumes later
(preemptive-resume, in readiness order), so it never delays regular work. Stage s's optimizer step
waits until its redundant forwards are done. No redundant forward is run by the last stage, nor
where the successor already runs on the same node (a degraded node runs that stage for real).
Approximation: preemption is instantaneous and free (a real GPU would finish the current kernel).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import simpy

from churnsim.calibration.pipeline_schedule import microbatch_route, stage_operation_order

from .pipeline_state import PipelineState
from .links import FifoMessageLink, ProcessorSharingLink

__all__ = ["IterationModel", "IterationResult", "PipelineState", "Span", "simulate_iteration"]

SPAN_KINDS = ("forward", "backward", "send", "redundant_forward", "allreduce", "optimizer")
NO_MICROBATCH = -1


@dataclass(frozen=True, kw_only=True)
class Span:
    """One interval of work; the field names are shared with real runs' spans for the Gantt plot."""

    stage: int
    kind: str  # one of SPAN_KINDS
    microbatch: int  # NO_MICROBATCH (-1) for all-reduce and optimizer
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class IterationResult:
    time_s: float
    """End of the last optimizer step (of the last operation if there is nothing after it)."""
    spans: tuple[Span, ...]
    """Sorted by (start_s, stage, kind, microbatch). Zero-length sends and all-reduces are omitted."""
    busy_s: tuple[float, ...]
    """Per stage: its compute time (forward, backward, redundant forward, optimizer step)."""
    bubble_fraction: float
    """1 − Σ busy_s / (num_stages · time_s): the idle share of the stages' compute."""


@lru_cache(maxsize=256)
def _operation_orders(schedule: str, num_stages: int, num_microbatches: int, swap: bool) -> tuple:
    return tuple(
        stage_operation_order(
            schedule,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage=stage,
            swap_odd_microbatches=swap,
        )
        for stage in range(num_stages)
    )


@lru_cache(maxsize=256)
def _routes(num_stages: int, num_microbatches: int, swap: bool) -> tuple:
    return tuple(
        microbatch_route(num_stages, microbatch, swap_odd_microbatches=swap)
        for microbatch in range(num_microbatches)
    )


class _BackgroundTask:
    __slots__ = ("stage", "microbatch", "remaining_s", "on_done")

    def __init__(self, stage: int, microbatch: int, duration_s: float, on_done: Callable[[], None]):
        self.stage = stage
        self.microbatch = microbatch
        self.remaining_s = duration_s
        self.on_done = on_done


class _Node:
    """One node's compute: regular work in request order; background work fills idle time."""

    def __init__(self, env: simpy.Environment, record: Callable[[int, str, int, float, float], None]):
        self.env = env
        self.record = record
        self.running_regular = False
        self.queue: deque = deque()  # (duration_s, stage, kind, microbatch, done event)
        self.background: deque[_BackgroundTask] = deque()
        self.background_started_s = 0.0
        self.background_running = False
        self.background_generation = 0

    def run(self, duration_s: float, stage: int, kind: str, microbatch: int) -> simpy.Event:
        if self.running_regular:
            done = self.env.event()
            self.queue.append((duration_s, stage, kind, microbatch, done))
            return done
        return self._start(duration_s, stage, kind, microbatch, None)

    def _start(self, duration_s, stage, kind, microbatch, done) -> simpy.Event:
        self._pause_background()
        self.running_regular = True
        start_s = self.env.now
        finished = self.env.timeout(duration_s)
        finished.callbacks.append(lambda _event: self._finish(stage, kind, microbatch, start_s, done))
        return finished

    def _finish(self, stage, kind, microbatch, start_s, done) -> None:
        self.record(stage, kind, microbatch, start_s, self.env.now)
        self.running_regular = False
        if done is not None:
            done.succeed()
        if self.queue:
            self._start(*self.queue.popleft())
        else:
            self._resume_background()

    def add_background(self, task: _BackgroundTask) -> None:
        self.background.append(task)
        if not self.running_regular:
            self._resume_background()

    def _pause_background(self) -> None:
        if not self.background_running:
            return
        self.background_running = False
        self.background_generation += 1  # the armed completion is now stale
        task = self.background[0]
        now = self.env.now
        if now > self.background_started_s:
            task.remaining_s -= now - self.background_started_s
            self.record(task.stage, "redundant_forward", task.microbatch, self.background_started_s, now)

    def _resume_background(self) -> None:
        if self.background_running or not self.background:
            return
        self.background_running = True
        self.background_started_s = self.env.now
        self.background_generation += 1
        generation = self.background_generation
        wakeup = self.env.timeout(max(self.background[0].remaining_s, 0.0))
        wakeup.callbacks.append(lambda _event: self._background_done(generation))

    def _background_done(self, generation: int) -> None:
        if generation != self.background_generation:
            return
        task = self.background.popleft()
        self.background_running = False
        if self.env.now > self.background_started_s:
            self.record(task.stage, "redundant_forward", task.microbatch, self.background_started_s, self.env.now)
        task.on_done()
        self._resume_background()


class _IterationRun:
    """The SimPy processes and bookkeeping of one simulated iteration."""

    def __init__(self, state: PipelineState) -> None:
        self.state = state
        self.env = simpy.Environment()
        self.spans: list[tuple] = []
        self.busy_s = [0.0] * state.num_stages
        self.nodes = {node: _Node(self.env, self._record) for node in set(state.node_of_stage)}
        self.links: dict[tuple[int, int], FifoMessageLink] = {}
        self.allreduce_links: dict[int, ProcessorSharingLink] = {}
        self.arrived: set = set()
        self.waiting: dict = {}
        self.routes = _routes(state.num_stages, state.num_microbatches, state.swap_odd_microbatches)
        self.orders = _operation_orders(
            state.schedule, state.num_stages, state.num_microbatches, state.swap_odd_microbatches
        )
        self.current_operation: list = [None] * state.num_stages
        self.finished_s = [math.nan] * state.num_stages

    def _record(self, stage: int, kind: str, microbatch: int, start_s: float, end_s: float) -> None:
        self.spans.append((start_s, stage, kind, microbatch, end_s))
        if kind != "send" and kind != "allreduce":
            self.busy_s[stage] += end_s - start_s

    def _hop_seconds(self, hop, direction: str) -> float:
        state = self.state
        if direction == "forward":
            parts = (state.embedding_forward_s, state.block_forward_s[hop.stage], state.head_forward_s)
        else:
            parts = (state.embedding_backward_s, state.block_backward_s[hop.stage], state.head_backward_s)
        return (
            (parts[0] if hop.runs_embedding else 0.0)
            + (parts[1] if hop.runs_blocks else 0.0)
            + (parts[2] if hop.runs_head else 0.0)
        )

    def _deliver(self, key) -> None:
        event = self.waiting.pop(key, None)
        if event is None:
            self.arrived.add(key)
        else:
            event.succeed()

    def _send(self, sender_stage: int, receiver_stage: int, microbatch: int, key) -> None:
        state = self.state
        source, target = state.node_of_stage[sender_stage], state.node_of_stage[receiver_stage]
        if source == target:
            self._deliver(key)
            return
        link = self.links.get((source, target))
        if link is None:
            link = FifoMessageLink(
                self.env,
                bandwidth_bytes_per_s=state.link_bandwidth_bytes_per_s[source][target],
                latency_s=state.link_latency_s[source][target],
                name=f"{source}->{target}",
            )
            self.links[(source, target)] = link
        start_s = self.env.now

        def arrived(_event) -> None:
            if self.env.now > start_s:
                self._record(sender_stage, "send", microbatch, start_s, self.env.now)
            self._deliver(key)

        link.transfer(state.activation_bytes).callbacks.append(arrived)

    def _redundant_forward_s(self, stage: int) -> float | None:
        state = self.state
        successor = stage + 1
        if (
            not state.redundant_forward
            or successor >= state.num_stages
            or state.node_of_stage[successor] == state.node_of_stage[stage]
        ):
            return None
        head_s = state.head_forward_s if successor == state.num_stages - 1 else 0.0
        return state.block_forward_s[successor] + head_s

    def _stage(self, stage: int):
        state, env = self.state, self.env
        node = self.nodes[state.node_of_stage[stage]]
        redundant_s = self._redundant_forward_s(stage)
        # Every microbatch gets one redundant forward; the optimizer step waits for all of them.
        pending_redundant = [0 if redundant_s is None else state.num_microbatches]
        redundant_done = env.event()

        def one_redundant_done() -> None:
            pending_redundant[0] -= 1
            if pending_redundant[0] == 0:
                redundant_done.succeed()

        operations = self.orders[stage]
        for position, operation in enumerate(operations):
            self.current_operation[stage] = operation
            microbatch, hop_index = operation.microbatch, operation.hop_index
            route = self.routes[microbatch]
            forward = operation.direction == "forward"
            needs_input = hop_index > 0 if forward else hop_index < len(route) - 1
            if needs_input:
                key = (forward, microbatch, hop_index)
                if key in self.arrived:
                    self.arrived.discard(key)
                else:
                    arrival = env.event()
                    self.waiting[key] = arrival
                    yield arrival
            yield node.run(self._hop_seconds(route[hop_index], operation.direction), stage,
                           operation.direction, microbatch)
            if forward:
                if hop_index + 1 < len(route):
                    self._send(stage, route[hop_index + 1].stage, microbatch, (True, microbatch, hop_index + 1))
                if redundant_s is not None and self._is_last_forward_of(operations, position, stage):
                    node.add_background(_BackgroundTask(stage, microbatch, redundant_s, one_redundant_done))
            elif hop_index > 0:
                self._send(stage, route[hop_index - 1].stage, microbatch, (False, microbatch, hop_index - 1))
        self.current_operation[stage] = "all-reduce"
        yield from self._allreduce(stage)
        if pending_redundant[0] > 0:
            self.current_operation[stage] = "waiting for its redundant forwards"
            yield redundant_done
        self.current_operation[stage] = "optimizer step"
        if state.optimizer_step_s > 0:
            yield node.run(state.optimizer_step_s, stage, "optimizer", NO_MICROBATCH)
        self.current_operation[stage] = None
        self.finished_s[stage] = env.now

    @staticmethod
    def _is_last_forward_of(operations, position: int, stage: int) -> bool:
        """Whether no later forward of the same microbatch follows on this stage (swapped routes)."""
        operation = operations[position]
        following = operations[position + 1] if position + 1 < len(operations) else None
        return not (
            following is not None
            and following.direction == "forward"
            and following.microbatch == operation.microbatch
        )

    def _allreduce(self, stage: int):
        """Ring all-reduce, 2(D−1)/D · bytes / bandwidth + 2(D−1) · latency (Patarasuk & Yuan 2009).

        Stages on the same node share that node's data-parallel bandwidth (one PS link per node).
        """
        state = self.state
        degree = state.data_parallel_degree
        if degree == 1:
            return
        node = state.node_of_stage[stage]
        link = self.allreduce_links.get(node)
        if link is None:
            link = ProcessorSharingLink(
                self.env,
                bandwidth_bytes_per_s=state.allreduce_bandwidth_bytes_per_s,
                latency_s=2 * (degree - 1) * state.allreduce_latency_s,
                name=f"allreduce@{node}",
            )
            self.allreduce_links[node] = link
        start_s = self.env.now
        yield link.transfer(2 * (degree - 1) / degree * state.gradient_bytes_per_stage[stage])
        if self.env.now > start_s:
            self._record(stage, "allreduce", NO_MICROBATCH, start_s, self.env.now)

    def run(self) -> IterationResult:
        state = self.state
        for stage in range(state.num_stages):
            self.env.process(self._stage(stage))
        self.env.run()
        stuck = [
            f"stage {stage} at {operation}"
            for stage, operation in enumerate(self.current_operation)
            if operation is not None
        ]
        if stuck:
            raise RuntimeError("pipeline iteration deadlocked: " + "; ".join(stuck))
        time_s = max(self.finished_s)
        spans = tuple(
            Span(stage=stage, kind=kind, microbatch=microbatch, start_s=start_s, end_s=end_s)
            for start_s, stage, kind, microbatch, end_s in sorted(
                self.spans, key=lambda row: (row[0], row[1], SPAN_KINDS.index(row[2]), row[3])
            )
        )
        busy_s = tuple(self.busy_s)
        bubble = 1.0 - sum(busy_s) / (state.num_stages * time_s) if time_s > 0 else 0.0
        return IterationResult(time_s=time_s, spans=spans, busy_s=busy_s, bubble_fraction=bubble)


def simulate_iteration(state: PipelineState) -> IterationResult:
    """Simulate one iteration of `state` (no cache; see `IterationModel`)."""
    return _IterationRun(state).run()


class IterationModel:
    """`simulate_iteration` with a cache keyed by the (hashable) pipeline state.

    Hashing a state (nested tuples) on every lookup is costly, so a lookup first tries the state
    object itself (by identity; callers such as the recovery policies reuse their state objects).
    """

    def __init__(self, *, max_entries: int = 4096) -> None:
        self._cache: dict[PipelineState, IterationResult] = {}
        self._by_identity: dict[int, tuple[PipelineState, IterationResult]] = {}
        """id(state) → (state, result); holding the state keeps its id from being reused."""
        self._max_entries = max_entries
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    def result(self, state: PipelineState) -> IterationResult:
        known = self._by_identity.get(id(state))
        if known is not None and known[0] is state:
            self.num_cache_hits += 1
            return known[1]
        cached = self._cache.get(state)
        if cached is not None:
            self.num_cache_hits += 1
            self._remember_identity(state, cached)
            return cached
        self.num_cache_misses += 1
        result = simulate_iteration(state)
        if len(self._cache) >= self._max_entries:
            self._cache.pop(next(iter(self._cache)))  # evict the oldest entry
        self._cache[state] = result
        self._remember_identity(state, result)
        return result

    def _remember_identity(self, state: PipelineState, result: IterationResult) -> None:
        if len(self._by_identity) >= self._max_entries:
            self._by_identity.clear()
        self._by_identity[id(state)] = (state, result)

    def iteration_time_s(self, state: PipelineState) -> float:
        return self.result(state).time_s
