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

The context hands a method everything it may touch: the stage's module and optimizer (through
`StageRuntime`, which the method may replace the optimizer of), an optimizer factory, the
communicator, the device, the run directory and the span recorder.
"""

from __future__ import annotations

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


@dataclass(kw_only=True)
class MethodContext:
    """What a method may use on its rank."""

    stage: int
    num_stages: int
    model_config: ModelConfig
    runtime: StageRuntime
    make_optimizer: Callable[[float], torch.optim.Optimizer]
    """Fresh optimizer for `runtime.module` at base learning rate × the given scale."""
    communicator: Communicator
    device: torch.device
    run_dir: Path | None
    spans: SpanRecorder
    """Record timed work with `spans.span("recovery.transfer")`: the recorder stamps the current step."""
    seed: int
    num_iterations: int
    run_id: str = DEFAULT_RUN_ID
    """The run this rank belongs to: checkpoints are bound to it (and to the stage) and refused otherwise."""
    resume: bool = False
    """This run continues an earlier attempt of `run_id` from its durable checkpoints (`RecoveryMethod.resume`)."""


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
