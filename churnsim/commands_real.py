"""Commands that run real PyTorch pipelines: `real run` (torch is imported only inside the command)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import typer

from churnsim.app import real_app

_CHECKPOINT_INTERVAL_FIELDS = {
    "checkpoint": "interval_iterations",
    "async_checkpoint": "interval_iterations",
    "redundant": "fallback_interval_iterations",
}
_ROLLBACK_METHODS = ("checkpoint", "async_checkpoint")


def real_method_config(name: str, *, checkpoint_interval: Optional[int], rollback: Optional[str]) -> Any:
    """The calibration method config for `--method` with the flags that apply to it."""
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.methods import method_from_name

    parameters: dict[str, Any] = {}
    if checkpoint_interval is not None:
        if name not in _CHECKPOINT_INTERVAL_FIELDS:
            raise InputError(
                f"--checkpoint-interval does not apply to method {name!r}: use it with {', '.join(_CHECKPOINT_INTERVAL_FIELDS)}"
            )
        parameters[_CHECKPOINT_INTERVAL_FIELDS[name]] = checkpoint_interval
    if rollback is not None:
        if name not in _ROLLBACK_METHODS:
            raise InputError(f"--rollback does not apply to method {name!r}: use it with {' or '.join(_ROLLBACK_METHODS)}")
        parameters["rollback"] = rollback
    return method_from_name(name, **parameters)


def real_failures(
    *,
    failures_path: Optional[Path],
    failure_rate: Optional[float],
    nominal_iteration_s: float,
    num_stages: int,
    num_iterations: int,
    seed: int,
) -> tuple[tuple[int, int], ...]:
    from churnsim.calibration.errors import InputError
    from churnsim.real.failure_sources import failures_from_schedule, sample_failures

    if (failures_path is None) == (failure_rate is None):
        raise InputError("give --failures FILE or --failure-rate P (exactly one; --failure-rate 0 runs without failures)")
    if failures_path is not None:
        return failures_from_schedule(failures_path, num_stages, num_iterations)
    assert failure_rate is not None
    return sample_failures(
        failure_rate, nominal_iteration_s=nominal_iteration_s, num_stages=num_stages, num_iterations=num_iterations, seed=seed
    )


def summary_paragraph(result: Any, *, out: Path) -> str:
    """One paragraph: iterations, final losses, each failure and what it was rebuilt from, wall time."""
    metrics = result.metrics

    def loss(value: float) -> str:
        return "n/a" if not math.isfinite(value) else f"{value:.4f}"

    eval_losses = metrics["eval_loss"].dropna()
    parts = [
        f"{result.config.method.name}: {result.config.num_iterations} iterations in {len(metrics)} executed steps, "
        f"{metrics['wall_time_s'].iloc[-1]:.1f} s wall time; final train loss {loss(float(metrics['train_loss'].iloc[-1]))}, "
        f"final eval loss {loss(float(eval_losses.iloc[-1]) if len(eval_losses) else math.nan)}."
    ]
    if not result.recoveries:
        parts.append("No failures.")
    else:
        parts.append(f"{len(result.failures)} stage failure(s):")
        descriptions = []
        for row in result.recoveries:
            sources = ", ".join(f"stage {stage} from {source}" for stage, source in row["rebuilt_from"].items())
            resume = f", resumed at iteration {row['resume_iteration']}" if row["resume_iteration"] is not None else ""
            descriptions.append(f"step {row['step']}: {sources}{resume}")
        parts.append("; ".join(descriptions) + ".")
    parts.append(f"Run record: {out}")
    return " ".join(parts)


@real_app.command("run")
def real_run_command(
    method: str = typer.Option(..., "--method", help="Recovery method (see DESIGN.md §2), e.g. checkpoint, redundant, checkfree."),
    stages: int = typer.Option(..., "--stages", help="Pipeline stages S (one local process each)."),
    iterations: int = typer.Option(..., "--iterations", help="Training iterations to complete."),
    out: Path = typer.Option(..., "--out", help="Directory for the run record (written only when the run finishes)."),
    failures_path: Optional[Path] = typer.Option(None, "--failures", help="Failure-schedule CSV (iteration column)."),
    failure_rate: Optional[float] = typer.Option(None, "--failure-rate", help="Per-stage hourly failure probability h."),
    nominal_iteration_s: float = typer.Option(60.0, "--nominal-iteration-s", help="Iteration time T that scales h to a per-iteration probability."),
    model: str = typer.Option("tiny", "--model", help="Model preset."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Override the preset's number of layers."),
    microbatches: int = typer.Option(4, "--microbatches", help="Microbatches per iteration."),
    microbatch_size: int = typer.Option(8, "--microbatch-size", help="Sequences per microbatch (the default matches the built-in cpu-tiny calibration)."),
    schedule: str = typer.Option("1f1b", "--schedule", help="Pipeline schedule: 1f1b or gpipe."),
    device: str = typer.Option("cpu", "--device", help="cpu (gloo) or cuda (NCCL)."),
    corpus: Optional[Path] = typer.Option(None, "--corpus", help="Text file or directory (default: the Python standard library's sources)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the model init, data order and sampled failures."),
    eval_every: int = typer.Option(10, "--eval-every", help="Held-out loss every K iterations (0: only at the end)."),
    lr: float = typer.Option(1e-3, "--lr", help="Learning rate (the default matches the built-in cpu-tiny calibration)."),
    checkpoint_interval: Optional[int] = typer.Option(None, "--checkpoint-interval", help="K for checkpoint/async_checkpoint; fallback interval for redundant."),
    rollback: Optional[str] = typer.Option(None, "--rollback", help="checkpoint/async_checkpoint: all or stage."),
    write_config: Optional[Path] = typer.Option(
        None, "--write-config", help="Write the run's config as JSON for torchrun on several machines, and print the command, instead of running."
    ),
) -> None:
    """A real pipeline run on this machine with injected failures → a run record."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from churnsim.calibration.errors import InputError

    if seed < 0:
        raise InputError(f"--seed {seed}: must be >= 0")
    if corpus is not None and not corpus.exists():
        raise InputError(f"--corpus {corpus}: no such file or directory; give a text file or a directory of text files")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: use cpu or cuda")
    method_config = real_method_config(method, checkpoint_interval=checkpoint_interval, rollback=rollback)

    # torch and the trainer only from here on.
    from churnsim.real.launch import launch_local
    from churnsim.real.model import model_preset
    from churnsim.real.trainer import TrainingConfig

    model_config = model_preset(model, **({"num_layers": layers} if layers is not None else {}))
    failures = real_failures(
        failures_path=failures_path,
        failure_rate=failure_rate,
        nominal_iteration_s=nominal_iteration_s,
        num_stages=stages,
        num_iterations=iterations,
        seed=seed,
    )
    config = TrainingConfig(
        model=model_config,
        num_stages=stages,
        num_microbatches=microbatches,
        microbatch_size=microbatch_size,
        num_iterations=iterations,
        seed=seed,
        schedule=schedule,
        method=method_config,
        failures=failures,
        learning_rate=lr,
        eval_interval_iterations=eval_every,
        corpus=str(corpus) if corpus is not None else None,
        device=device,
    )
    if write_config is not None:
        import json

        from churnsim.calibration.base import atomic_write_text

        atomic_write_text(write_config, json.dumps(config.to_dict(), indent=2) + "\n")
        Console().print(
            f"wrote {write_config}; on every machine, with nodes × processes = {stages} ranks in all, run:\n"
            f"  torchrun --nnodes N --nproc-per-node P --rdzv-endpoint HOST:PORT -m churnsim.real.launch "
            f"--config {write_config} --run-dir {out}",
            soft_wrap=True,
        )
        return
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine; use --device cpu")
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task(f"{method} × {stages} stages", total=iterations)

        def on_progress(row: dict[str, Any]) -> None:
            progress.update(
                task,
                completed=row["iteration"] + 1,
                description=f"{method} × {stages} stages, step {row['step']}, loss {row['train_loss']:.3f}",
            )

        result = launch_local(
            config,
            run_dir=out,
            on_progress=on_progress,
            failure_rate_per_stage_hour=failure_rate,
        )
    Console().print(summary_paragraph(result, out=out), soft_wrap=True)
