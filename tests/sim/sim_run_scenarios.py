"""Small scenarios for the run-model tests, built in code (ExplicitCompute, UniformNetwork)."""

from __future__ import annotations

import math

from churnsim.calibration.churn import NoChurn
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import default_methods
from churnsim.calibration.scenario import (
    ExplicitCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    StorageTier,
    TargetSpec,
    UniformNetwork,
)
from churnsim.calibration.failure_sampling import FailureEvent

FORWARD_S = 1.0
BACKWARD_S = 2.0
NUM_STAGES = 4
NUM_MICROBATCHES = 4
# GPipe with free links: (M + S − 1)(t_f + t_b)
CLOSED_FORM_ITERATION_S = (NUM_MICROBATCHES + NUM_STAGES - 1) * (FORWARD_S + BACKWARD_S)


def tiers(*, remote_bandwidth: float = 1e6, remote_shared: bool = True, host_bandwidth: float = 1e9) -> tuple[StorageTier, ...]:
    return (
        StorageTier(name="host_memory", write_bandwidth_bytes_per_s=host_bandwidth, read_bandwidth_bytes_per_s=host_bandwidth, survives_node_loss=False),
        StorageTier(name="local_disk", write_bandwidth_bytes_per_s=1e8, read_bandwidth_bytes_per_s=1e8, survives_node_loss=False),
        StorageTier(
            name="remote",
            write_bandwidth_bytes_per_s=remote_bandwidth,
            read_bandwidth_bytes_per_s=remote_bandwidth,
            latency_s=0.1,
            survives_node_loss=True,
            shared=remote_shared,
        ),
    )


def small_scenario(
    *,
    num_stages: int = NUM_STAGES,
    target_iterations: int = 100,
    link_bandwidth: float = math.inf,
    storage: tuple[StorageTier, ...] | None = None,
    join_delay_s: float = 30.0,
    restart_s: float = 5.0,
    churn=None,
    optimizer_step_s: float = 0.0,
    max_wall_clock_s: float = 30 * 24 * 3600.0,
    vocab_size: int = 100,
) -> Scenario:
    """num_stages stages of one layer each (d 64, vocab 100), GPipe, 4 microbatches of 1 s / 2 s."""
    return Scenario(
        name="small-test",
        model=ModelSpec(num_layers=num_stages, hidden_size=64, num_heads=4, vocab_size=vocab_size, sequence_length=16),
        pipeline=PipelineSpec(num_stages=num_stages, schedule="gpipe", microbatch_size=1, num_microbatches=NUM_MICROBATCHES),
        compute=ExplicitCompute(block_forward_s=FORWARD_S, block_backward_s=BACKWARD_S, optimizer_step_s=optimizer_step_s),
        network=UniformNetwork(latency_s=0.0, bandwidth_bytes_per_s=link_bandwidth),
        storage=tiers() if storage is None else storage,
        churn=churn or NoChurn(kind="none"),
        recovery=RecoverySpec(join_delay_s=join_delay_s, restart_s=restart_s),
        methods=tuple(method for method in default_methods() if method.minimum_stages <= num_stages),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5)),
        target=TargetSpec(iterations=target_iterations, max_wall_clock_s=max_wall_clock_s),
    )


def method(name: str, **parameters):
    return method_from_name(name, **parameters)


def failure(time_s: float, stage: int) -> FailureEvent:
    return FailureEvent(time_s=time_s, stage=stage, kind="poisson")
