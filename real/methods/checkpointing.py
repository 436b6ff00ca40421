"""`checkpoint` and `async_checkpoint`: save every K iterations, roll back at a failure (DESIGN.md §2).

Both methods wrap a checkpoint engine (real/checkpoint) in one `CheckpointKeeper`, which `redundant`
reuses for its fallback:

- Saves: after the optimizer step of iteration i, when (i + 1) % K == 0, every stage saves its
  weights, optimizer state and torch RNG state tagged with i + 1 = the iteration training resumes
  at. The initial weights are an implicit checkpoint with tag 0 on every stage (as in the
  simulator), so a failure before the first save restarts from iteration 0.
- `checkpoint` writes synchronously (`SynchronousCheckpointEngine`, training blocked) to
  `<checkpoint_dir>/stage-<s>`, checkpoint_dir = `<run_dir>/checkpoints`, the "remote" tier that
  survives node loss. `tier = "local_disk"` writes to `<run_dir>/local/stage-<s>` instead, which
  dies with the node.
- `async_checkpoint` uses `LazyAsyncCheckpointEngine` (DataStates-LLM): host buffer, then
  `<run_dir>/local/stage-<s>` (dies with the node), then `<checkpoint_dir>/stage-<s>`; training
  waits only before the next optimizer step for an unfinished snapshot copy.
- Rollback `all`: every stage lists the tags it can load (for a failed stage only what survived
  node loss: its local level was wiped by `forget_node_state`), the ranks agree on the newest tag
  every stage has (an all-gather), every stage restores it, and the outcome's `resume_iteration`
  makes the trainer replay from there. Data order is a function of the iteration, so in
  deterministic mode the replay is bit-exact. Survivors first let their in-flight saves become
  durable, so nothing is purged while it is being read.
- Rollback `stage`: only the failed stage loads its newest surviving checkpoint; no rewind.

After a rollback to tag k, checkpoints of tags > k saved before the rollback belong to the
abandoned timeline and are never loaded (`_is_current`); checkpoints of another run (run id) or
stage are never listed (the engines bind them), and a fresh run ignores what an earlier one left.

Robust reads: a failed stage reads only levels that survive node loss, whatever its node-local
directories still hold. The ranks agree on a tag from the checkpoints that pass the cheap checks
(manifest, binding, data file header); when a stage then finds that checkpoint damaged while loading
it (tensor checksums), it tries the same tag at its other levels, and failing that, every stage
agrees again without that tag. Tag 0 (the initial weights) always loads, so recovery always ends.

Resume (`resume`, a run continued with `--resume` after it failed or was killed): every stage
restores, the same agreement, the newest tag all stages hold at levels that survive node loss.

Levels apart: the remote level may live under `training.remote_checkpoint_dir` (another file
system; `<dir>/<run id>/stage-<s>`) and behind a path of `training.remote_checkpoint_bytes_per_s`
(writes and reads paced). Hard failures: the launcher deletes a killed stage's node-local level
(`<run_dir>/local/stage-<s>`: its disk died with it), and the replacement, a new process, reads only
the levels that survive node loss; which level every recovery read, and how many bytes, is recorded
(`MethodContext.reads`).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from churnsim.calibration.errors import InputError

from ..checkpoint import (
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointInfo,
    LazyAsyncCheckpointEngine,
    SynchronousCheckpointEngine,
)
from ..spans import SpanRecorder
from ..warnings_relay import warn  # a recovery that goes further back than it might have must not pass silently
from .base import MethodContext, RecoveryMethod, RecoveryOutcome
from .stage_state import capture_stage_state, restore_stage_state, state_nbytes

RNG_KEY = "rng.torch"
_MAX_SKIPPED_NOTES = 20
"""Skipped files named one by one in a recovery's record row, per stage (the rest are counted)."""


def check_finite_state(state: dict[str, Any], where: str) -> None:
    """Refuse a loaded state whose floating-point tensors hold NaN or infinity (CheckpointCorruptError:
    it is skipped like a damaged file, for an older checkpoint)."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointCorruptError(f"{where}: tensor '{key}' holds NaN or infinite values; not loaded")

REMOTE_TIER = "remote"
LOCAL_TIERS = ("local_disk", "local")
ASYNC_LEVELS = ("local_disk", "remote")
INITIAL_WEIGHTS = "initial weights"


class EngineSpans:
    """The engines' span callback: called from background threads, so appends are serialised."""

    def __init__(self, spans: SpanRecorder, *, skip: tuple[str, ...] = ("load",)) -> None:
        self.spans = spans
        self.skip = skip
        self._lock = threading.Lock()

    def __call__(self, kind: str, start_s: float, end_s: float) -> None:
        if kind in self.skip:
            return  # loads are recorded by the method as "recovery.load"
        with self._lock:
            origin_s = self.spans.origin_s  # engine times are raw perf_counter values
            self.spans.add(kind, None, None, start_s - origin_s, end_s - origin_s)


def node_directory_name(stage: int, replica: int) -> str:
    """The folder of node (stage, replica) in each checkpoint level: replica 0's is its stage's."""
    return f"stage-{stage}" + (f"-replica-{replica}" if replica else "")


def node_local_level(run_dir: str | Path, stage: int, replica: int) -> Path:
    """Node (stage, replica)'s node-local checkpoint level in run directory `run_dir`: it dies with the node."""
    return Path(run_dir) / "local" / node_directory_name(stage, replica)


def drop_node_local_level(run_dir: str | Path, stage: int, replica: int) -> None:
    """What a node's death does to its disk: its node-local checkpoint level is gone."""
    shutil.rmtree(node_local_level(run_dir, stage, replica), ignore_errors=True)


class CheckpointDirectories:
    """Where stage s keeps its checkpoints; a temporary root when the run has no directory."""

    def __init__(self, context: MethodContext) -> None:
        self._temporary: Path | None = None
        if context.run_dir is None:
            self._temporary = Path(tempfile.mkdtemp(prefix=f"churnsim-checkpoints-stage{context.stage}-"))
            root = self._temporary
        else:
            root = Path(context.run_dir)
        # Data parallelism: every replica keeps its own copy of its stage's checkpoints (replica 0
        # where a one-pipeline run keeps them); no sharding over the replicas.
        stage_directory = node_directory_name(context.stage, context.replica)
        if context.remote_checkpoint_dir is not None:
            # Another file system, shared by runs: each run below its own id.
            self.remote = Path(context.remote_checkpoint_dir) / context.run_id / stage_directory
        else:
            self.remote = root / "checkpoints" / stage_directory
        """The "remote" tier (checkpoint_dir): survives node loss."""
        self.local = node_local_level(root, context.stage, context.replica)
        """Node-local disk: dies with the node."""

    def cleanup(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)


def synchronous_engine(
    context: MethodContext, directories: CheckpointDirectories, tier: str, *, keep_last: int = 2
) -> SynchronousCheckpointEngine:
    """A blocking engine on `tier`: the remote checkpoint dir, or node-local disk."""
    throttle = None
    if tier == REMOTE_TIER:
        directory, survives, throttle = directories.remote, True, context.remote_bytes_per_s
    elif tier in LOCAL_TIERS:
        directory, survives = directories.local, False
    else:
        raise InputError(f"checkpoint tier {tier!r} does not exist in real runs: use 'remote' or 'local_disk'")
    return SynchronousCheckpointEngine(
        directory,
        level=tier,
        survives_node_loss=survives,
        keep_last=keep_last,
        record_span=EngineSpans(context.spans),
        run_id=context.run_id,
        stage=context.stage,
        throttle_bytes_per_s=throttle,
        binding_key=context.checkpoint_key,
    )


class CheckpointKeeper:
    """Saves one stage's state every `interval_iterations` and restores it collectively at failures."""

    def __init__(
        self,
        context: MethodContext,
        engine: CheckpointEngine,
        directories: CheckpointDirectories,
        *,
        interval_iterations: int,
        rollback: str,
    ) -> None:
        if rollback not in ("all", "stage"):
            raise InputError(f"rollback {rollback!r}: use 'all' or 'stage'")
        self.context = context
        self.engine = engine
        self.directories = directories
        self.interval_iterations = interval_iterations
        self.rollback = rollback
        # (tag k, time): checkpoints of tags > k saved before that time are from an abandoned timeline.
        # The first entry discards everything an earlier run of the same run id left in the same
        # directories, unless this run resumes that one (`resume` then abandons beyond its tag).
        # Under hard failures a replacement process uses the run's start, not its own.
        started_ns = context.run_started_ns if context.run_started_ns is not None else time.time_ns()
        self._abandoned: list[tuple[int, int]] = [] if context.resume else [(-1, started_ns)]

    # -- steady state ---------------------------------------------------------------------------

    def before_optimizer_step(self) -> float:
        return self.engine.wait_before_optimizer_step()

    def after_optimizer_step(self, iteration: int) -> None:
        tag = iteration + 1
        if tag % self.interval_iterations == 0:
            runtime = self.context.runtime
            state = capture_stage_state(runtime.module, runtime.optimizer)
            state[RNG_KEY] = torch.get_rng_state()
            self.engine.save(state, tag)
        self.engine.mark_boundary()  # a failure noticed at the next step's start strikes here

    def forget_node_state(self) -> None:
        """The node died: host buffers, in-flight saves and node-local levels are gone."""
        self.engine.lose_node_local_levels()

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self.directories.cleanup()

    # -- recovery -------------------------------------------------------------------------------

    def replicated_metadata(self) -> list[list[int]]:
        """The abandoned timelines (every rank appends the same at each rollback)."""
        return [list(entry) for entry in self._abandoned]

    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        """A replacement continues the survivors' timeline: the longest list any survivor keeps."""
        known = [entries for entries in survivors if entries is not None]
        if known:
            self._abandoned = [(int(tag), int(ns)) for tag, ns in max(known, key=len)]

    def _is_current(self, info: CheckpointInfo) -> bool:
        return not any(info.iteration > tag and info.sequence < abandoned_ns for tag, abandoned_ns in self._abandoned)

    def available_tags(self, *, surviving_node_loss: bool = False) -> set[int]:
        """Tags this stage can restore now (0 = the initial weights, always available).

        `surviving_node_loss=True`: only from levels that survive node loss (this stage's node died)."""
        infos = self.engine.list_durable(surviving_node_loss=surviving_node_loss)
        return {info.iteration for info in infos if self._is_current(info)} | {0}

    def _try_restore(self, tag: int, *, surviving_node_loss: bool) -> str | None:
        """Restore tag `tag` from the newest intact copy at any readable level; None, or why it failed."""
        context = self.context
        runtime = context.runtime
        with context.spans.span("recovery.load"):
            if tag == 0:
                # The implicit checkpoint: the seeded initialisation, a fresh optimizer.
                runtime.module.reset_parameters(context.seed)
                runtime.optimizer = context.make_optimizer(1.0)
                runtime.lr_scale = 1.0
                return None
            infos = self.engine.list_durable(surviving_node_loss=surviving_node_loss)
            candidates = [info for info in infos if info.iteration == tag and self._is_current(info)]
            problem = f"no checkpoint of iteration {tag} left"
            for info in sorted(candidates, key=lambda info: -info.sequence):  # newest first, fastest level on ties
                try:
                    state = self.engine.load(info)  # every checksum verified before anything changes
                    check_finite_state(state, str(info.data_path))
                except CheckpointCorruptError as error:
                    problem = str(error)
                    continue
                context.reads.add(info.level, info.file_nbytes)
                torch.set_rng_state(state.pop(RNG_KEY))
                restore_stage_state(runtime, context.make_optimizer, state)
                return None
            return problem

    def _restore_agreed(self, *, surviving_node_loss: bool) -> tuple[int, list[str]]:
        """Collective: every stage restores the newest tag all stages can load; (tag, notes on skipped checkpoints)."""
        communicator = self.context.communicator
        refused: set[int] = set()
        skipped = self.engine.skipped(surviving_node_loss=surviving_node_loss)
        for line in skipped:  # each rank says what it skipped itself: one line each, no duplicates
            warn(f"stage {self.context.stage}: checkpoint skipped: {line}")
        notes = []  # damaged or foreign files the listings passed over: why a rollback may go further back
        for stage, (count, lines) in zip(
            communicator.group_stages, communicator.all_gather_objects([len(skipped), skipped[:_MAX_SKIPPED_NOTES]])
        ):
            notes.extend(f"stage {stage}: checkpoint skipped: {line}" for line in lines)
            if count > len(lines):
                notes.append(f"stage {stage}: {count - len(lines)} more checkpoint file(s) skipped")
        across_replicas = self.context.gather_over_replicas
        while True:
            tags = self.available_tags(surviving_node_loss=surviving_node_loss) - refused
            gathered = communicator.all_gather_objects(sorted(tags))
            common = set.intersection(*(set(each) for each in gathered))
            if across_replicas is not None:
                # Data parallelism: every replica pipeline rolls back to the same tag, or they train apart.
                common = set.intersection(*(set(each) for each in across_replicas(sorted(common))))
            tag = max(common)
            problem = self._try_restore(tag, surviving_node_loss=surviving_node_loss)
            if problem is not None:
                refused.add(tag)
                warn(f"stage {self.context.stage}: checkpoint of iteration {tag} not loadable, skipped ({problem})")
            problems = communicator.all_gather_objects(problem)
            notes.extend(
                f"stage {stage}: iteration {tag} not loadable, skipped ({text})"
                for stage, text in zip(communicator.group_stages, problems)
                if text
            )
            retry = any(problems)
            if across_replicas is not None:
                retry = any(across_replicas(retry))  # every replica tries again, or none
            if not retry:
                return tag, notes

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        # No background copy may read tensors we are about to overwrite.
        self.engine.wait_before_optimizer_step()
        if self.rollback == "all":
            return self._rollback_all(failed_stages, iteration)
        return self._rollback_stage(failed_stages, iteration)

    def _rollback_all(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        context = self.context
        if context.stage not in failed_stages:
            self.engine.wait_until_durable()  # in-flight saves land (and purge) before we list and read
        tag, skipped = self._restore_agreed(surviving_node_loss=context.stage in failed_stages)
        self._abandoned.append((tag, time.time_ns()))
        source = f"checkpoint(iteration {tag})" if tag > 0 else f"{INITIAL_WEIGHTS} (no checkpoint yet)"
        notes = [f"rollback all: every stage restored to iteration {tag}, {iteration - tag} iteration(s) replayed", *skipped]
        if tag == 0:
            notes.append("no checkpoint held by every stage yet: all stages restart from the initial weights at iteration 0")
            if context.stage == context.communicator.group_stages[0] and context.replica == 0:  # one line for the group
                warn(f"restart from scratch: {notes[-1]} (the failure struck before iteration {iteration})")
        return RecoveryOutcome(
            failed_stages=failed_stages,
            resume_iteration=tag,
            rebuilt_from={stage: source for stage in failed_stages},
            notes=tuple(notes),
        )

    def restore_newest(self, *, surviving_node_loss: bool = True, allowed: set[int] | None = None) -> int:
        """Load this stage's newest checkpoint it can still read (tag 0: the initial weights); returns the tag.
        `allowed`: only those tags (the ones every replica of the stage holds; 0 is always allowed).

        Local to this rank, after this stage's node died (so by default only levels that survive node
        loss are read): the stage-local rollback of `rollback = "stage"` and CheckFree's edge checkpoints.
        A damaged checkpoint is skipped for the next older one."""
        self.engine.wait_before_optimizer_step()  # no background copy may read what we overwrite
        tags = self.available_tags(surviving_node_loss=surviving_node_loss)
        if allowed is not None:
            tags &= allowed | {0}
        for tag in sorted(tags, reverse=True):
            problem = self._try_restore(tag, surviving_node_loss=surviving_node_loss)
            if problem is None:
                if tag == 0:
                    warn(f"restart from scratch: stage {self.context.stage} restarts from its initial weights (no checkpoint it can load)")
                return tag
            warn(f"stage {self.context.stage}: checkpoint of iteration {tag} not loadable, skipped ({problem})")
        raise AssertionError("tag 0, the initial weights, always restores")

    def resume(self) -> RecoveryOutcome:
        """Collective, at the start of a resumed run: every stage restores the newest tag all stages
        hold at levels that survive node loss (the earlier attempt's nodes are gone)."""
        context = self.context
        self.engine.wait_before_optimizer_step()
        tag, skipped = self._restore_agreed(surviving_node_loss=True)
        self._abandoned.append((tag, time.time_ns()))  # tags beyond it belong to the failed attempt
        stages = frozenset(range(context.num_stages))
        source = f"checkpoint(iteration {tag})" if tag > 0 else f"{INITIAL_WEIGHTS} (no durable checkpoint held by every stage)"
        if tag == 0 and context.stage == context.communicator.group_stages[0]:
            warn(f"restart from scratch: resumed run {context.run_id} starts again at iteration 0: no durable checkpoint held by every stage")
        return RecoveryOutcome(
            failed_stages=stages,
            resume_iteration=tag,
            rebuilt_from={stage: source for stage in stages},
            notes=(f"resumed run {context.run_id} at iteration {tag} from its durable checkpoints", *skipped),
        )

    def _rollback_stage(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        context = self.context
        tag = restore_newest_agreed(context, self, lost=context.stage in failed_stages)
        tags = context.communicator.all_gather_objects(tag)
        rebuilt_from, notes = {}, []
        for stage in sorted(failed_stages):
            stage_tag = tags[stage]
            rebuilt_from[stage] = f"checkpoint(iteration {stage_tag})" if stage_tag > 0 else INITIAL_WEIGHTS
            notes.append(f"rollback stage: stage {stage} is {iteration - stage_tag} iteration(s) stale, the others kept")
        return RecoveryOutcome(failed_stages=failed_stages, rebuilt_from=rebuilt_from, notes=tuple(notes))


def restore_newest_agreed(context: MethodContext, keeper: CheckpointKeeper | None, *, lost: bool) -> int | None:
    """A stage-local rollback, called on every rank of the pipeline: a lost stage (`lost`) reloads its
    newest checkpoint that survived (`CheckpointKeeper.restore_newest`); returns its tag, None elsewhere.

    Data parallelism: every replica pipeline runs this at once, and the replicas of a lost stage must
    reload the same tag (their levels may hold different ones, e.g. asynchronous saves that became
    durable at different moments): one all-gather over the grid picks the newest tag all of them hold."""
    allowed = None
    if context.gather_over_replicas is not None:
        mine = [context.stage, sorted(keeper.available_tags(surviving_node_loss=True))] if lost and keeper is not None else None
        held = [set(entry[1]) for entry in context.gather_over_replicas(mine) if entry is not None and entry[0] == context.stage]
        allowed = set.intersection(*held) if held else None
    if not lost or keeper is None:
        return None
    return keeper.restore_newest(allowed=allowed)


class CheckpointingMethod(RecoveryMethod):
    """Shared hooks of the two checkpoint methods; subclasses only build their engine."""

    resumable: ClassVar[bool] = True

    def __init__(self, config: Any, context: MethodContext) -> None:
        super().__init__(config, context)
        directories = CheckpointDirectories(context)
        self.keeper = CheckpointKeeper(
            context,
            self.build_engine(directories),
            directories,
            interval_iterations=config.interval_iterations,
            rollback=config.rollback,
        )

    def build_engine(self, directories: CheckpointDirectories) -> CheckpointEngine:
        raise NotImplementedError

    def before_optimizer_step(self, iteration: int) -> float:
        return self.keeper.before_optimizer_step()

    def after_optimizer_step(self, iteration: int) -> None:
        self.keeper.after_optimizer_step(iteration)

    def forget_node_state(self) -> None:
        self.keeper.forget_node_state()

    def replicated_metadata(self) -> Any:
        return self.keeper.replicated_metadata()

    def adopt_replicated_metadata(self, survivors: list[Any]) -> None:
        self.keeper.adopt_replicated_metadata(survivors)

    def recover(self, failed_stages: frozenset[int], iteration: int) -> RecoveryOutcome:
        return self.keeper.recover(failed_stages, iteration)

    def resume(self) -> RecoveryOutcome:
        return self.keeper.resume()

    def close(self) -> None:
        self.keeper.close()


class CheckpointMethod(CheckpointingMethod):
    """Synchronous checkpoints every `interval_iterations` to `tier` (default: the remote checkpoint dir)."""

    name: ClassVar[str] = "checkpoint"

    def build_engine(self, directories: CheckpointDirectories) -> CheckpointEngine:
        return synchronous_engine(self.context, directories, self.config.tier)


def estimated_state_bytes(module: torch.nn.Module) -> int:
    """Bytes of one checkpoint of `module` under AdamW: weights, two moments, step counters, RNG, padding.

    An estimate taken before the first step (the optimizer state does not exist yet)."""
    parameters = list(module.parameters())
    weights = state_nbytes({str(i): p for i, p in enumerate(parameters)})
    return 3 * weights + len(parameters) * (4 + 3 * 64) + 16 * 1024


class AsyncCheckpointMethod(CheckpointingMethod):
    """Lazy asynchronous checkpoints: host buffer → node-local dir → remote checkpoint dir."""

    name: ClassVar[str] = "async_checkpoint"

    def build_engine(self, directories: CheckpointDirectories) -> CheckpointEngine:
        config = self.config
        if tuple(config.levels) != ASYNC_LEVELS:
            raise InputError(
                f"async_checkpoint levels {tuple(config.levels)} are not available in real runs: use {ASYNC_LEVELS}"
            )
        host_buffer_bytes = config.host_buffer_bytes or 2 * estimated_state_bytes(self.context.runtime.module)
        return LazyAsyncCheckpointEngine(
            directories.local,
            directories.remote,
            host_buffer_bytes,
            self.context.device,
            # Headroom over keep_per_level: a lost node's newest saves may never reach the remote
            # level, and the agreed rollback point must still be on every survivor.
            keep_last=config.keep_per_level + 2,
            record_span=EngineSpans(self.context.spans),
            run_id=self.context.run_id,
            stage=self.context.stage,
            throttle_remote_bytes_per_s=self.context.remote_bytes_per_s,
            binding_key=self.context.checkpoint_key,
        )

