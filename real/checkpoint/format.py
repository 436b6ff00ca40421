"""The checkpoint file format and the durable-write primitives both engines share.

One file per save per level (`<stem>.ckpt`), laid out as:

    bytes 0..8     magic b"CHSIMCK1"
    bytes 8..16    header length H, unsigned 64-bit little endian
    bytes 16..16+H JSON header, padded with spaces to H bytes:
                   {"format": "churnsim-checkpoint", "format_version": 1, "iteration": i,
                    "byteorder": "little",
                    "tensors": {key: {"dtype": "float32", "shape": [..], "offset": o,
                                      "nbytes": n, "sha256": hex}},   # in the state dict's order
                    "metadata": {"encoding": "pickle", "offset": o, "nbytes": n, "sha256": hex}}
    then           each tensor's raw bytes (C-contiguous, native little-endian) at its offset,
                   offsets aligned to 64 bytes, zero padding between them
    then           the pickled non-tensor metadata at its offset

The header is reserved with placeholder checksums of the final length, so a streaming writer can
write the payload first (hashing as it goes) and the header last; the bytes depend only on the
state, never on which engine wrote them. A separate small manifest (`<stem>.manifest.json`) records
the data file's size and the header's SHA-256; it is written only after the data file is durable,
so a manifest on disk means a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from churnsim.calibration.errors import InputError

MAGIC = b"CHSIMCK1"
FORMAT_VERSION = 1
ALIGNMENT_BYTES = 64
_PREFIX_BYTES = len(MAGIC) + 8
_PLACEHOLDER_SHA256 = "0" * 64
# Pieces for pwrite/readinto: large enough to keep syscalls cheap, small enough that hashing and
# writing release the GIL often (reference §7: 16-64 MiB chunks).
IO_PIECE_BYTES = 64 * 1024 * 1024


class CheckpointCorruptError(InputError):
    """A checkpoint file on disk does not match its checksums or its manifest."""


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """Where one tensor lives in the data file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Offsets of every tensor and of the metadata in one data file."""

    iteration: int
    header_nbytes: int
    tensors: tuple[TensorEntry, ...]
    metadata_offset: int
    metadata_nbytes: int

    @property
    def file_nbytes(self) -> int:
        return self.metadata_offset + self.metadata_nbytes

    @property
    def payload_nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)


def _align(value: int) -> int:
    return -(-value // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def split_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """Tensors at the top level of `state`, and everything else pickled now (captured by value)."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise InputError(
                f"checkpoint state key {key!r} is a {type(key).__name__}; use str keys"
            )
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            metadata[key] = value
    try:
        metadata_bytes = pickle.dumps(metadata, protocol=4)
    except Exception as error:  # noqa: BLE001 - re-raised with the fix named
        raise InputError(
            f"checkpoint metadata is not picklable ({error}); keep non-tensor values small and plain"
        ) from error
    return tensors, metadata_bytes


def tensor_nbytes(tensor: torch.Tensor) -> int:
    # numel × element size of a contiguous copy, not the storage size (views share big storages).
    return tensor.numel() * tensor.element_size()


def _header_json(layout: Layout, tensor_sha256: dict[str, str], metadata_sha256: str) -> bytes:
    header = {
        "format": "churnsim-checkpoint",
        "format_version": FORMAT_VERSION,
        "iteration": layout.iteration,
        "byteorder": "little",
        "tensors": {
            entry.key: {
                "dtype": str(entry.dtype).removeprefix("torch."),
                "shape": list(entry.shape),
                "offset": entry.offset,
                "nbytes": entry.nbytes,
                "sha256": tensor_sha256.get(entry.key, _PLACEHOLDER_SHA256),
            }
            for entry in layout.tensors
        },
        "metadata": {
            "encoding": "pickle",
            "offset": layout.metadata_offset,
            "nbytes": layout.metadata_nbytes,
            "sha256": metadata_sha256,
        },
    }
    return json.dumps(header, separators=(",", ":")).encode()


# Layouts of recent state signatures: training saves the same shapes every time, and planning
# re-encodes the JSON header two or three times, on the training thread (save() of both engines).
_LAYOUT_CACHE: dict[tuple[Any, ...], Layout] = {}
_LAYOUT_CACHE_MAX_ENTRIES = 16


def plan_layout(
    iteration: int, tensors: dict[str, torch.Tensor], metadata_nbytes: int
) -> Layout:
    """Offsets for `tensors` (in dict order) and the metadata; deterministic in the state alone.

    The header's length depends on the iteration only through its number of decimal digits, so a
    layout planned for another iteration with as many digits, the same tensors (keys, dtypes,
    shapes) and the same metadata length is the same layout with the iteration replaced.
    """
    signature = tuple((key, t.dtype, tuple(t.shape)) for key, t in tensors.items())
    cache_key = (signature, len(str(iteration)), metadata_nbytes)
    cached = _LAYOUT_CACHE.get(cache_key)
    if cached is not None:
        return dataclasses.replace(cached, iteration=iteration)
    layout = _plan_layout_uncached(iteration, signature, metadata_nbytes)
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_MAX_ENTRIES:
        _LAYOUT_CACHE.pop(next(iter(_LAYOUT_CACHE)))  # oldest first: dicts keep insertion order
    _LAYOUT_CACHE[cache_key] = layout  # a race between threads only plans the same layout twice
    return layout


def _plan_layout_uncached(
    iteration: int, signature: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
    metadata_nbytes: int,
) -> Layout:
    entries_without_offsets = [
        TensorEntry(key=key, dtype=dtype, shape=shape, offset=0,
                    nbytes=math.prod(shape) * dtype.itemsize)
        for key, dtype, shape in signature
    ]
    # Offsets change the header's length, which changes the offsets: iterate to the fixed point
    # (two or three rounds, as the digits of the offsets settle).
    header_nbytes = 0
    while True:
        offset = _align(_PREFIX_BYTES + header_nbytes)
        entries = []
        for entry in entries_without_offsets:
            entries.append(
                TensorEntry(
                    key=entry.key, dtype=entry.dtype, shape=entry.shape, offset=offset,
                    nbytes=entry.nbytes,
                )
            )
            offset = _align(offset + entry.nbytes)
        layout = Layout(
            iteration=iteration, header_nbytes=header_nbytes, tensors=tuple(entries),
            metadata_offset=offset, metadata_nbytes=metadata_nbytes,
        )
        needed = len(_header_json(layout, {}, _PLACEHOLDER_SHA256))
        if needed <= header_nbytes:
            return layout
        header_nbytes = needed


def encode_header(layout: Layout, tensor_sha256: dict[str, str], metadata_sha256: str) -> bytes:
    """The file's first bytes (magic, length, padded JSON header) with the real checksums."""
    body = _header_json(layout, tensor_sha256, metadata_sha256)
    assert len(body) <= layout.header_nbytes, "checksums must not change the header length"
    body = body.ljust(layout.header_nbytes, b" ")
    return MAGIC + struct.pack("<Q", layout.header_nbytes) + body


def tensor_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `tensor`'s contiguous bytes (a copy only if it is not contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return flat.view(torch.uint8)


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


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """The parsed JSON header of data file `path` and the raw bytes it was parsed from."""
    with open(path, "rb") as file:
        prefix = file.read(_PREFIX_BYTES)
        if len(prefix) != _PREFIX_BYTES or prefix[:8] != MAGIC:
            raise CheckpointCorruptError(
                f"{path}: not a churnsim checkpoint (bad magic); delete it or load another level"
            )
        (header_nbytes,) = struct.unpack("<Q", prefix[8:])
        raw = file.read(header_nbytes)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise CheckpointCorruptError(
            f"{path}: header is not valid JSON ({error}); delete it or load another level"
        ) from error
    return header, prefix + raw


def _read_exact(file: Any, path: Path, offset: int, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    file.seek(offset)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        count = file.readinto(view[done : min(nbytes, done + IO_PIECE_BYTES)])
        if not count:
            raise CheckpointCorruptError(
                f"{path}: truncated at byte {offset + done}; delete it or load another level"
            )
        done += count
    return buffer


def read_data_file(path: Path) -> tuple[int, dict[str, Any]]:
    """(iteration, state) from data file `path`, every checksum verified; tensors on the CPU."""
    header, _ = read_header(path)
    state: dict[str, Any] = {}
    with open(path, "rb") as file:
        for key, entry in header["tensors"].items():
            buffer = _read_exact(file, path, entry["offset"], entry["nbytes"])
            actual = hashlib.sha256(buffer).hexdigest()
            if actual != entry["sha256"]:
                raise CheckpointCorruptError(
                    f"{path}: checksum mismatch for tensor '{key}' (expected {entry['sha256'][:12]}…,"
                    f" got {actual[:12]}…); delete it or load another level"
                )
            dtype = getattr(torch, entry["dtype"])
            shape = tuple(entry["shape"])
            if entry["nbytes"] == 0:
                state[key] = torch.empty(shape, dtype=dtype)
            else:
                state[key] = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
        meta = header["metadata"]
        meta_bytes = _read_exact(file, path, meta["offset"], meta["nbytes"])
    if hashlib.sha256(meta_bytes).hexdigest() != meta["sha256"]:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch for the metadata; delete it or load another level"
        )
    state.update(pickle.loads(meta_bytes))  # our own file, checksummed: trusted like torch.load
    return int(header["iteration"]), state
