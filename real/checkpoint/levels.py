"""One storage level (a directory): streaming crash-consistent writes, manifests, `latest`, keep-N.

Commit protocol of one checkpoint at one level (reference §7, crash consistency):
data to `<stem>.ckpt.<pid>.tmp` → fsync → rename to `<stem>.ckpt` → fsync directory; then the
manifest the same way; then `latest` the same way; then purge checkpoints beyond keep-N (manifest
first, so a half-purged checkpoint is never taken for a complete one). A crash at any point leaves
`latest` naming a complete, checksummed checkpoint (or no `latest` at all). Leftover temp files are
deleted when a level is opened; one engine owns a directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .format import (
    IO_PIECE_BYTES,
    CheckpointCorruptError,
    Layout,
    atomic_write_bytes,
    encode_header,
    fsync_directory,
    pwrite_all,
    read_header,
)

LATEST_FILE = "latest"
_MANIFEST_SUFFIX = ".manifest.json"
_DATA_SUFFIX = ".ckpt"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A checkpoint that is durable at one level."""

    iteration: int
    level: str
    sequence: int
    """Save order (nanosecond clock at save(), strictly increasing per engine): newest = largest."""
    manifest_path: Path
    data_path: Path
    file_nbytes: int


class DataFileWriter:
    """Streams one data file into a temp file; `commit()` makes it durable under its final name."""

    def __init__(self, directory: Path, stem: str, layout: Layout) -> None:
        self.final_path = directory / f"{stem}{_DATA_SUFFIX}"
        self.temporary_path = directory / f"{stem}{_DATA_SUFFIX}.{os.getpid()}.tmp"
        self._layout = layout
        self._hashers = {entry.key: hashlib.sha256() for entry in layout.tensors}
        self._offsets = {entry.key: entry.offset for entry in layout.tensors}
        self._fd: int | None = os.open(
            self.temporary_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
        )
        # SHA-256 (~1.8 GB/s per core) is as slow as the disk: hash on a second thread while this
        # one writes (both release the GIL). One worker keeps each tensor's updates in order.
        self._hash_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
        self._pending_hashes: list[Future[None]] = []
        self.bytes_written = 0

    def write_piece(self, key: str, offset_in_tensor: int, data: Any) -> None:
        """Write bytes of tensor `key` that start `offset_in_tensor` bytes into it (in order).

        `data` must stay unchanged until the next `sync()` or `commit()` returns.
        """
        assert self._fd is not None
        self._pending_hashes.append(self._hash_executor.submit(self._hashers[key].update, data))
        pwrite_all(self._fd, data, self._offsets[key] + offset_in_tensor)
        self.bytes_written += memoryview(data).nbytes

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
        """Write metadata and header, fsync, rename, fsync the directory; return the header bytes."""
        assert self._fd is not None
        self._finish_hashing()
        self._hash_executor.shutdown()
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
        fsync_directory(self.final_path.parent)
        return header

    def abort(self) -> None:
        """Close and delete the temp file (after an error or a simulated node loss)."""
        self._hash_executor.shutdown(wait=True, cancel_futures=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.temporary_path.unlink(missing_ok=True)


class LevelDirectory:
    """A directory holding the checkpoints of one engine at one storage level."""

    def __init__(
        self, path: Path | str, *, name: str, survives_node_loss: bool, keep_last: int
    ) -> None:
        self.path = Path(path)
        self.name = name
        self.survives_node_loss = survives_node_loss
        self.keep_last = keep_last
        self.path.mkdir(parents=True, exist_ok=True)
        self.remove_temporary_files()

    def stem(self, iteration: int, sequence: int) -> str:
        # The sequence makes a re-save of the same iteration (after a rollback) a distinct file.
        return f"iter{iteration:010d}-{sequence:020d}"

    def data_path(self, stem: str) -> Path:
        return self.path / f"{stem}{_DATA_SUFFIX}"

    def manifest_path(self, stem: str) -> Path:
        return self.path / f"{stem}{_MANIFEST_SUFFIX}"

    def remove_temporary_files(self) -> None:
        for leftover in self.path.glob("*.tmp"):
            leftover.unlink(missing_ok=True)

    def commit(self, *, stem: str, iteration: int, sequence: int, header: bytes,
               file_nbytes: int, protected_stems: frozenset[str] = frozenset()) -> CheckpointInfo:
        """Write the manifest, move `latest`, purge beyond keep-N; the data file must be durable."""
        manifest = {
            "format_version": 1,
            "iteration": iteration,
            "sequence": sequence,
            "data_file": self.data_path(stem).name,
            "data_file_nbytes": file_nbytes,
            "header_sha256": hashlib.sha256(header).hexdigest(),
            "committed_unix_s": time.time(),
        }
        manifest_path = self.manifest_path(stem)
        atomic_write_bytes(manifest_path, json.dumps(manifest, indent=1).encode())
        latest = {"manifest": manifest_path.name, "iteration": iteration, "sequence": sequence}
        atomic_write_bytes(self.path / LATEST_FILE, json.dumps(latest).encode())
        self.purge(protected_stems | {stem})
        return self._info(manifest_path, manifest)

    def _info(self, manifest_path: Path, manifest: dict[str, Any]) -> CheckpointInfo:
        return CheckpointInfo(
            iteration=int(manifest["iteration"]), level=self.name,
            sequence=int(manifest["sequence"]), manifest_path=manifest_path,
            data_path=self.path / manifest["data_file"],
            file_nbytes=int(manifest["data_file_nbytes"]),
        )

    def read_manifest(self, manifest_path: Path) -> CheckpointInfo:
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CheckpointCorruptError(
                f"{manifest_path}: manifest is missing; this level's checkpoint was purged or lost"
            ) from None
        except ValueError as error:
            raise CheckpointCorruptError(
                f"{manifest_path}: manifest is not valid JSON ({error}); delete it"
            ) from error
        return self._info(manifest_path, manifest)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint `latest` names, or None when this level holds none."""
        for attempt in range(3):
            try:
                pointer = json.loads((self.path / LATEST_FILE).read_text())
            except FileNotFoundError:
                return None
            manifest_path = self.path / pointer["manifest"]
            # A concurrent commit may move `latest` and purge what we just read: read again.
            if manifest_path.exists() or attempt == 2:
                return self.read_manifest(manifest_path)
        raise AssertionError("unreachable")

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint at this level, oldest first."""
        infos = []
        for path in self.path.glob(f"*{_MANIFEST_SUFFIX}"):
            try:
                infos.append(self.read_manifest(path))
            except CheckpointCorruptError:
                if path.exists():  # a concurrent purge is not corruption; a bad manifest is
                    raise
        return sorted(infos, key=lambda info: info.sequence)

    def purge(self, protected_stems: frozenset[str]) -> list[CheckpointInfo]:
        """Delete all but the newest keep_last checkpoints (never a protected one)."""
        infos = self.checkpoints()
        removed = []
        for info in infos[: max(0, len(infos) - self.keep_last)]:
            if info.manifest_path.name.removesuffix(_MANIFEST_SUFFIX) in protected_stems:
                continue
            info.manifest_path.unlink(missing_ok=True)
            info.data_path.unlink(missing_ok=True)
            removed.append(info)
        if removed:
            fsync_directory(self.path)
        return removed

    def wipe(self) -> None:
        """Forget everything at this level (its node died)."""
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
    """Copy a committed data file to `target_directory` durably (temp, fsync, rename, fsync dir).

    `should_stop()` is polled between pieces; when it turns true the temp file is deleted and
    InterruptedError is raised (a simulated node loss mid-copy). `pace(nbytes, seconds)` is called
    after each piece (bandwidth emulation).
    """
    final_path = target_directory / source.name
    temporary = target_directory / f"{source.name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    copied = 0
    try:
        with open(source, "rb", buffering=0) as reader:
            buffer = bytearray(min(IO_PIECE_BYTES, max(1, source.stat().st_size)))
            while True:
                if should_stop():
                    raise InterruptedError(f"copy of {source.name} interrupted")
                count = reader.readinto(buffer)
                if not count:
                    break
                piece_start_s = time.perf_counter()
                pwrite_all(fd, memoryview(buffer)[:count], copied)
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
    fsync_directory(target_directory)
    return final_path, copied


def verify_against_manifest(info: CheckpointInfo) -> None:
    """Raise CheckpointCorruptError naming the file unless size and header match the manifest."""
    if not info.data_path.exists():
        raise CheckpointCorruptError(
            f"{info.data_path}: data file named by {info.manifest_path.name} is missing;"
            " load another level"
        )
    size = info.data_path.stat().st_size
    if size != info.file_nbytes:
        raise CheckpointCorruptError(
            f"{info.data_path}: size {size} bytes differs from the manifest's {info.file_nbytes};"
            " delete it or load another level"
        )
    manifest = json.loads(info.manifest_path.read_text())
    _, header_bytes = read_header(info.data_path)
    if hashlib.sha256(header_bytes).hexdigest() != manifest["header_sha256"]:
        raise CheckpointCorruptError(
            f"{info.data_path}: header checksum differs from {info.manifest_path.name};"
            " delete it or load another level"
        )
