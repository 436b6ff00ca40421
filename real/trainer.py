"""The per-rank training loop of a real pipeline run, with failure injection and method hooks.

Per executed iteration (a *step*): apply the failures scheduled for this step (destroy the failed
stages' state, then the method's collective `recover`), run the pipeline's forward/backward for all
microbatches, then `before_optimizer_step`, gradient clipping, AdamW, `after_optimizer_step`, and
every `eval_interval_iterations` a held-out loss.

Failures come from two sources, both decided the same way on every rank:
- `failure_path`: the scenario's churn model, sampled by the contract's sampler (the path
  `churnsim simulate` samples for the same seed and replication). Stage 0 walks it by its clock
  (seconds since the start-of-run barrier) and, before every step, tells all ranks which stages'
  failures came due (one all-reduce of S integers): a failure at time t strikes at the first
  iteration boundary at or after t. Approximation: the iteration in flight at t completes; the
  failure table records the injection time, which is what the validator replays.
- `failures`: (step, stage) pairs, for tests and calibration runs that place failures exactly.
A step counts executed iterations, so after a rollback (a method's `resume_iteration`) replayed
iterations do not fail again; without rollbacks step == iteration.

Gradient clipping: `per_stage` (default) clips each stage's gradient norm on its own, as the
CheckFree reference code does; `global` clips by the norm of the whole model's gradient, which costs
one all-reduce of a scalar per iteration; `none` disables clipping.

Deterministic mode: `torch.use_deterministic_algorithms(True)`, one thread, seeds per stage derived
from the run seed. Model init depends only on (seed, part, layer), data only on (seed, iteration),
a replacement's init on (seed, stage, step).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import FailureCursor, FailurePathSpec
from churnsim.calibration.methods import MethodConfig, NoneConfig, method_from_name
from churnsim.calibration.pipeline_schedule import SCHEDULES

from .checkpoint.format import DEFAULT_RUN_ID
from .data import DEFAULT_CORPUS_MAX_BYTES, TokenData, split_microbatches
from .distributed import Communicator
from .methods import MethodContext, StageRuntime, build_method
from .model import ModelConfig, StageModule, check_stage_split, derive_seed
from .pipeline import PipelineStage
from .spans import SpanRecorder

_FAILURE_INIT_STREAM = 11
_STAGE_TORCH_STREAM = 12
FAILURE_KIND = "stage_failure"


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Everything a real run needs; the same object on every rank."""

    model: ModelConfig
    num_stages: int
    num_microbatches: int
    """M: microbatches per iteration."""
    microbatch_size: int
    """B: sequences per microbatch."""
    num_iterations: int
    """Training iterations to complete (rolled-back iterations are done again)."""
    seed: int
    schedule: str = "1f1b"
    method: MethodConfig = dataclasses.field(default_factory=NoneConfig)
    failures: tuple[tuple[int, int], ...] = ()
    """(step, stage) pairs: stage fails before the first microbatch of that step."""
    failure_path: FailurePathSpec | None = None
    """Failures by time from a churn model (module docstring); None: only `failures`."""
    learning_rate: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    gradient_clipping: Literal["per_stage", "global", "none"] = "per_stage"
    max_gradient_norm: float = 1.0
    eval_interval_iterations: int = 0
    """Held-out loss after every this many iterations and after the last; 0 = only after the last."""
    num_eval_batches: int = 2
    """Held-out batches of `microbatch_size` sequences per evaluation."""
    corpus: str | None = None
    """Text file or directory; None = the Python standard library's sources."""
    corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES
    held_out_fraction: float = 0.05
    device: str = "cpu"
    timeout_s: float = 30.0
    """Upper bound on any single wait for a peer; a lost peer ends the run with an error."""
    deterministic: bool = True
    num_threads: int = 1
    """torch intra-op threads per rank (1 keeps S ranks from oversubscribing a small machine)."""
    run_id: str = DEFAULT_RUN_ID
    """The run's id, bound into every checkpoint it writes (the launcher sets it; see run_directory.py)."""
    resume: bool = False
    """Continue run `run_id` from the newest checkpoint every stage holds durably (a method with
    `resumable = True`); steps start at that iteration, the failures scheduled before it are not replayed."""

    def __post_init__(self) -> None:
        check_stage_split(self.model.num_layers, self.num_stages)
        for name in ("num_microbatches", "microbatch_size", "num_iterations", "num_eval_batches", "num_threads"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise InputError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.learning_rate <= 0 or self.eval_interval_iterations < 0 or self.timeout_s <= 0:
            raise InputError("learning_rate and timeout_s must be > 0 and eval_interval_iterations >= 0")
        if self.gradient_clipping not in ("per_stage", "global", "none"):
            raise InputError(f"gradient_clipping {self.gradient_clipping!r}: use per_stage, global or none")
        for step, stage in self.failures:
            if step < 0 or not 0 <= stage < self.num_stages:
                raise InputError(
                    f"failure (step {step}, stage {stage}) is outside steps >= 0 and stages 0..{self.num_stages - 1}"
                )

    def failures_by_step(self) -> dict[int, frozenset[int]]:
        grouped: dict[int, set[int]] = {}
        for step, stage in self.failures:
            grouped.setdefault(step, set()).add(stage)
        return {step: frozenset(stages) for step, stages in grouped.items()}

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["model"] = dataclasses.asdict(self.model)
        data["method"] = self.method.model_dump()
        data["failures"] = [list(pair) for pair in self.failures]
        if self.failure_path is not None:
            data["failure_path"] = dataclasses.asdict(self.failure_path) | {"churn": self.failure_path.churn.model_dump()}
        data["adam_betas"] = list(self.adam_betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingConfig:
        data = dict(data)
        data["model"] = ModelConfig(**data["model"])
        if "method" in data:
            method = dict(data["method"])
            data["method"] = method_from_name(method.pop("name"), **method)
        data["failures"] = tuple(tuple(pair) for pair in data.get("failures", ()))
        if data.get("failure_path") is not None:
            from churnsim.calibration.churn import parse_churn_config

            path = dict(data["failure_path"])
            data["failure_path"] = FailurePathSpec(**(path | {"churn": parse_churn_config(path["churn"], "failure_path.churn")}))
        if "adam_betas" in data:
            data["adam_betas"] = tuple(data["adam_betas"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"unknown training config keys {unknown}: remove them or check their spelling")
        return cls(**data)


@dataclass(kw_only=True)
class RankResult:
    """What one rank hands back to the launcher."""

    rank: int
    stage: int
    iteration_rows: list[dict[str, Any]] = field(default_factory=list)
    """Per step: step, iteration, end_s, train_loss (head stage), eval_loss (head stage), blocked_s."""
    spans: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)


def set_determinism(config: TrainingConfig, stage: int) -> None:
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(derive_seed(config.seed, _STAGE_TORCH_STREAM, stage))
    torch.use_deterministic_algorithms(config.deterministic)


def _clip_gradients(config: TrainingConfig, module: StageModule, communicator: Communicator) -> None:
    parameters = [p for p in module.parameters() if p.grad is not None]
    if config.gradient_clipping == "none":
        return
    if config.gradient_clipping == "per_stage":
        if parameters:
            torch.nn.utils.clip_grad_norm_(parameters, config.max_gradient_norm)
        return
    # global: every rank joins the all-reduce, even one without gradients.
    squared = torch.zeros(1, dtype=torch.float64, device=communicator.device)
    for parameter in parameters:
        squared += torch.linalg.vector_norm(parameter.grad).double() ** 2  # type: ignore[arg-type]
    total_norm = float(communicator.all_reduce_sum(squared).sqrt())
    scale = config.max_gradient_norm / (total_norm + 1e-6)
    if scale < 1.0:
        for parameter in parameters:
            parameter.grad.mul_(scale)  # type: ignore[union-attr]


def train_stage(
    config: TrainingConfig,
    communicator: Communicator,
    *,
    run_dir: Path | None = None,
    on_iteration_done: Callable[[dict[str, Any]], None] | None = None,
) -> RankResult:
    """Run the whole training loop for this rank's stage (rank == stage); collective across ranks.

    `on_iteration_done(row)` gets each finished iteration's row (e.g. to report progress).
    """
    if communicator.world_size != config.num_stages:
        raise InputError(
            f"world size {communicator.world_size} differs from num_stages {config.num_stages}: "
            "start one process per stage"
        )
    stage, last = communicator.rank, config.num_stages - 1
    device = communicator.device
    set_determinism(config, stage)
    module = StageModule(config.model, stage, config.num_stages, seed=config.seed).to(device)

    def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            module.parameters(),
            lr=config.learning_rate * lr_scale,
            betas=config.adam_betas,
            weight_decay=config.weight_decay,
        )

    data = None
    if stage in (0, last):
        data = TokenData.load(
            config.corpus,
            seq_len=config.model.seq_len,
            held_out_fraction=config.held_out_fraction,
            max_bytes=config.corpus_max_bytes,
        )
    spans = SpanRecorder(rank=communicator.rank, stage=stage, device=device)
    runtime = StageRuntime(module=module, optimizer=make_optimizer(1.0))
    context = MethodContext(
        stage=stage,
        num_stages=config.num_stages,
        model_config=config.model,
        runtime=runtime,
        make_optimizer=make_optimizer,
        communicator=communicator,
        device=device,
        run_dir=run_dir,
        spans=spans,
        seed=config.seed,
        num_iterations=config.num_iterations,
        run_id=config.run_id,
        resume=config.resume,
    )
    method = build_method(config.method, context)
    pipeline = PipelineStage(
        module=module,
        communicator=communicator,
        spans=spans,
        schedule=config.schedule,
        num_microbatches=config.num_microbatches,
        microbatch_size=config.microbatch_size,
        swap_odd_microbatches=method.swap_odd_microbatches,
        after_forward_hop=method.after_forward_hop,
    )
    eval_batches = (
        data.held_out_batches(num_batches=config.num_eval_batches, num_sequences=config.microbatch_size)
        if data is not None
        else None
    )
    result = RankResult(rank=communicator.rank, stage=stage)
    due_failures = _DueFailures(config, communicator, spans, result)

    communicator.barrier()
    spans.restart_clock()
    step, iteration = 0, 0
    try:
        if config.resume:
            started = time.perf_counter()
            outcome = method.resume()  # collective: every stage restores the same durable checkpoint
            step = iteration = outcome.resume_iteration or 0
            if stage == 0:
                row = outcome.as_row(step=step, iteration=iteration)
                result.recoveries.append(row | {"recovery_s": time.perf_counter() - started})
        while iteration < config.num_iterations:
            spans.step = step
            failed = due_failures.stages_failing_before(step)
            if failed:
                iteration = _apply_failures(config, failed, step, iteration, method, runtime, make_optimizer, spans, result)
            inputs = targets = None
            if data is not None:
                tokens, next_tokens = data.train_batch(
                    seed=config.seed,
                    iteration=iteration,
                    num_sequences=config.num_microbatches * config.microbatch_size,
                )
                inputs = split_microbatches(tokens, config.num_microbatches) if stage == 0 else None
                targets = split_microbatches(next_tokens, config.num_microbatches) if stage == last else None
            train_loss = pipeline.run_iteration(step, inputs=inputs, targets=targets)
            blocked_s = method.before_optimizer_step(iteration)
            with spans.span("optimizer", step):
                _clip_gradients(config, module, communicator)
                runtime.optimizer.step()
                runtime.optimizer.zero_grad(set_to_none=True)
            method.after_optimizer_step(iteration)
            eval_loss = None
            if (config.eval_interval_iterations and (iteration + 1) % config.eval_interval_iterations == 0) or (
                iteration + 1 == config.num_iterations
            ):
                eval_loss = pipeline.evaluate(
                    step,
                    num_batches=config.num_eval_batches,
                    inputs=[b[0] for b in eval_batches] if eval_batches is not None and stage == 0 else None,
                    targets=[b[1] for b in eval_batches] if eval_batches is not None and stage == last else None,
                )
            result.iteration_rows.append(
                {
                    "step": step,
                    "iteration": iteration,
                    "end_s": spans.now_s(),
                    "train_loss": train_loss if train_loss is not None else math.nan,
                    "eval_loss": eval_loss if eval_loss is not None else math.nan,
                    "blocked_s": blocked_s,
                }
            )
            if on_iteration_done is not None:
                on_iteration_done(result.iteration_rows[-1])
            step += 1
            iteration += 1
    finally:
        method.close()
    result.spans = spans.rows
    return result


def _apply_failures(
    config: TrainingConfig,
    failed: frozenset[int],
    step: int,
    iteration: int,
    method: Any,
    runtime: StageRuntime,
    make_optimizer: Any,
    spans: SpanRecorder,
    result: RankResult,
) -> int:
    """Destroy the failed stages' state, run the collective recovery; returns the iteration to run."""
    # Stages the method declares reliable (CheckFree's `edge_stages_reliable`) stay in the failure
    # table, as the simulator records them ("ignored"), but keep their state and need no recovery.
    failed = failed - method.reliable_stages
    if not failed:
        return iteration
    stage = runtime.module.stage
    if stage in failed:
        if method.destroys_state_on_failure:
            with spans.span("recovery.join", step):
                # The node dies first (its background work stops reading the weights), then the
                # replacement starts: fresh random weights, fresh optimizer, nothing remembered.
                method.forget_node_state()
                runtime.module.reset_parameters(derive_seed(config.seed, _FAILURE_INIT_STREAM, stage, step))
                runtime.optimizer = make_optimizer(1.0)
                runtime.lr_scale = 1.0
    started = time.perf_counter()
    outcome = method.recover(failed, iteration)
    if stage == 0:
        row = outcome.as_row(step=step, iteration=iteration)
        row["recovery_s"] = time.perf_counter() - started
        result.recoveries.append(row)
    return outcome.resume_iteration if outcome.resume_iteration is not None else iteration


class _DueFailures:
    """Which stages fail before a step, the same answer on every rank; stage 0 records the rows."""

    def __init__(self, config: TrainingConfig, communicator: Communicator, spans: SpanRecorder, result: RankResult) -> None:
        self.num_stages = config.num_stages
        self.by_step = config.failures_by_step()
        self.communicator = communicator
        self.spans = spans
        self.result = result
        self.cursor = FailureCursor(config.failure_path) if config.failure_path is not None else None

    def stages_failing_before(self, step: int) -> frozenset[int]:
        scheduled = self.by_step.get(step, frozenset())
        recorder = self.communicator.rank == 0
        now_s = self.spans.now_s()
        if recorder:
            for stage in sorted(scheduled):
                self.result.failures.append({"time_s": now_s, "iteration": step, "stage": stage, "kind": FAILURE_KIND})
        if self.cursor is None:
            return scheduled
        due = torch.zeros(self.num_stages, dtype=torch.int64, device=self.communicator.device)
        if recorder:
            for event in self.cursor.take_due(now_s):
                due[event.stage] = 1
                self.result.failures.append({"time_s": now_s, "iteration": step, "stage": event.stage, "kind": event.kind})
        due = self.communicator.all_reduce_sum(due)
        return scheduled | frozenset(int(stage) for stage in torch.nonzero(due).flatten().tolist())
