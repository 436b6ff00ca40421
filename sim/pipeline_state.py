"""Build the iteration model's `PipelineState` from a scenario (compute, links, all-reduce).

Compute per microbatch comes either from measured/assumed times (`ExplicitCompute`, a scalar applies
to every stage) or from FLOPs (`FlopsCompute`): a stage's transformer blocks cost 2·N_blocks·tokens
forward and 4·N_blocks·tokens backward (Kaplan et al., arXiv 2001.08361), tokens = microbatch size ×
sequence length, at peak × utilisation. The embedding lookup is taken as free (a gather, no matmul);
the head (lm_head) costs 2·(vocab·d)·tokens forward and twice that backward. Links come from the
scenario's network section (`calibration.network.link_matrices`), one node per stage; a degraded
node that runs two stages is expressed through `node_of_stage`.
"""

from __future__ import annotations

import dataclasses
import math

from churnsim.calibration.network import link_matrices
from churnsim.calibration.scenario import ExplicitCompute, FlopsCompute, Scenario

from .iteration_state import PipelineState


def _per_stage(value: float | tuple[float, ...], num_stages: int) -> tuple[float, ...]:
    if isinstance(value, tuple):
        return value
    return (float(value),) * num_stages


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
    if isinstance(compute, ExplicitCompute):
        block_forward_s = _per_stage(compute.block_forward_s, num_stages)
        block_backward_s = _per_stage(compute.block_backward_s, num_stages)
        embedding_forward_s, embedding_backward_s = compute.embedding_forward_s, compute.embedding_backward_s
        head_forward_s, head_backward_s = compute.head_forward_s, compute.head_backward_s
    else:
        assert isinstance(compute, FlopsCompute)
        flops_per_s = compute.peak_flops_per_s * compute.utilization
        tokens = pipeline.microbatch_size * model.sequence_length
        block_parameters = scenario.layers_per_stage * model.parameters_per_layer
        block_forward_s = (2.0 * block_parameters * tokens / flops_per_s,) * num_stages
        block_backward_s = (4.0 * block_parameters * tokens / flops_per_s,) * num_stages
        embedding_forward_s = embedding_backward_s = 0.0  # a lookup: negligible next to the blocks
        head_forward_s = 2.0 * model.vocab_size * model.hidden_size * tokens / flops_per_s
        head_backward_s = 2.0 * head_forward_s
    latency, bandwidth = link_matrices(scenario.network, num_stages)
    network = scenario.network
    gradient_bytes = tuple(
        scenario.stage_parameters(stage) * model.weight_bytes_per_parameter for stage in range(num_stages)
    )
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
        data_parallel_degree=pipeline.data_parallel_degree,
        gradient_bytes_per_stage=gradient_bytes,
        allreduce_bandwidth_bytes_per_s=network.allreduce_bandwidth_bytes_per_s,
        allreduce_latency_s=network.allreduce_latency_s,
        optimizer_step_s=compute.optimizer_step_s,
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
