"""Manifests: the small JSON file that makes one checkpoint exist at one level, and binds it.

    <stem>.manifest.json, stem = iter<iteration:010d>-<sequence:020d>:
    {"format": "churnsim-checkpoint-manifest", "format_version": 2, "run_id": "...", "stage": s,
     "iteration": i, "sequence": q, "data_file": "<stem>.ckpt", "data_file_nbytes": n,
     "header_sha256": hex, "committed_unix_s": t, ["binding_hmac": hex,] "manifest_sha256": hex}

A manifest is renamed into place only after its data file is durable, so a manifest means a
complete checkpoint. It binds the data file (its size, and its header's SHA-256; the header holds
every tensor's and the metadata's SHA-256) to a run, a stage and an iteration, and it checks itself
(`manifest_sha256` over the other fields, canonical JSON), so any damage to any part of a
checkpoint is found: `read_manifest` checks the manifest (fields, types, self-checksum, file
names), `check_binding` its run and stage, `verify_data_file` the data file against it; the
tensors' checksums are verified when the data are read (`format.read_data_file`).

Checksums catch damage, not forgery: anyone can recompute them. An engine with a binding key (the
run's secret, run_secret.checkpoint_key; it lives in `<run dir>/run.secret`, outside the checkpoint
directories) writes `binding_hmac`, an HMAC-SHA256 over the other fields, which bind the header and
through it every tensor, and refuses any manifest whose HMAC it cannot verify: a checkpoint from
another run, or one rewritten with recomputed checksums, is not loaded. An engine without a key
(tests, tools) writes none and checks none.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .format import CheckpointCorruptError, read_header

MANIFEST_FORMAT = "churnsim-checkpoint-manifest"
MANIFEST_VERSION = 2
MANIFEST_SUFFIX = ".manifest.json"
DATA_SUFFIX = ".ckpt"
_MAX_CLOCK_SKEW_NS = 24 * 3600 * 10**9
_FIELDS = {
    "format": str, "format_version": int, "run_id": str, "stage": int, "iteration": int,
    "sequence": int, "data_file": str, "data_file_nbytes": int, "header_sha256": str,
    "committed_unix_s": float, "manifest_sha256": str,
}


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
    run_id: str
    """The run that wrote it (bound in the manifest and the data file's header)."""
    stage: int
    """The pipeline stage (or shard) whose state it holds."""
    header_sha256: str


def stem_for(iteration: int, sequence: int) -> str:
    # The sequence makes a re-save of the same iteration (after a rollback) a distinct file.
    return f"iter{iteration:010d}-{sequence:020d}"


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def binding_hmac(key: bytes, fields: dict[str, Any]) -> str:
    """HMAC-SHA256 keyed by the run's secret over the manifest's fields (without the two checks)."""
    signed = {name: value for name, value in fields.items() if name not in ("binding_hmac", "manifest_sha256")}
    return hmac.new(key, _canonical(signed), hashlib.sha256).hexdigest()


def manifest_bytes(*, run_id: str, stage: int, iteration: int, sequence: int, data_file_nbytes: int,
                   header: bytes, committed_unix_s: float, binding_key: bytes | None = None) -> bytes:
    fields: dict[str, Any] = {
        "format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION, "run_id": run_id,
        "stage": stage, "iteration": iteration, "sequence": sequence,
        "data_file": stem_for(iteration, sequence) + DATA_SUFFIX, "data_file_nbytes": data_file_nbytes,
        "header_sha256": hashlib.sha256(header).hexdigest(), "committed_unix_s": committed_unix_s,
    }
    if binding_key is not None:
        fields["binding_hmac"] = binding_hmac(binding_key, fields)
    fields["manifest_sha256"] = hashlib.sha256(_canonical(fields)).hexdigest()
    return json.dumps(fields, indent=1).encode()


def _bad(path: Path, field: str, value: Any, expected: str) -> CheckpointCorruptError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return CheckpointCorruptError(
        f"{path}: manifest field '{field}' = {shown}, expected {expected}; the manifest is damaged"
        " or not churnsim's: delete it (and its data file) or load another checkpoint"
    )


def read_manifest(path: Path, *, level: str, binding_key: bytes | None = None) -> CheckpointInfo:
    """The checkpoint manifest `path` describes, every field checked (not yet its run, stage or data).

    `binding_key`: the manifest must carry a `binding_hmac` made with it (module docstring)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{path}: manifest is missing; this checkpoint was purged or lost, load another one"
        ) from None
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise CheckpointCorruptError(
            f"{path}: manifest is not valid JSON ({error}); delete it or load another checkpoint"
        ) from None
    if not isinstance(fields, dict):
        raise _bad(path, "(manifest)", fields, "a JSON object")
    if fields.get("format_version") == 1 and "format" not in fields:
        raise CheckpointCorruptError(
            f"{path}: manifest field 'format_version' = 1 belongs to checkpoints whose metadata was"
            " pickled, which churnsim no longer loads; re-create the checkpoint"
        )
    if set(fields) - {"binding_hmac"} != set(_FIELDS):
        raise _bad(path, "(keys)", sorted(fields), f"exactly {sorted(_FIELDS)}, and binding_hmac")
    if "binding_hmac" in fields and not isinstance(fields["binding_hmac"], str):
        raise _bad(path, "binding_hmac", fields["binding_hmac"], "a str")
    for name, kind in _FIELDS.items():
        value = fields[name]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if kind is float else (
            isinstance(value, kind) and not isinstance(value, bool))
        if not ok or (kind is int and value < 0):
            raise _bad(path, name, value, f"a {kind.__name__}" + (" >= 0" if kind is int else ""))
    if fields["format"] != MANIFEST_FORMAT:
        raise _bad(path, "format", fields["format"], repr(MANIFEST_FORMAT))
    if fields["format_version"] != MANIFEST_VERSION:
        raise _bad(path, "format_version", fields["format_version"], str(MANIFEST_VERSION))
    claimed = fields.pop("manifest_sha256")
    if hashlib.sha256(_canonical(fields)).hexdigest() != claimed:
        raise _bad(path, "manifest_sha256", claimed, "the SHA-256 of the other fields (a field was altered)")
    if binding_key is not None:
        claimed_hmac = fields.get("binding_hmac")
        if claimed_hmac is None or not hmac.compare_digest(str(claimed_hmac), binding_hmac(binding_key, fields)):
            raise CheckpointCorruptError(
                f"{path}: manifest field 'binding_hmac' does not verify with this run's secret "
                f"({'missing' if claimed_hmac is None else 'wrong'}): the checkpoint was written by another run or "
                "rewritten outside churnsim (checksums can be recomputed, this HMAC cannot); it is not loaded"
            )
    if fields["sequence"] > time.time_ns() + _MAX_CLOCK_SKEW_NS:  # newest-wins must not be gamed
        raise _bad(path, "sequence", fields["sequence"], "a save time (ns) not in the future")
    stem = stem_for(fields["iteration"], fields["sequence"])
    if path.name != stem + MANIFEST_SUFFIX:
        raise _bad(path, "iteration/sequence", (fields["iteration"], fields["sequence"]),
                   f"the ones in the file name {path.name} (manifests were renamed or swapped)")
    if fields["data_file"] != stem + DATA_SUFFIX:
        raise _bad(path, "data_file", fields["data_file"], repr(stem + DATA_SUFFIX))
    return CheckpointInfo(
        iteration=fields["iteration"], level=level, sequence=fields["sequence"], manifest_path=path,
        data_path=path.parent / fields["data_file"], file_nbytes=fields["data_file_nbytes"],
        run_id=fields["run_id"], stage=fields["stage"], header_sha256=fields["header_sha256"],
    )


def check_binding(info: CheckpointInfo, *, run_id: str, stage: int) -> None:
    """Refuse a checkpoint of another run or another stage."""
    if (info.run_id, info.stage) != (run_id, stage):
        raise CheckpointCorruptError(
            f"{info.manifest_path}: manifest fields 'run_id', 'stage' = {info.run_id!r}, {info.stage}"
            f" but this engine is run {run_id!r}, stage {stage}: the checkpoint belongs to another run"
            " or stage (swapped or planted); point the engine at its own directory"
        )


def verify_data_file(info: CheckpointInfo) -> dict[str, Any]:
    """The data file's checked header, once its size and header match the manifest."""
    try:
        size = info.data_path.stat().st_size
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{info.data_path}: data file named by {info.manifest_path.name} is missing;"
            " load another checkpoint"
        ) from None
    if size != info.file_nbytes:
        raise CheckpointCorruptError(
            f"{info.data_path}: size {size} bytes differs from the manifest's data_file_nbytes"
            f" {info.file_nbytes} (truncated or replaced); delete it or load another checkpoint"
        )
    header, header_bytes = read_header(info.data_path)
    if hashlib.sha256(header_bytes).hexdigest() != info.header_sha256:
        raise CheckpointCorruptError(
            f"{info.data_path}: header checksum differs from {info.manifest_path.name}'s header_sha256"
            " (damaged or swapped data file); delete it or load another checkpoint"
        )
    for name, expected in (("run_id", info.run_id), ("stage", info.stage), ("iteration", info.iteration)):
        if header[name] != expected:  # only a forged pair gets here: the checksum matched
            raise CheckpointCorruptError(
                f"{info.data_path}: header field '{name}' = {header[name]!r} differs from the manifest's"
                f" {expected!r}; delete both or load another checkpoint"
            )
    return header
