"""A Scenario as a real run: the same file `churnsim simulate` takes, turned into a `TrainingConfig`.

The scenario fixes the model, the pipeline (stages, schedule, microbatches), the method and its
knobs, the churn model (failures are drawn from the contract's sampler, so a real run injects the
path `simulate` samples for the same seed and replication), the seed and the target (a loss target
becomes the iterations the scenario's baseline curve needs for it). `scenario.training` adds what
only a real run needs: learning rate, evaluation, corpus, device.

What the simulator models but a real run on one machine does not take from the scenario: compute
times, links and storage bandwidths (they are whatever this machine measures, except a remote
checkpoint level's bandwidth, `training.remote_checkpoint_bytes_per_s`), the restart time (the
rendezvous is whatever it takes here). Under soft failures the join delay is not used either
(processes re-initialise in place); under hard failures (`training.failure_mode = "hard"`) a
replacement process starts `training.join_delay_s` after a kill, by default the scenario's
`recovery.join_delay_s`.

Data parallelism (`pipeline.data_parallel_degree` D > 1): one process per node, S × D of them, each
replica pipeline on its own shard of the global batch, each stage's gradients averaged over its
replicas. Failures strike nodes; a lost node heals by an exact copy from a surviving replica of its
stage while every replica waits at the iteration boundary (whatever `pipeline.while_replica_missing`
says: a real run always waits), and only a stage with no surviving replica goes to the method's own
recovery (real/replica_heal.py); under hard failures a killed node's replacement process does the
same once the grid has re-formed. Each replica keeps its own copy of its stage's checkpoints (`checkpoint_sharding = "data_parallel"` is not
carried out: no replica writes only a shard).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import FailurePathSpec
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import ModelSpec, Scenario

from .model import ModelConfig
from .trainer import TrainingConfig

FP32_BYTES = 4
INT64_BYTES = 8
# Weights, gradients and AdamW's two moments, all fp32 (real runs train in fp32).
TRAINING_STATE_BYTES_PER_PARAMETER = 4 * FP32_BYTES
# A process's own footprint with torch loaded (measured on CPU: ≈ 0.3 GB resident per rank).
PROCESS_OVERHEAD_BYTES = 400 * 2**20
# Share of this machine's available memory a run may plan to use.
USABLE_MEMORY_FRACTION = 0.8
# An optimistic CPU throughput, fp32 FLOP/s per core: a run that would take longer than
# MAX_CPU_RUN_S even at this speed is refused (real CPU throughput for these shapes is lower).
OPTIMISTIC_CPU_FLOPS_PER_CORE_S = 50e9
MAX_CPU_RUN_S = 24 * 3600.0


def model_config(spec: ModelSpec) -> ModelConfig:
    """The real model of a contract model spec (a scenario's or a calibration's)."""
    return ModelConfig(
        vocab_size=spec.vocab_size,
        dim=spec.hidden_size,
        num_heads=spec.num_heads,
        num_layers=spec.num_layers,
        seq_len=spec.sequence_length,
        ffn_hidden_dim=spec.ffn_hidden_size,
    )


def model_spec(config: ModelConfig) -> ModelSpec:
    """The contract model spec of a real model (the inverse of `model_config`; real runs train in fp32)."""
    return ModelSpec(
        num_layers=config.num_layers,
        hidden_size=config.dim,
        num_heads=config.num_heads,
        vocab_size=config.vocab_size,
        sequence_length=config.seq_len,
        ffn_hidden_size=config.ffn_hidden_dim,
        weight_bytes_per_parameter=FP32_BYTES,
        activation_bytes_per_element=FP32_BYTES,
    )


def check_one_pipeline(scenario: Scenario) -> None:
    """For real-run paths that train one pipeline only (the calibration suite): refuse data
    parallelism in one line."""
    if scenario.pipeline.data_parallel_degree != 1:
        raise InputError(
            f"pipeline.data_parallel_degree = {scenario.pipeline.data_parallel_degree}: real runs do not implement "
            "data parallelism yet; set it to 1 (--set pipeline.data_parallel_degree=1)"
        )


def training_config(scenario: Scenario, method: MethodConfig, *, replication: int = 0) -> TrainingConfig:
    """The real run of `method` on `scenario` (one process per node: stage × replica), failures from
    its churn model (`Scenario.only_method` picks the method of a scenario that lists several)."""
    training = scenario.training
    lr_scale = getattr(method, "lr_scale", 1.0)
    rebuilt_learning_rate = training.learning_rate * lr_scale
    if rebuilt_learning_rate > 1.0:
        # The bound training.learning_rate keeps; 1e300 overflowed the optimizer's float32 mid-run.
        raise InputError(
            f"methods.{method.name}.lr_scale = {lr_scale:g}: a rebuilt stage would train at training.learning_rate × "
            f"lr_scale = {rebuilt_learning_rate:g}, over 1; lower either (the CheckFree paper scales by 1.1)"
        )
    return TrainingConfig(
        model=model_config(scenario.model),
        num_stages=scenario.pipeline.num_stages,
        data_parallel_degree=scenario.pipeline.data_parallel_degree,
        num_microbatches=scenario.pipeline.num_microbatches,
        microbatch_size=scenario.pipeline.microbatch_size,
        num_iterations=scenario.target_iterations,
        seed=scenario.seed,
        schedule=scenario.pipeline.schedule,
        method=method,
        failure_path=FailurePathSpec.of(scenario, replication=replication),
        learning_rate=training.learning_rate,
        eval_interval_iterations=training.eval_every_iterations,
        num_eval_batches=training.num_eval_batches,
        corpus=training.corpus,
        corpus_max_bytes=training.corpus_max_bytes,
        device=training.device,
        timeout_s=training.peer_timeout_s,
        deterministic=training.deterministic,
        failure_mode=training.failure_mode,
        join_delay_s=training.join_delay_s if training.join_delay_s is not None else scenario.recovery.join_delay_s,
        max_replacements=scenario.recovery.max_replacements,
        remote_checkpoint_dir=training.remote_checkpoint_dir,
        remote_checkpoint_bytes_per_s=training.remote_checkpoint_bytes_per_s,
    )


@dataclass(frozen=True, kw_only=True)
class RunFootprint:
    """What a real run of a scenario needs, estimated before any process starts."""

    memory_bytes: float
    """Every process together (S × D): training state, activations in flight, torch itself."""
    training_flops: float
    """FLOPs of the whole run (forward + backward of every iteration)."""


def estimate_footprint(scenario: Scenario) -> RunFootprint:
    """Memory and FLOPs of a real run (approximate: fp32, activations of the microbatches in flight)."""
    model, pipeline = scenario.model, scenario.pipeline
    num_stages = pipeline.num_stages
    state_bytes = sum(scenario.stage_parameters(stage) for stage in range(num_stages)) * TRAINING_STATE_BYTES_PER_PARAMETER
    tokens_per_microbatch = pipeline.microbatch_size * model.sequence_length
    # Saved activations per layer per microbatch: ≈ 16 width-sized tensors per token plus the
    # attention probabilities (heads × T² per sequence); the order of Korthikanti et al. 2022, fp32.
    per_layer_bytes = FP32_BYTES * (
        tokens_per_microbatch * (16 * model.hidden_size + 2 * model.ffn_width)
        + 2 * pipeline.microbatch_size * model.num_heads * model.sequence_length**2
    )
    in_flight = pipeline.num_microbatches if pipeline.schedule == "gpipe" else min(pipeline.num_microbatches, num_stages)
    activation_bytes = in_flight * model.num_layers * per_layer_bytes
    logits_bytes = 3 * FP32_BYTES * tokens_per_microbatch * model.vocab_size  # logits, softmax, gradient
    # Every stage process builds the held-out batches (real/trainer.py): int64 windows of T + 1 tokens,
    # their offsets, and the inputs and targets cut from them, about four copies.
    evaluation_bytes = num_stages * 4 * INT64_BYTES * scenario.training.num_eval_batches * pipeline.microbatch_size * (model.sequence_length + 1)
    replicas = pipeline.data_parallel_degree
    memory = replicas * (state_bytes + activation_bytes + logits_bytes + evaluation_bytes + num_stages * PROCESS_OVERHEAD_BYTES)
    tokens_per_iteration = tokens_per_microbatch * pipeline.num_microbatches * replicas
    flops = 6.0 * model.num_parameters * tokens_per_iteration * scenario.target_iterations
    return RunFootprint(memory_bytes=memory, training_flops=flops)


def available_memory_bytes() -> float:
    """Memory this machine can give a run now (MemAvailable on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits_machine(scenario: Scenario, *, memory_bytes: float | None = None, num_cores: int | None = None) -> RunFootprint:
    """Refuse, with one line saying why and what to shrink, a scenario this machine cannot run."""
    footprint = estimate_footprint(scenario)
    available = available_memory_bytes() if memory_bytes is None else memory_bytes
    gib = 2**30
    if not math.isfinite(footprint.memory_bytes):  # checked first: comparisons with inf/nan say nothing
        raise InputError(f"scenario {scenario.name!r}: its size overflows; shrink the model")
    if footprint.memory_bytes > USABLE_MEMORY_FRACTION * available:
        raise InputError(
            f"scenario {scenario.name!r} needs about {footprint.memory_bytes / gib:.1f} GiB for a real run "
            f"({scenario.model.num_parameters / 1e6:.0f}M parameters with AdamW state, activations, {scenario.pipeline.num_stages} "
            f"processes) but this machine has {available / gib:.1f} GiB available: shrink model.num_layers, "
            "model.hidden_size, pipeline.microbatch_size or training.num_eval_batches (e.g. --set model.hidden_size=64), "
            "or run on bigger machines with torchrun"
        )
    if scenario.training.device == "cpu":
        cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
        best_case_s = footprint.training_flops / (cores * OPTIMISTIC_CPU_FLOPS_PER_CORE_S)
        if best_case_s > MAX_CPU_RUN_S:
            raise InputError(
                f"scenario {scenario.name!r} needs {footprint.training_flops:.2g} FLOPs for {scenario.target_iterations} "
                f"iterations: at least {best_case_s / 3600:.0f} h on this machine's {cores} CPU core(s); shrink the model "
                "or the target (e.g. --set target.loss=null --set target.iterations=100), or set training.device=cuda"
            )
    return footprint
