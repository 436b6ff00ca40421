"""Built-in scenarios, each a function returning a complete `Scenario`, with its sources.

Numbers come from ../shared/reference (checkfree.md, checkpointing.md, simulators.md); each field
that is a judgement rather than a published number says so. The loss curves of the paper presets
are illustrative, not fitted to the paper's curves (its loss tables are not confirmed from the
paper text): they put the target loss at the order of the paper's x-axis, 10–20k iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Mapping

from .apply import ApplyMode, apply_calibration
from .builtin import load_builtin_calibration
from .calibration_file import Calibration
from .churn import NoChurn, PoissonChurn, StageHourlyChurn, TraceChurn
from .convergence import ConvergenceSpec, PowerLawLossCurve, critical_batch_tokens_at_loss
from .paper_setbacks import PAPER_FIT_SOURCE, paper_fitted_setbacks
from .errors import InputError
from .scenario_overrides import apply_settings, methods_that_fit
from .methods import METHOD_NAMES, MethodConfig, method_from_name
from .network import CHECKFREE_EMULATOR_SITES, load_site_table
from .scenario import (
    ExplicitCompute,
    FlopsCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    SiteNetwork,
    StorageTier,
    TargetSpec,
    TrainingSpec,
    UniformNetwork,
    load_scenario,
    tokens_per_iteration,
)

CHECKFREE_PAPER = "Blagoev, Ersoy, Chen, 'All is Not Lost: LLM Recovery without Checkpoints', arXiv 2506.15461"
CHECKFREE_CODE = "gensyn-ai/CheckFree@8d7d547 (MIT): model sizes, stage layout, geo link table"
DATASTATES = "Maurya et al., 'DataStates-LLM', HPDC'24, doi 10.1145/3625549.3658685: storage tier bandwidths"
BAMBOO = "Thorpe et al., 'Bamboo', NSDI'23; uclasystem/bamboo@8080929 (MIT): p3 spot trace, 45 s ready time"
LLAMA3 = "Llama 3 herd, arXiv 2407.21783: 419 unexpected interruptions in 54 days on 16,384 H100"
LLAMA3_NETWORK = "Llama 3 herd, arXiv 2407.21783: a 400 Gb/s NIC per GPU (reference/checkpointing.md, link table)"
LLAMA3_FAILURES_PER_NODE_HOUR = 1.6e-4
"""419 interruptions / (54 days × 24 h × 2,048 nodes of 8 H100): per node, never multiplied by D."""

CHECKFREE_FAILURE_RATES = (0.05, 0.10, 0.16, 0.33)
CPU_TINY = "cpu-tiny"
CPU_TINY_TARGET_ITERATIONS = 80
# One failure per stage every 15 s: a real run of the preset (~10 s, 4 stages) sees a few failures.
CPU_TINY_FAILURES_PER_NODE_HOUR = 240.0
A100_BF16_PEAK_FLOPS_PER_S = 312e12
H100_BF16_PEAK_FLOPS_PER_S = 989e12
V100_FP16_PEAK_FLOPS_PER_S = 125e12
MEGABIT = 1e6 / 8


def default_methods(**overrides: dict[str, object]) -> tuple[MethodConfig, ...]:
    """Every method with default parameters, parameters of some overridden by name."""
    return tuple(method_from_name(name, **overrides.get(name, {})) for name in METHOD_NAMES)


def _wan_storage(remote_bandwidth_bytes_per_s: float) -> tuple[StorageTier, ...]:
    return (
        StorageTier(name="host_memory", write_bandwidth_bytes_per_s=25e9, read_bandwidth_bytes_per_s=25e9, survives_node_loss=False),
        StorageTier(name="local_disk", write_bandwidth_bytes_per_s=2e9, read_bandwidth_bytes_per_s=3e9, survives_node_loss=False),
        StorageTier(
            name="remote",
            write_bandwidth_bytes_per_s=remote_bandwidth_bytes_per_s,
            read_bandwidth_bytes_per_s=remote_bandwidth_bytes_per_s,
            latency_s=0.1,
            survives_node_loss=True,
            shared=True,
        ),
    )


EMBEDDING_NODE_TAG = "-embedding-node"
"""Name tag, after the model size, of the CheckFree presets in the authors' layout (a separate
(de)embedding node), e.g. `checkfree-500m-embedding-node-geo-10pct`."""


def batch_and_size_of_the_curve(model: ModelSpec, pipeline: PipelineSpec, target_loss: float) -> dict[str, float]:
    """The convergence fields that make a preset's loss curve count iterations of its own global
    batch and belong to its own model size, so that a --set of the batch (microbatches, their size,
    data-parallel replicas) or of the model (layers, width) carries the curve to the new one; B_noise
    from Kaplan et al.'s critical batch at the target loss and the size term from Hoffmann et al.'s
    fit, for models trained on web text as theirs were (calibration/convergence.py states the
    approximations)."""
    return {
        "baseline_tokens_per_iteration": float(tokens_per_iteration(model, pipeline)),
        "critical_batch_tokens": critical_batch_tokens_at_loss(target_loss),
        "baseline_parameters": float(model.num_parameters),
    }


def _checkfree_geo(
    *,
    size: str,
    model: ModelSpec,
    pipeline: PipelineSpec,
    failure_probability_per_stage_hour: float,
    curve: PowerLawLossCurve,
    target_loss: float,
    lr_scale: float = 1.1,
    embedding_placement: str = "edge_stages",
    web_text: bool = True,
    max_wall_clock_days: float = 30.0,
) -> Scenario:
    # Layout (pipeline.embedding_placement). Default "edge_stages": the embedding and the head run
    # with stage 0's and stage S-1's blocks, as in Megatron-style pipelines and in churnsim's real
    # runs, and stage i sits where the CheckFree emulator puts node 3·i (replica chain r0: Australia
    # → Germany → London → Canada → NL → Belgium → Iowa → ...), reference/checkfree.md §4.1. Kept
    # so that the presets' published results do not move. The CheckFree authors' emulator instead
    # runs the embedding and head on a node of their own that never fails (its "stage 0",
    # `LLamaFirstStage(n_layers=0)`, node 0 in Australia; checkfree.md §2 and §4.1), so a CheckFree+
    # swap costs no extra trip there: "separate_node" (the `*-embedding-node-*` presets) puts that node
    # in Australia (node S, the last entry of `sites`) and block stage i where the emulator puts
    # node 3·(i + 1).
    separate = embedding_placement == "separate_node"
    num_sites = len(CHECKFREE_EMULATOR_SITES)
    first = 1 if separate else 0
    sites = tuple(CHECKFREE_EMULATOR_SITES[(3 * (stage + first)) % num_sites] for stage in range(pipeline.num_stages))
    if separate:
        sites += (CHECKFREE_EMULATOR_SITES[0],)
    # The paper's failure unit is the whole stage: its simulator fails every data-parallel replica of
    # a stage at once and its emulator's replicas share one random seed (reference/checkfree.md §2),
    # so a failure is always a stage loss, as in the paper. `checkfree-emulator-replicas-independent`
    # asks what changes when they fail on their own.
    pipeline = pipeline.model_copy(update={"embedding_placement": embedding_placement, "replicas_fail_together": True})
    percent = round(failure_probability_per_stage_hour * 100)
    rebuild = {"lr_scale": lr_scale}
    layout = (
        "; the embedding and head on a separate never-failing node in Australia, as in the authors' emulator"
        if separate
        else ""
    )
    return Scenario(
        name=f"checkfree-{size}{EMBEDDING_NODE_TAG if separate else ''}-geo-{percent}pct",
        description=(
            f"CheckFree paper's {size} LLaMA-style setup on its emulated geo-distributed testbed, "
            f"{percent} %/h failure probability per stage, its data-parallel replicas failing together as in the paper{layout}"
        ),
        sources=(CHECKFREE_PAPER, CHECKFREE_CODE, DATASTATES, "WAN checkpoint bandwidth 500 Mb/s: gensyn.ai/articles/checkfree"),
        model=model,
        pipeline=pipeline,
        # GPU type is not stated by the paper: A100 bf16 peak at 40 % utilisation (a judgement).
        compute=FlopsCompute(peak_flops_per_s=A100_BF16_PEAK_FLOPS_PER_S, utilization=0.4, optimizer_step_s=0.05),
        network=SiteNetwork(sites=sites, table="checkfree_geo"),
        # Remote checkpoint storage behind one 500 Mb/s WAN link ("over 500 Mb/s", CheckFree blog).
        storage=_wan_storage(500 * MEGABIT),
        churn=StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=failure_probability_per_stage_hour),
        recovery=RecoverySpec(join_delay_s=30.0, restart_s=6.6),
        methods=default_methods(
            checkfree=rebuild, checkfree_plus=rebuild, copy=rebuild, uniform=rebuild, random=rebuild,
            checkpoint={"interval_iterations": 20},  # the CheckFree rollback replay's default F = 20
        ),
        # Setbacks fitted to the paper's own ablation (500M, 16 %/h), carried to every size and rate in
        # iterations unchanged (calibration/paper_setbacks.py states the assumptions).
        convergence=ConvergenceSpec(
            baseline=curve, setbacks=paper_fitted_setbacks(), setback_source="paper_fitted", source=PAPER_FIT_SOURCE,
            **(batch_and_size_of_the_curve(model, pipeline, target_loss) if web_text else {}),
        ),
        target=TargetSpec(loss=target_loss, max_wall_clock_s=max_wall_clock_days * 24 * 3600.0),
        seed=0,
        replications=10,
    )


def checkfree_124m_geo(failure_probability_per_stage_hour: float = 0.10, embedding_placement: str = "edge_stages") -> Scenario:
    """124M (really 83M: d 512, 12 layers in 4 stages), TinyStories, target loss 1.3."""
    return _checkfree_geo(
        size="124m",
        model=ModelSpec(name="checkfree-124m", num_layers=12, hidden_size=512, num_heads=8, vocab_size=32000, sequence_length=512),
        pipeline=PipelineSpec(num_stages=4, data_parallel_degree=2, microbatch_size=64, num_microbatches=4),
        failure_probability_per_stage_hour=failure_probability_per_stage_hour,
        # Illustrative: reaches 1.3 after about 10k iterations.
        curve=PowerLawLossCurve(floor_loss=0.9, scale=10.0, exponent=0.35, offset_iterations=100.0),
        target_loss=1.3,
        embedding_placement=embedding_placement,
        # TinyStories' losses are far below web text's: Kaplan et al.'s critical batch, fitted on web
        # text, would not hold, so this curve counts iterations alike whatever the batch.
        web_text=False,
    )


def checkfree_500m_geo(failure_probability_per_stage_hour: float = 0.10, embedding_placement: str = "edge_stages") -> Scenario:
    """500M (468M: d 1024, 24 layers in 12 stages), OpenWebText, target validation loss 2.9."""
    return _checkfree_geo(
        size="500m",
        model=ModelSpec(name="checkfree-500m", num_layers=24, hidden_size=1024, num_heads=16, vocab_size=32000, sequence_length=1024),
        pipeline=PipelineSpec(num_stages=12, data_parallel_degree=4, microbatch_size=16, num_microbatches=4),
        failure_probability_per_stage_hour=failure_probability_per_stage_hour,
        # Illustrative: reaches 2.9 after about 15k iterations.
        curve=PowerLawLossCurve(floor_loss=2.2, scale=20.3, exponent=0.35, offset_iterations=100.0),
        target_loss=2.9,
        embedding_placement=embedding_placement,
    )


def checkfree_1_5b_geo(failure_probability_per_stage_hour: float = 0.10, embedding_placement: str = "edge_stages") -> Scenario:
    """1.5B (1.74B: d 2048, 24 layers in 12 stages), RedPajama-V2, target loss 2.9."""
    return _checkfree_geo(
        size="1.5b",
        model=ModelSpec(name="checkfree-1.5b", num_layers=24, hidden_size=2048, num_heads=16, vocab_size=32000, sequence_length=4096),
        pipeline=PipelineSpec(num_stages=12, data_parallel_degree=8, microbatch_size=8, num_microbatches=2),
        failure_probability_per_stage_hour=failure_probability_per_stage_hour,
        # Illustrative: reaches 2.9 after about 12k iterations.
        curve=PowerLawLossCurve(floor_loss=2.1, scale=21.0, exponent=0.35, offset_iterations=100.0),
        target_loss=2.9,
        embedding_placement=embedding_placement,
        # Without failures the target takes 417 h (17 days) here: a run is given up after about four
        # times that, as the 500M's 30 days are about four times its 182 h; with the 30 days every
        # method but redundant computation ran out of time at 10 %/h.
        max_wall_clock_days=70.0,
    )


CHECKFREE_EMULATOR_REPLICAS = 3
"""The authors' emulator: 21 nodes, 7 partitions × 3 replicas (reference/checkfree.md §4.1)."""
CHECKFREE_EMULATOR_TOGETHER = "checkfree-emulator-replicas-fail-together"
CHECKFREE_EMULATOR_INDEPENDENT = "checkfree-emulator-replicas-fail-independently"


def checkfree_emulator_replica_link(num_block_stages: int = 6) -> tuple[float, float]:
    """(latency_s, bandwidth_bytes_per_s) of the slowest link between two replicas of one stage in the
    CheckFree emulator, where node n sits at site n % 7 and partition p's replicas are nodes 3p, 3p + 1,
    3p + 2 (partition 0 is the embedding node): three different sites per stage, so each stage's
    gradient exchange crosses the WAN. The stages exchange at the same time and the optimizer step
    waits for the slowest, so one link stands for all (Aus–Lon, 132 ms, 81 Mb/s)."""
    table = load_site_table("checkfree_geo")
    sites = CHECKFREE_EMULATOR_SITES
    links = []
    for partition in range(1, num_block_stages + 1):
        replica_sites = [sites[(CHECKFREE_EMULATOR_REPLICAS * partition + replica) % len(sites)] for replica in range(CHECKFREE_EMULATOR_REPLICAS)]
        links += [table[(a, b)] for a in replica_sites for b in replica_sites if a < b]
    return min(links, key=lambda link: link[1])


def checkfree_emulator(replicas_fail_together: bool, failure_probability_per_stage_hour: float = 0.10) -> Scenario:
    """The CheckFree authors' emulated geo-distributed testbed: the 500M model (d 1024, 24 layers) in 6
    block stages of 4 layers plus the never-failing (de)embedding node, 7 partitions × 3 data-parallel
    replicas, microbatches of 8 × 1024 tokens, 6 per replica pipeline, fp32 messages (32 MiB per
    activation, 256 MiB per stage's weights), at `failure_probability_per_stage_hour` per failure
    domain (reference/checkfree.md §2 and §4.1).

    `replicas_fail_together=True` is the emulator as its authors ran it: one seed per stage, so a
    stage's three replicas fail together and every failure is a stage loss. False: each node fails on
    its own at the same rate, and a lost node heals by copying a surviving replica; a stage is lost
    only when all three are down at once. The pair shows how much of CheckFree's case rests on the
    replicas failing together.

    The replicas' gradient exchange runs over the emulator's WAN links: a ring all-reduce at the
    slowest replica link (`checkfree_emulator_replica_link`), an approximation of the emulator's
    exchange, where each node sends its whole gradient to its two peers at once.
    """
    model = ModelSpec(
        name="checkfree-500m", num_layers=24, hidden_size=1024, num_heads=16, vocab_size=32000, sequence_length=1024,
        weight_bytes_per_parameter=4.0, activation_bytes_per_element=4.0,
    )
    pipeline = PipelineSpec(
        num_stages=6, data_parallel_degree=CHECKFREE_EMULATOR_REPLICAS, microbatch_size=8, num_microbatches=6,
    )
    scenario = _checkfree_geo(
        size="500m",
        model=model,
        pipeline=pipeline,
        failure_probability_per_stage_hour=failure_probability_per_stage_hour,
        # Illustrative, as checkfree-500m-geo's: reaches 2.9 after about 15k iterations of that batch.
        curve=PowerLawLossCurve(floor_loss=2.2, scale=20.3, exponent=0.35, offset_iterations=100.0),
        target_loss=2.9,
        embedding_placement="separate_node",
    )
    latency_s, bandwidth = checkfree_emulator_replica_link(pipeline.num_stages)
    network = scenario.network.model_copy(update={"allreduce_latency_s": latency_s, "allreduce_bandwidth_bytes_per_s": bandwidth})
    percent = round(failure_probability_per_stage_hour * 100)
    if replicas_fail_together:
        name, failures = CHECKFREE_EMULATOR_TOGETHER, (
            f"the 3 replicas of a stage fail together at {percent} %/h, as in the authors' emulator, so every failure is a stage loss"
        )
    else:
        name, failures = CHECKFREE_EMULATOR_INDEPENDENT, (
            f"each node fails on its own at {percent} %/h and heals from a surviving replica of its stage; a stage is lost only "
            f"when its 3 replicas are down at once (compare {CHECKFREE_EMULATOR_TOGETHER})"
        )
    return scenario.model_copy(
        update={
            "name": name,
            "description": (
                "CheckFree's emulated geo-distributed testbed: the 500M model in 7 partitions × 3 data-parallel replicas "
                f"(6 block stages and the never-failing embedding node), gradients exchanged over its WAN links; {failures}"
            ),
            "pipeline": scenario.pipeline.model_copy(update={"replicas_fail_together": replicas_fail_together}),
            "network": network,
        }
    )


def spot_p3_trace() -> Scenario:
    """GPT-1.5B-sized model on AWS p3.2xlarge spot nodes, replaying Bamboo's p3 preemption trace."""
    model = ModelSpec(name="gpt-1.5b", num_layers=48, hidden_size=1600, num_heads=25, vocab_size=50257, sequence_length=1024)
    pipeline = PipelineSpec(num_stages=12, data_parallel_degree=1, microbatch_size=1, num_microbatches=32)
    return Scenario(
        name="spot-p3-trace",
        description="12-stage pipeline of single-V100 spot nodes replaying the Bamboo AWS p3 trace (11.4 h, 167 preemptions)",
        sources=(
            BAMBOO,
            "Duan et al., 'Parcae', NSDI'24; JF-D/Parcae@efedee7: 10 Gb/s p2p ≈ 140 µs + 1.2 s/GiB",
            DATASTATES,
        ),
        model=model,
        pipeline=pipeline,
        compute=FlopsCompute(peak_flops_per_s=V100_FP16_PEAK_FLOPS_PER_S, utilization=0.3, optimizer_step_s=0.05),
        network=UniformNetwork(latency_s=140e-6, bandwidth_bytes_per_s=10e9 / 8),
        storage=(
            StorageTier(name="host_memory", write_bandwidth_bytes_per_s=12e9, read_bandwidth_bytes_per_s=12e9, survives_node_loss=False),
            StorageTier(name="local_disk", write_bandwidth_bytes_per_s=1e9, read_bandwidth_bytes_per_s=1e9, survives_node_loss=False),
            # Object store per node ≈ min(NIC, 16 streams × 90 MB/s) (reference/checkpointing.md §6).
            StorageTier(name="remote", write_bandwidth_bytes_per_s=1.4e9, read_bandwidth_bytes_per_s=1.4e9, latency_s=0.05, survives_node_loss=True),
        ),
        churn=TraceChurn(kind="trace", path="bamboo/p3-trace.csv", format="bamboo_csv", repeat=True),
        # Bamboo: an instance is ready 45 s after it arrives; local rendezvous 20 s.
        recovery=RecoverySpec(join_delay_s=45.0, restart_s=20.0),
        methods=default_methods(checkpoint={"interval_iterations": 100}),
        convergence=ConvergenceSpec(
            baseline=PowerLawLossCurve(floor_loss=2.3, scale=20.0, exponent=0.35, offset_iterations=100.0),
            **batch_and_size_of_the_curve(model, pipeline, 3.0),
        ),
        target=TargetSpec(loss=3.0),
        seed=0,
        replications=10,
    )


def datacenter_llama3() -> Scenario:
    """A 70B-class model on H100 nodes at the Llama 3 interruption rate."""
    data_parallel_degree = 128
    # 419 interruptions in 54 days over 2,048 nodes of 8 GPUs: 1.6e-4 per node-hour (≈ 1 per 3.1 h for
    # the whole job). The rate is per node: each of the 16 × 128 nodes fails on its own, and a lost
    # node heals by copying a surviving replica of its stage (calibration/replica_rule.py).
    return Scenario(
        name="datacenter-llama3",
        description=(
            "70B-class model, 16 pipeline stages × 128 data-parallel replicas of 8×H100 nodes, each node failing at the "
            "Llama 3 interruption rate (1.6e-4 per node-hour); a lost node heals from a surviving replica of its stage"
        ),
        sources=(LLAMA3, DATASTATES, "Kokolis et al., HPCA'25, arXiv 2410.21680 (ETTR)", LLAMA3_NETWORK),
        model=ModelSpec(name="llama-70b", num_layers=80, hidden_size=8192, num_heads=64, vocab_size=128256, sequence_length=8192, ffn_hidden_size=28672),
        pipeline=PipelineSpec(num_stages=16, data_parallel_degree=data_parallel_degree, microbatch_size=1, num_microbatches=16),
        compute=FlopsCompute(peak_flops_per_s=8 * H100_BF16_PEAK_FLOPS_PER_S, utilization=0.4, optimizer_step_s=0.1),
        # One 400 Gb/s NIC per GPU (reference/checkpointing.md's link table, "datacenter NIC: 400 Gb/s
        # per GPU (Llama 3)"): 8 × 50 GB/s per node, for the pipeline's sends and for each stage's
        # gradient all-reduce over its 128 replicas.
        network=UniformNetwork(
            latency_s=10e-6, bandwidth_bytes_per_s=400e9 / 8 * 8,
            allreduce_latency_s=20e-6, allreduce_bandwidth_bytes_per_s=400e9 / 8 * 8,
        ),
        storage=(
            StorageTier(name="host_memory", write_bandwidth_bytes_per_s=8 * 25e9, read_bandwidth_bytes_per_s=8 * 25e9, survives_node_loss=False),
            StorageTier(name="local_disk", write_bandwidth_bytes_per_s=8 * 3e9, read_bandwidth_bytes_per_s=8 * 3e9, survives_node_loss=False),
            # 2 TB/s sustained storage shared by 2,048 nodes ⇒ ≈ 1 GB/s per node (Llama 3).
            StorageTier(name="remote", write_bandwidth_bytes_per_s=1e9, read_bandwidth_bytes_per_s=1e9, latency_s=0.01, survives_node_loss=True),
        ),
        churn=PoissonChurn(kind="poisson", failures_per_node_hour=LLAMA3_FAILURES_PER_NODE_HOUR),
        # Datacenter recovery: about 20 min to replace a host, 3 min to select it (AIReSim defaults).
        recovery=RecoverySpec(join_delay_s=20 * 60.0, restart_s=3 * 60.0),
        methods=default_methods(checkpoint={"interval_iterations": 200}),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.6, scale=12.0, exponent=0.3, offset_iterations=100.0)),
        target=TargetSpec(iterations=20000),
        seed=0,
        replications=10,
    )


# ---------------------------------------------------------------- DataStates-LLM (HPDC'24)
DATASTATES_PAPER = (
    "Maurya, Underwood, Rafique, Cappello, Nicolae, 'DataStates-LLM: Lazy Asynchronous Checkpointing for "
    "Large Language Models', HPDC'24, doi 10.1145/3625549.3658685 (arXiv 2406.10707)"
)
POLARIS = "ALCF Polaris: 4× A100-40GB per node, pinned D2H 25 GB/s per GPU, Lustre 650 GB/s (DataStates-LLM §6)"


@dataclass(frozen=True)
class DataStatesRun:
    """One model of DataStates-LLM's evaluation [P Table 1, Fig. 4]: layers/hidden/heads, GPUs, the
    forward, backward and update seconds of one iteration, and its checkpoint size."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_gpus: int
    forward_s: float
    backward_s: float
    update_s: float
    checkpoint_bytes: float


DATASTATES_RUNS: dict[str, DataStatesRun] = {
    "7b": DataStatesRun(num_layers=32, hidden_size=4096, num_heads=32, num_gpus=8, forward_s=1.26, backward_s=1.82, update_s=0.12, checkpoint_bytes=83e9),
    "13b": DataStatesRun(num_layers=40, hidden_size=5120, num_heads=40, num_gpus=16, forward_s=1.85, backward_s=3.56, update_s=0.09, checkpoint_bytes=166e9),
    "30b": DataStatesRun(num_layers=60, hidden_size=6656, num_heads=52, num_gpus=32, forward_s=3.72, backward_s=8.58, update_s=0.11, checkpoint_bytes=444e9),
}
"""reference/checkpointing.md §4 ("Models (layers/hidden/heads, GPUs; F/B/U s) [Table 1, Fig. 4]";
checkpoints 83/166/444 GB)."""

DATASTATES_GPUS_PER_NODE = 4
"""Tensor parallelism 4 inside a Polaris node, pipeline stages = nodes [P §6]."""
DATASTATES_NICS_PER_NODE = 2
"""Two Slingshot-11 NICs of 200 Gb/s per Polaris node (reference/checkpointing.md §4)."""
DATASTATES_ITERATIONS = 50
"""The end-to-end runs of Figs. 11–12 train 50 iterations."""
DATASTATES_D2H_BYTES_PER_S_PER_GPU = 25e9
"""Pinned GPU→host copy per A100 on Polaris [P §6]."""
DATASTATES_HOST_CACHE_BYTES = 64 * 10**9
"""Pinned host cache per node: "≤ 64 GB host cache per node" (checkpointing.md, What matters most, 6)."""
DATASTATES_LUSTRE_BYTES_PER_S_PER_NODE = 7.4e9
"""Flush rate per node to Lustre, derived from the 7B every-iteration run (41.5 GB per node × 50 in
282 s; checkpointing.md §4 "Derived"). Not a hardware figure: that run is no independent check."""
DATASTATES_TORCH_SAVE_BYTES_PER_S_PER_NODE = 10.4e9
"""torch.save's serialization (pageable copy and pickling) per node, fitted so that churnsim gives
DeepSpeed's 7B every-iteration run, 631 s for 50 iterations [P Figs. 11–12] (49 checkpoints of
41.5 GB per node: 9.6 s each, 5.6 s of it the write at 7.4 GB/s). A fit, not a measurement."""
DATASTATES_VOCAB = 50257
"""The GPT-2 tokenizer of Megatron-DeepSpeed's GPT examples (an assumption: the paper does not give
it); it only sizes the embedding, and the checkpoint bytes are scaled to the published size anyway."""


def _even_split(num_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The most even split, larger stages first (60 in 8: 8, 8, 8, 8, 7, 7, 7, 7); None when equal."""
    base, extra = divmod(num_layers, num_stages)
    if not extra:
        return None
    return tuple(base + 1 if stage < extra else base for stage in range(num_stages))


def datastates(size: str, *, data_parallel_degree: int = 1, interval_iterations: int = 1) -> Scenario:
    """One DataStates-LLM run on Polaris: DeepSpeed's synchronous torch.save (`checkpoint`) against the
    lazy asynchronous engine (`async_checkpoint`), checkpointing every `interval_iterations`, no failures.

    Pipeline stage = node (TP 4 inside it), ZeRO-1: with data parallelism each replica writes 1/DP of
    its stage (`checkpoint_sharding = "data_parallel"`). F, B and U are the paper's measured seconds
    per iteration [P Fig. 4], split over the stages by their layers and run as one microbatch, so a
    healthy iteration takes F + B + U; the lazy copy hides behind F + B.
    """
    run = DATASTATES_RUNS[size]
    num_stages = run.num_gpus // DATASTATES_GPUS_PER_NODE
    hidden = run.hidden_size
    # SwiGLU at 8d/3 has the parameters of the paper's GPT MLP at 4d (12 d² per layer with attention).
    model = ModelSpec(
        name=f"datastates-{size}", num_layers=run.num_layers, hidden_size=hidden, num_heads=run.num_heads,
        vocab_size=DATASTATES_VOCAB, sequence_length=2048, ffn_hidden_size=8 * hidden // 3,
    )
    # Checkpoint bytes per parameter such that the checkpoint has the published size (12–15 B/param).
    model = model.model_copy(update={"checkpoint_bytes_per_parameter": run.checkpoint_bytes / model.num_parameters})
    tiers = (
        StorageTier(
            name="host_memory",
            write_bandwidth_bytes_per_s=DATASTATES_GPUS_PER_NODE * DATASTATES_D2H_BYTES_PER_S_PER_GPU,
            read_bandwidth_bytes_per_s=DATASTATES_GPUS_PER_NODE * DATASTATES_D2H_BYTES_PER_S_PER_GPU,
            survives_node_loss=False,
        ),
        # Two views of one Lustre: DataStates writes raw tensor bytes; DeepSpeed's torch.save first
        # serializes (reference/checkpointing.md §2, "DeepSpeed (sync torch.save: serialize + write)").
        # A run uses one method, so the two never share the link.
        StorageTier(
            name="lustre", write_bandwidth_bytes_per_s=DATASTATES_LUSTRE_BYTES_PER_S_PER_NODE,
            read_bandwidth_bytes_per_s=DATASTATES_LUSTRE_BYTES_PER_S_PER_NODE, survives_node_loss=True,
        ),
        StorageTier(
            name="lustre_torch_save", write_bandwidth_bytes_per_s=DATASTATES_LUSTRE_BYTES_PER_S_PER_NODE,
            read_bandwidth_bytes_per_s=DATASTATES_LUSTRE_BYTES_PER_S_PER_NODE, survives_node_loss=True,
            serialization_bytes_per_s=DATASTATES_TORCH_SAVE_BYTES_PER_S_PER_NODE,
        ),
    )
    suffix = f"-dp{data_parallel_degree}" if data_parallel_degree > 1 else ""
    return Scenario(
        name=f"datastates-{size}{suffix}",
        description=(
            f"DataStates-LLM's {size.upper()} run on Polaris ({num_stages} pipeline stages of 4 A100s"
            f"{f', {data_parallel_degree} data-parallel replicas each writing 1/{data_parallel_degree} of its stage checkpoint (ZeRO-1)' if data_parallel_degree > 1 else ''}), "
            f"checkpointing every {interval_iterations} iteration(s) for {DATASTATES_ITERATIONS} iterations without "
            "failures: DeepSpeed's torch.save (checkpoint) against lazy asynchronous checkpointing (async_checkpoint)"
        ),
        sources=(DATASTATES_PAPER, POLARIS),
        model=model,
        pipeline=PipelineSpec(
            num_stages=num_stages, data_parallel_degree=data_parallel_degree, schedule="gpipe", microbatch_size=16,
            num_microbatches=1, layers_per_stage=_even_split(run.num_layers, num_stages), checkpoint_sharding="data_parallel",
        ),
        compute=ExplicitCompute(
            block_forward_s=run.forward_s / num_stages, block_backward_s=run.backward_s / num_stages, optimizer_step_s=run.update_s,
        ),
        # Slingshot-11, 200 Gb/s per NIC. F/B/U were measured without data parallelism [P Table 1],
        # so with replicas each stage's gradients cross both NICs of its node (2 × 200 Gb/s) in a ring;
        # ZeRO-1's reduce-scatter and all-gather move the bytes of one all-reduce.
        network=UniformNetwork(
            latency_s=2e-6, bandwidth_bytes_per_s=25e9,
            allreduce_latency_s=2e-6, allreduce_bandwidth_bytes_per_s=DATASTATES_NICS_PER_NODE * 25e9,
        ),
        storage=tiers,
        churn=NoChurn(kind="none"),
        methods=(
            method_from_name("none"),
            method_from_name("checkpoint", interval_iterations=interval_iterations, tier="lustre_torch_save"),
            method_from_name(
                "async_checkpoint", interval_iterations=interval_iterations, host_buffer_bytes=DATASTATES_HOST_CACHE_BYTES,
                levels=("lustre",),
            ),
        ),
        # Illustrative: the runs are timed for a fixed number of iterations, not to a loss.
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=2.0, scale=10.0, exponent=0.3, offset_iterations=100.0)),
        target=TargetSpec(iterations=DATASTATES_ITERATIONS),
        seed=0,
        replications=1,
    )


SETBACK_SOURCE_WORDS = {
    "measured": "measured",
    "paper_fitted": "uncalibrated on this model, fitted to the CheckFree paper's ablation",
    "default": "uncalibrated defaults",
}


def with_calibrated_setbacks(scenario: Scenario, calibration_name: str = CPU_TINY) -> Scenario:
    """`scenario` with its convergence setbacks from a built-in calibration (mode "setbacks").

    The setbacks are carried over in optimizer steps unchanged (calibration/apply.py states the
    assumption). A missing, invalid or setback-less calibration leaves the scenario's own setbacks
    (paper-fitted or default), and the description says which; this never raises, so listing
    presets always works.
    """
    calibration, reason = load_builtin_calibration(calibration_name)
    if calibration is not None:
        try:
            return apply_calibration(scenario, calibration, mode="setbacks")
        except InputError as error:
            reason = str(error)
    kind = SETBACK_SOURCE_WORDS[scenario.convergence.setback_source or "default"]
    note = f" Convergence setbacks: {kind} ({reason})."
    return scenario.model_copy(update={"description": scenario.description + note})


def _paper(factory: Callable[..., Scenario], rate: float, embedding_placement: str = "edge_stages") -> Callable[[], Scenario]:
    return lambda: with_calibrated_setbacks(factory(rate, embedding_placement))


def _calibrated_tiers(calibration: Calibration | None) -> tuple[StorageTier, ...]:
    """local_disk (dies with the node) and remote (survives): measured where the calibration has them.

    A local calibration usually measures only `local_disk`; `remote` then takes its bandwidths (a
    second directory on the same machine, as in the calibration's own runs).
    """
    measured = {tier.name: tier for tier in calibration.storage} if calibration is not None else {}
    local = measured.get("local_disk")
    remote = measured.get("remote", local)

    def tier(name: str, source, survives: bool) -> StorageTier:
        write, read = (source.write_bandwidth_bytes_per_s, source.read_bandwidth_bytes_per_s) if source else (200e6, 1e9)
        return StorageTier(name=name, write_bandwidth_bytes_per_s=write, read_bandwidth_bytes_per_s=read, survives_node_loss=survives)

    return (tier("local_disk", local, False), tier("remote", remote, True))


def cpu_tiny(failures_per_node_hour: float = CPU_TINY_FAILURES_PER_NODE_HOUR) -> Scenario:
    """The tiny model in 4 stages on this kind of CPU machine, from the built-in calibration `cpu-tiny`.

    Compute, links, storage, join time and the convergence model (baseline and setbacks) are the
    calibration's (mode "full"); method parameters are those of the calibration suite (checkpoints
    every 10 iterations). The target is the calibrated baseline's loss after
    `CPU_TINY_TARGET_ITERATIONS`, inside the range the calibration runs measured. Without the file
    the preset keeps uncalibrated placeholders and says so.
    """
    scenario, calibration, reason = _cpu_tiny_before_calibration(failures_per_node_hour)
    if calibration is None:
        return scenario.model_copy(update={"description": scenario.description + f". UNCALIBRATED placeholders: {reason}."})
    return apply_calibration(scenario, calibration, mode="full")


CPU_TINY_BUILTIN_SOURCE = (
    "built-in calibration cpu-tiny, made by `churnsim calibrate --quick` on a 2-core machine "
    "(calibration/data/calibrations/cpu-tiny.json, provenance inside)"
)


def _cpu_tiny_before_calibration(failures_per_node_hour: float = CPU_TINY_FAILURES_PER_NODE_HOUR) -> tuple[Scenario, Calibration | None, str]:
    """`cpu_tiny` before its calibration is applied: the scenario, the calibration (None when its file
    cannot be used) and why not."""
    calibration, reason = load_builtin_calibration(CPU_TINY)
    model = ModelSpec(
        name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, sequence_length=64,
        weight_bytes_per_parameter=4.0, activation_bytes_per_element=4.0,
    )
    pipeline = PipelineSpec(num_stages=4, microbatch_size=8, num_microbatches=4)
    # Placeholders of the order measured on a 2-core CPU (used only without the calibration file).
    curve = PowerLawLossCurve(floor_loss=2.2, scale=3.3, exponent=0.5, offset_iterations=10.0)
    if calibration is not None:
        model = calibration.model.model_copy(update={"name": "tiny"})  # real run records leave the name unset
        pipeline, curve = calibration.pipeline, calibration.convergence.baseline
    scenario = Scenario(
        name="cpu-tiny" if failures_per_node_hour == CPU_TINY_FAILURES_PER_NODE_HOUR else f"cpu-tiny-{failures_per_node_hour:g}-per-hour",
        description=(
            f"the tiny byte-level model (4 layers, d 64) in 4 stages on local CPU processes, each stage's node failing "
            f"{failures_per_node_hour:g} times per hour (a ~10 s run sees a few failures); `churnsim real run --preset cpu-tiny` "
            "runs it for real"
        ),
        sources=(CPU_TINY_BUILTIN_SOURCE,) if calibration is not None else (),
        model=model,
        pipeline=pipeline,
        compute=ExplicitCompute(block_forward_s=0.003, block_backward_s=0.007, optimizer_step_s=0.045),
        network=UniformNetwork(latency_s=1e-4, bandwidth_bytes_per_s=2.5e9),
        storage=_calibrated_tiers(calibration),
        churn=PoissonChurn(kind="poisson", failures_per_node_hour=failures_per_node_hour),
        # Local processes: the replacement is the same process with fresh state (no rendezvous).
        recovery=RecoverySpec(join_delay_s=0.001, restart_s=0.0),
        methods=default_methods(
            checkpoint={"interval_iterations": 10},
            async_checkpoint={"interval_iterations": 10},
            redundant={"fallback_interval_iterations": 50},
            checkfree_plus={"replica_refresh_iterations": 20},
        ),
        convergence=ConvergenceSpec(baseline=curve),
        # An hour is far beyond a ~10 s run, and keeps the sampled failure path short.
        target=TargetSpec(loss=math.ceil(curve.loss(CPU_TINY_TARGET_ITERATIONS) * 100) / 100, max_wall_clock_s=3600.0),
        training=TrainingSpec(learning_rate=1e-3, eval_every_iterations=10),
        seed=0,
        replications=10,
    )
    return scenario, calibration, reason


PRESETS: dict[str, Callable[[], Scenario]] = {
    **{f"checkfree-124m-geo-{round(r * 100)}pct": _paper(checkfree_124m_geo, r) for r in CHECKFREE_FAILURE_RATES},
    **{f"checkfree-500m-geo-{round(r * 100)}pct": _paper(checkfree_500m_geo, r) for r in CHECKFREE_FAILURE_RATES},
    **{
        f"checkfree-500m{EMBEDDING_NODE_TAG}-geo-{round(r * 100)}pct": _paper(checkfree_500m_geo, r, "separate_node")
        for r in CHECKFREE_FAILURE_RATES
    },
    **{f"checkfree-1.5b-geo-{round(r * 100)}pct": _paper(checkfree_1_5b_geo, r) for r in CHECKFREE_FAILURE_RATES},
    # The authors' emulator layout, with its replicas failing together (as they ran it) and on their own.
    CHECKFREE_EMULATOR_TOGETHER: lambda: with_calibrated_setbacks(checkfree_emulator(replicas_fail_together=True)),
    CHECKFREE_EMULATOR_INDEPENDENT: lambda: with_calibrated_setbacks(checkfree_emulator(replicas_fail_together=False)),
    "spot-p3-trace": lambda: with_calibrated_setbacks(spot_p3_trace()),
    "datacenter-llama3": lambda: with_calibrated_setbacks(datacenter_llama3()),
    # DataStates-LLM's runs (no failures: the setbacks never apply; wrapped like every preset so the
    # description says where they would come from).
    "datastates-7b": lambda: with_calibrated_setbacks(datastates("7b")),
    "datastates-13b": lambda: with_calibrated_setbacks(datastates("13b")),
    "datastates-30b": lambda: with_calibrated_setbacks(datastates("30b")),
    # The DP scaling of Figs. 9–10 (256 and 512 GPUs), each replica writing its 1/16 of the checkpoint
    # (ZeRO-1): 48× less blocking than DeepSpeed at 30B.
    "datastates-13b-dp16": lambda: with_calibrated_setbacks(datastates("13b", data_parallel_degree=16)),
    "datastates-30b-dp16": lambda: with_calibrated_setbacks(datastates("30b", data_parallel_degree=16)),
    CPU_TINY: cpu_tiny,
}

DEFAULT_PRESET = "checkfree-500m-geo-10pct"


# Presets made from a calibration: how to build them before it is applied (the scenario, whose
# sources name the built-in calibration and nothing else; the calibration; why it is missing).
_BEFORE_CALIBRATION: dict[str, Callable[[], tuple[Scenario, Calibration | None, str]]] = {CPU_TINY: _cpu_tiny_before_calibration}
# The sections a calibration (mode "full") writes: a setting of one of them is applied after it too.
_CALIBRATED_SECTIONS = frozenset({"compute", "network", "storage", "recovery", "convergence"})


def calibrated_for_settings(name: str) -> bool:
    """Whether preset `name` takes `--set` settings before its calibration (`preset`)."""
    return name in _BEFORE_CALIBRATION


def configured_scenario(
    scenario: Scenario,
    preset_name: str | None,
    settings: Mapping[str, object] | None = None,
    *,
    methods: Sequence[str] = (),
    calibration: Calibration | None = None,
    calibration_mode: ApplyMode = "full",
) -> Scenario:
    """`scenario` (the preset `preset_name`, when it is one) narrowed to `methods`, with `settings`,
    on a calibrated machine when `calibration` is given: what the command line's `--method`, `--set`
    and `--calibration` and the Python API's `methods`, `settings` and `calibration` do.
    A calibrated preset (`calibrated_for_settings`) is built again with the settings before its
    calibration, so that another setup gets the calibration's compute model, where the calibrated
    setup's per-stage times would not fit. A `calibration` is applied last (calibration.apply,
    `calibration_mode`), and a setting of a section it writes after it again (`_calibrated`).
    Without `methods`, the methods the settings' pipeline cannot take (CheckFree+ at 3 stages) are
    left out, and the outputs say so (`scenario_overrides.methods_that_fit`)."""
    full = calibration is not None and calibration_mode == "full"
    if not methods and settings:
        methods = methods_that_fit(scenario, dict(settings))  # none chosen: leave out those the new pipeline cannot take
    if preset_name is not None and calibrated_for_settings(preset_name) and (settings or full):
        # Built again before its calibration: with the settings, and on the machine given (full) in
        # place of its built-in one.
        configured = preset(preset_name, settings, methods=methods, calibration=calibration if full else None)
        if full:
            return configured
    else:
        narrowed = scenario.with_methods(methods) if methods else scenario
        configured = apply_settings(narrowed, dict(settings)) if settings else narrowed
    if calibration is None:
        return configured
    return _calibrated(configured, calibration, mode=calibration_mode, settings=settings or {})


def build_scenario(
    source: Scenario | Path | str,
    *,
    methods: Sequence[str] = (),
    settings: Mapping[str, object] | None = None,
    calibration: Calibration | None = None,
    calibration_mode: ApplyMode = "full",
    replications: int | None = None,
    seed: int | None = None,
) -> Scenario:
    """The scenario a command or a Python API call runs, built one way for both: `source` (a
    `Scenario`; a `Path`, a scenario file; a `str`, a preset's name) configured with `methods`,
    `settings` and `calibration` (`configured_scenario`), then given `replications` and `seed`
    (None keeps the scenario's)."""
    if isinstance(source, Scenario):
        scenario, preset_name = source, None
    elif isinstance(source, Path):
        scenario, preset_name = load_scenario(str(source)), None
    else:
        scenario, preset_name = preset(source), source
    configured = configured_scenario(
        scenario, preset_name, settings, methods=methods, calibration=calibration, calibration_mode=calibration_mode
    )
    return configured.with_run_settings(replications=replications, seed=seed)


def _calibrated(configured: Scenario, calibration: Calibration, *, mode: ApplyMode, settings: Mapping[str, object]) -> Scenario:
    """`configured` with `calibration` applied; a setting of a section the calibration writes
    (compute, network, storage, recovery, convergence) is applied after it as well, so an explicit
    value wins."""
    calibrated = apply_calibration(configured, calibration, mode=mode)
    again = {path: value for path, value in settings.items() if path.split(".", 1)[0] in _CALIBRATED_SECTIONS}
    if {"compute.block_forward_s", "compute.block_backward_s"} <= again.keys() and "compute.carried_from" not in again:
        again["compute.carried_from"] = ""  # the hop times given, not carried by the compute model
    if again:
        calibrated = apply_settings(calibrated, again).model_copy(update={"name": configured.name})
    return calibrated


def preset(
    name: str, settings: Mapping[str, object] | None = None, *, methods: Sequence[str] = (), calibration: Calibration | None = None
) -> Scenario:
    """A built-in scenario; with `settings` (`--set` overrides, dotted paths) and `methods` (narrowed to
    those methods first, so that settings are checked against them alone: a 3-stage setting with
    CheckFree+ left out).

    A preset made from a calibration (`cpu-tiny`) takes the settings before its calibration: a
    changed model or pipeline then gets the calibration's compute model for that setup
    (`apply.calibrated_compute`), where the calibrated setup's per-stage times would not fit. A
    setting of a section the calibration writes (compute, network, storage, recovery, convergence)
    is applied after it as well, so an explicit value wins. `calibration` replaces its built-in
    calibration (another machine's).
    """
    try:
        factory = PRESETS[name]
    except KeyError:
        raise InputError(f"unknown preset {name!r}: use one of {', '.join(sorted(PRESETS))}") from None
    settings = dict(settings or {})
    before_calibration = _BEFORE_CALIBRATION.get(name)
    if (settings or calibration is not None) and before_calibration is not None:
        scenario, builtin_calibration, _ = before_calibration()
        chosen = calibration or builtin_calibration
        if chosen is not None:
            if methods:
                scenario = scenario.with_methods(methods)
            if calibration is not None:  # another machine's: the sources of the factory name its built-in calibration only
                scenario = scenario.model_copy(update={"sources": ()})
            return _calibrated(apply_settings(scenario, settings) if settings else scenario, chosen, mode="full", settings=settings)
    if calibration is not None:
        raise InputError(f"preset {name!r} is not made from a calibration; apply one with configured_scenario (--calibration)")
    scenario = factory()
    if methods:
        scenario = scenario.with_methods(methods)
    return apply_settings(scenario, settings) if settings else scenario
