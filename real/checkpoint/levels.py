"""One storage level (a directory): streaming crash-consistent writes, manifests, `latest`, keep-N.

Commit protocol of one checkpoint at one level (reference §7, crash consistency), with one
directory fsync between each rename and the next one that depends on it:
data to `<stem>.ckpt.<pid>.tmp` → fsync → rename to `<stem>.ckpt`; manifest to its temp file →
fsync; fsync directory (the data file's name is durable) → rename the manifest; `latest` to its
temp file → fsync; fsync directory (the manifest is durable) → rename `latest`; then, only if
something is beyond keep-N: fsync directory (the new `latest` is durable before what it replaced can
go) → delete manifests → delete their data files (a manifest is never left without its data). A
deletion is made durable by the next commit's first directory fsync: a crash before it brings back a
complete older checkpoint, which the next purge removes. A crash at any point leaves `latest` naming
a complete, checksummed checkpoint (or no `latest` at all). Leftover temp files are deleted when a
level is opened; one engine owns a directory.

Reading never trusts `latest` (a hint for people and tools): the newest checkpoint is found by
scanning the manifests, each checked against its data file and against this level's run and stage
(manifest.py). A damaged, foreign or half-deleted checkpoint is skipped and reported
(`LevelDirectory.scan`), so a lost `latest` hides nothing and a broken old manifest blocks nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from .durable import IO_PIECE_BYTES, fsync_directory, pwrite_all, write_durable_temporary
from .format import DEFAULT_RUN_ID, CheckpointCorruptError, Layout, encode_header
from .manifest import (
    DATA_SUFFIX,
    MANIFEST_SUFFIX,
    CheckpointInfo,
    check_binding,
    manifest_bytes,
    read_manifest,
    stem_for,
    verify_data_file,
)

LATEST_FILE = "latest"
_MANIFEST_SUFFIX = MANIFEST_SUFFIX
_DATA_SUFFIX = DATA_SUFFIX


# A piece at least this large is hashed on the engine's hash thread while this thread writes it
# (SHA-256, ~1.8 GB/s per core, is as slow as the disk); smaller ones are hashed inline, where a
# hand-off to another thread would cost more than the hash.
HASH_OFFLOAD_MIN_BYTES = 4 * 1024 * 1024


class DataFileWriter:
    """Streams one data file into a temp file; `commit()` makes it durable under its final name.

    `hash_executor` (one worker, owned by the engine) hashes large pieces concurrently with writes.
    """

    def __init__(self, directory: Path, stem: str, layout: Layout,
                 hash_executor: Executor | None = None) -> None:
        self.final_path = directory / f"{stem}{_DATA_SUFFIX}"
        self.temporary_path = directory / f"{stem}{_DATA_SUFFIX}.{os.getpid()}.tmp"
        self._layout = layout
        self._hashers = {entry.key: hashlib.sha256() for entry in layout.tensors}
        self._offsets = {entry.key: entry.offset for entry in layout.tensors}
        self._fd: int | None = os.open(
            self.temporary_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
        )
        self._hash_executor = hash_executor
        self._pending_hashes: list[Future[None]] = []
        self.bytes_written = 0

    def write_piece(self, key: str, offset_in_tensor: int, data: Any) -> None:
        """Write bytes of tensor `key` that start `offset_in_tensor` bytes into it (in order).

        `data` must stay unchanged until the next `sync()` or `commit()` returns.
        """
        nbytes = memoryview(data).nbytes
        self.write_span(self._offsets[key] + offset_in_tensor, data, ((key, 0, nbytes),))

    def write_span(self, file_offset: int, data: Any,
                   pieces: Sequence[tuple[str, int, int]]) -> None:
        """Write `data` at `file_offset` with one pwrite; `pieces` = (key, start in data, nbytes).

        Each piece is the next bytes of its tensor (pieces of a tensor arrive in order); bytes of
        `data` outside every piece are the file's zero padding. `data` must stay unchanged until
        the next `sync()` or `commit()` returns.
        """
        assert self._fd is not None
        view = memoryview(data).cast("B")
        # Once one piece went to the hash thread, later ones follow it there: a tensor's updates
        # must stay in order.
        if self._hash_executor is not None and (
            len(view) >= HASH_OFFLOAD_MIN_BYTES or self._pending_hashes
        ):
            self._pending_hashes.append(self._hash_executor.submit(self._hash, view, pieces))
        else:
            self._hash(view, pieces)
        pwrite_all(self._fd, view, file_offset)
        self.bytes_written += len(view)

    def _hash(self, view: memoryview, pieces: Sequence[tuple[str, int, int]]) -> None:
        for key, start, nbytes in pieces:
            self._hashers[key].update(view[start : start + nbytes])

    def _finish_hashing(self) -> None:
        for pending in self._pending_hashes:
            pending.result()
        self._pending_hashes.clear()

    def sync(self) -> None:
        """fsync what was written so far; the buffers passed to write_piece may then be reused."""
        assert self._fd is not None
        self._finish_hashing()
        os.fsync(self._fd)

    def commit(self, metadata_bytes: bytes) -> bytes:
        """Write metadata and header, fsync, rename; return the header bytes.

        The rename is made durable by the directory fsync in `LevelDirectory.commit`, which comes
        before the manifest that names this file is renamed into place.
        """
        assert self._fd is not None
        self._finish_hashing()
        pwrite_all(self._fd, metadata_bytes, self._layout.metadata_offset)
        header = encode_header(
            self._layout,
            {key: hasher.hexdigest() for key, hasher in self._hashers.items()},
            hashlib.sha256(metadata_bytes).hexdigest(),
        )
        pwrite_all(self._fd, header, 0)
        # Zero-padding after the last tensor may be a hole: fix the length explicitly.
        os.ftruncate(self._fd, self._layout.file_nbytes)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        self.bytes_written += len(metadata_bytes) + len(header)
        os.replace(self.temporary_path, self.final_path)
        return header

    def abort(self) -> None:
        """Close and delete the temp file (after an error or a simulated node loss)."""
        for pending in self._pending_hashes:
            pending.cancel()
        for pending in self._pending_hashes:
            if not pending.cancelled():
                pending.exception()  # wait: the hash thread may still read the caller's buffer
        self._pending_hashes.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.temporary_path.unlink(missing_ok=True)


class LevelDirectory:
    """A directory holding the checkpoints of one engine (one run, one stage) at one storage level."""

    def __init__(
        self, path: Path | str, *, name: str, survives_node_loss: bool, keep_last: int,
        run_id: str = DEFAULT_RUN_ID, stage: int = 0, binding_key: bytes | None = None,
    ) -> None:
        self.path = Path(path)
        self.binding_key = binding_key
        """The run's checkpoint key (manifest.py): written into every manifest, required of every one read."""
        self.name = name
        self.survives_node_loss = survives_node_loss
        self.keep_last = keep_last
        self.run_id = run_id
        self.stage = stage
        self.path.mkdir(parents=True, exist_ok=True)
        self.remove_temporary_files()
        self._committed: list[CheckpointInfo] | None = None  # known committed checkpoints

    def stem(self, iteration: int, sequence: int) -> str:
        return stem_for(iteration, sequence)

    def data_path(self, stem: str) -> Path:
        return self.path / f"{stem}{_DATA_SUFFIX}"

    def manifest_path(self, stem: str) -> Path:
        return self.path / f"{stem}{_MANIFEST_SUFFIX}"

    def remove_temporary_files(self) -> None:
        """Remove the temp files of writers that are gone. A live process's write in progress is left
        alone: under hard failures a redundant host writes a lost stage's checkpoints while that
        stage's replacement starts and opens the same directory."""
        for leftover in self.path.glob("*.tmp"):
            if not _writer_alive(leftover):
                leftover.unlink(missing_ok=True)

    def commit(self, *, stem: str, iteration: int, sequence: int, header: bytes,
               file_nbytes: int, protected_stems: frozenset[str] = frozenset()) -> CheckpointInfo:
        """Write the manifest, move `latest`, purge beyond keep-N.

        The data file must be fsync'ed and renamed to its final name; the first directory fsync
        here makes that rename durable before the manifest appears.
        """
        manifest_path = self.manifest_path(stem)
        manifest_temporary = write_durable_temporary(manifest_path, manifest_bytes(
            run_id=self.run_id, stage=self.stage, iteration=iteration, sequence=sequence,
            data_file_nbytes=file_nbytes, header=header, committed_unix_s=time.time(),
            binding_key=self.binding_key,
        ))
        fsync_directory(self.path)
        os.replace(manifest_temporary, manifest_path)
        self._point_latest_at(manifest_path, iteration, sequence)
        info = CheckpointInfo(
            iteration=iteration, level=self.name, sequence=sequence, manifest_path=manifest_path,
            data_path=self.data_path(stem), file_nbytes=file_nbytes, run_id=self.run_id,
            stage=self.stage, header_sha256=hashlib.sha256(header).hexdigest(),
        )
        if self._committed is not None:
            self._committed.append(info)
        self.purge(protected_stems | {stem})
        return info

    def _point_latest_at(self, manifest_path: Path, iteration: int, sequence: int) -> None:
        latest_path = self.path / LATEST_FILE
        latest = {"manifest": manifest_path.name, "iteration": iteration, "sequence": sequence}
        latest_temporary = write_durable_temporary(latest_path, json.dumps(latest).encode())
        fsync_directory(self.path)
        os.replace(latest_temporary, latest_path)

    def discard(self, stems: frozenset[str]) -> None:
        """Delete the checkpoints of `stems` (manifest first, so none is ever half there) and point
        `latest` at the newest one left: saves that were in flight when their node died."""
        doomed = [path for stem in sorted(stems) if (path := self.manifest_path(stem)).exists()]
        for path in doomed:
            path.unlink(missing_ok=True)
        for stem in stems:  # also a data file renamed into place whose manifest never came
            self.data_path(stem).unlink(missing_ok=True)
        if not doomed:
            return
        if self._committed is not None:
            self._committed = [info for info in self._committed if info.manifest_path not in doomed]
        newest = self.latest()
        if newest is None:
            (self.path / LATEST_FILE).unlink(missing_ok=True)
            fsync_directory(self.path)
        else:
            self._point_latest_at(newest.manifest_path, newest.iteration, newest.sequence)

    def verify(self, manifest_path: Path) -> CheckpointInfo:
        """The checkpoint `manifest_path` commits, once manifest, binding and data file header check out.

        Raises CheckpointCorruptError naming the file and the field; the tensors' checksums are
        verified when the data are read.
        """
        info = read_manifest(manifest_path, level=self.name, binding_key=self.binding_key)
        check_binding(info, run_id=self.run_id, stage=self.stage)
        verify_data_file(info)
        return info

    def scan(self) -> tuple[list[CheckpointInfo], list[str]]:
        """(this run's and stage's intact checkpoints, oldest first; one line per file skipped)."""
        infos, skipped = [], []
        manifests = sorted(self.path.glob(f"*{_MANIFEST_SUFFIX}"))
        for path in manifests:
            try:
                infos.append(self.verify(path))
            except CheckpointCorruptError as error:
                if path.exists():  # a concurrent purge (manifest first, then data) is not damage
                    skipped.append(str(error))
        named = {path.name.removesuffix(_MANIFEST_SUFFIX) for path in manifests}
        for data_path in sorted(self.path.glob(f"*{_DATA_SUFFIX}")):
            stem = data_path.name.removesuffix(_DATA_SUFFIX)
            if stem not in named and not self.manifest_path(stem).exists():
                skipped.append(f"{data_path}: data file without a manifest (deleted manifest or"
                               " interrupted commit); ignored, delete it")
        return sorted(infos, key=lambda info: info.sequence), skipped

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every intact committed checkpoint of this run and stage at this level, oldest first."""
        return self.scan()[0]

    def latest(self) -> CheckpointInfo | None:
        """The newest intact checkpoint at this level (found by its manifest, not by `latest`)."""
        infos = self.checkpoints()
        return infos[-1] if infos else None

    def purge(self, protected_stems: frozenset[str]) -> list[CheckpointInfo]:
        """Delete all but the newest keep_last checkpoints (never a protected one, never a foreign one)."""
        if self._committed is None:
            # Scanned once; afterwards this engine's own commits keep the list (it owns the
            # directory), so a commit does not re-read every manifest.
            self._committed = self.checkpoints()
        self._committed.sort(key=lambda info: info.sequence)
        doomed = [
            info for info in self._committed[: max(0, len(self._committed) - self.keep_last)]
            if info.manifest_path.name.removesuffix(_MANIFEST_SUFFIX) not in protected_stems
        ]
        if not doomed:
            return []
        fsync_directory(self.path)  # the `latest` just renamed is durable before anything goes
        for info in doomed:
            info.manifest_path.unlink(missing_ok=True)
        for info in doomed:
            info.data_path.unlink(missing_ok=True)
        self._committed = [info for info in self._committed if info not in doomed]
        return doomed

    def wipe(self) -> None:
        """Forget everything at this level (its node died)."""
        self._committed = []
        for path in self.path.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)
        fsync_directory(self.path)


def copy_data_file(
    source: Path,
    target_directory: Path,
    should_stop: Callable[[], bool],
    pace: Callable[[int, float], None] | None = None,
) -> tuple[Path, int]:
    """Copy a committed data file to `target_directory`: temp file, fsync, rename.

    The rename is made durable by the directory fsync of `LevelDirectory.commit`. The bytes move
    inside the kernel (copy_file_range) when it can, else through a buffer. `should_stop()` is
    polled between pieces; when it turns true the temp file is deleted and InterruptedError is
    raised (a simulated node loss mid-copy). `pace(nbytes, seconds)` is called after each piece
    (bandwidth emulation).
    """
    final_path = target_directory / source.name
    temporary = target_directory / f"{source.name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    copied = 0
    try:
        with open(source, "rb", buffering=0) as reader:
            source_nbytes = os.fstat(reader.fileno()).st_size
            buffer: bytearray | None = None
            while True:
                if should_stop():  # also after the last piece: its pace may end in a node loss
                    raise InterruptedError(f"copy of {source.name} interrupted")
                if copied == source_nbytes:
                    break
                piece_start_s = time.perf_counter()
                want = min(IO_PIECE_BYTES, source_nbytes - copied)
                count = 0
                if buffer is None:
                    try:
                        count = os.copy_file_range(reader.fileno(), fd, want, copied, copied)
                    except OSError:  # not supported between these file systems: copy through us
                        buffer = bytearray(min(IO_PIECE_BYTES, source_nbytes))
                if buffer is not None:
                    count = os.preadv(reader.fileno(), [memoryview(buffer)[:want]], copied)
                    pwrite_all(fd, memoryview(buffer)[:count], copied)
                if not count:
                    raise CheckpointCorruptError(
                        f"{source}: shrank while being copied; delete it or load another level"
                    )
                copied += count
                if pace is not None:
                    pace(count, time.perf_counter() - piece_start_s)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(temporary, final_path)
    return final_path, copied


def _writer_alive(temporary: Path) -> bool:
    """Whether another process that is still running owns `temporary` (`<name>.<pid>.tmp`)."""
    try:
        pid = int(temporary.name.rsplit(".", 2)[-2])
    except (ValueError, IndexError):
        return False
    if pid == os.getpid():
        return False  # our own leftover: nothing of ours is in flight while we clean up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
