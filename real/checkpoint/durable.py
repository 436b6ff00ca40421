"""Durable-write primitives of both engines: whole writes, fsync, temp file + atomic rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Pieces for pwrite/readinto: large enough to keep syscalls cheap, small enough that hashing and
# writing release the GIL often (reference §7: 16-64 MiB chunks).
IO_PIECE_BYTES = 64 * 1024 * 1024


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write a whole buffer at `offset`, resubmitting short writes, in pieces of IO_PIECE_BYTES."""
    view = memoryview(data).cast("B")
    written = 0
    while written < len(view):
        end = min(len(view), written + IO_PIECE_BYTES)
        written += os.pwrite(fd, view[written:end], offset + written)


def fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (POSIX needs the directory itself fsync'ed)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable_temporary(path: Path, data: bytes) -> Path:
    """Write `data` to a temp file beside `path` and fsync it; the caller renames it into place."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return temporary


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """temp file → write → fsync → atomic rename → fsync directory."""
    os.replace(write_durable_temporary(path, data), path)
    fsync_directory(path.parent)
