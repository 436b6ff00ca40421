"""The recovery-method interface of real runs: the trainer calls only these hooks.

Life of a method object (one per rank, built by `build_method`):

- `swap_odd_microbatches` is read once, when the pipeline is built (CheckFree+ routes).
- Every iteration: `after_forward_hop(...)` after each forward hop, `before_optimizer_step(i)`
  (returns the seconds training was blocked, e.g. waiting for a snapshot copy) once the gradients
  are complete and before clipping, `after_optimizer_step(i)` after the weights changed
  (checkpoint saves, replica refreshes).
- At a failure of stages F (before the iteration's first microbatch; stages in `reliable_stages`
  are recorded and otherwise left alone): on each failed stage whose
  state `destroys_state_on_failure` says is lost, the trainer calls `forget_node_state()` (the node
  died: background work stops), re-initialises the module in place and installs a fresh optimizer;
  then every rank calls `recover(F, i)` collectively, which moves real bytes over the process
  group or through files and returns a `RecoveryOutcome` (the same on every rank).
- `close()` at the end of the run.

Hard failures (`context.failure_mode == "hard"`): the failed stage's process is gone. Its
replacement builds a fresh method object, adopts what every rank knows alike from a survivor
(`replicated_metadata` / `adopt_replicated_metadata`, e.g. which checkpoints belong to an abandoned
timeline), and then every rank calls `recover` as above. A method with `runs_degraded` may keep the
survivors training while the replacement starts: a survivor that can run a lost stage
(`hostable_stages`) takes it over (`enter_degraded`) until the replacement is there
(`leave_degraded`, then `recover` hands the stage over).

The context hands a method everything it may touch: the stage's module and optimizer (through
`StageRuntime`, which the method may replace the optimizer of), an optimizer factory, the
communicator, the device, the run directory and the span recorder.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from churnsim.calibration.pipeline_schedule import Hop
from churnsim.calibration.rebuild_plan import reliable_stages

from ..checkpoint.format import DEFAULT_RUN_ID
from ..distributed import Communicator
from ..model import ModelConfig, StageModule
from ..spans import SpanRecorder

# Tags at and above this value are reserved for methods (pipeline tags stay far below).
METHOD_TAG_BASE = 1 << 24


@dataclass
class StageRuntime:
    """The mutable training state of this rank's stage; the trainer always reads it from here."""

    module: StageModule
    optimizer: torch.optim.Optimizer
    lr_scale: float = 1.0
    """Learning-rate multiplier currently applied to this stage (1.0 unless rebuilt)."""


@dataclass
class RecoveryReads:
    """What this rank's recoveries read from checkpoint files (the run record's bytes per recovery)."""

    file_bytes: int = 0
    levels: list[str] = field(default_factory=list)
    """Level of every checkpoint file read, in order (e.g. "remote")."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, level: str, nbytes: int) -> None:
        with self._lock:
            self.file_bytes += nbytes
            self.levels.append(level)


@dataclass(kw_only=True)
class MethodContext:
    """What a method may use on its rank."""

    stage: int
    num_stages: int
    model_config: ModelConfig
    runtime: StageRuntime
    make_optimizer: Callable[[float], torch.optim.Optimizer]
    """Fresh optimizer for `runtime.module` at base learning rate × the given scale."""
    optimizer_for: Callable[[torch.nn.Module, float], torch.optim.Optimizer] | None = None
    """Fresh optimizer, with the run's settings, for another module (a stage run from a replica)."""
    communicator: Communicator
    """This replica's pipeline: peers named by stage."""
    device: torch.device
    run_dir: Path | None
    spans: SpanRecorder
    """Record timed work with `spans.span("recovery.transfer")`: the recorder stamps the current step."""
    seed: int
    num_iterations: int
    run_id: str = DEFAULT_RUN_ID
    """The run this rank belongs to: checkpoints are bound to it (and to the stage) and refused otherwise."""
    checkpoint_key: bytes | None = field(default=None, repr=False)
    """The run's checkpoint key (run_secret.checkpoint_key): every checkpoint this rank writes carries its
    HMAC, and one without a valid HMAC is refused (real/checkpoint/manifest.py). None: unbound."""
    resume: bool = False
    """This run continues an earlier attempt of `run_id` from its durable checkpoints (`RecoveryMethod.resume`)."""
    failure_mode: str = "soft"
    """"soft": a failed stage re-initialises in place; "hard": its process was killed and replaced."""
    run_started_ns: int | None = None
    """Wall clock (ns) at which the run started, the same for every incarnation of every stage
    (hard failures); None: when this process built its method."""
    remote_checkpoint_dir: str | None = None
    """Root of the checkpoints' remote level; None: `<run_dir>/checkpoints`."""
    remote_bytes_per_s: float | None = None
    """Bandwidth of the path to the remote level (writes and reads paced to it); None: unthrottled."""
    replica: int = 0
    """Data parallelism: this node's replica (its pipeline is `communicator`; files go to its own directories)."""
    gather_over_replicas: Callable[[Any], list[Any]] | None = None
    """Data parallelism: every rank's value, on every rank of the whole grid (one all-gather), for the
    collective recoveries that every replica pipeline runs at once and must end alike (a rollback's
    tag); None with one replica."""
    reads: RecoveryReads = field(default_factory=RecoveryReads)
    killed_stages: frozenset[int] = frozenset()
    """During a `recover` after hard failures: the failed stages whose processes were killed (their
    replacements hold fresh random weights); empty otherwise."""


@dataclass(frozen=True, kw_only=True)
class RecoveryOutcome:
    """What a collective `recover` did; identical on every rank."""

    failed_stages: frozenset[int]
    resume_iteration: int | None = None
    """Iteration training continues from (rollback methods); None keeps the current iteration."""
    lr_scale: float = 1.0
    """Learning-rate multiplier given to the rebuilt stages."""
    rebuilt_from: dict[int, str] = field(default_factory=dict)
    """Per failed stage, a short description of what it starts from (e.g. 'weighted_average(1,3)')."""
    notes: tuple[str, ...] = ()
    """Degraded choices worth reporting, e.g. a replica that was lost together with its owner."""

    def as_row(self, *, step: int, iteration: int) -> dict[str, Any]:
        return {
            "step": step,
            "iteration": iteration,
            "failed_stages": sorted(self.failed_stages),
            "resume_iteration": self.resume_iteration,
            "lr_scale": self.lr_scale,
            "rebuilt_from": dict(sorted(self.rebuilt_from.items())),
            "notes": list(self.notes),
        }


class RecoveryMethod(ABC):
    """One recovery method on one rank."""

    name: ClassVar[str]

    def __init__(self, config: Any, context: MethodContext) -> None:
        self.config = config
        self.context = context

    @property
    def destroys_state_on_failure(self) -> bool:
        """False for methods whose failures are ignored (the contract's `ignores_failures` trait: `none`)."""
        return not self.config.ignores_failures

    @property
    def swap_odd_microbatches(self) -> bool:
        return False

    @property
    def reliable_stages(self) -> frozenset[int]:
        """Stages whose failures the trainer records but does not apply (CheckFree's `edge_stages_reliable`)."""
        return reliable_stages(self.config, self.context.num_stages)

    def after_forward_hop(
        self,
        *,
        iteration: int,
        microbatch: int,
        hop_index: int,
        hop: Hop,
        hop_input: torch.Tensor | None,
        hop_output: torch.Tensor,
    ) -> None:
        """Called after every forward hop this stage ran (Bamboo's redundant forward hooks in here)."""

    def before_optimizer_step(self, iteration: int) -> float:
        """Gradients are complete, not yet clipped; returns seconds training was blocked here."""
        return 0.0

    def after_optimizer_step(self, iteration: int) -> None:
        """Weights of `iteration` are final."""

    def forget_node_state(self) -> None:
        """This rank's node died: drop everything it held (replicas, snapshots in memory, norms)."""

    def heal_state(self) -> dict[str, Any]:
        """Data parallelism: what this node holds for the method besides its stage's weights and
        optimizer (a replica of another stage, the last gradient norm), which a healed replica of the
        same stage copies from it (real/replica_heal.py): tensors at the top level, the rest
        JSON-encodable. Nothing by default."""
        return {}

    def adopt_heal_state(self, state: dict[str, Any]) -> None:
        """A healed replica: take the `heal_state` of the surviving replica it copies."""

    @abstractmethod
    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        """Collective: every rank calls it with the same arguments after the failed stages were reset."""

    resumable: ClassVar[bool] = False
    """Whether `resume` can continue a failed run: the method keeps durable checkpoints of every stage."""

    def resume(self) -> RecoveryOutcome:
        """Collective, before the first iteration of a resumed run (`context.resume`): restore every
        stage from the newest checkpoint all stages hold durably; `resume_iteration` is where training
        continues. Only methods with `resumable = True` implement it."""
        raise NotImplementedError(f"method {self.name!r} keeps no checkpoints of every stage and cannot resume a run")

    def close(self) -> None:
        """End of run: finish background work, release resources."""

    # -- hard failures ---------------------------------------------------------------------------

    runs_degraded: ClassVar[bool] = False
    """Whether survivors can keep training while a lost stage's replacement starts (a survivor runs
    the lost stage from what it holds), instead of waiting for it."""

    def replicated_metadata(self) -> Any:
        """Small JSON-encodable state every rank keeps alike, which a replacement adopts from a survivor."""
        return None

    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        """A replacement process, before `recover`: the `replicated_metadata` of every survivor."""

    def hostable_stages(self) -> frozenset[int]:
        """Lost stages this rank could run itself, from what it holds now (`runs_degraded`)."""
        return frozenset()

    def enter_degraded(self, hosted: frozenset[int]) -> dict[int, StageRuntime]:
        """Start running the lost stages `hosted` here; returns their module and optimizer to train."""
        raise NotImplementedError(f"method {self.name!r} does not run degraded")

    def leave_degraded(self) -> None:
        """The replacements are here: stop running hosted stages and keep their state for `recover`."""
