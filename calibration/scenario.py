"""The Scenario: everything a simulated (or real) run needs, validated on load.

A scenario file is JSON (see README "File formats"): JSON round-trips every value exactly, needs no
extra dependency and is what pydantic validates natively. Units are in the field names.
"""

import math
from collections.abc import Sequence
from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Field, PlainSerializer, field_validator, model_validator

from .base import LONGEST_DURATION_S, SCHEMA_VERSION, FiniteNumbersModel, StrictModel, endless_transfer, load_model, save_model, validate_model
from .churn import ChurnConfig
from .convergence import ConvergenceSpec, iterations_for_target
from .errors import InputError
from .methods import MethodConfig, method_from_name

GIB = 2**30
CORPUS_MAX_BYTES = 2_000_000
"""How much of the training corpus a real run reads, unless its scenario says otherwise: the same
for `churnsim real run`, the calibration suite and the convergence lab, so that a calibration's loss
curve and setbacks stand for runs on the same text (the built-in `cpu-tiny` calibration's were
measured on it). A run that reads more of the corpus is not comparable: its smoothed loss after
the same iterations differs from that of a run of the same seed on these 2 MB."""


class ModelSpec(StrictModel):
    """A LLaMA-style decoder: RMSNorm, RoPE, SwiGLU, no biases, untied lm_head."""

    name: str = "custom"
    """A label for the model, shown in reports and in `churnsim presets`; it changes no result."""
    num_layers: int = Field(ge=1)
    """Transformer blocks (decoder layers), split over the pipeline's stages (`pipeline.layers_per_stage`)."""
    hidden_size: int = Field(ge=1)
    """Width d of the hidden states: sets the parameters of a block (4 d² + 3 d · ffn width + 2 d)
    and the activation bytes a microbatch sends from stage to stage."""
    num_heads: int = Field(ge=1)
    """Attention heads; must divide hidden_size. Real runs build the model with them; the
    simulator's times and bytes do not depend on them."""
    vocab_size: int = Field(ge=1)
    """Tokens in the vocabulary: the embedding and the lm_head hold vocab_size · hidden_size
    parameters each, and with compute from FLOPs it sets the head's time."""
    sequence_length: int = Field(ge=1)
    """Tokens per sequence: with `pipeline.microbatch_size`, the tokens of a microbatch, which set
    its activation bytes, its FLOPs and the global batch (tokens per iteration)."""
    ffn_hidden_size: int | None = Field(None, ge=1)
    """SwiGLU hidden width; None means 4 · hidden_size (the CheckFree reference models)."""
    weight_bytes_per_parameter: float = Field(2.0, gt=0)
    """Bytes per parameter moved when a stage's weights are sent (bf16: 2)."""
    checkpoint_bytes_per_parameter: float = Field(16.0, gt=0)
    """Bytes per parameter in a checkpoint: weights + fp32 master + Adam moments (ZeRO, arXiv 1910.02054)."""
    activation_bytes_per_element: float = Field(2.0, gt=0)
    """Bytes per element of the hidden states (and their gradients) sent between stages (bf16: 2): a
    microbatch sends microbatch_size · sequence_length · hidden_size elements across each stage boundary."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelSpec":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        return self

    @property
    def ffn_width(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def parameters_per_layer(self) -> int:
        # attention q, k, v, o (4 d²) + SwiGLU gate, up, down (3 d f) + two RMSNorm gains.
        return 4 * self.hidden_size**2 + 3 * self.hidden_size * self.ffn_width + 2 * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_parameters(self) -> int:
        # final RMSNorm + untied lm_head
        return self.hidden_size + self.vocab_size * self.hidden_size

    def boundary_activation_bytes(self, microbatch_size: int) -> float:
        """Bytes of one microbatch's hidden states crossing a stage boundary (gradients: the same)."""
        return microbatch_size * self.sequence_length * self.hidden_size * self.activation_bytes_per_element

    @property
    def num_parameters(self) -> int:
        return self.num_layers * self.parameters_per_layer + self.embedding_parameters + self.head_parameters


def stage_layer_counts(model: ModelSpec, pipeline: "PipelineSpec") -> tuple[int, ...]:
    """Transformer blocks of each stage: `pipeline.layers_per_stage`, or the equal split."""
    if pipeline.layers_per_stage is not None:
        return pipeline.layers_per_stage
    return (model.num_layers // pipeline.num_stages,) * pipeline.num_stages


def stage_parameter_count(model: ModelSpec, pipeline: "PipelineSpec", layers: int, stage: int) -> int:
    """Parameters held by `stage` of `layers` blocks: its blocks, plus the embedding (first) or head (last)."""
    count = layers * model.parameters_per_layer
    if stage == 0:
        count += model.embedding_parameters
    if stage == pipeline.num_stages - 1:
        count += model.head_parameters
    return count


def stage_parameter_counts(model: ModelSpec, pipeline: "PipelineSpec") -> tuple[int, ...]:
    """Parameters held by each stage (`stage_parameter_count`)."""
    return tuple(stage_parameter_count(model, pipeline, layers, stage) for stage, layers in enumerate(stage_layer_counts(model, pipeline)))


def method_pipeline_problem(method: MethodConfig, model: ModelSpec, pipeline: "PipelineSpec") -> tuple[str, str] | None:
    """Why `method` cannot run on this pipeline and how to fix that (each to follow the method's
    name); None if it can."""
    if pipeline.num_stages < method.minimum_stages:
        return f"needs at least {method.minimum_stages} pipeline stages, got {pipeline.num_stages}", "add stages or drop the method"
    counts = stage_layer_counts(model, pipeline)
    if method.family == "rebuild" and len(set(counts)) > 1:
        return (
            f"rebuilds a stage from its neighbours' blocks, which needs equal stages, but pipeline.layers_per_stage {list(counts)} is unequal",
            "split the layers equally or drop the method",
        )
    return None


EmbeddingPlacement = Literal["edge_stages", "separate_node"]
CheckpointSharding = Literal["whole_stage", "data_parallel"]


class PipelineSpec(StrictModel):
    num_stages: int = Field(ge=1)
    """Pipeline stages, each on a node of its own in every data-parallel replica; model.num_layers
    are split over them. Failures strike nodes (`churn`)."""
    data_parallel_degree: int = Field(1, ge=1)
    """D, replicas of the whole pipeline, each training on its own data: the pipeline is a grid of
    num_stages × D nodes, a node being one (stage, replica). D multiplies the global batch (tokens
    per iteration) and adds a ring all-reduce of each stage's gradients over its replicas before the
    optimizer step (`network.allreduce_latency_s`, `network.allreduce_bandwidth_bytes_per_s`); with
    `checkpoint_sharding = "data_parallel"` the replicas share a stage's checkpoint writes and reads.
    Churn strikes nodes at its per-node rate: a lost node whose stage has a surviving replica heals
    by a copy from it; only a stage whose replicas are all lost goes to the method's own recovery
    (calibration/replica_rule.py)."""
    replicas_fail_together: bool = False
    """True: the D replicas of a stage share one failure domain, so every failure the churn model
    samples for a stage takes all of them at once and is always a stage loss (CheckFree's emulator,
    reference/checkfree.md). False: each node fails on its own. No effect when D is 1."""
    while_replica_missing: Literal["continue", "wait"] = "continue"
    """What the data-parallel group does while a lost replica heals. `continue`: the replica
    pipelines that still have every stage train on, with a smaller global batch (torchft's dynamic
    mode, Oobleck); when none is complete the group waits. `wait`: every replica waits until the
    heal is done (a fixed global batch, as synchronous data-parallel jobs do). No effect when D is 1."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Order of each stage's forward and backward passes in an iteration: `gpipe` runs every
    microbatch's forward, then every backward; `1f1b` alternates one forward and one backward after
    a warm-up of forwards (calibration/pipeline_schedule.py)."""
    microbatch_size: int = Field(ge=1)
    """Sequences per microbatch: sets a microbatch's activation bytes and, with compute from FLOPs,
    its times; part of the global batch."""
    num_microbatches: int = Field(ge=1)
    """Microbatches each pipeline runs per iteration (one optimizer step): more of them fill the
    pipeline's idle start and end better; part of the global batch."""
    layers_per_stage: tuple[Annotated[int, Field(ge=1)], ...] | None = None
    """Transformer blocks of each stage, first to last, e.g. 60 layers in 8 stages as
    [8, 8, 8, 8, 7, 7, 7, 7]; they must add up to model.num_layers. None: model.num_layers split
    equally (it must then divide by num_stages). Compute times and checkpoint bytes follow each
    stage's count. Methods that rebuild a stage from its neighbours need equal stages."""
    embedding_placement: EmbeddingPlacement = "edge_stages"
    """Where the embedding and the head (final norm, lm_head, loss) run. `edge_stages`: with the
    first and last stages' blocks, as in Megatron-style pipelines and churnsim's real runs; a
    CheckFree+ swapped microbatch then makes two extra trips (stage 0 embeds and hands over to
    stage 1; stage S-2 hands back to S-1 for the head). `separate_node`: on a node of their own
    (node S, at `network.sites[S % len(sites)]`), as in the CheckFree authors' emulator (its stage 0,
    reference/checkfree.md §2 and §4.1): every microbatch goes node S → the block stages → node S,
    and the swap adds no trip (the swapped pairs still wait on each other, since every stage takes
    its microbatches in index order). That node is taken never to fail, as in the authors' runs;
    its state is counted with stages 0 and S-1 in checkpoint and transfer bytes. Simulator only:
    real runs refuse it (`check_real_run_layout`)."""
    checkpoint_sharding: CheckpointSharding = "whole_stage"
    """`whole_stage`: one node per stage writes and reads the stage's whole checkpoint.
    `data_parallel`: each of the stage's data_parallel_degree replicas writes and reads 1/DP of it
    in parallel over its own link (ZeRO-1 partitioned optimizer state, as in DataStates-LLM's runs,
    reference/checkpointing.md §4); on a `shared` tier the shards still share the one link."""

    @property
    def num_nodes(self) -> int:
        """Nodes of the stage × replica grid (S × D): one process each in a real run."""
        return self.num_stages * self.data_parallel_degree


def seconds_by_method(value: object) -> tuple[tuple[str, float], ...]:
    """A mapping of method name to seconds as sorted (name, seconds) pairs: hashable, as the
    simulator keys its caches by compute (sim/model/methods/base.py). Malformed input raises ValueError,
    which validation turns into its one-line message."""
    example = 'give an object of method name to seconds, e.g. {"checkpoint": 0.05}'
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value):
        pairs = [tuple(pair) for pair in value]
    else:
        raise ValueError(f"{value!r} is not a mapping of method to seconds; {example}")
    result = []
    for name, seconds in pairs:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, str)):
            raise ValueError(f"{name!r}: {seconds!r} is not a number of seconds; {example}")
        try:
            result.append((str(name), float(seconds)))
        except ValueError:
            raise ValueError(f"{name!r}: {seconds!r} is not a number of seconds; {example}") from None
    return tuple(sorted(result))


SecondsByMethod = Annotated[
    tuple[tuple[str, float], ...],
    BeforeValidator(seconds_by_method),
    PlainSerializer(dict, return_type=dict[str, float]),
]
"""Method name → seconds; written and read as a JSON object."""


class ExplicitCompute(StrictModel):
    """Measured or assumed times per microbatch; a scalar applies to every stage."""

    kind: Literal["explicit"] = "explicit"
    block_forward_s: float | tuple[float, ...]
    """Forward time of one stage's transformer blocks for one microbatch."""
    block_backward_s: float | tuple[float, ...]
    """Backward time of one stage's transformer blocks for one microbatch."""
    embedding_forward_s: float = Field(0.0, ge=0)
    """Forward time of the embedding lookup for one microbatch, on the first stage (or on the
    embedding's own node under `pipeline.embedding_placement = "separate_node"`)."""
    embedding_backward_s: float = Field(0.0, ge=0)
    """Backward time of the embedding for one microbatch, where its forward runs."""
    head_forward_s: float = Field(0.0, ge=0)
    """Forward time of the head (final norm, lm_head and loss) for one microbatch, on the last stage
    (or on the embedding's own node under `pipeline.embedding_placement = "separate_node"`)."""
    head_backward_s: float = Field(0.0, ge=0)
    """Backward time of the head for one microbatch, where its forward runs."""
    optimizer_step_s: float = Field(0.0, ge=0)
    """Time of each stage's optimizer step, once per iteration after its backward passes and its
    all-reduce."""
    shared_cores: int | None = Field(None, ge=1)
    """None: each stage computes on a device of its own. A number: the stages are one-thread
    processes on one host with this many CPU cores, which they share when they compute at the same
    time (a local CPU run); the times above are then core-seconds of work, not wall time."""
    run_speed_log_sd: float = Field(0.0, ge=0, le=1)
    """How much one run's speed scatters about the typical one, as the standard deviation of its
    log (0.035: about ±7 % at 95 %). Each replication scales the times above by one draw
    (calibration/speed_uncertainty.py); calibrations set it from their runs' speeds. 0: none."""
    method_iteration_extra_s: SecondsByMethod = ()
    """Per method, its measured steady extra over the plain pipeline's iteration on the calibrated
    setup (`Calibration.method_iteration_extra_s`; set by a calibration, empty otherwise). A run of
    that method lasts the plain iteration plus this, scaled to the scenario's setup
    (sim.model.method_extras.with_measured_method_extra)."""
    method_model_extra_s: SecondsByMethod = ()
    """Per method, the extra the iteration model itself gave it on the calibrated setup
    (`Calibration.method_model_extra_s`): the reference the measured extra is scaled by."""
    carried_from: str = ""
    """The calibrated setup and calibration these times were carried from by its compute model
    (calibration/apply.py), for a setup the calibration did not measure; every output then says so
    (`compute_carry_note`). Empty: times measured on this setup, or given."""

    @field_validator("block_forward_s", "block_backward_s")
    @classmethod
    def _finite_non_negative_seconds(cls, value: float | tuple[float, ...]) -> float | tuple[float, ...]:
        for seconds in value if isinstance(value, tuple) else (value,):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{seconds} is not a finite number of seconds >= 0; give measured times per microbatch")
        return value


class FlopsCompute(StrictModel):
    """Times derived from FLOPs: forward 2·N·tokens, backward 4·N·tokens (Kaplan et al., arXiv 2001.08361)."""

    kind: Literal["flops"] = "flops"
    peak_flops_per_s: float = Field(gt=0)
    """Peak FLOP/s of the device each stage runs on: every compute time is the work's FLOPs over
    peak_flops_per_s · utilization (the head's forward: 2 · vocab_size · hidden_size per token; the
    embedding's lookup is taken as free)."""
    utilization: float = Field(0.4, gt=0, le=1)
    """Model FLOPs utilisation (Llama 3 reports 0.38–0.43)."""
    optimizer_step_s: float = Field(0.0, ge=0)
    """Time of each stage's optimizer step, once per iteration after its backward passes and its
    all-reduce; given, not derived from FLOPs."""


ComputeSpec = Union[ExplicitCompute, FlopsCompute]


class UniformNetwork(StrictModel):
    """Every pair of nodes is joined by an identical link."""

    kind: Literal["uniform"] = "uniform"
    latency_s: float = Field(ge=0, allow_inf_nan=False)
    """Latency of the link between any two nodes, paid by every transfer on it: activations and
    gradients between stages, and stage weights sent during a recovery."""
    bandwidth_bytes_per_s: float = Field(gt=0)
    """Bandwidth of the link between any two nodes, in each direction; transfers on a link at the
    same time share it."""
    allreduce_latency_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Latency of one step of the data-parallel ring all-reduce, which takes 2(D − 1) steps
    (D = pipeline.data_parallel_degree). No effect when D is 1."""
    allreduce_bandwidth_bytes_per_s: float = Field(math.inf, gt=0)
    """Bandwidth of each node for the data-parallel all-reduce: a stage's ring all-reduce of its G
    gradient bytes (its parameters × model.weight_bytes_per_parameter) moves 2(D − 1)/D · G at this
    rate (Patarasuk & Yuan 2009); stages on one node share it. Infinity: free. No effect when D is 1."""


class SiteNetwork(StrictModel):
    """Nodes placed at named sites; links between sites come from a latency/bandwidth table."""

    kind: Literal["sites"] = "sites"
    sites: tuple[str, ...] = Field(min_length=1)
    """Site of the node running stage i is sites[i % len(sites)]; a replacement keeps the site."""
    table: str = "checkfree_geo"
    """A built-in table name or a CSV path with columns site_a, site_b, delay_ms, bandwidth_GiB_per_s."""
    same_site_latency_s: float = Field(0.010, ge=0, allow_inf_nan=False)
    """Latency of the link between two nodes at the same site (`table` gives those between sites)."""
    same_site_bandwidth_bytes_per_s: float = Field(0.5 * GIB, gt=0)
    """Bandwidth of the link between two nodes at the same site, in each direction; transfers on a link
    at the same time share it."""
    allreduce_latency_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Latency of one step of the data-parallel ring all-reduce, which takes 2(D − 1) steps
    (D = pipeline.data_parallel_degree). No effect when D is 1."""
    allreduce_bandwidth_bytes_per_s: float = Field(math.inf, gt=0)
    """Bandwidth of each node for the data-parallel all-reduce: a stage's ring all-reduce of its G
    gradient bytes (its parameters × model.weight_bytes_per_parameter) moves 2(D − 1)/D · G at this
    rate (Patarasuk & Yuan 2009); stages on one node share it. Infinity: free. No effect when D is 1."""


NetworkSpec = Union[UniformNetwork, SiteNetwork]


class StorageTier(StrictModel):
    name: str = Field(min_length=1)
    """The name methods use for the tier (`tier`, `levels`, `fallback_tier`, `edge_checkpoint_tier`).
    `host_memory` is the tier `async_checkpoint` copies its snapshots into; unique within `storage`."""
    write_bandwidth_bytes_per_s: float = Field(gt=0)
    """Bandwidth of a node's link for writes to this tier (checkpoint saves); the writes on one link
    at the same time share it (one link for every stage when `shared`)."""
    read_bandwidth_bytes_per_s: float = Field(gt=0)
    """Bandwidth of a node's link for reads from this tier (restores after a failure); the reads on one
    link at the same time share it (one link for every stage when `shared`)."""
    # At most 31.7 years, as every latency the simulator takes (sim/model/pipeline_state.py).
    latency_s: float = Field(0.0, ge=0, le=LONGEST_DURATION_S, allow_inf_nan=False)
    """Seconds every transfer to or from this tier waits before its bytes flow."""
    fixed_cost_s: float = Field(0.0, ge=0, le=LONGEST_DURATION_S, allow_inf_nan=False)
    """Seconds every transfer to or from this tier costs beyond `latency_s` whatever its size: a
    calibration's measured fixed cost of a checkpoint write (serialisation, checksums, fsync, rename).
    A calibration sets it rather than adding to the latency, so applying one to a scenario that was
    made from another (a file saved from a calibrated preset) counts it once."""
    capacity_bytes: int | None = Field(None, gt=0)
    """Size of the tier, for the record; None: not given. Neither the simulator nor real runs limit
    what a tier holds by it."""
    survives_node_loss: bool
    """Host memory and local disks die with their node; remote storage survives."""
    shared: bool = False
    """True when all stages share one link to this tier (remote storage behind one uplink)."""
    serialization_bytes_per_s: float | None = Field(None, gt=0)
    """How fast a writing node turns state into this tier's format before it writes (torch.save's
    pickling and copies: DeepSpeed's synchronous checkpoint, reference/checkpointing.md §2). Paid by
    each writer on its own CPU, not shared, then the write follows at the tier's bandwidth. None:
    raw tensor bytes, no serialization step (DataStates-LLM's format). Writes only."""

    @property
    def total_latency_s(self) -> float:
        """What a transfer waits beyond its bytes: the latency and the fixed cost."""
        return self.latency_s + self.fixed_cost_s


class RecoverySpec(StrictModel):
    join_delay_s: float = Field(30.0, ge=0)
    """Time from a failure until the replacement node is ready (CheckFree: 30 s placeholder)."""
    restart_s: float = Field(6.6, ge=0)
    """Rendezvous and process-group rebuild after a replacement joins (Parcae: 6.6 s measured)."""
    restart_s_by_method: dict[str, float] = Field(default_factory=dict)
    """The restart of the methods named here, where it was measured for each (a calibration's
    recovery steps beyond their recorded parts, calibration.fit_timing.recovery_events); other
    methods take `restart_s`."""

    @field_validator("restart_s_by_method")
    @classmethod
    def _non_negative_restarts(cls, value: dict[str, float]) -> dict[str, float]:
        negative = {name: seconds for name, seconds in value.items() if not (math.isfinite(seconds) and seconds >= 0)}
        if negative:
            raise ValueError(f"restart times must be finite and >= 0 seconds, got {negative}")
        return value

    survivor_restart_s: float = Field(0.0, ge=0)
    """Hard failures launched under an agent that restarts every worker (`training.failure_mode =
    "hard"` with `training.hard_failure_launch = "agent"`): seconds from a failure until the surviving
    stages' processes, restarted by the agent, are ready again (the death's detection, the agent's
    restart, process start, each survivor's snapshot read back from node memory). Training stops for
    it on every stage loss, before the method's recovery; the replacement's join delay runs meanwhile.
    0: not charged. A calibration with hard-failure runs sets it from its fitted components
    (`Calibration.hard_failure_costs`), scaled to this scenario's stage state."""
    max_replacements: int = Field(64, ge=0)
    """Hard failures in a real run (`training.failure_mode = "hard"`): the most stage processes the
    launcher replaces in one run; a run whose processes die more often ends there, as a replacement
    that keeps dying would otherwise never stop. The simulator does not cap its replacements: a run
    predicted past this many failures is one a real launcher would have stopped."""

    def restart_s_for(self, method: str) -> float:
        """The restart after a replacement joins, for the method named `method`."""
        return self.restart_s_by_method.get(method, self.restart_s)


class TargetSpec(StrictModel):
    loss: float | None = Field(None, gt=0)
    """Stop when the convergence model reaches this loss."""
    iterations: int | None = Field(None, ge=1)
    """Stop after this many iterations of effective progress (used when loss is None)."""
    max_wall_clock_s: float = Field(30 * 24 * 3600.0, gt=0)
    """Give up (and report the target as not reached) after this simulated time."""

    @model_validator(mode="after")
    def _one_target(self) -> "TargetSpec":
        if (self.loss is None) == (self.iterations is None):
            raise ValueError("give exactly one of target.loss or target.iterations")
        return self


class TrainingSpec(StrictModel):
    """How a real run trains this scenario (`churnsim real run`). The simulator reads only
    `failure_mode` and `hard_failure_launch` (whether a hard failure restarts the survivors): its
    convergence model stands for the loss the other settings produce."""

    learning_rate: float = Field(1e-3, gt=0, le=1.0)
    """AdamW learning rate (1e-3: the built-in cpu-tiny calibration's runs). At most 1: AdamW moves
    each weight by about the rate every step, and 1e300 overflowed the optimizer's float32 mid-run."""
    eval_every_iterations: int = Field(10, ge=1)
    """Held-out loss after every this many iterations, and after the last."""
    num_eval_batches: int = Field(2, ge=1)
    """Held-out batches of `pipeline.microbatch_size` sequences per evaluation."""
    corpus: str | None = None
    """Text file or directory of the training text; None = the Python standard library's sources."""
    corpus_max_bytes: int = Field(CORPUS_MAX_BYTES, ge=4096)
    """Read at most this many bytes of the corpus (`CORPUS_MAX_BYTES`: what the calibration's runs read)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: gloo; cuda: NCCL, one GPU per stage process."""
    deterministic: bool = True
    """torch deterministic algorithms, one thread per stage: a rollback replays bit for bit."""
    peer_timeout_s: float = Field(30.0, gt=0, le=LONGEST_DURATION_S)
    """Longest wait for a peer stage; a lost peer ends the run with an error. `churnsim real run`'s
    launcher also ends the run, naming the rank, when a rank's heartbeat is older than half of it
    (a stopped or frozen process)."""
    failure_mode: Literal["soft", "hard"] = "soft"
    """soft: a failed stage's process re-initialises the stage in place. hard: the failed stage's
    process is killed (SIGKILL; any external SIGKILL of a stage process counts too), a replacement
    process starts after the join delay, joins the surviving processes by rendezvous, and the
    method recovers the stage over the network or from files (`churnsim real run` only)."""
    join_delay_s: float | None = Field(None, ge=0, le=3600)
    """Hard failures: seconds from a kill until its replacement process starts. None: the
    scenario's recovery.join_delay_s."""
    hard_failure_launch: Literal["agent", "in_process"] = "agent"
    """How hard failures are launched. agent: under torch.distributed.elastic's agent (torchrun,
    `churnsim real run`), which restarts every local worker when one dies: the survivors read their
    stage back from node memory and lose the work since their last snapshot (taken after every
    update: the iteration in flight), and the simulator charges their restart
    (`recovery.survivor_restart_s`, badput `survivor_restart_s`). in_process: the survivors' processes
    keep running and only the replacement starts (torchft, a rendezvous without the agent); nothing
    more is charged. `churnsim real run` always launches under the agent: in_process is for
    predicting an engine that keeps the survivors. The simulator reads this field and
    `failure_mode`, and no other of this section."""
    remote_checkpoint_dir: str | None = None
    """Directory of the checkpoints' remote level (`checkpoint`'s remote tier, `async_checkpoint`'s
    second level, the fallback and edge checkpoints), e.g. on another file system; each run keeps
    its own `<run id>/stage-<s>` below it. None: `<run dir>/checkpoints`."""
    remote_checkpoint_bytes_per_s: float | None = Field(None, ge=1.0)
    """Bandwidth of the path to the remote level: writes to it and reads from it are paced to this
    rate, so that its cost is measurable on one machine. None: as fast as the disk. At least 1 B/s:
    the pacing sleeps, and at 1e-300 B/s a sleep overflowed the clock mid-run."""


def tokens_per_iteration(model: ModelSpec, pipeline: PipelineSpec) -> int:
    """The global batch: every microbatch of every data-parallel pipeline, in tokens."""
    return model.sequence_length * pipeline.microbatch_size * pipeline.num_microbatches * pipeline.data_parallel_degree


class Scenario(FiniteNumbersModel):
    # Every number finite (FiniteNumbersModel): an infinite restart time used to fail an assertion in
    # the simulator, an infinite checkpoint size to hang it.
    schema_version: Literal[1] = SCHEMA_VERSION
    """Version of the scenario file format; 1 is the only one."""
    name: str = Field(min_length=1)
    """Short name of the scenario, shown in every output."""
    description: str = ""
    """One line on what the scenario stands for, shown in reports and in `churnsim presets`."""
    sources: tuple[str, ...] = ()
    """Where the numbers come from (papers, traces, calibration files)."""
    model: ModelSpec
    """The model trained: its size sets compute times, checkpoint bytes and the bytes sent between stages."""
    pipeline: PipelineSpec
    """How the model is split into stages and each iteration's batch into microbatches."""
    compute: ComputeSpec = Field(discriminator="kind")
    """Time of each stage's work per microbatch: given (`explicit`) or derived from FLOPs (`flops`),
    selected by `kind`."""
    network: NetworkSpec = Field(discriminator="kind")
    """Links between the stages' nodes and the data-parallel all-reduce: one link for every pair
    (`uniform`) or links by site (`sites`), selected by `kind`."""
    storage: tuple[StorageTier, ...] = ()
    """Storage tiers that checkpoints are written to and read from; each method names the tiers it uses."""
    churn: ChurnConfig
    """When stages fail, selected by `kind`: none, a rate, a distribution of lifetimes, bursts, a trace
    or a schedule."""
    recovery: RecoverySpec = RecoverySpec()
    """What every failure costs whatever the method: the wait for a replacement node and the restart
    after it joins."""
    methods: tuple[MethodConfig, ...] = Field(min_length=1)
    convergence: ConvergenceSpec
    """The loss curve of a run without failures and what a rebuild costs in iterations of it
    (setbacks): how progress turns into loss."""
    target: TargetSpec
    """When a run is done: a loss or a number of iterations, and the longest simulated time to try."""
    seed: int = Field(0, ge=0)
    """Base seed: replication r draws its failures and setbacks from (seed, r), so a run repeats
    exactly and every method of a replication meets the same failures."""
    replications: int = Field(1, ge=1)
    """Simulated runs per method, each with its own failures (and setback draws); the intervals of
    the answers come from their spread."""
    training: TrainingSpec = TrainingSpec()
    """Real runs only: learning rate, evaluation, corpus, device."""

    @property
    def tokens_per_iteration(self) -> int:
        return tokens_per_iteration(self.model, self.pipeline)

    @property
    def survivor_restart_charged_s(self) -> float:
        """What the simulator charges on a stage loss for the survivors' restart: the scenario's
        `recovery.survivor_restart_s` where hard failures are launched under an agent that restarts
        every worker (`training.hard_failure_launch = "agent"`), else 0."""
        training = self.training
        if training.failure_mode == "hard" and training.hard_failure_launch == "agent":
            return self.recovery.survivor_restart_s
        return 0.0

    @model_validator(mode="after")
    def _convergence_at_own_batch_and_size(self) -> "Scenario":
        # A curve counted in iterations of another batch is carried to this scenario's once, here,
        # where every way of making a scenario (a file, --set, a sweep's grid point) passes, so that
        # every reader of `convergence` sees iterations of this scenario's batch (ConvergenceSpec.at_batch).
        # The model is frozen: the validated value is set in place, as a field assignment would.
        # A curve given for a model of another size is moved to this model's (ConvergenceSpec.at_model_size).
        carried = self.convergence.at_batch(self.tokens_per_iteration).at_model_size(self.model.num_parameters)
        if carried is not self.convergence:
            target = self.target.loss
            if carried.model_carried_from_parameters is not None and target is not None and target <= carried.baseline.floor_loss:
                raise ValueError(
                    f"target.loss {target:g} is at or below the loss floor {carried.baseline.floor_loss:.4g} of the curve carried to this "
                    f"model's {self.model.num_parameters:,} parameters (from {carried.model_carried_from_parameters:,.0f}): a model this "
                    "small never reaches it; raise target.loss or the model's size"
                )
            self.__dict__["convergence"] = carried
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        layers, stages = self.model.num_layers, self.pipeline.num_stages
        if stages > layers:
            raise ValueError(f"pipeline.num_stages {stages} exceeds model.num_layers {layers}; reduce num_stages or add layers")
        split = self.pipeline.layers_per_stage
        if split is None and layers % stages:
            raise ValueError(
                f"model.num_layers {layers} is not divisible by pipeline.num_stages {stages}; "
                "give pipeline.layers_per_stage (one count per stage, adding up to num_layers) for an unequal split"
            )
        if split is not None:
            if len(split) != stages:
                raise ValueError(
                    f"pipeline.layers_per_stage lists {len(split)} stage{'s' if len(split) != 1 else ''} but pipeline.num_stages is {stages}; give one count per stage"
                )
            if sum(split) != layers:
                raise ValueError(
                    f"pipeline.layers_per_stage {list(split)} adds up to {sum(split)} layers but model.num_layers is {layers}; "
                    "make the counts add up to num_layers"
                )
        if isinstance(self.compute, ExplicitCompute):
            for field in ("block_forward_s", "block_backward_s"):
                value = getattr(self.compute, field)
                if isinstance(value, tuple) and len(value) != stages:
                    raise ValueError(
                        f"compute.{field} lists {len(value)} stage{'s' if len(value) != 1 else ''} but pipeline.num_stages is {stages}; "
                        "give one time per stage, or one number for every stage"
                    )
        # Each is finite alone, but their product with the model's size can overflow to inf bytes,
        # which no transfer ends (1e300 checkpoint bytes a parameter hung a processor-sharing link).
        parameters = self.model.num_parameters
        for field, total_bytes in (
            ("weight_bytes_per_parameter", parameters * self.model.weight_bytes_per_parameter),
            ("checkpoint_bytes_per_parameter", parameters * self.model.checkpoint_bytes_per_parameter),
            ("activation_bytes_per_element", self.activation_bytes),
        ):
            if not math.isfinite(total_bytes):
                raise ValueError(f"model.{field} {getattr(self.model, field):g} makes the model's bytes overflow to {total_bytes}; give a smaller size")
        # Like a link's transfers (sim/model/pipeline_state.py), a tier's must end within 31.7 years: at 1e-300
        # B/s every replay of a what-if ran to its 30-day limit, minutes per answer.
        stage_checkpoint_bytes = max(self.stage_parameters(stage) for stage in range(stages)) * self.model.checkpoint_bytes_per_parameter
        for tier in self.storage:
            slowest = min(tier.write_bandwidth_bytes_per_s, tier.read_bandwidth_bytes_per_s)
            problem = endless_transfer(
                f"storage tier {tier.name!r}", slowest, stage_checkpoint_bytes, f"write or read a stage's checkpoint of {stage_checkpoint_bytes:g} bytes"
            )
            if problem is not None:
                raise ValueError(problem)
        tier_names = [tier.name for tier in self.storage]
        if len(set(tier_names)) != len(tier_names):
            raise ValueError(f"storage tier names repeat: {tier_names}")
        seen: set[str] = set()
        for method in self.methods:
            if method.name in seen:
                raise ValueError(f"method {method.name!r} is listed twice in methods")
            seen.add(method.name)
            problem = self.method_problem(method)
            if problem is not None:
                raise ValueError(problem)
        if self.target.loss is not None:
            iterations_for_target(self.convergence.baseline, self.target.loss)
        return self

    def method_problem(self, method: MethodConfig) -> str | None:
        """Why this scenario cannot run `method` (a storage tier it lacks, a pipeline the method cannot
        take), in one line; None when it can."""
        tier_names = [tier.name for tier in self.storage]
        for tier in method.tiers_used:
            if tier not in tier_names:
                return f"method {method.name!r} uses storage tier {tier!r}, which is not in storage {tier_names}; add it"
        problem = method_pipeline_problem(method, self.model, self.pipeline)
        return None if problem is None else f"method {method.name!r} {problem[0]}; {problem[1]}"

    def method_config(self, name: str) -> MethodConfig:
        """This scenario's own configuration of method `name`, or the method's defaults where it lists none."""
        return next((method for method in self.methods if method.name == name), None) or method_from_name(name)

    def with_methods(self, names: Sequence[str]) -> "Scenario":
        """This scenario with the methods named, in that order: its own configuration of each one it
        lists, the defaults of the others; validated, so a method the pipeline cannot take is refused."""
        if len(set(names)) != len(names):
            raise InputError(f"--method lists a method twice: {list(names)}")
        methods = [self.method_config(name).model_dump() for name in names]
        return validate_model(Scenario, {**self.model_dump(), "methods": methods}, f"scenario {self.name} with methods {', '.join(names)}")

    def with_run_settings(self, *, replications: int | None = None, seed: int | None = None) -> "Scenario":
        """This scenario with another number of replications or base seed (None keeps it); validated."""
        update = {key: value for key, value in (("replications", replications), ("seed", seed)) if value is not None}
        if not update:
            return self
        return validate_model(Scenario, {**self.model_dump(), **update}, f"scenario {self.name} with {update}")

    def only_method(self, name: str | None) -> "Scenario":
        """This scenario with one method: `name`, or its only method (a real run performs one)."""
        by_name = {method.name: method for method in self.methods}
        if name is None and len(by_name) > 1:
            raise InputError(
                f"scenario {self.name!r} lists {len(by_name)} methods; a real run performs one: give --method, one of {', '.join(by_name)}"
            )
        chosen = name or self.methods[0].name
        if chosen not in by_name:
            raise InputError(
                f"--method {chosen!r} is not among scenario {self.name!r}'s methods ({', '.join(by_name)}); "
                "add it to the scenario's methods or pick one of those"
            )
        return self.model_copy(update={"methods": (by_name[chosen],)})

    def tier(self, name: str) -> StorageTier:
        for tier in self.storage:
            if tier.name == name:
                return tier
        raise KeyError(name)

    @property
    def stage_layer_counts(self) -> tuple[int, ...]:
        """Transformer blocks of each stage: `pipeline.layers_per_stage`, or the equal split."""
        return stage_layer_counts(self.model, self.pipeline)

    def stage_layers(self, stage: int) -> int:
        return self.stage_layer_counts[stage]

    @property
    def layers_per_stage(self) -> int:
        """Blocks of every stage when all stages are equal; an unequal split has no single count
        (use `stage_layers`)."""
        counts = set(self.stage_layer_counts)
        if len(counts) > 1:
            raise ValueError(f"pipeline.layers_per_stage {list(self.stage_layer_counts)} is unequal: use stage_layers(stage)")
        return counts.pop()

    def check_real_run_layout(self) -> None:
        """Raise InputError (one line) for a layout only the simulator models: real runs split the
        layers equally and keep the embedding and head with the first and last stages."""
        if self.pipeline.embedding_placement != "edge_stages":
            raise InputError(
                f"pipeline.embedding_placement = {self.pipeline.embedding_placement!r}: real runs keep the embedding and head "
                "with the first and last stages; set it to 'edge_stages' (--set pipeline.embedding_placement=edge_stages)"
            )
        if len(set(self.stage_layer_counts)) > 1:
            raise InputError(
                f"pipeline.layers_per_stage {list(self.stage_layer_counts)}: real runs split the layers equally; "
                "remove pipeline.layers_per_stage and use a num_stages that divides model.num_layers"
            )

    def stage_parameters(self, stage: int) -> int:
        """Parameters held by one stage: its blocks, plus the embedding (first) or head (last)."""
        return stage_parameter_count(self.model, self.pipeline, self.stage_layers(stage), stage)

    @property
    def activation_bytes(self) -> float:
        """Bytes of one microbatch's hidden states crossing a stage boundary (gradients: the same)."""
        return self.model.boundary_activation_bytes(self.pipeline.microbatch_size)

    @property
    def target_iterations(self) -> int:
        if self.target.iterations is not None:
            return self.target.iterations
        assert self.target.loss is not None
        return iterations_for_target(self.convergence.baseline, self.target.loss)



def load_scenario(path: str) -> Scenario:
    return load_model(Scenario, path)


def save_scenario(scenario: Scenario, path: str) -> None:
    save_model(scenario, path)
