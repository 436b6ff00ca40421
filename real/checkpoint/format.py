"""The checkpoint file format and the durable-write primitives both engines share.

One file per save per level (`<stem>.ckpt`), laid out as:

    bytes 0..8     magic b"CHSIMCK1"
    bytes 8..16    header length H, unsigned 64-bit little endian
    bytes 16..16+H JSON header, padded with spaces to H bytes:
                   {"format": "churnsim-checkpoint", "format_version": 2, "run_id": "...",
                    "stage": s, "iteration": i, "byteorder": "little",
                    "tensors": {key: {"dtype": "float32", "shape": [..], "offset": o,
                                      "nbytes": n, "sha256": hex}},   # in the state dict's order
                    "metadata": {"encoding": "json", "offset": o, "nbytes": n, "sha256": hex}}
    then           each tensor's raw bytes (C-contiguous, native little-endian) at its offset,
                   offsets aligned to 64 bytes, zero padding between them
    then           the non-tensor metadata as a JSON tree (real/safe_codec.py) at its offset

No pickle anywhere: reading a file can only produce tensors and plain data, so a planted file cannot
run code, and every field is checked (types, dtypes from torch's own list, offsets inside the file)
before any byte is trusted. Version 1 files (pickled metadata) are refused, not read.

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
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from churnsim.calibration.errors import InputError

from ..safe_codec import (
    SafeCodecError,
    check_tensor_entry,
    dtype_name,
    from_json_tree,
    json_bytes,
    parse_json,
    tensor_from_bytes,
    to_json_tree,
)
from .durable import IO_PIECE_BYTES

MAGIC = b"CHSIMCK1"
FORMAT_VERSION = 2
DEFAULT_RUN_ID = "unbound"
"""The run id of an engine built without one: it loads only checkpoints written without one."""
ALIGNMENT_BYTES = 64
_PREFIX_BYTES = len(MAGIC) + 8
_PLACEHOLDER_SHA256 = "0" * 64


class CheckpointCorruptError(InputError):
    """A checkpoint on disk is damaged (checksums, sizes, fields) or is not this run's and stage's."""


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
    run_id: str = DEFAULT_RUN_ID
    stage: int = 0

    @property
    def file_nbytes(self) -> int:
        return self.metadata_offset + self.metadata_nbytes

    @property
    def payload_nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)


def _align(value: int) -> int:
    return -(-value // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def split_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """Tensors at the top level of `state`, and everything else JSON-encoded now (captured by value)."""
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
        metadata_bytes = json_bytes(to_json_tree(metadata, where="checkpoint metadata"))
    except SafeCodecError as error:
        raise InputError(f"{error}; keep non-tensor values small and plain") from None
    return tensors, metadata_bytes


def tensor_nbytes(tensor: torch.Tensor) -> int:
    # numel × element size of a contiguous copy, not the storage size (views share big storages).
    return tensor.numel() * tensor.element_size()


def _header_json(layout: Layout, tensor_sha256: dict[str, str], metadata_sha256: str) -> bytes:
    header = {
        "format": "churnsim-checkpoint",
        "format_version": FORMAT_VERSION,
        "run_id": layout.run_id,
        "stage": layout.stage,
        "iteration": layout.iteration,
        "byteorder": "little",
        "tensors": {
            entry.key: {
                "dtype": dtype_name(entry.dtype),
                "shape": list(entry.shape),
                "offset": entry.offset,
                "nbytes": entry.nbytes,
                "sha256": tensor_sha256.get(entry.key, _PLACEHOLDER_SHA256),
            }
            for entry in layout.tensors
        },
        "metadata": {
            "encoding": "json",
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
    iteration: int, tensors: dict[str, torch.Tensor], metadata_nbytes: int, *,
    run_id: str = DEFAULT_RUN_ID, stage: int = 0,
) -> Layout:
    """Offsets for `tensors` (in dict order) and the metadata; deterministic in the state and binding.

    The header's length depends on the iteration only through its number of decimal digits, so a
    layout planned for another iteration with as many digits, the same tensors (keys, dtypes,
    shapes), binding and metadata length is the same layout with the iteration replaced.
    """
    signature = tuple((key, t.dtype, tuple(t.shape)) for key, t in tensors.items())
    cache_key = (signature, len(str(iteration)), run_id, stage, metadata_nbytes)
    cached = _LAYOUT_CACHE.get(cache_key)
    if cached is not None:
        return dataclasses.replace(cached, iteration=iteration)
    layout = _plan_layout_uncached(iteration, signature, metadata_nbytes, run_id=run_id, stage=stage)
    if len(_LAYOUT_CACHE) >= _LAYOUT_CACHE_MAX_ENTRIES:
        _LAYOUT_CACHE.pop(next(iter(_LAYOUT_CACHE)))  # oldest first: dicts keep insertion order
    _LAYOUT_CACHE[cache_key] = layout  # a race between threads only plans the same layout twice
    return layout


def _plan_layout_uncached(
    iteration: int, signature: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
    metadata_nbytes: int, *, run_id: str = DEFAULT_RUN_ID, stage: int = 0,
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
            metadata_offset=offset, metadata_nbytes=metadata_nbytes, run_id=run_id, stage=stage,
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


def read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """The checked JSON header of data file `path` and the raw bytes it was parsed from.

    Every field is validated against the file's size before anything else trusts it.
    """
    try:
        with open(path, "rb") as file:
            file_nbytes = os.fstat(file.fileno()).st_size
            prefix = file.read(_PREFIX_BYTES)
            if len(prefix) != _PREFIX_BYTES or prefix[:8] != MAGIC:
                raise CheckpointCorruptError(
                    f"{path}: not a churnsim checkpoint (bad magic); delete it or load another checkpoint"
                )
            (header_nbytes,) = struct.unpack("<Q", prefix[8:])
            if _PREFIX_BYTES + header_nbytes > file_nbytes:
                raise CheckpointCorruptError(
                    f"{path}: header length {header_nbytes} runs past the end of the file ({file_nbytes}"
                    " bytes): truncated or damaged; delete it or load another checkpoint"
                )
            raw = file.read(header_nbytes)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: data file is missing; load another checkpoint") from None
    try:
        header = parse_json(raw, "header")
    except SafeCodecError as error:
        raise CheckpointCorruptError(f"{path}: {error}; delete it or load another checkpoint") from None
    check_header(header, path, file_nbytes, payload_start=_PREFIX_BYTES + header_nbytes)
    return header, prefix + raw


def _field_error(path: Path, field: str, value: Any, expected: str) -> CheckpointCorruptError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return CheckpointCorruptError(
        f"{path}: header field '{field}' = {shown}, expected {expected}; the file is damaged or was not"
        " written by this churnsim: delete it or load another checkpoint"
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def check_header(header: Any, path: Path, file_nbytes: int, *, payload_start: int) -> None:
    """Raise CheckpointCorruptError naming the field unless `header` is a well-formed version-2 header
    whose tensors and metadata lie between `payload_start` (the header's end) and the file's end."""
    if not isinstance(header, dict):
        raise _field_error(path, "(header)", header, "a JSON object")
    if header.get("format") != "churnsim-checkpoint":
        raise _field_error(path, "format", header.get("format"), "'churnsim-checkpoint'")
    if header.get("format_version") != FORMAT_VERSION:
        version = header.get("format_version")
        if version == 1:
            raise CheckpointCorruptError(
                f"{path}: header field 'format_version' = 1: version 1 stored its metadata with pickle,"
                " which churnsim no longer loads (it could run code); re-create the checkpoint"
            )
        raise _field_error(path, "format_version", version, str(FORMAT_VERSION))
    expected_keys = {"format", "format_version", "run_id", "stage", "iteration", "byteorder",
                     "tensors", "metadata"}
    if set(header) != expected_keys:
        raise _field_error(path, "(keys)", sorted(header), f"exactly {sorted(expected_keys)}")
    if not isinstance(header["run_id"], str) or not header["run_id"]:
        raise _field_error(path, "run_id", header["run_id"], "a non-empty string")
    for name in ("stage", "iteration"):
        if not _is_count(header[name]):
            raise _field_error(path, name, header[name], "an integer >= 0")
    if header["byteorder"] != "little":
        raise _field_error(path, "byteorder", header["byteorder"], "'little'")
    tensors = header["tensors"]
    if not isinstance(tensors, dict):
        raise _field_error(path, "tensors", tensors, "an object of tensor entries")
    regions = []
    for key, entry in tensors.items():
        where = f"tensors.{key}"
        try:
            _, _, nbytes = check_tensor_entry(
                {k: v for k, v in entry.items() if k in ("dtype", "shape", "nbytes")}
                if isinstance(entry, dict) else entry, where)
        except SafeCodecError as error:
            raise CheckpointCorruptError(f"{path}: header {error}; delete it or load another checkpoint") from None
        if set(entry) != {"dtype", "shape", "offset", "nbytes", "sha256"}:
            raise _field_error(path, where, sorted(entry), "keys dtype, shape, offset, nbytes, sha256")
        if not _is_sha256(entry["sha256"]):
            raise _field_error(path, f"{where}.sha256", entry["sha256"], "64 hex digits")
        regions.append((where, entry["offset"], nbytes))
    metadata = header["metadata"]
    if not isinstance(metadata, dict) or set(metadata) != {"encoding", "offset", "nbytes", "sha256"}:
        raise _field_error(path, "metadata", metadata, "keys encoding, offset, nbytes, sha256")
    if metadata["encoding"] != "json":
        raise _field_error(path, "metadata.encoding", metadata["encoding"], "'json'")
    if not _is_sha256(metadata["sha256"]):
        raise _field_error(path, "metadata.sha256", metadata["sha256"], "64 hex digits")
    if not _is_count(metadata["nbytes"]):
        raise _field_error(path, "metadata.nbytes", metadata["nbytes"], "an integer >= 0")
    regions.append(("metadata", metadata["offset"], metadata["nbytes"]))
    for where, offset, nbytes in regions:
        if not _is_count(offset) or offset < payload_start or offset + nbytes > file_nbytes:
            raise _field_error(
                path, f"{where}.offset" if where != "metadata" else "metadata.offset", offset,
                f"an offset whose {nbytes} bytes lie inside the file ({file_nbytes} bytes)",
            )


def _read_exact(file: Any, path: Path, offset: int, nbytes: int) -> bytearray:
    buffer = bytearray(nbytes)
    file.seek(offset)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        count = file.readinto(view[done : min(nbytes, done + IO_PIECE_BYTES)])
        if not count:
            raise CheckpointCorruptError(
                f"{path}: truncated at byte {offset + done}; delete it or load another checkpoint"
            )
        done += count
    return buffer


def read_data_file(
    path: Path, *, header_sha256: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, state) from data file `path`, every field and checksum verified; tensors on the CPU.

    `header_sha256` (the manifest's) must match the header as read here, when given.
    """
    header, header_bytes = read_header(path)
    if header_sha256 is not None and hashlib.sha256(header_bytes).hexdigest() != header_sha256:
        raise CheckpointCorruptError(
            f"{path}: header checksum differs from its manifest's header_sha256 (replaced or damaged);"
            " load another checkpoint"
        )
    state: dict[str, Any] = {}
    with open(path, "rb") as file:
        for key, entry in header["tensors"].items():
            buffer = _read_exact(file, path, entry["offset"], entry["nbytes"])
            actual = hashlib.sha256(buffer).hexdigest()
            if actual != entry["sha256"]:
                raise CheckpointCorruptError(
                    f"{path}: checksum mismatch for tensor '{key}' (expected {entry['sha256'][:12]}…,"
                    f" got {actual[:12]}…); delete it or load another checkpoint"
                )
            dtype, shape, _ = check_tensor_entry(
                {k: entry[k] for k in ("dtype", "shape", "nbytes")}, f"tensors.{key}"
            )
            state[key] = tensor_from_bytes(buffer, dtype, shape)
        meta = header["metadata"]
        meta_bytes = _read_exact(file, path, meta["offset"], meta["nbytes"])
    if hashlib.sha256(meta_bytes).hexdigest() != meta["sha256"]:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch for the metadata; delete it or load another checkpoint"
        )
    try:
        metadata = from_json_tree(parse_json(meta_bytes, "metadata"), where="metadata")
    except SafeCodecError as error:
        raise CheckpointCorruptError(f"{path}: {error}; delete it or load another checkpoint") from None
    if not isinstance(metadata, dict) or set(metadata) & set(state):
        raise CheckpointCorruptError(
            f"{path}: metadata is not an object of keys distinct from the tensors'; delete it or load"
            " another checkpoint"
        )
    state.update(metadata)
    return header, state
