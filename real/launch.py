"""Start a real pipeline run: S local processes (`launch_local`) or one rank under torchrun (`main`).

Each rank runs `trainer.train_stage`; the per-rank results (iteration rows, spans, failures,
recovery outcomes) are gathered to rank 0 over the process group, merged, and written as a run
record (calibration/run_record.py) when a run directory is given.

    torchrun --nproc-per-node 4 -m churnsim.real.launch --scenario scenario.json --method checkfree --run-dir runs/a
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as multiprocessing

from churnsim.calibration.errors import InputError

from .distributed import Communicator, destroy_process_group, find_free_port, init_process_group
from .trainer import RankResult, TrainingConfig, train_stage

if TYPE_CHECKING:
    import pandas as pd

# pandas and the run-record module are imported where used: spawned ranks never need them, and
# each import costs every rank start-up time.
FAILURE_TABLE_COLUMNS = ("time_s", "iteration", "stage", "kind")


@dataclass(kw_only=True)
class RunResult:
    """A finished real run, merged over ranks."""

    config: TrainingConfig
    metrics: pd.DataFrame
    """step, iteration, wall_time_s, train_loss, eval_loss (+ blocked_s: max over ranks)."""
    spans: pd.DataFrame
    failures: pd.DataFrame
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    run_dir: Path | None = None


def merge_rank_results(config: TrainingConfig, results: list[RankResult]) -> RunResult:
    """One table per kind: a step ends when its slowest rank ends; losses come from the last stage."""
    import pandas as pd

    from churnsim.calibration.run_record import SPANS_COLUMNS

    rows = pd.DataFrame([row | {"stage": r.stage} for r in results for row in r.iteration_rows])
    head = rows[rows["stage"] == config.num_stages - 1].set_index("step")
    grouped = rows.groupby("step")
    metrics = pd.DataFrame(
        {
            "step": head.index.to_numpy(),
            "iteration": head["iteration"].to_numpy(),
            "wall_time_s": grouped["end_s"].max().loc[head.index].to_numpy(),
            "train_loss": head["train_loss"].to_numpy(),
            "eval_loss": head["eval_loss"].to_numpy(),
            "blocked_s": grouped["blocked_s"].max().loc[head.index].to_numpy(),
        }
    )
    spans = pd.DataFrame([row for r in results for row in r.spans], columns=list(SPANS_COLUMNS))
    spans = spans.sort_values(["start_s", "rank"], kind="stable").reset_index(drop=True)
    failures = pd.DataFrame([row for r in results for row in r.failures], columns=list(FAILURE_TABLE_COLUMNS))
    # Stage 0 records every failure in the order it handed them out (the failure path's order).
    failures = failures.sort_values(["iteration"], kind="stable").reset_index(drop=True)
    recoveries = [row for r in results for row in r.recoveries]
    return RunResult(config=config, metrics=metrics, spans=spans, failures=failures, recoveries=recoveries)


def write_record(
    result: RunResult,
    run_dir: str | Path,
    *,
    run_id: str | None = None,
    checkpoint_directory: str | None = None,
    failure_rate_per_stage_hour: float | None = None,
    scenario: Any = None,
    replication: int = 0,
) -> Path:
    """Write `result` as a run record directory (manifest, metrics, spans, failures).

    `scenario` (a contract Scenario) is the scenario the run was made from, kept in the manifest so
    that the simulator can replay the run from the same file.
    """
    from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
    from churnsim.calibration.run_record import (
        METRICS_COLUMNS,
        RealRunSettings,
        RunManifest,
        make_run_record,
        provenance_fields,
        write_run_record,
    )
    from churnsim.calibration.scenario import ModelSpec, PipelineSpec

    config = result.config
    model = config.model
    settings = RealRunSettings(
        model=ModelSpec(
            num_layers=model.num_layers,
            hidden_size=model.dim,
            num_heads=model.num_heads,
            vocab_size=model.vocab_size,
            sequence_length=model.seq_len,
            ffn_hidden_size=model.ffn_hidden_dim,
            weight_bytes_per_parameter=4.0,  # real runs train in fp32
            activation_bytes_per_element=4.0,
        ),
        pipeline=PipelineSpec(
            num_stages=config.num_stages,
            schedule=config.schedule,  # type: ignore[arg-type]
            microbatch_size=config.microbatch_size,
            num_microbatches=config.num_microbatches,
        ),
        method=config.method,
        num_iterations=config.num_iterations,
        learning_rate=config.learning_rate,
        eval_every_iterations=config.eval_interval_iterations or config.num_iterations,
        device=config.device,  # type: ignore[arg-type]
        corpus=config.corpus or "python-stdlib",
        deterministic=config.deterministic,
        checkpoint_directory=checkpoint_directory,
        failure_rate_per_stage_hour=failure_rate_per_stage_hour,
    )
    manifest = RunManifest(
        run_id=run_id or uuid.uuid4().hex[:12],
        source="real",
        method=config.method.name,
        seed=config.seed,
        replication=replication,
        scenario=scenario,
        real_settings=settings,
        **provenance_fields(),
        notes=tuple(
            f"step {row['step']}: stages {row['failed_stages']} rebuilt from {row['rebuilt_from']}"
            + (f"; {'; '.join(row['notes'])}" if row["notes"] else "")
            for row in result.recoveries
        ),
        summary={
            "num_steps": int(len(result.metrics)),
            "final_train_loss": _finite_or_none(result.metrics["train_loss"].iloc[-1]),
            "final_eval_loss": _finite_or_none(result.metrics["eval_loss"].iloc[-1]),
            "wall_time_s": float(result.metrics["wall_time_s"].iloc[-1]),
            "num_failures": int(len(result.failures)),
        },
    )
    failures = FailureSchedule(
        failures=tuple(
            ScheduledFailure(time_s=float(row.time_s), iteration=int(row.iteration), stage=int(row.stage), kind=str(row.kind))
            for row in result.failures.itertuples()
        )
    )
    record = make_run_record(manifest, result.metrics.loc[:, list(METRICS_COLUMNS)], result.spans, failures)
    return write_run_record(record, run_dir)


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


# -- generic spawning (also used by the tests) ---------------------------------------------------


def _worker(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    timeout_s: float,
    function: Callable[..., Any],
    arguments: tuple[Any, ...],
    result_path: str,
) -> None:
    communicator = init_process_group(
        rank=rank, world_size=world_size, device=device, timeout_s=timeout_s, master_addr="127.0.0.1", master_port=port
    )
    try:
        value = function(communicator, *arguments)
        gathered = communicator.gather_objects(value, destination=0)
        if rank == 0:
            with open(result_path, "wb") as file:
                pickle.dump(gathered, file)
    finally:
        destroy_process_group()


def run_distributed(
    function: Callable[..., Any],
    world_size: int,
    *arguments: Any,
    device: str = "cpu",
    timeout_s: float = 60.0,
    poll: Callable[[], None] | None = None,
    poll_interval_s: float = 0.25,
) -> list[Any]:
    """Run `function(communicator, *arguments)` on `world_size` local processes; returns each rank's value.

    `function` must be importable by name (a module-level function). Processes start from a fork
    server that imported torch and the trainer once (CPU), so later runs in the same interpreter
    start in a fraction of a second; CUDA runs use plain spawn, since forking after CUDA
    initialisation is unsafe. `poll()` is called every `poll_interval_s` while the ranks run (progress).
    """
    if device == "cpu":
        start_method = "forkserver"
        # Only takes effect before the fork server starts; later calls are harmless no-ops.
        multiprocessing.set_forkserver_preload(["torch", "churnsim.real.trainer", "churnsim.real.launch"])
    else:
        start_method = "spawn"
    with tempfile.TemporaryDirectory(prefix="churnsim-real-") as directory:
        result_path = os.path.join(directory, "results.pkl")
        context = multiprocessing.start_processes(
            _worker,
            args=(world_size, find_free_port(), device, timeout_s, function, arguments, result_path),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        while not context.join(timeout=poll_interval_s):
            if poll is not None:
                poll()
        with open(result_path, "rb") as file:
            return pickle.load(file)


def _train(
    communicator: Communicator, config: TrainingConfig, run_dir: Path | None, progress_path: str | None
) -> RankResult:
    report = None
    if progress_path is not None and communicator.rank == config.num_stages - 1:  # the stage with the loss

        def report(row: dict[str, Any]) -> None:
            temporary = f"{progress_path}.tmp"
            with open(temporary, "w") as file:
                json.dump({k: row[k] for k in ("step", "iteration", "train_loss")}, file)
            os.replace(temporary, progress_path)  # the parent never reads a half-written file

    return train_stage(config, communicator, run_dir=run_dir, on_iteration_done=report)


def launch_local(
    config: TrainingConfig,
    *,
    run_dir: str | Path | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    failure_rate_per_stage_hour: float | None = None,
    scenario: Any = None,
    replication: int = 0,
) -> RunResult:
    """Run `config` with one local process per stage; writes a run record when `run_dir` is given.

    The ranks work in a hidden sibling `.<name>.work` of `run_dir` (checkpoints, node-local
    levels); only a finished run writes `run_dir`: the record, plus the remote-tier checkpoints in
    `run_dir/checkpoints`. A failed run leaves `run_dir` untouched. `on_progress(row)` gets the
    latest finished iteration (step, iteration, train_loss) while the run goes on.
    """
    directory = Path(run_dir) if run_dir is not None else None
    work_directory = None
    if directory is not None:
        work_directory = directory.parent / f".{directory.name}.work"
        shutil.rmtree(work_directory, ignore_errors=True)
        work_directory.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="churnsim-progress-") as progress_directory:
        progress_path = os.path.join(progress_directory, "progress.json") if on_progress is not None else None
        last_seen: list[Any] = [None]

        def poll() -> None:
            if progress_path is None:
                return
            try:
                with open(progress_path) as file:
                    row = json.load(file)
            except (OSError, ValueError):
                return  # nothing finished yet
            if row != last_seen[0]:
                last_seen[0] = row
                on_progress(row)  # type: ignore[misc]

        try:
            results = run_distributed(
                _train,
                config.num_stages,
                config,
                work_directory,
                progress_path,
                device=config.device,
                timeout_s=config.timeout_s,
                poll=poll,
            )
            poll()
            result = merge_rank_results(config, results)
            if directory is not None and work_directory is not None:
                checkpoints = work_directory / "checkpoints"
                kept = directory / "checkpoints" if checkpoints.is_dir() else None
                result.run_dir = write_record(
                    result,
                    directory,
                    checkpoint_directory=str(kept.resolve()) if kept is not None else None,
                    failure_rate_per_stage_hour=failure_rate_per_stage_hour,
                    scenario=scenario,
                    replication=replication,
                )
                if kept is not None:
                    os.replace(checkpoints, kept)
        finally:
            if work_directory is not None:
                shutil.rmtree(work_directory, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """One rank of a run under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by torchrun)."""
    from churnsim.calibration.scenario import load_scenario

    from .scenario_run import training_config

    parser = argparse.ArgumentParser(description="One rank of a churnsim real pipeline run (use with torchrun).")
    parser.add_argument("--scenario", required=True, help="scenario JSON file (`churnsim real run ... --write-config FILE` writes one)")
    parser.add_argument("--method", default=None, help="the method to run, if the scenario lists several")
    parser.add_argument("--replication", type=int, default=0, help="which replication's failure path to inject")
    parser.add_argument("--run-dir", default=None, help="where rank 0 writes the run record")
    arguments = parser.parse_args(argv)
    try:
        scenario = load_scenario(arguments.scenario).only_method(arguments.method)
        config = training_config(scenario, scenario.methods[0], replication=arguments.replication)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    communicator = init_process_group(device=config.device, timeout_s=config.timeout_s)
    run_dir = Path(arguments.run_dir) if arguments.run_dir else None
    try:
        rank_result = train_stage(config, communicator, run_dir=run_dir)
        gathered = communicator.gather_objects(rank_result, destination=0)
    finally:
        destroy_process_group()
    if gathered is not None and run_dir is not None:
        write_record(merge_rank_results(config, gathered), run_dir, scenario=scenario, replication=arguments.replication)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
