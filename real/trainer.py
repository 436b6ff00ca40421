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

Hard failures (`failure_mode = "hard"`, DESIGN.md section 2; workers of torch.distributed.elastic's
agent, real/agent_launch.py and real/agent_membership.py): a failing stage's process kills itself with
SIGKILL at the boundary, and any stage process may be killed from outside at any moment. Every
process keeps a snapshot of its stage in its node's memory after each update (real/node_memory.py).
When a process dies the agent stops the others and starts every worker again: the survivors reload
their snapshots, the lost stage's new process starts after the join delay, and the new group agrees
(one all-gather) on which stages lost their state, on the step to continue from (the furthest any
survivor applied its update: a survivor interrupted before its optimizer step drops that
iteration's gradients) and on the clock; then the method recovers the lost stages (`recover`, as for
soft failures). The survivors therefore wait (restarted) rather than train degraded while the lost
stage's process starts: `redundant`'s degraded phase (`_enter_degraded`) is reached only by a
membership that offers a group of the survivors alone, which torchrun's agent never does. Each stage
journals its rows (real/journal.py) so that a killed process's record survives it.

Data parallelism (`data_parallel_degree` D > 1): one process per node (stage, replica) of the S × D
grid. Each replica pipeline trains on its shard of the global batch of the
iteration (the batch depends on (seed, iteration); replica r takes the r-th slice); after the
backward pass each stage averages its gradients, and the head its loss, over its replicas (one
all-reduce per stage, span `allreduce` with its bytes), so the optimizer step keeps the replicas
bit-identical. Failures strike nodes: before each step one all-reduce over the whole grid tells every
rank which nodes fail (`FailureEvent.replica`; a schedule names (step, stage, replica)), and
`_apply_node_failures` does what `real/replica_heal.py` decides: lost nodes are wiped, a node whose
stage keeps a replica copies that replica's state (span `recovery.heal`), a stage with no replica
left goes to the method's `recover` in every replica pipeline. Every replica waits at that boundary
until the heals are done (the run record says so). Only replica 0 evaluates (the replicas hold the
same weights). Under hard failures (`_HardFailureGridTrainer`) the agent's worker slots are the
nodes; a killed node's new process heals the same way once the agent has restarted the whole grid
(every replica waits for it), and the grid's collectives run point to point over each round's group.

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
import os
import signal
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
from churnsim.calibration.scenario import CORPUS_MAX_BYTES
from churnsim.calibration.tables import STEP_SYNC_SPAN

from .checkpoint.format import DEFAULT_RUN_ID
from .cpu_placement import pin_stage_process
from .data import TokenData, split_microbatches
from .agent_membership import unix_offset_s
from .distributed import Communicator, GroupBroken, data_parallel_communicators
from .methods import MethodContext, StageRuntime, build_method
from .methods.checkpointing import drop_node_local_level
from .model import ModelConfig, StageModule, check_stage_split, derive_seed
from .pipeline import PipelineStage
from .spans import SpanRecorder

_FAILURE_INIT_STREAM = 11
_STAGE_TORCH_STREAM = 12
FAILURE_KIND = "stage_failure"
EXTERNAL_KILL_KIND = "external_kill"
"""Failure-table kind of a stage process killed from outside the run (hard failures)."""
FAILURE_MODES = ("soft", "hard")


class NonFiniteLoss(RuntimeError):
    """The training loss turned NaN or infinite: the run fails (exit 1), naming the iteration and stage."""


class NonFiniteWeights(RuntimeError):
    """A stage's weights hold NaN or infinity after a recovery or a resume: the run fails."""


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
    failures: tuple[tuple[int, ...], ...] = ()
    """(step, stage) pairs: stage fails before the first microbatch of that step; with data
    parallelism (step, stage, replica) names one node (a pair: replica 0)."""
    data_parallel_degree: int = 1
    """D: replicas of the whole pipeline, one process per (stage, replica), each training on its own
    shard of every global batch; a stage's gradients are averaged over its replicas before the
    optimizer step (module docstring of real/replica_heal.py for a lost replica)."""
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
    corpus_max_bytes: int = CORPUS_MAX_BYTES
    held_out_fraction: float = 0.05
    device: str = "cpu"
    timeout_s: float = 30.0
    """Upper bound on any single wait for a peer; a lost peer ends the run with an error."""
    deterministic: bool = True
    num_threads: int = 1
    """torch intra-op threads per rank (1 keeps S ranks from oversubscribing a small machine)."""
    pin_stages_to_cores: bool = False
    """Each stage process on physical cores of its own where the machine has enough (real/cpu_placement.py);
    `launch_local` turns it on when the environment sets CHURNSIM_PIN_STAGES=1."""
    run_id: str = DEFAULT_RUN_ID
    """The run's id, bound into every checkpoint it writes (the launcher sets it; see run_directory.py)."""
    resume: bool = False
    """Continue run `run_id` from the newest checkpoint every stage holds durably (a method with
    `resumable = True`); steps start at that iteration, the failures scheduled before it are not replayed."""
    failure_mode: str = "soft"
    """"soft": a failing stage re-initialises in place; "hard": its process is killed and replaced
    (module docstring; runs under torch.distributed.elastic's agent)."""
    join_delay_s: float = 0.0
    """Hard failures: seconds from a kill until the replacement process starts."""
    max_replacements: int = 64
    """Hard failures: how many times the agent may restart the workers before the run ends
    (the scenario's `recovery.max_replacements`)."""
    remote_checkpoint_dir: str | None = None
    """Root of the checkpoints' remote level (another file system); None: `<run_dir>/checkpoints`."""
    remote_checkpoint_bytes_per_s: float | None = None
    """Bandwidth of the path to the remote level (writes and reads paced); None: unthrottled."""
    checkpoint_key: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    """The run's checkpoint key (run_secret.py; the launcher sets it): a secret, so never in `to_dict`
    (run.json, the record) nor in `repr`. None: checkpoints are written without an HMAC and read unchecked."""

    @property
    def num_nodes(self) -> int:
        """Processes of the run: one per node of the stage × replica grid (S × D)."""
        return self.num_stages * self.data_parallel_degree

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
        if self.failure_mode not in FAILURE_MODES:
            raise InputError(f"failure_mode {self.failure_mode!r}: use soft or hard")
        if self.max_replacements < 0:
            raise InputError(f"max_replacements must be >= 0, got {self.max_replacements}")
        if not (math.isfinite(self.join_delay_s) and self.join_delay_s >= 0):
            raise InputError(f"join_delay_s must be a finite number >= 0, got {self.join_delay_s}")
        if self.remote_checkpoint_bytes_per_s is not None and not self.remote_checkpoint_bytes_per_s > 0:
            raise InputError(f"remote_checkpoint_bytes_per_s must be > 0, got {self.remote_checkpoint_bytes_per_s}")
        if self.data_parallel_degree < 1:
            raise InputError(f"data_parallel_degree must be >= 1, got {self.data_parallel_degree}")
        if self.data_parallel_degree > 1 and self.resume:
            raise InputError(
                f"resume with data_parallel_degree {self.data_parallel_degree}: continuing a data-parallel run from its "
                "checkpoints is not supported yet; start the run again"
            )
        for failure in self.failures:
            if len(failure) not in (2, 3):
                raise InputError(f"failure {tuple(failure)}: give (step, stage) or (step, stage, replica)")
            step, stage, replica = (*failure, 0)[:3]
            if step < 0 or not 0 <= stage < self.num_stages or not 0 <= replica < self.data_parallel_degree:
                raise InputError(
                    f"failure (step {step}, stage {stage}, replica {replica}) is outside steps >= 0, stages "
                    f"0..{self.num_stages - 1} and replicas 0..{self.data_parallel_degree - 1}"
                )

    def failures_by_step(self) -> dict[int, frozenset[int]]:
        grouped: dict[int, set[int]] = {}
        for step, stage, *_ in self.failures:
            grouped.setdefault(step, set()).add(stage)
        return {step: frozenset(stages) for step, stages in grouped.items()}

    def node_failures_by_step(self) -> dict[int, frozenset[tuple[int, int]]]:
        """Per step, the (stage, replica) nodes that fail before it."""
        grouped: dict[int, set[tuple[int, int]]] = {}
        for step, stage, *rest in self.failures:
            grouped.setdefault(step, set()).add((stage, rest[0] if rest else 0))
        return {step: frozenset(nodes) for step, nodes in grouped.items()}

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "checkpoint_key"}
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
    replica: int = 0
    iteration_rows: list[dict[str, Any]] = field(default_factory=list)
    """Per step: step, iteration, end_s, train_loss (head stage), eval_loss (head stage), blocked_s."""
    spans: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)


def set_determinism(config: TrainingConfig, stage: int) -> None:
    torch.set_num_threads(config.num_threads)
    torch.manual_seed(derive_seed(config.seed, _STAGE_TORCH_STREAM, stage))
    torch.use_deterministic_algorithms(config.deterministic)


def _clip_gradients(config: TrainingConfig, modules: list[StageModule], communicator: Communicator) -> None:
    """Clip the gradients of the stages this process runs (its own, and a hosted one while degraded)."""
    if config.gradient_clipping == "none":
        return
    if config.gradient_clipping == "per_stage":
        for module in modules:
            parameters = [p for p in module.parameters() if p.grad is not None]
            if parameters:
                torch.nn.utils.clip_grad_norm_(parameters, config.max_gradient_norm)
        return
    parameters = [p for module in modules for p in module.parameters() if p.grad is not None]
    # global: every rank joins the all-reduce, even one without gradients.
    squared = torch.zeros(1, dtype=torch.float64, device=communicator.device)
    for parameter in parameters:
        squared += torch.linalg.vector_norm(parameter.grad).double() ** 2  # type: ignore[arg-type]
    total_norm = float(communicator.all_reduce_sum(squared).sqrt())
    scale = config.max_gradient_norm / (total_norm + 1e-6)
    if scale < 1.0:
        for parameter in parameters:
            parameter.grad.mul_(scale)  # type: ignore[union-attr]


class _Stage:
    """Everything one stage process trains with: model, optimizer, method, pipeline, data, record."""

    def __init__(
        self,
        config: TrainingConfig,
        communicator: Communicator,
        run_dir: Path | None,
        *,
        run_started_ns: int | None = None,
        stage_group: Communicator | None = None,
        world: Communicator | None = None,
    ) -> None:
        self.config = config
        self.communicator = communicator
        """This replica's pipeline (peers named by stage; the whole group without data parallelism)."""
        self.stage_group = stage_group
        """Data parallelism: this stage's replicas (peers named by replica); None with one replica."""
        stage = self.stage = communicator.rank
        self.replica = stage_group.rank if stage_group is not None else 0
        self.global_rank = self.replica * config.num_stages + stage
        self.last = config.num_stages - 1
        device = self.device = communicator.device
        pin_stage_process(self.global_rank, config.num_nodes, config.num_threads, config.pin_stages_to_cores)
        set_determinism(config, stage)
        module = self.module = StageModule(config.model, stage, config.num_stages, seed=config.seed).to(device)

        def optimizer_for(target: torch.nn.Module, lr_scale: float) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                target.parameters(),
                lr=config.learning_rate * lr_scale,
                betas=config.adam_betas,
                weight_decay=config.weight_decay,
            )

        def make_optimizer(lr_scale: float) -> torch.optim.Optimizer:
            return optimizer_for(module, lr_scale)

        self.make_optimizer = make_optimizer
        self.data: TokenData | None = None
        self.eval_batches: list[Any] | None = None
        if stage in (0, self.last):
            self._load_data()
        self.spans = SpanRecorder(rank=self.global_rank, stage=stage, device=device)
        self.runtime = StageRuntime(module=module, optimizer=make_optimizer(1.0))
        self.context = MethodContext(
            stage=stage,
            num_stages=config.num_stages,
            model_config=config.model,
            runtime=self.runtime,
            make_optimizer=make_optimizer,
            optimizer_for=optimizer_for,
            communicator=communicator,
            device=device,
            run_dir=run_dir,
            spans=self.spans,
            seed=config.seed,
            num_iterations=config.num_iterations,
            run_id=config.run_id,
            checkpoint_key=config.checkpoint_key,
            resume=config.resume,
            failure_mode=config.failure_mode,
            run_started_ns=run_started_ns,
            remote_checkpoint_dir=config.remote_checkpoint_dir,
            remote_bytes_per_s=config.remote_checkpoint_bytes_per_s,
            replica=self.replica,
            gather_over_replicas=world.all_gather_objects if world is not None and stage_group is not None else None,
        )
        self.method = build_method(config.method, self.context)
        self.hosted: dict[int, StageRuntime] = {}
        """Stages this process runs besides its own while their processes are down (degraded)."""
        self.pipeline = self._build_pipeline(None)
        self.result = RankResult(rank=self.global_rank, stage=stage, replica=self.replica)
        self.journal: Any = None
        """The stage's RankJournal (real/journal.py) when its rows are kept on disk as they come."""

    def _load_data(self) -> None:
        config = self.config
        self.data = TokenData.load(
            config.corpus, seq_len=config.model.seq_len, held_out_fraction=config.held_out_fraction, max_bytes=config.corpus_max_bytes
        )
        self.eval_batches = self.data.held_out_batches(num_batches=config.num_eval_batches, num_sequences=config.microbatch_size)

    def _build_pipeline(self, placement: tuple[int, ...] | None) -> PipelineStage:
        config = self.config
        return PipelineStage(
            module=self.module,
            communicator=self.communicator,
            spans=self.spans,
            schedule=config.schedule,
            num_microbatches=config.num_microbatches,
            microbatch_size=config.microbatch_size,
            swap_odd_microbatches=self.method.swap_odd_microbatches,
            after_forward_hop=self.method.after_forward_hop,
            placement=placement,
            hosted_modules={stage: runtime.module for stage, runtime in self.hosted.items()},
        )

    def set_hosted(self, hosted: dict[int, StageRuntime], placement: tuple[int, ...] | None) -> None:
        """Run `hosted` besides this stage, with the pipeline's stages placed on processes as given."""
        self.hosted = hosted
        self.pipeline = self._build_pipeline(placement)
        runs_first = self.pipeline.placement[0] == self.stage
        if (runs_first or self.pipeline.runs_head) and self.data is None:
            self._load_data()  # a process now running the last stage needs the targets

    def check_finite_weights(self, when: str) -> None:
        """Every weight this process holds is finite; NonFiniteWeights (the run fails) otherwise."""
        for stage, runtime in ((self.stage, self.runtime), *self.hosted.items()):
            for name, parameter in runtime.module.named_parameters():
                if not bool(torch.isfinite(parameter).all()):
                    raise NonFiniteWeights(
                        f"stage {stage}: weight '{name}' holds NaN or infinite values {when}; the run cannot go on "
                        "(its recovery produced unusable weights)"
                    )

    def run_iteration(self, step: int, iteration: int, *, after_update: Callable[[], None] | None = None) -> dict[str, Any]:
        """One training iteration (forward/backward, optimizer, method hooks, evaluation); its row.

        `after_update()` runs right after the optimizer step, before anything else communicates."""
        config, pipeline, method, runtime = self.config, self.pipeline, self.method, self.runtime
        inputs = targets = None
        if self.data is not None:
            # The global batch depends only on (seed, iteration); replica r trains on its r-th shard.
            per_replica = config.num_microbatches * config.microbatch_size
            tokens, next_tokens = self.data.train_batch(
                seed=config.seed, iteration=iteration, num_sequences=per_replica * config.data_parallel_degree
            )
            shard = slice(self.replica * per_replica, (self.replica + 1) * per_replica)
            tokens, next_tokens = tokens[shard], next_tokens[shard]
            inputs = split_microbatches(tokens, config.num_microbatches) if pipeline.placement[0] == self.stage else None
            targets = split_microbatches(next_tokens, config.num_microbatches) if pipeline.runs_head else None
        train_loss = pipeline.run_iteration(step, inputs=inputs, targets=targets)
        if self.stage_group is not None:
            train_loss = self._average_over_replicas(step, train_loss)
        if train_loss is not None and not math.isfinite(train_loss):
            raise NonFiniteLoss(
                f"the training loss is {train_loss} at iteration {iteration} (step {step}), stage {self.last} (the last, "
                "which computes it): training diverged; lower training.learning_rate or check the data"
            )
        blocked_s = method.before_optimizer_step(iteration)
        runtimes = [runtime, *self.hosted.values()]
        with self.spans.span("optimizer", step):
            _clip_gradients(config, [each.module for each in runtimes], self.communicator)
            for each in runtimes:
                each.optimizer.step()
                each.optimizer.zero_grad(set_to_none=True)
        if after_update is not None:
            after_update()
        if self.journal is not None:
            # The update is applied: its row is on disk before a checkpoint can hold the update, so a
            # run killed from here on and resumed from that checkpoint misses no iteration (the
            # full row below, with the held-out loss, replaces this one when read back).
            self.journal.write_now(
                "iteration",
                {"step": step, "iteration": iteration, "end_s": self.spans.now_s(),
                 "train_loss": train_loss if train_loss is not None else math.nan, "eval_loss": math.nan,
                 "blocked_s": blocked_s, "runs_head": pipeline.runs_head},
            )  # fmt: skip
        method.after_optimizer_step(iteration)
        eval_loss = None
        # Replicas hold the same weights: replica 0 alone evaluates them.
        if self.replica == 0 and (config.eval_interval_iterations and (iteration + 1) % config.eval_interval_iterations == 0) or (
            self.replica == 0 and iteration + 1 == config.num_iterations
        ):
            eval_batches = self.eval_batches
            eval_loss = pipeline.evaluate(
                step,
                num_batches=config.num_eval_batches,
                inputs=[b[0] for b in eval_batches] if eval_batches is not None and pipeline.placement[0] == self.stage else None,
                targets=[b[1] for b in eval_batches] if eval_batches is not None and pipeline.runs_head else None,
            )
        row = {
            "step": step,
            "iteration": iteration,
            "end_s": self.spans.now_s(),
            "train_loss": train_loss if train_loss is not None else math.nan,
            "eval_loss": eval_loss if eval_loss is not None else math.nan,
            "blocked_s": blocked_s,
            "runs_head": pipeline.runs_head,
        }
        self.result.iteration_rows.append(row)
        return row

    def _average_over_replicas(self, step: int, train_loss: float | None) -> float | None:
        """Average this stage's gradients (and, on the head, the training loss) over its replicas: one
        all-reduce on the stage's group. Every replica ends with the same bits, so after the same
        optimizer step the replicas stay identical."""
        assert self.stage_group is not None
        gradients = [p.grad for p in self.runtime.module.parameters() if p.grad is not None]
        pieces = [gradient.reshape(-1) for gradient in gradients]
        if train_loss is not None:
            pieces.append(torch.tensor([train_loss], dtype=torch.float32, device=self.device))
        flat = torch.cat(pieces) if pieces else torch.zeros(0, device=self.device)
        with self.spans.span("allreduce", step, nbytes=flat.numel() * flat.element_size()):
            self.stage_group.all_reduce_sum(flat)
        flat.div_(self.config.data_parallel_degree)
        offset = 0
        for gradient in gradients:
            gradient.copy_(flat[offset : offset + gradient.numel()].view_as(gradient))
            offset += gradient.numel()
        return float(flat[-1]) if train_loss is not None else None


def train_stage(
    config: TrainingConfig,
    communicator: Communicator | None,
    *,
    run_dir: Path | None = None,
    on_iteration_done: Callable[[dict[str, Any]], None] | None = None,
    membership: Any = None,
    journal_directory: str | None = None,
    after_run: Callable[[Any], None] | None = None,
) -> RankResult:
    """Run the whole training loop for this rank's stage (rank == stage); collective across ranks.

    `on_iteration_done(row)` gets each finished iteration's row on the process that computed its
    loss (e.g. to report progress). Hard failures need `membership` (real/agent_membership.py's
    `AgentMembership`, a worker of torch.distributed.elastic's agent), which forms the process group
    itself (`communicator` is unused).
    `journal_directory`: this attempt's journal folder in the run directory (real/journal.py); every
    row is written there as soon as its step ends, so a killed launcher's run keeps them.
    `after_run(parts)` sees this rank's trained state once the last iteration is
    done (its `runtime`, `method`, `stage`, `replica`), e.g. to compare replicas.

    Data parallelism (`config.data_parallel_degree` D > 1): `communicator` is the whole S × D grid,
    rank = replica × S + stage; the rank trains stage `rank % S` of replica `rank // S`.
    """
    if config.failure_mode == "hard":
        if membership is None:
            raise InputError(
                "failure_mode 'hard' needs torch.distributed.elastic's agent, which restarts killed stage processes "
                "(churnsim real run, launch_local, or torchrun with the command `churnsim real run --write-config` prints)"
            )
        trainer = _HardFailureGridTrainer if config.data_parallel_degree > 1 else _HardFailureTrainer
        return trainer(config, membership, run_dir, on_iteration_done, journal_directory, after_run=after_run).run()
    assert communicator is not None
    world = communicator
    stage_group = None
    if config.data_parallel_degree > 1:
        communicator, stage_group = data_parallel_communicators(world, config.num_stages, config.data_parallel_degree)
    elif communicator.world_size != config.num_stages:
        raise InputError(
            f"world size {communicator.world_size} differs from num_stages {config.num_stages}: "
            "start one process per stage"
        )
    parts = _Stage(config, communicator, run_dir, stage_group=stage_group, world=world)
    stage, spans, method, result = parts.stage, parts.spans, parts.method, parts.result
    due_failures = _DueFailures(config, world, spans, result)
    journal = None
    if journal_directory is not None:
        from .journal import RankJournal, node_journal_path

        journal = RankJournal(
            node_journal_path(journal_directory, stage, parts.replica),
            {"iteration": result.iteration_rows, "span": spans.rows, "failure": result.failures, "recovery": result.recoveries},
        )
        parts.journal = journal

    world.barrier()
    spans.restart_clock()
    step, iteration = 0, 0
    try:
        if config.resume:
            started = time.perf_counter()
            outcome = method.resume()  # collective: every stage restores the same durable checkpoint
            step = iteration = outcome.resume_iteration or 0
            parts.check_finite_weights(f"after resuming at iteration {iteration}")
            if stage == 0:
                row = outcome.as_row(step=step, iteration=iteration)
                result.recoveries.append(row | {"recovery_s": time.perf_counter() - started})
        while iteration < config.num_iterations:
            spans.step = step
            if stage_group is None:
                failed = due_failures.stages_failing_before(step)
                if failed:
                    iteration = _apply_failures(config, failed, step, iteration, parts)
            else:
                lost = due_failures.nodes_failing_before(step)
                if lost:
                    iteration = _apply_node_failures(config, lost, step, iteration, parts, world)
            row = parts.run_iteration(step, iteration)
            if journal is not None:
                journal.flush()  # the step's rows outlive a kill of the launcher from here on
            if on_iteration_done is not None and parts.pipeline.runs_head:
                on_iteration_done(row)
            step += 1
            iteration += 1
        if after_run is not None:
            after_run(parts)
    finally:
        if journal is not None:
            journal.flush()
        method.close()
    result.spans = spans.rows
    return result




def _apply_failures(config: TrainingConfig, failed: frozenset[int], step: int, iteration: int, parts: _Stage) -> int:
    """Destroy the failed stages' state, run the collective recovery; returns the iteration to run."""
    method, runtime, spans = parts.method, parts.runtime, parts.spans
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
                runtime.optimizer = parts.make_optimizer(1.0)
                runtime.lr_scale = 1.0
    measure = _RecoveryMeasure(parts)
    outcome = method.recover(failed, iteration)
    parts.check_finite_weights(f"after the recovery at step {step} (iteration {iteration})")
    costs = measure.gather()
    if stage == 0:
        row = outcome.as_row(step=step, iteration=iteration)
        row["recovery_s"] = costs.pop("recovery_s")
        parts.result.recoveries.append(row | {"failure_mode": config.failure_mode} | costs)
    return outcome.resume_iteration if outcome.resume_iteration is not None else iteration


def _apply_node_failures(
    config: TrainingConfig, lost: frozenset[tuple[int, int]], step: int, iteration: int, parts: _Stage, world: Communicator
) -> int:
    """Data parallelism, soft failures: the nodes `lost` at this boundary (the same set on every rank).
    Lost nodes are wiped; those of stages with a surviving replica heal by a copy from it
    (real/replica_heal.py); stages with no surviving replica go to the method's own recovery, in
    every replica pipeline at once. Every replica waits at this boundary until all of it is done.
    Returns the iteration to run (a rollback's, the same in every replica)."""
    from .replica_heal import heal_replicas, node_loss_actions

    method, runtime, spans = parts.method, parts.runtime, parts.spans
    assert parts.stage_group is not None
    started = time.perf_counter()
    actions = node_loss_actions(
        config.method, lost, num_stages=config.num_stages, data_parallel_degree=config.data_parallel_degree,
        destroys_state=method.destroys_state_on_failure,
    )  # fmt: skip
    if (parts.stage, parts.replica) in actions.wiped:
        with spans.span("recovery.join", step):
            method.forget_node_state()
            # The same fresh weights in every replica: what a lost stage's recovery does not set
            # (a copied edge's embedding or head) starts alike everywhere, so the replicas stay equal.
            runtime.module.reset_parameters(derive_seed(config.seed, _FAILURE_INIT_STREAM, parts.stage, step))
            runtime.optimizer = parts.make_optimizer(1.0)
            runtime.lr_scale = 1.0
    own_heals = [heal for heal in actions.heals if heal.stage == parts.stage]
    heal_started_s = spans.now_s()
    heal = heal_replicas(parts.stage_group, runtime, parts.make_optimizer, method, own_heals)
    if heal.seconds > 0:
        spans.add("recovery.heal", step, None, heal_started_s, spans.now_s(), nbytes=heal.bytes_received or heal.bytes_sent)
    resume_iteration = iteration
    if actions.lost_stages:
        measure = _RecoveryMeasure(parts)
        outcome = method.recover(actions.lost_stages, iteration)
        parts.check_finite_weights(f"after the recovery at step {step} (iteration {iteration})")
        costs = measure.gather()  # over this replica's pipeline
        if outcome.resume_iteration is not None:
            resume_iteration = outcome.resume_iteration
        _check_replicas_agree(parts, f"after the recovery of stages {sorted(actions.lost_stages)} at step {step}")
        if parts.stage == 0:
            row = outcome.as_row(step=step, iteration=iteration)
            row["recovery_s"] = costs.pop("recovery_s")
            extra = {"failure_mode": config.failure_mode, "replica": parts.replica, "handled_as": "stage_loss"}
            parts.result.recoveries.append(row | extra | costs)
    elif own_heals and (parts.stage, parts.replica) in {(each.stage, each.replica) for each in own_heals}:
        parts.check_finite_weights(f"after the heal at step {step} (iteration {iteration})")
    # One exchange over every rank: the heals' costs for the record, and a check that every replica
    # continues from the same iteration (replicas that disagree would train apart).
    gathered = world.all_gather_objects(
        {"heal_s": heal.seconds, "heal_bytes": heal.bytes_received, "resume_iteration": resume_iteration}
    )
    resumes = sorted({each["resume_iteration"] for each in gathered})
    if len(resumes) > 1:
        raise RuntimeError(
            f"step {step}: the replicas' recoveries continue from different iterations {resumes}; their checkpoints "
            "differ, so the replicas would train apart"
        )
    if world.rank == 0 and actions.heals:
        parts.result.recoveries.append(
            {
                "step": step, "iteration": iteration, "failure_mode": config.failure_mode, "handled_as": "replica_heal",
                "failed_stages": [], "resume_iteration": None, "lr_scale": 1.0,
                "failed_nodes": sorted(list(node) for node in lost),
                "heals": [{"stage": h.stage, "replica": h.replica, "source_replica": h.source_replica} for h in actions.heals],
                "rebuilt_from": {f"{h.stage} replica {h.replica}": f"replica {h.source_replica} (exact copy)" for h in actions.heals},
                "notes": ["every replica waits at the iteration boundary while the heal copies (pipeline.while_replica_missing = wait)"],
                "heal_s": max(each["heal_s"] for each in gathered),
                "heal_bytes": int(sum(each["heal_bytes"] for each in gathered)),
                "recovery_s": time.perf_counter() - started,
                "replicas_waited": True,
            }
        )  # fmt: skip
    return resume_iteration


def _check_replicas_agree(parts: _Stage, when: str) -> None:
    """Data parallelism: every replica of this stage holds the same weights (a digest of their bytes,
    one all-gather on the stage's group); replicas that differ would train apart, so the run fails."""
    import hashlib

    assert parts.stage_group is not None
    digest = hashlib.sha256()
    for name, tensor in parts.runtime.module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = parts.stage_group.all_gather_objects(digest.hexdigest())
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"stage {parts.stage}: its replicas hold different weights {when} (method {parts.config.method.name}: each "
            "replica pipeline recovered from different checkpoints); the replicas would train apart"
        )


RECOVERY_SPAN_KINDS = {"recovery.transfer": "transfer_s", "recovery.load": "load_s", "recovery.rebuild": "rebuild_s"}


class _RecoveryMeasure:
    """What one collective recovery cost on every rank: seconds per kind, bytes over the network and
    from files, levels read. `gather()` is collective; rank 0's answer has every rank's numbers."""

    def __init__(self, parts: _Stage) -> None:
        self.parts = parts
        self.started_perf_s = time.perf_counter()
        self.first_span = len(parts.spans.rows)
        self.bytes_received = parts.communicator.bytes_received
        self.file_bytes = parts.context.reads.file_bytes
        self.levels_read = len(parts.context.reads.levels)

    def gather(self, **extra: Any) -> dict[str, Any]:
        parts = self.parts
        mine: dict[str, Any] = {"recovery_s": time.perf_counter() - self.started_perf_s} | extra
        for kind in RECOVERY_SPAN_KINDS.values():
            mine[kind] = 0.0
        for row in parts.spans.rows[self.first_span :]:
            if row["kind"] in RECOVERY_SPAN_KINDS:
                mine[RECOVERY_SPAN_KINDS[row["kind"]]] += row["end_s"] - row["start_s"]
        mine["network_bytes"] = parts.communicator.bytes_received - self.bytes_received
        mine["file_bytes"] = parts.context.reads.file_bytes - self.file_bytes
        mine["levels_read"] = parts.context.reads.levels[self.levels_read :]
        gathered = parts.communicator.all_gather_objects(mine)
        stages = parts.communicator.group_stages
        costs: dict[str, Any] = {}
        for key in mine:
            values = [each[key] for each in gathered]
            if key in ("network_bytes", "file_bytes"):
                costs[key] = int(sum(values))  # bytes the recovery moved, over all ranks
            elif key == "levels_read":
                costs[key] = {stage: levels for stage, levels in zip(stages, values) if levels}
            else:
                costs[key] = max(values)  # ranks work in parallel: the slowest sets the pace
        return costs


class _DueFailures:
    """Which stages fail before a step, the same answer on every rank; stage 0 records the rows."""

    def __init__(self, config: TrainingConfig, communicator: Communicator, spans: SpanRecorder, result: RankResult) -> None:
        self.num_stages = config.num_stages
        self.data_parallel_degree = config.data_parallel_degree
        self.by_step = config.failures_by_step()
        self.nodes_by_step = config.node_failures_by_step()
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
        due = torch.zeros(self.num_stages, dtype=torch.int64, device=self.communicator.device)
        if recorder and self.cursor is not None:
            for event in self.cursor.take_due(now_s):
                due[event.stage] = 1
                self.result.failures.append({"time_s": now_s, "iteration": step, "stage": event.stage, "kind": event.kind})
        # Every run starts every step with this all-reduce, with or without a failure path, so that
        # steps are timed alike whatever injects the failures (a calibration's scheduled ones, a
        # scenario's sampled ones): the step boundary is a synchronisation point in both.
        with self.spans.span(STEP_SYNC_SPAN, step):
            due = self.communicator.all_reduce_sum(due)
        return scheduled | frozenset(int(stage) for stage in torch.nonzero(due).flatten().tolist())

    def nodes_failing_before(self, step: int) -> frozenset[tuple[int, int]]:
        """Data parallelism: the (stage, replica) nodes that fail before `step`, the same on every rank
        of the whole grid (`communicator` is the world: rank 0 is stage 0 of replica 0, which walks the
        failure path and records the rows; one all-reduce of S × D flags, node (s, r) at r × S + s)."""
        num_stages = self.num_stages
        recorder = self.communicator.rank == 0
        now_s = self.spans.now_s()
        due = torch.zeros(num_stages * self.data_parallel_degree, dtype=torch.int64, device=self.communicator.device)
        if recorder:
            for stage, replica in sorted(self.nodes_by_step.get(step, frozenset())):
                due[replica * num_stages + stage] = 1
                self.result.failures.append({"time_s": now_s, "iteration": step, "stage": stage, "replica": replica, "kind": FAILURE_KIND})
            if self.cursor is not None:
                for event in self.cursor.take_due(now_s):
                    due[event.replica * num_stages + event.stage] = 1
                    self.result.failures.append(
                        {"time_s": now_s, "iteration": step, "stage": event.stage, "replica": event.replica, "kind": event.kind}
                    )
        with self.spans.span(STEP_SYNC_SPAN, step):
            due = self.communicator.all_reduce_sum(due)
        return frozenset(divmod(int(index), num_stages)[::-1] for index in torch.nonzero(due).flatten().tolist())

    def at_boundary(self, step: int, *, decided_through: int, newer_generation: bool) -> tuple[frozenset[int], bool]:
        """Hard failures: one all-reduce at every boundary, of the failures due (scheduled for this
        step unless decided before, or from the failure path) and of "a newer generation exists"
        (seen by any rank). Returns (stages failing, switch to the newer generation)."""
        recorder = self.communicator.rank == 0
        now_s = self.spans.now_s()
        flags = torch.zeros(self.num_stages + 1, dtype=torch.int64, device=self.communicator.device)
        if recorder:
            if step > decided_through:  # a step re-run after a re-formed group fails only once
                for stage in sorted(self.by_step.get(step, frozenset())):
                    flags[stage] = 1
                    self.result.failures.append({"time_s": now_s, "iteration": step, "stage": stage, "kind": FAILURE_KIND})
            if self.cursor is not None:
                for event in self.cursor.take_due(now_s):
                    flags[event.stage] = 1
                    self.result.failures.append(
                        {"time_s": now_s, "iteration": step, "stage": event.stage, "kind": event.kind, "event_time_s": event.time_s}
                    )
        flags[self.num_stages] = int(newer_generation)
        flags = self.communicator.all_reduce_sum(flags)
        failed = frozenset(int(stage) for stage in torch.nonzero(flags[: self.num_stages]).flatten().tolist())
        return failed, bool(flags[self.num_stages] > 0)

    def nodes_at_boundary(self, step: int, *, decided_through: int, newer_generation: bool) -> tuple[frozenset[tuple[int, int]], bool]:
        """Hard failures with data parallelism: `at_boundary` for the nodes of the grid (flags of
        S × D nodes, node (s, r) at r × S + s, and "a newer generation exists")."""
        num_stages = self.num_stages
        num_nodes = num_stages * self.data_parallel_degree
        recorder = self.communicator.rank == 0
        now_s = self.spans.now_s()
        flags = torch.zeros(num_nodes + 1, dtype=torch.int64, device=self.communicator.device)
        if recorder:
            if step > decided_through:
                for stage, replica in sorted(self.nodes_by_step.get(step, frozenset())):
                    flags[replica * num_stages + stage] = 1
                    self.result.failures.append({"time_s": now_s, "iteration": step, "stage": stage, "replica": replica, "kind": FAILURE_KIND})
            if self.cursor is not None:
                for event in self.cursor.take_due(now_s):
                    flags[event.replica * num_stages + event.stage] = 1
                    self.result.failures.append(
                        {"time_s": now_s, "iteration": step, "stage": event.stage, "replica": event.replica, "kind": event.kind,
                         "event_time_s": event.time_s}
                    )  # fmt: skip
        flags[num_nodes] = int(newer_generation)
        with self.spans.span(STEP_SYNC_SPAN, step):
            flags = self.communicator.all_reduce_sum(flags)
        failed = frozenset(divmod(int(index), num_stages)[::-1] for index in torch.nonzero(flags[:num_nodes]).flatten().tolist())
        return failed, bool(flags[num_nodes] > 0)

    def skip_handed_out(self, failure_rows: list[dict[str, Any]]) -> None:
        """A replacement of stage 0: its predecessor handed out the path's events up to the newest
        in its journal; walk past them so that none fails twice."""
        times = [row["event_time_s"] for row in failure_rows if "event_time_s" in row]
        if self.cursor is not None and times:
            self.cursor.take_due(max(times))


AGENT_RESTART_NOTE = (
    "torchrun's agent restarted every worker: the survivors reloaded their state from node memory (no degraded "
    "phase), the lost stage's new process joined after the join delay, counted from the death"
)
"""In every hard-failure recovery row: what the agent's restart means for the costs the row names."""


class _HardFailureTrainer:
    """The training loop of one stage process under hard failures (module docstring)."""

    def __init__(
        self,
        config: TrainingConfig,
        membership: Any,
        run_dir: Path | None,
        on_iteration_done: Any,
        journal_directory: str | None = None,
        *,
        after_run: Callable[[Any], None] | None = None,
    ) -> None:
        from .journal import RankJournal, memory_journal_path, node_journal_path

        self.config = config
        self.membership = membership
        self.on_iteration_done = on_iteration_done
        self.after_run = after_run
        settings = membership.settings
        self.world = membership.communicator
        """The whole group (every stage; with data parallelism every node of the grid)."""
        self.parts = self._build_parts(run_dir)
        self.ready_perf_s = time.perf_counter()
        parts = self.parts
        self.journal = RankJournal(
            # A replacement continues its predecessors' journal: the run directory's when there is one.
            node_journal_path(journal_directory, parts.stage, parts.replica)
            if journal_directory is not None
            else memory_journal_path(settings.directory, self.world.rank),
            {"iteration": parts.result.iteration_rows, "span": parts.spans.rows, "failure": parts.result.failures,
             "recovery": parts.result.recoveries},
        )  # fmt: skip
        parts.journal = self.journal
        self.due_failures = _DueFailures(config, self.world, parts.spans, parts.result)
        self.has_state = not membership.is_replacement
        """Whether this process holds its stage's trained state (a replacement does once recovered)."""
        self.step = 0
        self.iteration = 0
        """The next step and iteration to run: advanced as soon as an iteration's update is applied."""
        self.decided_through = -1
        """Steps whose scheduled failures were decided already (they do not fire again on a re-run)."""
        self.scheduled_kills: set[int] = set()
        """Stages the injector killed whose deaths are not yet matched with the membership's (their rows exist)."""
        self.handled_deaths: set[int] = set()
        """The membership's death ids already recorded (or matched with a scheduled kill)."""
        self.full_group = True
        self.join_s = 0.0
        """A replacement: from its predecessor's death to ready to rendezvous."""
        self._join_recorded = False
        self.rendezvous_s = 0.0
        self.restart_costs: dict[str, Any] = {}
        """torchrun: what the agent's restart of the workers cost (`_note_round_costs`), for the recovery row."""
        self.kill_unix_s: float | None = None
        """torchrun: when the injector decided the kill the group is re-forming for (snapshots carry it)."""

    def _build_parts(self, run_dir: Path | None) -> _Stage:
        return _Stage(self.config, self.world, run_dir, run_started_ns=self.membership.settings.run_started_unix_ns)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> RankResult:
        config, parts, membership = self.config, self.parts, self.membership
        needs_group = True
        try:
            # Under torchrun's agent every process of a later round starts anew (real/agent_membership.py).
            if membership.is_replacement or getattr(membership, "is_restart", False):
                self.journal.replay()
                if parts.stage == 0:
                    self.due_failures.skip_handed_out(parts.result.failures)
                if getattr(membership, "restored", None) is not None:
                    self._restore_snapshot(membership.restored)
            else:
                self._join_first_generation()
                needs_group = False
            while True:
                try:
                    if needs_group:
                        self._reform()
                        needs_group = False
                    if self.iteration >= config.num_iterations:
                        if not self.full_group:
                            needs_group = True  # the replacement is coming: hand its stage over first
                            continue
                        self.world.barrier()  # nobody leaves while a peer may still need it
                        if self.after_run is not None:
                            self.after_run(parts)
                        break
                    needs_group = self._one_step()
                except GroupBroken:
                    needs_group = True
        finally:
            self.journal.flush()
            parts.method.close()
        parts.result.spans = parts.spans.rows
        return parts.result

    def _join_first_generation(self) -> None:
        parts = self.parts
        self.membership.join()
        self._joined_group()
        self.world.barrier()
        parts.spans.restart_clock()
        if self.world.rank == 0:
            self.membership.mark_started()
        if self.config.resume:
            started = time.perf_counter()
            outcome = parts.method.resume()
            self.step = self.iteration = outcome.resume_iteration or 0
            parts.check_finite_weights(f"after resuming at iteration {self.iteration}")
            self.decided_through = self.step - 1
            if parts.stage == 0:
                row = outcome.as_row(step=self.step, iteration=self.iteration)
                parts.result.recoveries.append(row | {"recovery_s": time.perf_counter() - started})
        self._save_snapshot()

    def _joined_group(self) -> None:
        """A new generation of the group formed (data parallelism: the grid's communicators restart)."""

    def _one_step(self) -> bool:
        """Run the next step; True when the group must re-form first (a kill, or a newer generation)."""
        config, parts = self.config, self.parts
        step, iteration = self.step, self.iteration
        parts.spans.step = step
        failed, switch = self.due_failures.at_boundary(
            step, decided_through=self.decided_through, newer_generation=self.membership.newer_generation_announced()
        )
        if failed:
            self.decided_through = step
            self.journal.flush()  # the failure rows outlive whichever process dies now
        # A stage already down (run by its host) cannot fail again.
        failed = (failed - parts.method.reliable_stages) & frozenset(parts.communicator.group_stages)
        if failed and parts.method.destroys_state_on_failure:
            if parts.stage in failed:
                self._kill_own_node()
            self.scheduled_kills |= failed
            self.kill_unix_s = time.time()
            self._save_snapshot()  # a restarted survivor must not decide these failures again
            return True  # also when a newer generation exists: the kill comes first
        if switch:
            return True
        if failed:  # `none`: recorded, state kept (the no-failure reference)
            self.iteration = _apply_failures(config, failed, step, iteration, parts)
            iteration = self.iteration

        def applied() -> None:
            self.step, self.iteration = step + 1, iteration + 1

        row = parts.run_iteration(step, iteration, after_update=applied)
        self.journal.flush()
        self._save_snapshot()
        if self.on_iteration_done is not None and parts.pipeline.runs_head and parts.replica == 0:
            self.on_iteration_done(row)
        return False

    def _kill_own_node(self) -> None:
        """The injector's kill of this process: its journal kept; under the agent its node dies too,
        memory (the snapshot) and disk (the node-local checkpoint level); then SIGKILL."""
        parts = self.parts
        self.journal.flush()
        if hasattr(self.membership, "before_own_kill"):
            self.membership.before_own_kill()
            if parts.context.run_dir is not None:
                drop_node_local_level(parts.context.run_dir, parts.stage, parts.replica)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is not deliverable late; never reached

    # -- host-memory snapshots (torchrun: real/agent_membership.py) --------------------------------

    def _save_snapshot(self) -> None:
        """Keep this stage's state in its node's memory, so that a restart of the process (not of the
        node) loses nothing: weights, optimizer, RNG, what the method holds in memory, the counters."""
        save = getattr(self.membership, "save_snapshot", None)
        if save is None or not self.has_state:
            return
        from .methods.stage_state import capture_stage_state

        parts = self.parts
        runtime = parts.runtime
        with parts.spans.span("host_snapshot", self.step):
            save(self.step, kill_unix_s=self.kill_unix_s, payload={
                "state": capture_stage_state(runtime.module, runtime.optimizer), "lr_scale": runtime.lr_scale,
                "rng": torch.get_rng_state(), "method": parts.method.heal_state(),  # what a heal would copy: replicas, norms
                "step": self.step, "iteration": self.iteration, "decided_through": self.decided_through,
                "scheduled_kills": sorted(self.scheduled_kills), "handled_deaths": sorted(self.handled_deaths),
                "origin_unix_s": parts.spans.origin_s + unix_offset_s(),
            })  # fmt: skip

    def _restore_snapshot(self, payload: dict[str, Any]) -> None:
        from .methods.stage_state import restore_stage_state

        parts = self.parts
        restore_stage_state(parts.runtime, parts.make_optimizer, payload["state"])
        parts.runtime.lr_scale = float(payload["lr_scale"])
        torch.set_rng_state(payload["rng"])
        parts.method.adopt_heal_state(payload["method"])
        parts.spans.set_origin(float(payload["origin_unix_s"]) - unix_offset_s())
        self.step, self.iteration = int(payload["step"]), int(payload["iteration"])
        self.decided_through = int(payload["decided_through"])
        self.scheduled_kills = {int(stage) for stage in payload["scheduled_kills"]}
        self.handled_deaths = {int(death) for death in payload["handled_deaths"]}
        self.has_state = True

    def _note_round_costs(self, gathered: list[dict[str, Any]]) -> None:
        """From a new group's all-gather (`_deaths_and_times`), the same on every rank (wall clock,
        seconds): the rendezvous proper, from the last member's arrival to the group formed everywhere,
        and under the agent the costs of its restart of the workers."""
        self.rendezvous_s = max(each["formed_unix_s"] for each in gathered) - max(each["arrived_unix_s"] for each in gathered)
        measured = getattr(self.membership, "restart_costs", None)
        if not measured:
            self.restart_costs = {}
            return
        survivors = [each for each in gathered if each["restore_bytes"]]
        detected = self.membership.deaths[0]["detected_perf_s"] + unix_offset_s() if self.membership.deaths else None
        self.restart_costs = dict(measured) | {
            "process_start_s": max(each["ready_unix_s"] - each["started_unix_s"] for each in gathered if each["started_unix_s"] is not None),
            "survivor_reload_s": max((each["restore_s"] for each in survivors), default=0.0),
            "survivor_reload_bytes": int(sum(each["restore_bytes"] for each in survivors)),
            "survivor_restart_s": max((each["ready_unix_s"] for each in survivors), default=detected) - detected if detected is not None else None,
        }

    # -- re-forming the group ------------------------------------------------------------------

    def _reform(self) -> None:
        """Leave the broken group, join the next generation, agree on the state, recover."""
        parts, method = self.parts, self.parts.method
        started_perf_s = time.perf_counter()
        parts.pipeline.reset()
        for runtime in parts.hosted.values():
            runtime.module.zero_grad(set_to_none=True)
        if parts.hosted:
            method.leave_degraded()  # the hosted stage's state stays in the method for whatever comes next
            parts.set_hosted({}, None)
        while True:
            announcement = self.membership.join()
            agreed = self._agree(announcement, started_perf_s)
            if agreed is None:
                continue  # a group of the survivors that cannot train: wait for the next one
            return

    def _hard_recovery_row(self, row: dict[str, Any], announcement: Any, *more: dict[str, Any]) -> dict[str, Any]:
        """A hard failure's recovery row: `row`, the round's generation, `more`, and under the agent the
        costs of its restart (with the note that says what they mean)."""
        if self.restart_costs:
            row = row | {"notes": [*row["notes"], AGENT_RESTART_NOTE]}
        merged = row | {"failure_mode": "hard", "degraded": False, "generation": announcement.generation}
        for part in more:
            merged |= part
        return merged | self.restart_costs

    def _deaths_and_times(self, announcement: Any) -> dict[str, Any]:
        """What every rank says at a group's all-gather of the kills and deaths it knows, and of its
        clock's origin, when it arrived, the group formed and it was ready, on the wall clock
        (perf_counter's origin differs between machines)."""
        return {
            "origin_unix_s": self.parts.spans.origin_s + unix_offset_s() if self.has_state else None,
            "scheduled_kills": sorted(self.scheduled_kills),
            "handled_deaths": sorted(self.handled_deaths),
            "arrived_unix_s": announcement.arrived_perf_s + unix_offset_s(),
            "formed_unix_s": announcement.formed_perf_s + unix_offset_s(),
            "ready_unix_s": self.ready_perf_s + unix_offset_s(),
            "started_unix_s": getattr(self.membership, "started_unix_s", None),
            "restore_s": getattr(self.membership, "restore_s", 0.0),
            "restore_bytes": getattr(self.membership, "restore_bytes", 0),
        }

    def _agree(self, announcement: Any, started_perf_s: float) -> bool | None:
        """One all-gather on the new group, then degraded training or recovery; None: wait for the next group."""
        parts, method, config = self.parts, self.parts.method, self.config
        communicator = parts.communicator
        members = announcement.members
        mine = {
            "stage": parts.stage,
            "has_state": self.has_state,
            "step": self.step,
            "iteration": self.iteration,
            "decided_through": self.decided_through,
            "origin_s": parts.spans.origin_s if self.has_state else None,
            "metadata": method.replicated_metadata() if self.has_state else None,
            "hostable": sorted(method.hostable_stages()) if self.has_state else [],
            **self._deaths_and_times(announcement),
        }
        gathered = communicator.all_gather_objects(mine)
        self._note_round_costs(gathered)
        survivors = [each for each in gathered if each["has_state"]]
        if not survivors:
            raise RuntimeError(
                f"generation {announcement.generation}: every stage process of the group lost its state at once, "
                "nothing to recover from; continue the run with --resume from its durable checkpoints"
            )
        first = survivors[0]
        if not self.has_state:
            # A replacement: the run's clock and the state every rank keeps alike, from a survivor.
            parts.spans.set_origin(first["origin_unix_s"] - unix_offset_s())
            method.adopt_replicated_metadata([each["metadata"] for each in survivors])
        furthest = max(survivors, key=lambda each: each["step"])
        step, iteration = furthest["step"], furthest["iteration"]
        parts.spans.step = step
        self.decided_through = max(each["decided_through"] for each in survivors)
        self.scheduled_kills = {stage for each in gathered for stage in each["scheduled_kills"]}
        self.handled_deaths = {death for each in survivors for death in each["handled_deaths"]}
        self._record_rejoin_spans(announcement, started_perf_s, step)
        self._record_deaths(announcement, step)
        self.journal.truncate_from(step)
        behind = sorted(each["stage"] for each in survivors if each["step"] < step)
        present = frozenset(members)
        lost = frozenset(range(config.num_stages)) - {each["stage"] for each in survivors}
        if not announcement.full:
            absent = frozenset(range(config.num_stages)) - present
            hosts = {stage: [each["stage"] for each in survivors if stage in each["hostable"]] for stage in absent}
            viable = (
                method.runs_degraded
                and lost == absent  # every process present holds its state
                and all(len(candidates) == 1 for candidates in hosts.values())
            )
            if not viable:
                return None
            self.step, self.iteration = step, iteration
            self._enter_degraded({stage: candidates[0] for stage, candidates in hosts.items()}, behind, started_perf_s)
            return True
        self._recover(lost, step, iteration, behind, started_perf_s, announcement)
        return True

    def _record_rejoin_spans(self, announcement: Any, started_perf_s: float, step: int) -> None:
        spans, origin_s = self.parts.spans, self.parts.spans.origin_s
        settings = self.membership.settings
        if not self.has_state and settings.death_detected_perf_s is not None and not self._join_recorded:
            # From the death to this process ready to rendezvous: the join delay,
            # the process start, the model build.
            spans.add("recovery.join", step, None, settings.death_detected_perf_s - origin_s, self.ready_perf_s - origin_s)
            self._join_recorded = True
            self.join_s = self.ready_perf_s - settings.death_detected_perf_s
        if self.has_state and announcement.arrived_perf_s > started_perf_s:
            spans.add("recovery.wait", step, None, started_perf_s - origin_s, announcement.arrived_perf_s - origin_s)
        spans.add("recovery.rendezvous", step, None, announcement.arrived_perf_s - origin_s, announcement.formed_perf_s - origin_s)

    def _record_deaths(self, announcement: Any, step: int) -> None:
        """Stage 0 records each death not recorded yet: a scheduled kill has its row already. In a
        group without stage 0 (its process is down) nothing is marked: a later group records them."""
        parts = self.parts
        if 0 not in announcement.members:
            return
        for death in sorted(announcement.deaths, key=lambda death: death["id"]):
            if death["id"] in self.handled_deaths:
                continue
            self.handled_deaths.add(death["id"])
            if death["stage"] in self.scheduled_kills:
                self.scheduled_kills.discard(death["stage"])  # the injector's kill: its row exists
                continue
            if parts.stage == 0:
                parts.result.failures.append(
                    {
                        "time_s": death["detected_perf_s"] - parts.spans.origin_s,
                        "iteration": step,
                        "stage": death["stage"],
                        "kind": EXTERNAL_KILL_KIND,
                        "death_id": death["id"],
                    }
                )

    def _enter_degraded(self, hosts: dict[int, int], behind: list[int], started_perf_s: float) -> None:
        """Train without the absent stages: each runs on its host from what the host holds."""
        parts = self.parts
        placement = tuple(hosts.get(stage, stage) for stage in range(self.config.num_stages))
        mine = frozenset(stage for stage, host in hosts.items() if host == parts.stage)
        measure = _RecoveryMeasure(parts)
        hosted = parts.method.enter_degraded(mine) if mine else {}
        parts.set_hosted(hosted, placement)
        self.full_group = False
        costs = measure.gather(join_s=0.0, rendezvous_s=self.rendezvous_s, stalled_s=time.perf_counter() - started_perf_s)
        if parts.stage == 0:
            notes = [f"degraded: stage {host} runs stage {stage} from its replica until the replacement joins" for stage, host in sorted(hosts.items())]
            if behind:
                notes.append(f"stages {behind} had not applied the update of step {self.step - 1} when the group broke; they skip it")
            row = {
                "step": self.step, "iteration": self.iteration, "failed_stages": sorted(hosts), "resume_iteration": None,
                "lr_scale": 1.0, "rebuilt_from": {stage: f"degraded: run by stage {host}" for stage, host in sorted(hosts.items())},
                "notes": notes, "failure_mode": "hard", "degraded": True,
            }  # fmt: skip
            parts.result.recoveries.append(row | costs)
        self.journal.flush()

    def _recover(self, lost: frozenset[int], step: int, iteration: int, behind: list[int], started_perf_s: float, announcement: Any) -> None:
        parts, config = self.parts, self.config
        runtime = parts.runtime
        parts.set_hosted({}, None)
        self.full_group = True
        self.kill_unix_s = None
        if not self.has_state:
            # The replacement's own start: fresh random weights, as a soft failure's re-initialisation.
            runtime.module.reset_parameters(derive_seed(config.seed, _FAILURE_INIT_STREAM, parts.stage, step))
            runtime.optimizer = parts.make_optimizer(1.0)
            runtime.lr_scale = 1.0
        runtime.module.zero_grad(set_to_none=True)
        self.step, self.iteration = step, iteration
        if not lost:
            return
        parts.context.killed_stages = lost
        measure = _RecoveryMeasure(parts)
        try:
            outcome = parts.method.recover(lost, iteration)
        finally:
            parts.context.killed_stages = frozenset()
        parts.check_finite_weights(f"after the recovery at step {step} (iteration {iteration})")
        self.has_state = True
        costs = measure.gather(
            join_s=self.join_s if parts.stage in lost else 0.0,
            rendezvous_s=self.rendezvous_s,
            stalled_s=time.perf_counter() - started_perf_s,
        )
        if outcome.resume_iteration is not None:
            self.iteration = outcome.resume_iteration
        if parts.stage == 0:
            row = outcome.as_row(step=step, iteration=iteration)
            unplanned = sorted(lost - set(outcome.rebuilt_from))
            if unplanned:  # e.g. an edge the method declares reliable, killed from outside all the same
                row["rebuilt_from"] |= {stage: "random init (the method has no recovery for this stage)" for stage in unplanned}
            if behind:
                row["notes"] = [*row["notes"], f"stages {behind} had not applied the update of step {step - 1} when the group broke; they skip it"]
            parts.result.recoveries.append(self._hard_recovery_row(row, announcement, costs))
        self.journal.flush()
        self._save_snapshot()


class _HardFailureGridTrainer(_HardFailureTrainer):
    """Hard failures with data parallelism: one process per node of the S × D grid (the agent's
    worker slot = replica × S + stage). There is no degraded phase: when a node's process dies every
    replica waits for its replacement (the whole grid re-forms), which then copies its stage's state
    from a surviving replica (`replica_heal`); a stage whose replicas all died goes to the method's
    own recovery in every replica pipeline, as under soft failures. The grid's collectives (the
    gradient all-reduce, the pipelines', the heals' messages) run point to point over the group of
    the current generation, as a one-pipeline run's do under hard failures."""

    def _build_parts(self, run_dir: Path | None) -> _Stage:
        config = self.config
        pipeline, stage_group = data_parallel_communicators(self.world, config.num_stages, config.data_parallel_degree, make_groups=False)
        return _Stage(
            config, pipeline, run_dir, run_started_ns=self.membership.settings.run_started_unix_ns, stage_group=stage_group, world=self.world
        )

    def _joined_group(self) -> None:
        assert self.parts.stage_group is not None
        self.parts.communicator.restart()
        self.parts.stage_group.restart()

    def _node(self, slot: int) -> tuple[int, int]:
        replica, stage = divmod(slot, self.config.num_stages)
        return stage, replica

    def _slot(self, node: tuple[int, int]) -> int:
        return node[1] * self.config.num_stages + node[0]

    def _one_step(self) -> bool:
        from .replica_heal import node_loss_actions

        config, parts = self.config, self.parts
        step, iteration = self.step, self.iteration
        parts.spans.step = step
        failed, switch = self.due_failures.nodes_at_boundary(
            step, decided_through=self.decided_through, newer_generation=self.membership.newer_generation_announced()
        )
        if failed:
            self.decided_through = step
            self.journal.flush()  # the failure rows outlive whichever process dies now
        actions = node_loss_actions(
            config.method, failed, num_stages=config.num_stages, data_parallel_degree=config.data_parallel_degree,
            destroys_state=parts.method.destroys_state_on_failure,
        )  # fmt: skip
        if actions.wiped:
            if (parts.stage, parts.replica) in actions.wiped:
                self._kill_own_node()
            self.scheduled_kills |= {self._slot(node) for node in actions.wiped}
            self.kill_unix_s = time.time()
            self._save_snapshot()  # a restarted survivor must not decide these failures again
            return True
        if switch:
            return True

        def applied() -> None:
            self.step, self.iteration = step + 1, iteration + 1

        row = parts.run_iteration(step, iteration, after_update=applied)
        self.journal.flush()
        self._save_snapshot()
        if self.on_iteration_done is not None and parts.pipeline.runs_head and parts.replica == 0:
            self.on_iteration_done(row)
        return False

    def _agree(self, announcement: Any, started_perf_s: float) -> bool | None:
        if not announcement.full:
            return None  # the grid waits for its replacements
        self._joined_group()
        parts, method = self.parts, self.parts.method
        mine = {
            "slot": self.world.rank,
            "has_state": self.has_state,
            "step": self.step,
            "iteration": self.iteration,
            "decided_through": self.decided_through,
            "metadata": method.replicated_metadata() if self.has_state else None,
            **self._deaths_and_times(announcement),
            # A replacement: from its predecessor's death to this process ready.
            "join_s": self.ready_perf_s - detected if not self.has_state and (detected := self.membership.settings.death_detected_perf_s) is not None else 0.0,
        }
        gathered = self.world.all_gather_objects(mine)
        self._note_round_costs(gathered)
        survivors = [each for each in gathered if each["has_state"]]
        if not survivors:
            raise RuntimeError(
                f"generation {announcement.generation}: every process of the grid lost its state at once, nothing to "
                "recover from; start the run again"
            )
        if not self.has_state:
            parts.spans.set_origin(survivors[0]["origin_unix_s"] - unix_offset_s())
            method.adopt_replicated_metadata([each["metadata"] for each in survivors])
        furthest = max(survivors, key=lambda each: each["step"])
        step, iteration = furthest["step"], furthest["iteration"]
        parts.spans.step = step
        self.decided_through = max(each["decided_through"] for each in survivors)
        self.scheduled_kills = {slot for each in gathered for slot in each["scheduled_kills"]}
        self.handled_deaths = {death for each in survivors for death in each["handled_deaths"]}
        self._record_rejoin_spans(announcement, started_perf_s, step)
        self._record_deaths(announcement, step)
        self.journal.truncate_from(step)
        dead = {self._node(each["slot"]) for each in gathered if not each["has_state"]}
        up_to_date = {self._node(each["slot"]) for each in survivors if each["step"] == step}
        # A survivor stopped before its update of step − 1 copies a replica that applied it, where its
        # stage has one (without one, it skips that update, as in a one-pipeline run).
        behind = {
            self._node(each["slot"]) for each in survivors
            if each["step"] < step and any(node[0] == self._node(each["slot"])[0] for node in up_to_date)
        }  # fmt: skip
        join_s = max(each["join_s"] for each in gathered)
        self._recover_grid(dead, behind, step, iteration, started_perf_s, announcement, join_s)
        return True

    def _recover_grid(
        self, dead: set[tuple[int, int]], behind: set[tuple[int, int]], step: int, iteration: int, started_perf_s: float,
        announcement: Any, join_s: float,
    ) -> None:  # fmt: skip
        from churnsim.calibration.replica_rule import ReplicaHeal

        from .replica_heal import heal_replicas, node_loss_actions

        parts, config = self.parts, self.config
        runtime, method, spans = parts.runtime, parts.method, parts.spans
        num_stages, replicas = config.num_stages, config.data_parallel_degree
        if not self.has_state:
            # The replacement's own start: the same fresh weights as any replacement of this stage.
            runtime.module.reset_parameters(derive_seed(config.seed, _FAILURE_INIT_STREAM, parts.stage, step))
            runtime.optimizer = parts.make_optimizer(1.0)
            runtime.lr_scale = 1.0
        runtime.module.zero_grad(set_to_none=True)
        self.step, self.iteration = step, iteration
        lost = dead | behind
        # The processes died: their state is gone whatever the method declares (`none`, reliable edges).
        actions = node_loss_actions(config.method, lost, num_stages=num_stages, data_parallel_degree=replicas)
        heals = list(actions.heals)
        notes = []
        for stage in sorted({node[0] for node, handled in actions.handled_as.items() if handled == "ignored"}):
            survivors = [r for r in range(replicas) if (stage, r) not in lost]
            if survivors:
                heals += [ReplicaHeal(stage=stage, replica=r, source_replica=survivors[0], optimizer_state_from="source")
                          for r in range(replicas) if (stage, r) in lost]  # fmt: skip
            else:
                notes.append(f"stage {stage}: every replica's process was killed and the method has no recovery for it: random init")
        own_heals = [heal for heal in heals if heal.stage == parts.stage]
        heal_started_s = spans.now_s()
        heal = heal_replicas(parts.stage_group, runtime, parts.make_optimizer, method, own_heals)  # type: ignore[arg-type]
        if heal.seconds > 0:
            spans.add("recovery.heal", step, None, heal_started_s, spans.now_s(), nbytes=heal.bytes_received or heal.bytes_sent)
        resume_iteration = iteration
        if actions.lost_stages:
            parts.context.killed_stages = frozenset(stage for stage in actions.lost_stages if any(node[0] == stage for node in dead))
            measure = _RecoveryMeasure(parts)
            try:
                outcome = method.recover(actions.lost_stages, iteration)
            finally:
                parts.context.killed_stages = frozenset()
            parts.check_finite_weights(f"after the recovery at step {step} (iteration {iteration})")
            _check_replicas_agree(parts, f"after the recovery of stages {sorted(actions.lost_stages)} at step {step}")
            costs = measure.gather(join_s=join_s, rendezvous_s=self.rendezvous_s, stalled_s=time.perf_counter() - started_perf_s)
            if outcome.resume_iteration is not None:
                resume_iteration = outcome.resume_iteration
            if parts.stage == 0:
                row = outcome.as_row(step=step, iteration=iteration)
                loss = {"replica": parts.replica, "handled_as": "stage_loss"}
                parts.result.recoveries.append(self._hard_recovery_row(row, announcement, loss, costs))
        self.has_state = True
        gathered = self.world.all_gather_objects({"heal_s": heal.seconds, "heal_bytes": heal.bytes_received, "resume_iteration": resume_iteration})
        resumes = sorted({each["resume_iteration"] for each in gathered})
        if len(resumes) > 1:
            raise RuntimeError(f"step {step}: the replicas' recoveries continue from different iterations {resumes}; they would train apart")
        self.iteration = resume_iteration
        if self.world.rank == 0 and heals:
            if behind:
                notes.append(f"nodes {sorted(behind)} had not applied the update of step {step - 1}: they copied a replica that had")
            heal_row = {
                "step": step, "iteration": iteration,
                "handled_as": "replica_heal", "failed_stages": [], "resume_iteration": None, "lr_scale": 1.0,
                "failed_nodes": sorted(list(node) for node in lost),
                "heals": [{"stage": h.stage, "replica": h.replica, "source_replica": h.source_replica} for h in heals],
                "rebuilt_from": {f"{h.stage} replica {h.replica}": f"replica {h.source_replica} (exact copy)" for h in heals},
                "notes": ["every replica waited for the replacement process and its heal", *notes],
                "heal_s": max(each["heal_s"] for each in gathered),
                "heal_bytes": int(sum(each["heal_bytes"] for each in gathered)),
                "join_s": join_s, "rendezvous_s": self.rendezvous_s, "stalled_s": time.perf_counter() - started_perf_s,
                "recovery_s": time.perf_counter() - started_perf_s, "replicas_waited": True,
            }  # fmt: skip
            self.parts.result.recoveries.append(self._hard_recovery_row(heal_row, announcement))
        self.kill_unix_s = None
        self.journal.flush()
        self._save_snapshot()

    def _record_deaths(self, announcement: Any, step: int) -> None:
        """Slot 0 records each death not recorded yet, naming its node; a scheduled kill has its row."""
        if 0 not in announcement.members:
            return
        for death in sorted(announcement.deaths, key=lambda death: death["id"]):
            if death["id"] in self.handled_deaths:
                continue
            self.handled_deaths.add(death["id"])
            if death["stage"] in self.scheduled_kills:  # a death's "stage" is the worker slot
                self.scheduled_kills.discard(death["stage"])
                continue
            if self.world.rank == 0:
                stage, replica = self._node(death["stage"])
                self.parts.result.failures.append(
                    {"time_s": death["detected_perf_s"] - self.parts.spans.origin_s, "iteration": step, "stage": stage,
                     "replica": replica, "kind": EXTERNAL_KILL_KIND, "death_id": death["id"]}
                )  # fmt: skip
