"""The checkpoint engine interface and the synchronous backend.

One engine per process (= per pipeline stage) owns one directory per storage level. Engines know
nothing about pipelines: they save a flat state dict (tensors + small JSON-encodable metadata)
tagged with an iteration, report how long training was blocked, and restore the newest checkpoint
that is durable at a level that still exists. An engine is bound to a run id and a stage (shard)
index: it writes them into every manifest and header and refuses checkpoints of any other
(CheckpointCorruptError, as for damage); nothing it reads can run code (format.py). Shape after torchtitan's components/checkpointer: one
abstract manager, two backends (`SynchronousCheckpointEngine`, `LazyAsyncCheckpointEngine`).

Spans go to an optional `record_span(kind, start_s, end_s)` callback (time.perf_counter clock),
called from whichever thread did the work, so it must be thread-safe. Kinds:
"save"     training blocked by checkpointing (a save() call; a wait_before_optimizer_step that
           actually waited);
"snapshot" copy of one save's tensors out of the live state (device → host);
"flush"    one checkpoint written and committed at one level;
"load"     one load().

A level may sit behind a bandwidth-limited path (`read_bytes_per_s` per level name, and each
backend's write throttles): loads from it take at least size / rate, so the cost of reading a remote
level is measurable on one machine.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from churnsim.calibration.errors import InputError

from .format import DEFAULT_RUN_ID, CheckpointCorruptError, plan_layout, read_data_file, split_state, tensor_bytes_view
from .levels import CheckpointInfo, DataFileWriter, LevelDirectory

SpanCallback = Callable[[str, float, float], None]
"""`record_span(kind, start_s, end_s)`: where an engine reports its timed work (e.g. a `SpanRecorder.add`)."""


class CheckpointEngineFailed(RuntimeError):
    """Background checkpoint work failed; the original exception is the `__cause__`."""


@dataclass(frozen=True, kw_only=True)
class CheckpointStats:
    """Counters of one engine since it was built (a copy; later saves do not change it)."""

    num_saves: int
    total_blocked_s: float
    blocked_s_per_save: tuple[float, ...]
    """Training time blocked per save: the save() call plus the waits that followed it."""
    bytes_written_per_level: dict[str, int]
    flush_s_per_level: dict[str, float]
    """Busy time writing, fsync'ing and committing at each level (not time spent idle)."""
    num_committed_per_level: dict[str, int]
    commit_lag_s_per_level: dict[str, tuple[float, ...]]
    """Per committed checkpoint: from save() to durable at that level (L in reference §6)."""
    snapshot_s_total: float


@dataclass(kw_only=True)
class _Counters:
    level_names: tuple[str, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)
    blocked_s_per_save: list[float] = field(default_factory=list)
    extra_blocked_s: float = 0.0  # waits before the first save
    bytes_written: dict[str, int] = field(default_factory=dict)
    flush_s: dict[str, float] = field(default_factory=dict)
    commit_lag_s: dict[str, list[float]] = field(default_factory=dict)
    snapshot_s_total: float = 0.0

    def __post_init__(self) -> None:
        for name in self.level_names:
            self.bytes_written[name] = 0
            self.flush_s[name] = 0.0
            self.commit_lag_s[name] = []

    def add_blocked(self, seconds: float, *, new_save: bool) -> None:
        with self.lock:
            if new_save:
                self.blocked_s_per_save.append(seconds)
            elif self.blocked_s_per_save:
                self.blocked_s_per_save[-1] += seconds
            else:
                self.extra_blocked_s += seconds

    def add_flush(self, level: str, *, nbytes: int, busy_s: float) -> None:
        with self.lock:
            self.bytes_written[level] += nbytes
            self.flush_s[level] += busy_s

    def add_commit(self, level: str, lag_s: float) -> None:
        with self.lock:
            self.commit_lag_s[level].append(lag_s)

    def add_snapshot(self, seconds: float) -> None:
        with self.lock:
            self.snapshot_s_total += seconds

    def freeze(self) -> CheckpointStats:
        with self.lock:
            return CheckpointStats(
                num_saves=len(self.blocked_s_per_save),
                total_blocked_s=sum(self.blocked_s_per_save) + self.extra_blocked_s,
                blocked_s_per_save=tuple(self.blocked_s_per_save),
                bytes_written_per_level=dict(self.bytes_written),
                flush_s_per_level=dict(self.flush_s),
                num_committed_per_level={k: len(v) for k, v in self.commit_lag_s.items()},
                commit_lag_s_per_level={k: tuple(v) for k, v in self.commit_lag_s.items()},
                snapshot_s_total=self.snapshot_s_total,
            )


class CheckpointEngine(abc.ABC):
    """Saves and restores one process's state; levels are ordered fastest first."""

    def __init__(self, levels: list[LevelDirectory], record_span: SpanCallback | None) -> None:
        names = [level.name for level in levels]
        assert len(set(names)) == len(names), "level names are unique"
        self._levels = levels
        self._record_span = record_span
        self.read_bytes_per_s: dict[str, float] = {}
        """Level name -> bandwidth its loads are paced to (emulates a slow path); unlisted: unpaced."""
        self._counters = _Counters(level_names=tuple(names))
        self._sequence_lock = threading.Lock()
        self._last_sequence = 0
        # Hashes large pieces while they are written; its thread starts at the first such piece.
        self._hash_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")

    # --- the interface -------------------------------------------------------------------------

    @abc.abstractmethod
    def save(self, state: dict[str, torch.Tensor | Any], iteration: int) -> None:
        """Checkpoint `state` as it is now (values at this call, even if mutated after the wait)."""

    @abc.abstractmethod
    def wait_before_optimizer_step(self) -> float:
        """Block until saved tensors may be mutated in place; return the seconds blocked."""

    @abc.abstractmethod
    def wait_until_durable(self) -> None:
        """Block until every save so far is committed at every level."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish background work and release resources; the engine cannot save afterwards."""

    def mark_boundary(self) -> None:
        """An iteration boundary passed: a node that fails before the next one dies here, and a
        background save that lands after this instant lands too late (`lose_node_local_levels`).
        Nothing is in flight after a synchronous save returns."""

    def lose_node_local_levels(self) -> None:
        """Simulate node loss: every level that does not survive it is deleted and forgotten."""
        for level in self._levels:
            if not level.survives_node_loss:
                level.wipe()

    # --- shared behaviour ----------------------------------------------------------------------

    @property
    def level_names(self) -> tuple[str, ...]:
        """Level names, fastest first."""
        return tuple(level.name for level in self._levels)

    def _level(self, name: str) -> LevelDirectory:
        for level in self._levels:
            if level.name == name:
                return level
        raise InputError(f"checkpoint level '{name}' does not exist; use one of {self.level_names}")

    def _before_read(self) -> None:
        """Hook: the async engine surfaces background errors here."""

    @property
    def run_id(self) -> str:
        """The run this engine's checkpoints are bound to."""
        return self._levels[0].run_id

    @property
    def stage(self) -> int:
        """The stage (shard) this engine's checkpoints are bound to."""
        return self._levels[0].stage

    def _levels_to_read(self, level: str | None, surviving_node_loss: bool) -> list[LevelDirectory]:
        levels = self._levels if level is None else [self._level(level)]
        return [each for each in levels if each.survives_node_loss or not surviving_node_loss]

    def latest_durable(
        self, level: str | None = None, *, surviving_node_loss: bool = False
    ) -> CheckpointInfo | None:
        """Newest intact checkpoint at `level`, or at any level (fastest wins ties).

        `surviving_node_loss=True` reads only levels that survive the loss of this node.
        """
        infos = self.list_durable(level, surviving_node_loss=surviving_node_loss)
        return max(infos, key=lambda info: (info.sequence, -self.level_names.index(info.level)),
                   default=None)

    def list_durable(
        self, level: str | None = None, *, surviving_node_loss: bool = False
    ) -> list[CheckpointInfo]:
        """Every intact committed checkpoint of this run and stage at `level` (or all levels), oldest first.

        Found by scanning manifests (a lost `latest` hides nothing); damaged or foreign files are
        skipped, see `skipped()`. `surviving_node_loss=True` reads only levels that survive node loss.
        """
        self._before_read()
        levels = self._levels_to_read(level, surviving_node_loss)
        infos = [info for each in levels for info in each.checkpoints()]
        return sorted(infos, key=lambda info: (info.sequence, self.level_names.index(info.level)))

    def skipped(self, level: str | None = None, *, surviving_node_loss: bool = False) -> list[str]:
        """One line per checkpoint file the listings skip: damaged, foreign, or without a manifest."""
        return [line for each in self._levels_to_read(level, surviving_node_loss) for line in each.scan()[1]]

    def load(self, info: CheckpointInfo) -> dict[str, Any]:
        """The saved state (tensors on the CPU, metadata decoded), every field and checksum verified.

        `info` is re-read from its manifest, which must be at one of this engine's levels and
        belong to this engine's run and stage. Raises CheckpointCorruptError naming the file and the
        field when anything does not match.
        """
        self._before_read()
        start_s = time.perf_counter()
        level = self._level(info.level)
        if info.manifest_path.parent.resolve() != level.path.resolve():
            raise CheckpointCorruptError(
                f"{info.manifest_path}: not in level '{level.name}' ({level.path}) of this engine;"
                " load checkpoints this engine listed"
            )
        verified = level.verify(info.manifest_path)
        # The header is checked against the manifest again as it is read: a file swapped in since
        # verify() cannot slip through.
        _, state = read_data_file(verified.data_path, header_sha256=verified.header_sha256)
        rate = self.read_bytes_per_s.get(level.name)
        if rate is not None:
            time.sleep(max(0.0, verified.file_nbytes / rate - (time.perf_counter() - start_s)))
        self._span("load", start_s, time.perf_counter())
        return state

    def stats(self) -> CheckpointStats:
        return self._counters.freeze()

    def register_optimizer_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call wait_before_optimizer_step() before every optimizer.step(); returns the handle."""

        def wait_hook(*_args: Any, **_kwargs: Any) -> None:
            self.wait_before_optimizer_step()  # a pre-hook must return None

        return optimizer.register_step_pre_hook(wait_hook)

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _span(self, kind: str, start_s: float, end_s: float) -> None:
        if self._record_span is not None:
            self._record_span(kind, start_s, end_s)

    def _next_sequence(self) -> int:
        # Wall-clock nanoseconds so that a new engine on the same directories keeps ordering
        # after an old one; forced strictly increasing within this engine.
        with self._sequence_lock:
            self._last_sequence = max(self._last_sequence + 1, time.time_ns())
            return self._last_sequence


def check_binding_arguments(run_id: Any, stage: Any) -> None:
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200:
        raise InputError(f"checkpoint run_id = {run_id!r}; use a non-empty string of at most 200 characters")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise InputError(f"checkpoint stage = {stage!r}; use an int >= 0")


def check_state(state: Any, iteration: Any) -> None:
    if not isinstance(state, dict):
        raise InputError(f"checkpoint state is a {type(state).__name__}; pass a dict")
    if not isinstance(iteration, int) or iteration < 0:
        raise InputError(f"checkpoint iteration = {iteration!r}; use an int >= 0")


class SynchronousCheckpointEngine(CheckpointEngine):
    """Blocking checkpoints: serialise and write durably inside save() (DeepSpeed-style baseline)."""

    def __init__(
        self,
        directory: Path | str,
        *,
        level: str = "storage",
        survives_node_loss: bool = True,
        keep_last: int = 2,
        record_span: SpanCallback | None = None,
        run_id: str = DEFAULT_RUN_ID,
        stage: int = 0,
        throttle_bytes_per_s: float | None = None,
        binding_key: bytes | None = None,
    ) -> None:
        """`throttle_bytes_per_s`: writes and loads at this level take at least size / rate (a slow path).
        `binding_key`: the run's checkpoint key; manifests carry its HMAC and need it to load (manifest.py)."""
        if keep_last < 1:
            raise InputError(f"keep_last = {keep_last}; use 1 or more")
        if throttle_bytes_per_s is not None and not throttle_bytes_per_s > 0:
            raise InputError(f"throttle_bytes_per_s = {throttle_bytes_per_s}; use a positive rate or None")
        check_binding_arguments(run_id, stage)
        self._throttle_bytes_per_s = throttle_bytes_per_s
        storage = LevelDirectory(
            directory, name=level, survives_node_loss=survives_node_loss, keep_last=keep_last,
            run_id=run_id, stage=stage, binding_key=binding_key,
        )
        super().__init__([storage], record_span)
        self._storage = storage
        self._closed = False
        if throttle_bytes_per_s is not None:
            self.read_bytes_per_s[level] = throttle_bytes_per_s

    def save(self, state: dict[str, torch.Tensor | Any], iteration: int) -> None:
        if self._closed:
            raise InputError("save() on a closed checkpoint engine; build a new engine")
        check_state(state, iteration)
        start_s = time.perf_counter()
        tensors, metadata_bytes = split_state(state)
        sequence = self._next_sequence()
        layout = plan_layout(iteration, tensors, len(metadata_bytes), run_id=self.run_id,
                             stage=self.stage)
        stem = self._storage.stem(iteration, sequence)
        writer = DataFileWriter(self._storage.path, stem, layout, self._hash_executor)
        try:
            for entry in layout.tensors:
                data = tensor_bytes_view(tensors[entry.key])
                if data.device.type != "cpu":
                    data = data.cpu()  # blocking device → host copy: this is the baseline's cost
                if entry.nbytes:
                    writer.write_piece(entry.key, 0, data.numpy())
            header = writer.commit(metadata_bytes)
            if self._throttle_bytes_per_s is not None:  # the slow path: training stays blocked meanwhile
                time.sleep(max(0.0, layout.file_nbytes / self._throttle_bytes_per_s - (time.perf_counter() - start_s)))
        except BaseException:
            writer.abort()
            raise
        self._storage.commit(
            stem=stem, iteration=iteration, sequence=sequence, header=header,
            file_nbytes=layout.file_nbytes,
        )
        end_s = time.perf_counter()
        self._counters.add_flush(self._storage.name, nbytes=writer.bytes_written,
                                 busy_s=end_s - start_s)
        self._counters.add_commit(self._storage.name, end_s - start_s)
        self._counters.add_blocked(end_s - start_s, new_save=True)
        self._span("flush", start_s, end_s)
        self._span("save", start_s, end_s)

    def wait_before_optimizer_step(self) -> float:
        self._counters.add_blocked(0.0, new_save=False)
        return 0.0

    def wait_until_durable(self) -> None:
        """Nothing to wait for: save() returns only once the checkpoint is durable."""

    def close(self) -> None:
        self._closed = True
        self._hash_executor.shutdown()
