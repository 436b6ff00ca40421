"""The measurements only real runs can give, for `churnsim calibrate` (simulators.md section 6).

- `measure_link_profile`: ping-pong of tensors from 1 KiB to 16 MiB between two processes over the
  run's backend (gloo on CPU); one-way time = round trip / 2, the median over repeats per size.
- `measure_storage_bandwidth`: write + fsync, then read, of one file in a directory (a storage tier).
- `suite_plan` / `run_suite`: short real runs of the tiny model in 4 stages (so CheckFree+ works), or
  of a scenario's model and pipeline (`scenario_suite_settings`): one no-failure `none` run per seed
  (baseline loss curve and timings), no-failure runs of other shapes (`suite_shapes`) and,
  for every method in the real METHODS registry that the pipeline can take, one run with failures
  injected alternately at interior and edge stages, spaced so that the setback windows of
  consecutive failures do not overlap; and one short run with hard failures (`hard_failure_run`:
  processes killed and restarted under torchrun's agent), whose recoveries.csv gives the
  calibration the hard-failure components (calibration.hard_failure_costs).

Every process runs torch with one thread (the suite's processes share a small machine).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TYPE_CHECKING, Literal

from churnsim.calibration.compute_cost import processes_outnumber_cores
from churnsim.calibration.errors import InputError
from churnsim.calibration.fit_convergence import DEFAULT_WINDOW_ITERATIONS
from churnsim.calibration.methods import method_from_name, method_traits, reference_method
from churnsim.calibration.scenario import CORPUS_MAX_BYTES

from .distributed import Communicator
from .launch import launch_local, run_distributed
from .model import ModelConfig, model_preset
from .trainer import TrainingConfig

if TYPE_CHECKING:
    import pandas as pd

KIB = 1024
MIB = 1024 * KIB
LINK_SIZES_BYTES: tuple[int, ...] = tuple(KIB * 4**power for power in range(8))
"""1 KiB, 4 KiB, ..., 16 MiB."""
_PING_TAG = 7_000
_PONG_TAG = 7_001

SUITE_NUM_STAGES = 4
SETBACK_WINDOW_ITERATIONS = DEFAULT_WINDOW_ITERATIONS
"""Window of iterations before and after a failure over which its setback is measured (fit_convergence)."""

# Method parameters scaled to runs of a few hundred iterations: checkpoints and replica refreshes
# must happen several times inside one run to be measured at all.
SUITE_METHOD_PARAMETERS: dict[str, dict[str, object]] = {
    "checkpoint": {"interval_iterations": 10},
    "async_checkpoint": {"interval_iterations": 10},
    "redundant": {"fallback_interval_iterations": 50},
    "checkfree_plus": {"replica_refresh_iterations": 20},
    # The simulator charges checkfree's edge setback only to an edge rebuilt by `copy` (an edge
    # reloaded from its edge checkpoint costs staleness instead), so that is what is measured here.
    "checkfree": {"edge_fallback": "copy"},
}



def failure_stage_cycle(num_stages: int) -> tuple[int, ...]:
    """Interior and edge stages in turn, so each method gets setback samples at both positions:
    (1, 3, 2, 0) for 4 stages; a 2-stage pipeline has edges only."""
    return (1, num_stages - 1, num_stages - 2 if num_stages > 2 else 0, 0)


# -- link -------------------------------------------------------------------------------------


def _ping_pong(communicator: Communicator, sizes_bytes: tuple[int, ...], num_repeats: int) -> list[tuple[int, float]]:
    """Rank 0 sends each size to rank 1 and waits for it back; returns (bytes, one-way median s) on rank 0."""
    import torch

    torch.set_num_threads(1)
    rows: list[tuple[int, float]] = []
    for num_bytes in sizes_bytes:
        buffer = torch.zeros(max(num_bytes // 4, 1), dtype=torch.float32, device=communicator.device)
        one_way_s = []
        for repeat in range(num_repeats + 2):  # the first two warm the connection and the allocator
            if communicator.rank == 0:
                started = time.perf_counter()
                communicator.send(buffer, 1, _PING_TAG)
                communicator.recv_into(buffer, 1, _PONG_TAG)
                if repeat >= 2:
                    one_way_s.append((time.perf_counter() - started) / 2.0)
            else:
                communicator.recv_into(buffer, 0, _PING_TAG)
                communicator.send(buffer, 0, _PONG_TAG)
        if communicator.rank == 0:
            rows.append((buffer.numel() * 4, statistics.median(one_way_s)))
    return rows


def measure_link_profile(
    *,
    sizes_bytes: Sequence[int] = LINK_SIZES_BYTES,
    num_repeats: int = 10,
    device: str = "cpu",
    timeout_s: float = 60.0,
) -> pd.DataFrame:
    """Point-to-point one-way time against bytes between two local processes: columns bytes, seconds."""
    import pandas as pd

    if num_repeats < 1 or not sizes_bytes or min(sizes_bytes) < 4:
        raise InputError(f"link profile: num_repeats {num_repeats} must be >= 1 and sizes_bytes {list(sizes_bytes)} >= 4 bytes each")
    results = run_distributed(_ping_pong, 2, tuple(int(size) for size in sizes_bytes), num_repeats, device=device, timeout_s=timeout_s)
    return pd.DataFrame(results[0], columns=["bytes", "seconds"])


# -- storage ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StorageMeasurement:
    """Seconds to write (with fsync) and read back `num_bytes`, one value per repeat."""

    name: str
    num_bytes: int
    write_seconds: tuple[float, ...]
    read_seconds: tuple[float, ...]


def _drop_page_cache(path: Path) -> None:
    # Best effort: without it the read would come from memory. Linux honours it for a synced file.
    if hasattr(os, "posix_fadvise"):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def measure_storage_bandwidth(
    directory: str | Path, *, name: str = "local_disk", num_bytes: int = 32 * MIB, num_repeats: int = 3, chunk_bytes: int = 4 * MIB
) -> StorageMeasurement:
    """Write `num_bytes` to a file in `directory` and fsync, then read it back (page cache dropped first)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"storage tier {name!r}: {directory} is not a directory; create it or pass another one")
    if num_bytes < 1 or num_repeats < 1:
        raise InputError(f"storage tier {name!r}: num_bytes {num_bytes} and num_repeats {num_repeats} must be >= 1")
    chunk = os.urandom(min(chunk_bytes, num_bytes))
    path = directory / f".churnsim-bandwidth-{os.getpid()}.bin"
    write_seconds, read_seconds = [], []
    try:
        for _ in range(num_repeats):
            started = time.perf_counter()
            with open(path, "wb") as file:
                remaining = num_bytes
                while remaining > 0:
                    remaining -= file.write(chunk[: min(len(chunk), remaining)])
                file.flush()
                os.fsync(file.fileno())
            write_seconds.append(time.perf_counter() - started)
            _drop_page_cache(path)
            started = time.perf_counter()
            with open(path, "rb", buffering=0) as file:
                while file.read(chunk_bytes):
                    pass
            read_seconds.append(time.perf_counter() - started)
    finally:
        path.unlink(missing_ok=True)
    return StorageMeasurement(name=name, num_bytes=num_bytes, write_seconds=tuple(write_seconds), read_seconds=tuple(read_seconds))


# -- the suite of short runs ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SuiteRun:
    run_id: str
    purpose: Literal["baseline", "failures", "shape", "data_parallel", "hard_failures", "held_out"]
    config: TrainingConfig
    failure_rate_per_stage_hour: float | None = None
    """Recorded in the manifest when the failures were sampled from an hourly rate."""
    scenario: Any = None
    """The contract Scenario the run was made from, when it was (kept in the manifest)."""


@dataclass(frozen=True, kw_only=True)
class SuiteSettings:
    """Sizes of the suite; `quick_settings()` takes a few minutes on a CPU."""

    num_iterations: int
    seeds: tuple[int, ...]
    """One baseline run per seed; failure runs take the seeds in turn (paired with a same-seed baseline)."""
    failure_spacing_iterations: int
    num_microbatches: int = 4
    microbatch_size: int = 8
    eval_interval_iterations: int = 50
    corpus_max_bytes: int = CORPUS_MAX_BYTES
    learning_rate: float = 1e-3
    model: ModelConfig | None = None
    """The model every run trains; None: the tiny model (`model_preset("tiny")`)."""
    num_stages: int = SUITE_NUM_STAGES
    schedule: str = "1f1b"
    num_hard_failures: int = 2
    """Kills of the hard-failure run (`hard_failure_run`): each restarts every stage process."""


def quick_settings() -> SuiteSettings:
    # Sized to take a few minutes on a small CPU machine: 10 runs + 4 shapes of 100 iterations, and one
    # hard-failure run of 40 iterations with 2 kills (each restarts every stage process).
    return SuiteSettings(num_iterations=100, seeds=(0, 1), failure_spacing_iterations=25)


SHAPE_ITERATIONS = 40
DATA_PARALLEL_DEGREE = 2
"""Replicas of the suite's data-parallel run (`data_parallel_run`)."""
DATA_PARALLEL_FAILURE_STEPS: tuple[tuple[int, int, int], ...] = ((12, 0, 1), (26, 1, 0))
"""(step, stage, replica) of its soft replica losses: one per stage, so the heals copy two sizes of state."""
SHAPE_SCENARIO_FIELDS: dict[str, str] = {
    "num_stages": "pipeline.num_stages",
    "num_microbatches": "pipeline.num_microbatches",
    "microbatch_size": "pipeline.microbatch_size",
    "num_layers": "model.num_layers",
    "dim": "model.hidden_size",
    "seq_len": "model.sequence_length",
}
"""The scenario field each size of a shape (`suite_shapes`) sets, to check a shape as a scenario."""


def suite_shared_cores(device: str) -> int | None:
    """The CPU cores this machine's stage processes will share in the suite (None on CUDA), read as
    the fit reads them from the runs' records (calibration.cpu_sharing.cores_of_hardware)."""
    from churnsim.calibration.cpu_sharing import cores_of_hardware
    from churnsim.calibration.run_record import hardware_description

    return cores_of_hardware(hardware_description(), device)


def suite_shapes(settings: SuiteSettings, *, shared_cores: int | None) -> tuple[tuple[str, dict[str, int]], ...]:
    """No-failure runs of other setups than the suite's own: half the stages (twice the layers per
    stage; left out where that is fewer than 2 stages or splits the layers unequally), twice the
    microbatches, twice the tokens per microbatch, and where the stage processes outnumber the
    `shared_cores` they share (None: a device each), twice the layers in as many stages. They tell
    the compute cost model (calibration.compute_cost) how a hop's work grows with layers and tokens,
    with or without a core of its own, and the iteration with microbatches, so that a calibration
    predicts setups it did not run. Then half the width and twice the sequence length: with the
    other shapes all of one width and sequence, the fit cannot tell work per FLOP from work per byte
    (a width change scales the matmuls' FLOPs by its square but the elementwise bytes linearly, a
    longer sequence adds attention's FLOPs per token). For the tiny model in 4 stages × 4
    microbatches of 8 on 2 cores: "2-stages", "8-microbatches", "microbatch-16", "8-layers",
    "width-32", "seq-128"."""
    model = settings.model or model_preset("tiny")
    num_layers = model.num_layers
    half = settings.num_stages // 2
    shapes: list[tuple[str, dict[str, int]]] = []
    if half >= 2 and num_layers % half == 0 and settings.num_stages % 2 == 0:
        shapes.append((f"{half}-stages", {"num_stages": half}))
    shapes.append((f"{2 * settings.num_microbatches}-microbatches", {"num_microbatches": 2 * settings.num_microbatches}))
    shapes.append((f"microbatch-{2 * settings.microbatch_size}", {"microbatch_size": 2 * settings.microbatch_size}))
    if processes_outnumber_cores(settings.num_stages, shared_cores):
        # The 2-stage shape gives each process a core: only this one shows deeper stages sharing them.
        shapes.append((f"{2 * num_layers}-layers", {"num_layers": 2 * num_layers}))
    # Half the width where the heads still split it into even sizes (RoPE's pairs): it fits wherever
    # the suite's own runs fit, as twice the width may not; twice the width otherwise.
    half_width_heads_split = model.dim % (2 * model.num_heads) == 0 and (model.dim // 2 // model.num_heads) % 2 == 0
    width = model.dim // 2 if half_width_heads_split else 2 * model.dim
    shapes.append((f"width-{width}", {"dim": width}))
    shapes.append((f"seq-{2 * model.seq_len}", {"seq_len": 2 * model.seq_len}))
    return tuple(shapes)


def scenario_suite_settings(scenario: Any, base: SuiteSettings) -> SuiteSettings:
    """`base` (quick or full) on the model, pipeline and training of a contract Scenario: what
    `churnsim calibrate --preset/--scenario/--set` measures. Real runs take one pipeline, no data
    parallelism, equal stages (`Scenario.check_real_run_layout`)."""
    from .scenario_run import check_one_pipeline, model_config

    check_one_pipeline(scenario)
    scenario.check_real_run_layout()
    if scenario.pipeline.num_stages < 2:
        raise InputError("pipeline.num_stages = 1: the suite fails stages and rebuilds them from neighbours; calibrate 2 stages or more")
    return dataclasses.replace(
        base,
        model=model_config(scenario.model),
        num_stages=scenario.pipeline.num_stages,
        num_microbatches=scenario.pipeline.num_microbatches,
        microbatch_size=scenario.pipeline.microbatch_size,
        schedule=scenario.pipeline.schedule,
        learning_rate=scenario.training.learning_rate,
        corpus_max_bytes=scenario.training.corpus_max_bytes,
    )


def full_settings() -> SuiteSettings:
    return SuiteSettings(num_iterations=300, seeds=(0, 1, 2), failure_spacing_iterations=40, num_hard_failures=4)


def failure_steps(
    num_iterations: int, spacing_iterations: int, *, window_iterations: int = SETBACK_WINDOW_ITERATIONS, num_stages: int = SUITE_NUM_STAGES
) -> tuple[tuple[int, int], ...]:
    """(step, stage) failures every `spacing_iterations`, interior and edge stages in turn.

    A failure is placed only where a whole setback window fits before the next one and the end of
    the run, so every failure gives one setback sample.
    """
    if spacing_iterations < window_iterations:
        raise InputError(
            f"failure spacing {spacing_iterations} iterations is shorter than the setback window {window_iterations}; "
            "space failures further apart"
        )
    steps = range(spacing_iterations, num_iterations - window_iterations + 1, spacing_iterations)
    cycle = failure_stage_cycle(num_stages)
    return tuple((step, cycle[index % len(cycle)]) for index, step in enumerate(steps))


def suite_method_config(name: str):
    return method_from_name(name, **SUITE_METHOD_PARAMETERS.get(name, {}))


def training_config(
    settings: SuiteSettings,
    *,
    method: str,
    seed: int,
    failures: tuple[tuple[int, int], ...] = (),
    device: str = "cpu",
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    microbatch_size: int | None = None,
    num_iterations: int | None = None,
    num_layers: int | None = None,
    dim: int | None = None,
    seq_len: int | None = None,
    data_parallel_degree: int = 1,
) -> TrainingConfig:
    """The suite's model and pipeline (the tiny model in 4 stages unless the settings name others);
    the keyword sizes give another setup."""
    model = settings.model or model_preset("tiny")
    return TrainingConfig(
        model=dataclasses.replace(
            model, num_layers=num_layers or model.num_layers, dim=dim or model.dim, seq_len=seq_len or model.seq_len
        ),
        num_stages=num_stages or settings.num_stages,
        schedule=settings.schedule,
        num_microbatches=num_microbatches or settings.num_microbatches,
        microbatch_size=microbatch_size or settings.microbatch_size,
        num_iterations=num_iterations or settings.num_iterations,
        seed=seed,
        method=suite_method_config(method),
        failures=failures,
        learning_rate=settings.learning_rate,
        eval_interval_iterations=settings.eval_interval_iterations,
        corpus_max_bytes=settings.corpus_max_bytes,
        device=device,
        num_threads=1,
        data_parallel_degree=data_parallel_degree,
    )


def data_parallel_run(settings: SuiteSettings, *, method: str, device: str = "cpu", prefix: str = "fit") -> SuiteRun:
    """A short run of the suite's model in 2 stages (the suite's own stages where the layers do not
    split in two) × `DATA_PARALLEL_DEGREE` replicas, with one soft replica loss per stage: its
    `allreduce` spans and its heals' `recovery.heal` spans give the calibration the all-reduce and
    the heal (calibration.fit_timing.fit_allreduce, fit_replica_heal). No stage is lost, so the
    method's own recovery is not part of it."""
    model = settings.model or model_preset("tiny")
    num_stages = 2 if model.num_layers % 2 == 0 else settings.num_stages
    config = training_config(
        settings, method=method, seed=settings.seeds[0], device=device, num_stages=num_stages, num_iterations=SHAPE_ITERATIONS,
        failures=DATA_PARALLEL_FAILURE_STEPS, data_parallel_degree=DATA_PARALLEL_DEGREE,
    )
    return SuiteRun(run_id=f"{prefix}-data-parallel-{num_stages}x{DATA_PARALLEL_DEGREE}", purpose="data_parallel", config=config)


HARD_FAILURE_ITERATIONS = SHAPE_ITERATIONS
HARD_FAILURE_METHODS: tuple[str, ...] = ("checkfree", "copy")
"""The hard-failure run's method, the first of these the suite runs (else its first failing method):
a rebuild from neighbours recovers without rolling back, so the short run spends its time on the
restarts it measures."""


def hard_failure_steps(num_iterations: int, num_stages: int, count: int) -> tuple[tuple[int, int], ...]:
    """(step, stage) of `count` kills spread evenly over the run, interior and edge stages in turn
    (`failure_stage_cycle`), so the survivors that reload differ from kill to kill."""
    cycle = failure_stage_cycle(num_stages)
    return tuple((num_iterations * (index + 1) // (count + 1), cycle[index % len(cycle)]) for index in range(count))


def hard_failure_run(settings: SuiteSettings, *, method: str, device: str = "cpu", prefix: str = "fit") -> SuiteRun:
    """A short run of the suite's setup whose failures are hard (`failure_mode = "hard"`, no join
    delay): each kill makes torchrun's agent restart every stage process, the survivors reload their
    stage from node memory and the method recovers the lost one. Its recoveries.csv names each part
    (detection, the agent's restart, process start, rendezvous, the survivors' reload, the transfer);
    its failures are too close for setback windows, and the fit takes no steady timing from it."""
    config = training_config(
        settings, method=method, seed=settings.seeds[0], device=device, num_iterations=HARD_FAILURE_ITERATIONS,
        failures=hard_failure_steps(HARD_FAILURE_ITERATIONS, settings.num_stages, settings.num_hard_failures),
    )  # fmt: skip
    config = dataclasses.replace(config, failure_mode="hard", join_delay_s=0.0)
    return SuiteRun(run_id=f"{prefix}-{method}-hard", purpose="hard_failures", config=config)


def registered_methods() -> tuple[str, ...]:
    """The methods real runs implement now (the registry grows as methods are added)."""
    from churnsim.calibration.methods import METHOD_NAMES

    from .methods import METHODS

    return tuple(name for name in METHOD_NAMES if name in METHODS)


def suite_plan(
    settings: SuiteSettings,
    *,
    device: str = "cpu",
    shared_cores: int | None,
    methods: Sequence[str] | None = None,
    prefix: str = "fit",
) -> tuple[SuiteRun, ...]:
    """Baseline runs (the reference method `none`, no failures) per seed, no-failure runs of other
    shapes (`suite_shapes`, `shared_cores` the CPU cores the stage processes share: None with a
    device each; required, since it decides whether the double-depth shape runs), a data-parallel
    run with replica losses (`data_parallel_run`), then one failure run per method (by default every registered method the pipeline
    can take: CheckFree+ needs 4 stages), and one short hard-failure run (`hard_failure_run`)."""
    chosen = tuple(methods) if methods is not None else tuple(
        name for name in registered_methods() if method_traits(name).minimum_stages <= settings.num_stages
    )
    reference = reference_method()
    runs = [
        SuiteRun(
            run_id=f"{prefix}-{reference}-s{seed}",
            purpose="baseline",
            config=training_config(settings, method=reference, seed=seed, device=device),
        )
        for seed in settings.seeds
    ]
    runs += [
        SuiteRun(
            run_id=f"{prefix}-shape-{shape}",
            purpose="shape",
            config=training_config(
                settings, method=reference, seed=settings.seeds[0], device=device, num_iterations=SHAPE_ITERATIONS, **sizes
            ),
        )
        for shape, sizes in suite_shapes(settings, shared_cores=shared_cores)
    ]
    failing = [method for method in chosen if not method_traits(method).ignores_failures]
    if failing:  # a method that handles failures: a stage loss would go to it, a replica loss heals
        runs.append(data_parallel_run(settings, method=failing[0], device=device, prefix=prefix))
    failures = failure_steps(settings.num_iterations, settings.failure_spacing_iterations, num_stages=settings.num_stages)
    for index, name in enumerate(failing):
        seed = settings.seeds[index % len(settings.seeds)]
        runs.append(
            SuiteRun(
                run_id=f"{prefix}-{name}-s{seed}",
                purpose="failures",
                config=training_config(settings, method=name, seed=seed, failures=failures, device=device),
            )
        )
    if failing and settings.num_hard_failures > 0:
        hard_method = next((name for name in HARD_FAILURE_METHODS if name in failing), failing[0])
        runs.append(hard_failure_run(settings, method=hard_method, device=device, prefix=prefix))
    return tuple(runs)


def run_suite(
    plan: Sequence[SuiteRun], runs_out: str | Path, *, on_run_done: Callable[[SuiteRun, float], None] | None = None
) -> list[Path]:
    """Run every planned run locally; each writes its run record to `runs_out/<run_id>`."""
    runs_out = Path(runs_out)
    runs_out.mkdir(parents=True, exist_ok=True)
    written = []
    for run in plan:
        started = time.perf_counter()
        directory = runs_out / run.run_id
        launch_local(
            run.config,
            run_dir=directory,
            failure_rate_per_stage_hour=run.failure_rate_per_stage_hour,
            scenario=run.scenario,
            run_id=run.run_id,
            restart_unfinished=True,  # a calibration re-run replaces what an interrupted one left
        )
        set_run_id(directory, run.run_id)
        written.append(directory)
        if on_run_done is not None:
            on_run_done(run, time.perf_counter() - started)
    return written


def set_run_id(directory: str | Path, run_id: str) -> None:
    """Give a written run record a readable run id (the launcher draws a random one)."""
    from churnsim.calibration.base import load_model, save_model
    from churnsim.calibration.run_record import MANIFEST_FILE, RunManifest

    path = Path(directory) / MANIFEST_FILE
    manifest = load_model(RunManifest, path)
    save_model(manifest.model_copy(update={"run_id": run_id}), path)
