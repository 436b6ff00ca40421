"""The pipeline state one iteration is simulated for, and how a scenario builds it.

`PipelineState` is everything that determines one iteration's timeline, frozen and hashable so that
results can be cached. A degraded node that runs two stages is two stages mapped to one node in `node_of_stage`. Links are
given per ordered node pair (full duplex): `link_latency_s[a][b]` and
`link_bandwidth_bytes_per_s[a][b]` describe the direction a → b; the diagonal is unused because a
transfer between stages on the same node is free.

`build_pipeline_state` makes it from a scenario (compute, links, all-reduce). Compute per microbatch comes either from measured/assumed times (`ExplicitCompute`, a scalar applies
to every stage) or from FLOPs (`FlopsCompute`): a stage's transformer blocks cost 2·N_blocks·tokens
forward and 4·N_blocks·tokens backward (Kaplan et al., arXiv 2001.08361), tokens = microbatch size ×
sequence length, at peak × utilisation. The embedding lookup is taken as free (a gather, no matmul);
the head (lm_head) costs 2·(vocab·d)·tokens forward and twice that backward. Links come from the
scenario's network section (`calibration.network.link_matrices`), one node per stage; a degraded
node that runs two stages is expressed through `node_of_stage`.

Unequal stages (`pipeline.layers_per_stage`): FLOPs follow each stage's blocks; an explicit scalar
block time is the time of a stage of average size, scaled by each stage's share of the layers.
A separate (de)embedding node (`pipeline.embedding_placement = "separate_node"`) is node S
(`embedding_node`): it runs the embedding and the head and all-reduces their gradients; the stages
then hold and all-reduce only their blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from churnsim.calibration.base import LONGEST_DURATION_S, endless_transfer
from churnsim.calibration.errors import InputError
from churnsim.calibration.network import link_matrices
from churnsim.calibration.pipeline_schedule import SCHEDULES
from churnsim.calibration.scenario import ExplicitCompute, FlopsCompute, Scenario

Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True, kw_only=True)
class PipelineState:
    """Everything that determines one iteration's timeline. Lists are stored as tuples."""

    num_stages: int
    num_microbatches: int
    schedule: str
    """"gpipe" or "1f1b"."""
    block_forward_s: tuple[float, ...]
    """Per stage: forward time of its transformer blocks for one microbatch."""
    block_backward_s: tuple[float, ...]
    embedding_forward_s: float = 0.0
    """Runs on stage 0 (the hop that embeds)."""
    embedding_backward_s: float = 0.0
    head_forward_s: float = 0.0
    """Final norm, lm_head and loss; runs on stage S − 1 (the hop that owns the head)."""
    head_backward_s: float = 0.0
    activation_bytes: float = 0.0
    """Per microbatch per hop boundary; a gradient has the same size."""
    node_of_stage: tuple[int, ...] | None = None
    """Node each stage runs on; None means stage i on node i."""
    link_latency_s: Matrix | None = None
    """[a][b] for the direction a → b; None means zero everywhere."""
    link_bandwidth_bytes_per_s: Matrix | None = None
    """[a][b] for the direction a → b; None means infinite everywhere."""
    swap_odd_microbatches: bool = False
    """CheckFree+ routes (see calibration.pipeline_schedule)."""
    embedding_node: int | None = None
    """Node that runs the embedding and the head when they have a node of their own (a scenario's
    `pipeline.embedding_placement = "separate_node"`; it must differ from every stage's node). None:
    they run with the blocks of stages 0 and S-1."""
    embedding_gradient_bytes: float = 0.0
    """Bytes the embedding node all-reduces for the embedding (with `embedding_node` only)."""
    head_gradient_bytes: float = 0.0
    """Bytes the embedding node all-reduces for the final norm and lm_head (with `embedding_node` only)."""
    redundant_forward: bool = False
    """Bamboo: each stage also runs its successor's forward in idle time (see sim.model.iteration)."""
    data_parallel_degree: int = 1
    gradient_bytes_per_stage: tuple[float, ...] | None = None
    """Bytes each stage all-reduces; None means zero."""
    allreduce_bandwidth_bytes_per_s: float = math.inf
    allreduce_latency_s: float = 0.0
    optimizer_step_s: float = 0.0
    shared_cores: int | None = None
    """None: every node computes on a processor of its own. A number: every node is a one-thread
    process on one host with this many CPU cores, which running operations share (see
    sim.model.iteration); operation times are then core-seconds of work. With data parallelism the
    host runs all `data_parallel_degree` replicas' processes, so one replica gets cores / D."""
    _num_nodes: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        stages = self.num_stages
        if not (isinstance(stages, int) and stages >= 1):
            raise InputError(f"num_stages = {stages!r} must be an integer >= 1")
        if not (isinstance(self.num_microbatches, int) and self.num_microbatches >= 1):
            raise InputError(f"num_microbatches = {self.num_microbatches!r} must be an integer >= 1")
        if self.schedule not in SCHEDULES:
            raise InputError(f"schedule = {self.schedule!r} is unknown: use one of {', '.join(SCHEDULES)}")
        if not (isinstance(self.data_parallel_degree, int) and self.data_parallel_degree >= 1):
            raise InputError(f"data_parallel_degree = {self.data_parallel_degree!r} must be an integer >= 1")
        for name in ("block_forward_s", "block_backward_s"):
            self._set(name, _seconds_vector(name, getattr(self, name), stages))
        gradient = self.gradient_bytes_per_stage
        self._set("gradient_bytes_per_stage", _seconds_vector(
            "gradient_bytes_per_stage", (0.0,) * stages if gradient is None else gradient, stages, seconds=False))
        for name in ("embedding_forward_s", "embedding_backward_s", "head_forward_s", "head_backward_s",
                     "allreduce_latency_s", "optimizer_step_s"):
            self._set(name, _non_negative(name, getattr(self, name), seconds=True))
        for name in ("activation_bytes", "embedding_gradient_bytes", "head_gradient_bytes"):
            self._set(name, _non_negative(name, getattr(self, name)))
        bandwidth = float(self.allreduce_bandwidth_bytes_per_s)
        if not bandwidth > 0:
            raise InputError(f"allreduce_bandwidth_bytes_per_s = {bandwidth} must be > 0 (math.inf allowed)")
        self._set("allreduce_bandwidth_bytes_per_s", bandwidth)
        nodes = tuple(range(stages)) if self.node_of_stage is None else tuple(self.node_of_stage)
        if len(nodes) != stages or any(not isinstance(n, int) or n < 0 for n in nodes):
            raise InputError(
                f"node_of_stage = {nodes} must list one node index >= 0 per stage ({stages} stages)"
            )
        self._set("node_of_stage", nodes)
        num_nodes = max(nodes) + 1
        embedding_node = self.embedding_node
        if embedding_node is not None:
            if not (isinstance(embedding_node, int) and embedding_node >= 0) or embedding_node in nodes:
                raise InputError(
                    f"embedding_node = {embedding_node!r} must be a node index >= 0 that runs no stage (stages run on {nodes})"
                )
            num_nodes = max(num_nodes, embedding_node + 1)
        self._set("_num_nodes", num_nodes)
        latency = self.link_latency_s
        self._set("link_latency_s", _matrix(
            "link_latency_s", ((0.0,) * num_nodes,) * num_nodes if latency is None else latency, num_nodes,
            allow_zero=True))
        bandwidth_matrix = self.link_bandwidth_bytes_per_s
        self._set("link_bandwidth_bytes_per_s", _matrix(
            "link_bandwidth_bytes_per_s",
            ((math.inf,) * num_nodes,) * num_nodes if bandwidth_matrix is None else bandwidth_matrix,
            num_nodes, allow_zero=False))
        self._check_transfers_end()
        cores = self.shared_cores
        if cores is not None and not (isinstance(cores, int) and cores >= 1):
            raise InputError(f"shared_cores = {cores!r} must be None or an integer >= 1")
        self._set("swap_odd_microbatches", bool(self.swap_odd_microbatches))
        self._set("redundant_forward", bool(self.redundant_forward))

    def _check_transfers_end(self) -> None:
        # Like every operation, a transfer must end within LONGEST_DURATION_S: at 1e-300 B/s one
        # overflowed to an iteration of inf s, and the time accounting to NaN.
        matrix = self.link_bandwidth_bytes_per_s
        assert matrix is not None
        slowest = min((value for a, row in enumerate(matrix) for b, value in enumerate(row) if a != b), default=math.inf)
        problem = endless_transfer(
            "the slowest link", slowest, self.activation_bytes, f"carry {self.activation_bytes:g} activation bytes",
            "give the network larger bandwidths",
        )
        if problem is None and self.data_parallel_degree > 1:
            largest_gradient = max((*self.gradient_bytes_per_stage, self.embedding_gradient_bytes, self.head_gradient_bytes))
            problem = endless_transfer(
                "the all-reduce's bandwidth", self.allreduce_bandwidth_bytes_per_s, largest_gradient, f"carry {largest_gradient:g} gradient bytes"
            )
        if problem is not None:
            raise InputError(problem)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @classmethod
    def uniform(
        cls,
        *,
        num_stages: int,
        num_microbatches: int,
        schedule: str,
        forward_s: float,
        backward_s: float,
        link_latency_s: float = 0.0,
        link_bandwidth_bytes_per_s: float = math.inf,
        **other: Any,
    ) -> PipelineState:
        """Equal stages (block times `forward_s`, `backward_s`) and one latency/bandwidth per pair.

        `other` takes any further field (activation_bytes, node_of_stage, data_parallel_degree, ...).
        """
        nodes = other.get("node_of_stage")
        num_nodes = num_stages if nodes is None else max(nodes) + 1
        if other.get("embedding_node") is not None:
            num_nodes = max(num_nodes, other["embedding_node"] + 1)
        return cls(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            block_forward_s=(forward_s,) * num_stages,
            block_backward_s=(backward_s,) * num_stages,
            link_latency_s=((link_latency_s,) * num_nodes,) * num_nodes,
            link_bandwidth_bytes_per_s=((link_bandwidth_bytes_per_s,) * num_nodes,) * num_nodes,
            **other,
        )

    def as_dict(self) -> dict[str, Any]:
        """Init fields only, e.g. for a manifest."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def _non_negative(name: str, value: Any, *, seconds: bool = False) -> float:
    number = float(value)
    if not (number >= 0 and math.isfinite(number)):
        raise InputError(f"{name} = {value!r} must be finite and >= 0")
    if seconds and number > LONGEST_DURATION_S:
        raise InputError(f"{name} = {value!r} is more than {LONGEST_DURATION_S:g} s (31.7 years); give seconds of one operation")
    return number


def _seconds_vector(name: str, values: Any, length: int, *, seconds: bool = True) -> tuple[float, ...]:
    vector = tuple(_non_negative(name, value, seconds=seconds) for value in values)
    if len(vector) != length:
        raise InputError(f"{name} has {len(vector)} entries; give one per stage ({length})")
    return vector


def _matrix(name: str, rows: Any, size: int, *, allow_zero: bool) -> Matrix:
    matrix = tuple(tuple(float(value) for value in row) for row in rows)
    if len(matrix) < size or any(len(row) != len(matrix) for row in matrix):
        raise InputError(f"{name} must be a square matrix covering all {size} nodes; got {len(matrix)} rows")
    for row_index, row in enumerate(matrix):
        for column_index, value in enumerate(row):
            if row_index == column_index:
                continue  # same node: transfers are free, the diagonal is never read
            bad = (not 0 <= value <= LONGEST_DURATION_S) if allow_zero else not value > 0
            if bad:
                rule = f"finite, >= 0 and at most {LONGEST_DURATION_S:g} s" if allow_zero else "> 0 (math.inf allowed)"
                raise InputError(f"{name} contains {value}; every entry must be {rule}")
    return matrix


def _per_stage(value: float | tuple[float, ...], num_stages: int, layers: tuple[int, ...]) -> tuple[float, ...]:
    """Per-stage times: a tuple as given; a scalar is the time of a stage of average size, scaled by
    each stage's share of the layers (equal stages: the scalar itself)."""
    if isinstance(value, tuple):
        return value
    if len(set(layers)) == 1:
        return (float(value),) * num_stages
    mean_layers = sum(layers) / num_stages
    return tuple(float(value) * count / mean_layers for count in layers)


def build_pipeline_state(
    scenario: Scenario,
    *,
    swap_odd_microbatches: bool = False,
    redundant_forward: bool = False,
    node_of_stage: tuple[int, ...] | None = None,
) -> PipelineState:
    """The pipeline state of `scenario` with the given method flags and stage placement."""
    model, pipeline, compute = scenario.model, scenario.pipeline, scenario.compute
    num_stages = pipeline.num_stages
    layers = scenario.stage_layer_counts
    shared_cores = None
    if isinstance(compute, ExplicitCompute):
        shared_cores = compute.shared_cores
        block_forward_s = _per_stage(compute.block_forward_s, num_stages, layers)
        block_backward_s = _per_stage(compute.block_backward_s, num_stages, layers)
        embedding_forward_s, embedding_backward_s = compute.embedding_forward_s, compute.embedding_backward_s
        head_forward_s, head_backward_s = compute.head_forward_s, compute.head_backward_s
    else:
        assert isinstance(compute, FlopsCompute)
        flops_per_s = compute.peak_flops_per_s * compute.utilization
        tokens = pipeline.microbatch_size * model.sequence_length
        block_parameters = tuple(count * model.parameters_per_layer for count in layers)
        block_forward_s = tuple(2.0 * parameters * tokens / flops_per_s for parameters in block_parameters)
        block_backward_s = tuple(4.0 * parameters * tokens / flops_per_s for parameters in block_parameters)
        embedding_forward_s = embedding_backward_s = 0.0  # a lookup: negligible next to the blocks
        head_forward_s = 2.0 * model.vocab_size * model.hidden_size * tokens / flops_per_s
        head_backward_s = 2.0 * head_forward_s
    separate = pipeline.embedding_placement == "separate_node"
    # The separate (de)embedding node is node S: its links are those of the S-th node of the network.
    latency, bandwidth = link_matrices(scenario.network, num_stages + 1 if separate else num_stages)
    network = scenario.network
    weight_bytes = model.weight_bytes_per_parameter
    gradient_bytes = tuple(scenario.stage_parameters(stage) * weight_bytes for stage in range(num_stages))
    if separate:
        # The stages all-reduce only their blocks; the embedding node all-reduces the rest.
        gradient_bytes = tuple(count * model.parameters_per_layer * weight_bytes for count in layers)
    return PipelineState(
        num_stages=num_stages,
        num_microbatches=pipeline.num_microbatches,
        schedule=pipeline.schedule,
        block_forward_s=block_forward_s,
        block_backward_s=block_backward_s,
        embedding_forward_s=embedding_forward_s,
        embedding_backward_s=embedding_backward_s,
        head_forward_s=head_forward_s,
        head_backward_s=head_backward_s,
        activation_bytes=scenario.activation_bytes,
        node_of_stage=node_of_stage,
        link_latency_s=latency,
        link_bandwidth_bytes_per_s=bandwidth,
        swap_odd_microbatches=swap_odd_microbatches,
        redundant_forward=redundant_forward,
        embedding_node=num_stages if separate else None,
        embedding_gradient_bytes=model.embedding_parameters * weight_bytes if separate else 0.0,
        head_gradient_bytes=model.head_parameters * weight_bytes if separate else 0.0,
        data_parallel_degree=pipeline.data_parallel_degree,
        gradient_bytes_per_stage=gradient_bytes,
        allreduce_bandwidth_bytes_per_s=network.allreduce_bandwidth_bytes_per_s,
        allreduce_latency_s=network.allreduce_latency_s,
        optimizer_step_s=compute.optimizer_step_s,
        shared_cores=shared_cores,
    )


def compute_only_state(state: PipelineState) -> PipelineState:
    """The same pipeline with free links and all-reduce: what compute and the schedule alone cost."""
    return dataclasses.replace(
        state,
        link_latency_s=None,
        link_bandwidth_bytes_per_s=None,
        allreduce_latency_s=0.0,
        allreduce_bandwidth_bytes_per_s=math.inf,
    )
