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

Shared cores (`PipelineState.shared_cores`, a local run whose stage processes outnumber the CPU
cores): every node is a one-thread process on one host, and the operations running at the same
time share the host's cores equally (processor sharing, `_SharedCores`): with n running, each does
min(1, cores / n) core-seconds of its work per second. Operation times are then core-seconds of
work (what a run measures when its process has a core to itself), not wall time. With data
parallelism the host runs every replica's pipeline, D copies of the one simulated here doing the
same operations at the same time, so the simulated replica gets cores / D of the host. Approximation:
the operating system's scheduler is taken as perfectly fair and switching as free, and the replicas
as in lockstep.

A separate (de)embedding node (`PipelineState.embedding_node`, the authors' CheckFree layout): it
runs two schedule parts, the embedding (first hop) and the head (last hop), as two processes that
share the node's compute in request order and its all-reduce link; spans and `busy_s` report it as
stage S (one past the last stage). Stages 0 and S-1 then run only their blocks.
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
    """Per stage: its compute time (forward, backward, redundant forward, optimizer step); with a
    separate embedding node, one more entry for it (index S)."""
    bubble_fraction: float
    """1 − Σ busy_s / (len(busy_s) · time_s): the idle share of the compute nodes' time."""


@lru_cache(maxsize=256)
def _operation_orders(schedule: str, num_stages: int, num_microbatches: int, swap: bool, separate: bool = False) -> tuple:
    """Per schedule unit: the stages 0..S-1, then (separate node only) its embedding and head parts."""
    placement = "separate_node" if separate else "edge_stages"
    units = [(stage, None) for stage in range(num_stages)]
    if separate:
        units += [(num_stages, "embedding"), (num_stages, "head")]
    return tuple(
        stage_operation_order(
            schedule,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            stage=stage,
            swap_odd_microbatches=swap,
            embedding_placement=placement,
            part=part,
        )
        for stage, part in units
    )


@lru_cache(maxsize=256)
def _routes(num_stages: int, num_microbatches: int, swap: bool, separate: bool = False) -> tuple:
    placement = "separate_node" if separate else "edge_stages"
    return tuple(
        microbatch_route(num_stages, microbatch, swap_odd_microbatches=swap, embedding_placement=placement)
        for microbatch in range(num_microbatches)
    )


class _BackgroundTask:
    __slots__ = ("stage", "microbatch", "remaining_s", "on_done")

    def __init__(self, stage: int, microbatch: int, duration_s: float, on_done: Callable[[], None]):
        self.stage = stage
        self.microbatch = microbatch
        self.remaining_s = duration_s
        self.on_done = on_done


class _SharedCores:
    """Processor sharing of a host's cores among the operations running on it, one thread each.

    With n operations running each progresses at min(1, cores / n) core-seconds per second; one
    wake-up is armed for the operation that finishes first and re-armed whenever n changes.
    """

    # Work left below this many core-seconds counts as done (floating-point residue of the rates).
    _DONE_CORE_S = 1e-12

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        self.env = env
        self.cores = cores
        self.remaining_core_s: dict[object, float] = {}
        self.on_done: dict[object, Callable[[], None]] = {}
        self.updated_s = 0.0
        self.generation = 0

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self.remaining_core_s))

    def _advance(self) -> None:
        elapsed_s = self.env.now - self.updated_s
        if elapsed_s > 0 and self.remaining_core_s:
            done_core_s = elapsed_s * self._rate()
            for operation in self.remaining_core_s:
                self.remaining_core_s[operation] -= done_core_s
        self.updated_s = self.env.now

    def start(self, work_core_s: float, on_done: Callable[[], None]) -> object:
        """Start an operation of `work_core_s`; `on_done()` runs when it completes. Returns its token."""
        self._advance()
        token = object()
        self.remaining_core_s[token] = work_core_s
        self.on_done[token] = on_done
        self._arm()
        return token

    def stop(self, token: object) -> float:
        """Take an unfinished operation off the cores; returns its remaining core-seconds."""
        self._advance()
        remaining = self.remaining_core_s.pop(token)
        del self.on_done[token]
        self._arm()
        return max(remaining, 0.0)

    def _arm(self) -> None:
        self.generation += 1
        if not self.remaining_core_s:
            return
        generation = self.generation
        delay_s = max(min(self.remaining_core_s.values()), 0.0) / self._rate()
        self.env.timeout(delay_s).callbacks.append(lambda _event: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation != self.generation:
            return
        self._advance()
        # Also done: work whose end the clock cannot tell from now (now + left / rate == now in
        # floating point, at a late hour with a sliver left); waiting for it would wake at now forever.
        now, rate = self.env.now, self._rate()
        finished = [token for token, left in self.remaining_core_s.items() if left <= self._DONE_CORE_S or now + left / rate <= now]
        callbacks = []
        for token in finished:
            del self.remaining_core_s[token]
            callbacks.append(self.on_done.pop(token))
        self._arm()
        for callback in callbacks:
            callback()


class _Node:
    """One node's compute: regular work in request order; background work fills idle time.

    With `cores` (a `_SharedCores`) its operations run on the host's shared cores instead of a
    processor of its own.
    """

    def __init__(
        self,
        env: simpy.Environment,
        record: Callable[[int, str, int, float, float], None],
        cores: _SharedCores | None = None,
    ):
        self.env = env
        self.record = record
        self.cores = cores
        self.background_token: object | None = None
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
        if self.cores is None:
            finished = self.env.timeout(duration_s)
        else:
            finished = self.env.event()
            self.cores.start(duration_s, finished.succeed)
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
        if self.cores is not None:
            task.remaining_s = self.cores.stop(self.background_token)
        elif now > self.background_started_s:
            task.remaining_s -= now - self.background_started_s
        if now > self.background_started_s:
            self.record(task.stage, "redundant_forward", task.microbatch, self.background_started_s, now)

    def _resume_background(self) -> None:
        if self.background_running or not self.background:
            return
        self.background_running = True
        self.background_started_s = self.env.now
        self.background_generation += 1
        generation = self.background_generation
        remaining_s = max(self.background[0].remaining_s, 0.0)
        if self.cores is not None:
            self.background_token = self.cores.start(remaining_s, lambda: self._background_done(generation))
            return
        wakeup = self.env.timeout(remaining_s)
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
        num_stages = state.num_stages
        separate = state.embedding_node is not None
        # Schedule units: the stages, then the embedding node's embedding and head parts. Each unit
        # is one process; `unit_stage` is the stage its spans report (S for the embedding node).
        self.unit_node = tuple(state.node_of_stage) + ((state.embedding_node,) * 2 if separate else ())
        self.unit_stage = tuple(range(num_stages)) + ((num_stages,) * 2 if separate else ())
        self.unit_gradient_bytes = tuple(state.gradient_bytes_per_stage) + (
            (state.embedding_gradient_bytes, state.head_gradient_bytes) if separate else ()
        )
        self.busy_s = [0.0] * (num_stages + 1 if separate else num_stages)
        cores = (
            _SharedCores(self.env, state.shared_cores / state.data_parallel_degree)
            if state.shared_cores is not None
            else None
        )
        self.nodes = {node: _Node(self.env, self._record, cores) for node in set(self.unit_node)}
        self.links: dict[tuple[int, int], FifoMessageLink] = {}
        self.allreduce_links: dict[int, ProcessorSharingLink] = {}
        self.arrived: set = set()
        self.waiting: dict = {}
        self.routes = _routes(num_stages, state.num_microbatches, state.swap_odd_microbatches, separate)
        self.orders = _operation_orders(
            state.schedule, num_stages, state.num_microbatches, state.swap_odd_microbatches, separate
        )
        self.current_operation: list = [None] * len(self.unit_node)
        self.finished_s = [math.nan] * len(self.unit_node)
        # The embedding node steps its optimizer once, in its embedding part (which finishes last),
        # after the head part's all-reduce.
        self.head_part_reduced = self.env.event() if separate else None

    def _record(self, stage: int, kind: str, microbatch: int, start_s: float, end_s: float) -> None:
        self.spans.append((start_s, stage, kind, microbatch, end_s))
        if kind != "send" and kind != "allreduce":
            self.busy_s[stage] += end_s - start_s

    def _hop_seconds(self, hop, direction: str) -> float:
        state = self.state
        if direction == "forward":
            embedding_s, blocks, head_s = state.embedding_forward_s, state.block_forward_s, state.head_forward_s
        else:
            embedding_s, blocks, head_s = state.embedding_backward_s, state.block_backward_s, state.head_backward_s
        return (
            (embedding_s if hop.runs_embedding else 0.0)
            + (blocks[hop.stage] if hop.runs_blocks else 0.0)
            + (head_s if hop.runs_head else 0.0)
        )

    def _unit_of(self, hop) -> int:
        """The schedule unit that runs `hop`: its stage, or one of the embedding node's two parts."""
        if hop.stage < self.state.num_stages:
            return hop.stage
        return hop.stage + (0 if hop.runs_embedding else 1)

    def _deliver(self, key) -> None:
        event = self.waiting.pop(key, None)
        if event is None:
            self.arrived.add(key)
        else:
            event.succeed()

    def _send(self, sender_unit: int, receiver_unit: int, microbatch: int, key) -> None:
        state = self.state
        source, target = self.unit_node[sender_unit], self.unit_node[receiver_unit]
        sender_stage = self.unit_stage[sender_unit]
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
        # The head runs on the last stage only when the embedding node does not run it.
        head_on_successor = successor == state.num_stages - 1 and state.embedding_node is None
        return state.block_forward_s[successor] + (state.head_forward_s if head_on_successor else 0.0)

    def _stage(self, unit: int):
        state, env = self.state, self.env
        stage = self.unit_stage[unit]
        node = self.nodes[self.unit_node[unit]]
        redundant_s = self._redundant_forward_s(stage) if unit < state.num_stages else None
        # Every microbatch gets one redundant forward; the optimizer step waits for all of them.
        pending_redundant = [0 if redundant_s is None else state.num_microbatches]
        redundant_done = env.event()

        def one_redundant_done() -> None:
            pending_redundant[0] -= 1
            if pending_redundant[0] == 0:
                redundant_done.succeed()

        operations = self.orders[unit]
        for position, operation in enumerate(operations):
            self.current_operation[unit] = operation
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
                    self._send(unit, self._unit_of(route[hop_index + 1]), microbatch, (True, microbatch, hop_index + 1))
                if redundant_s is not None and self._is_last_forward_of(operations, position, stage):
                    node.add_background(_BackgroundTask(stage, microbatch, redundant_s, one_redundant_done))
            elif hop_index > 0:
                self._send(unit, self._unit_of(route[hop_index - 1]), microbatch, (False, microbatch, hop_index - 1))
        self.current_operation[unit] = "all-reduce"
        yield from self._allreduce(unit)
        if pending_redundant[0] > 0:
            self.current_operation[unit] = "waiting for its redundant forwards"
            yield redundant_done
        if unit > state.num_stages:  # the embedding node's head part: its optimizer step is the embedding part's
            self.head_part_reduced.succeed()
            self.current_operation[unit] = None
            self.finished_s[unit] = env.now
            return
        if unit == state.num_stages:
            self.current_operation[unit] = "waiting for the head part's all-reduce"
            yield self.head_part_reduced
        self.current_operation[unit] = "optimizer step"
        if state.optimizer_step_s > 0:
            yield node.run(state.optimizer_step_s, stage, "optimizer", NO_MICROBATCH)
        self.current_operation[unit] = None
        self.finished_s[unit] = env.now

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

    def _allreduce(self, unit: int):
        """Ring all-reduce, 2(D−1)/D · bytes / bandwidth + 2(D−1) · latency (Patarasuk & Yuan 2009).

        Stages on the same node share that node's data-parallel bandwidth (one PS link per node).
        """
        state = self.state
        degree = state.data_parallel_degree
        if degree == 1:
            return
        stage = self.unit_stage[unit]
        node = self.unit_node[unit]
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
        yield link.transfer(2 * (degree - 1) / degree * self.unit_gradient_bytes[unit])
        if self.env.now > start_s:
            self._record(stage, "allreduce", NO_MICROBATCH, start_s, self.env.now)

    def _unit_name(self, unit: int) -> str:
        if unit < self.state.num_stages:
            return f"stage {unit}"
        return f"embedding node ({'embedding' if unit == self.state.num_stages else 'head'})"

    def run(self) -> IterationResult:
        for unit in range(len(self.unit_node)):
            self.env.process(self._stage(unit))
        self.env.run()
        stuck = [
            f"{self._unit_name(unit)} at {operation}"
            for unit, operation in enumerate(self.current_operation)
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
        bubble = 1.0 - sum(busy_s) / (len(busy_s) * time_s) if time_s > 0 else 0.0
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


_SHARED_ITERATION_MODEL = IterationModel(max_entries=256)
"""Bounded lower than a run's own model: it outlives runs, and a large pipeline's spans take room."""


def shared_iteration_model() -> IterationModel:
    """This process's iteration model, the default of every run: a state's iteration is a pure
    function of the (frozen) state, so the runs of a sweep simulate each state once, not once per
    run or replication."""
    return _SHARED_ITERATION_MODEL
