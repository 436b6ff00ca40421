"""Pickle-free encoding of what real runs store and exchange: a JSON tree plus raw tensor bytes.

`pickle.loads` runs whatever code its bytes name, so a planted checkpoint file, a results file or a
message from anyone who reaches a rank's port could run anything. The bytes read here can only
describe data: decoding builds nothing but the types below, and dataclasses only from an allow-list.

JSON tree (`to_json_tree` / `from_json_tree`):

    None, bool, int, float (NaN, ±inf as JSON's NaN, Infinity), str, list   themselves
    dict whose keys are all str, none starting with "$"                     a JSON object
    any other dict (int or tuple keys ...; order kept)                      {"$dict": [[key, value], ...]}
    tuple, set, frozenset                                                   {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}
    torch.Tensor (only where a tensor table is given)                       {"$tensor": index into the table}
    torch.dtype, pathlib.Path                                               {"$dtype": "float32"}, {"$path": "/a/b"}
    a dataclass on the allow-list (`register_dataclass`)                    {"$dataclass": "module.Name", "fields": {...}}

Message (`encode` / `decode`), e.g. a rank's result:

    b"CHSIMWR1" | u64 little-endian length J | J bytes of JSON
    {"value": tree, "tensors": [{"dtype": "float32", "shape": [..], "nbytes": n}, ...]} | tensor bytes, in table order

Tensors come back on the CPU, contiguous, with the same dtype, shape and bytes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import struct
from pathlib import Path, PurePath
from typing import Any

import torch

MAGIC = b"CHSIMWR1"
_PREFIX_BYTES = len(MAGIC) + 8
_TAGS = ("$dict", "$tuple", "$set", "$frozenset", "$tensor", "$dtype", "$path", "$dataclass")

DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values() if isinstance(value, torch.dtype)
}
"""Every dtype torch defines, by name ("float32", "bfloat16", ...): the only dtypes a file may name."""

# Dataclasses that may cross a process boundary, by "module.QualName"; resolved when first needed
# (importing these fixed modules of our own package is safe, the names come from this list only).
_ALLOWED_DATACLASS_NAMES = {
    "churnsim.real.trainer.RankResult",
    "churnsim.real.methods.base.RecoveryOutcome",
}
_REGISTERED: dict[str, type] = {}


class SafeCodecError(ValueError):
    """Bytes or a value the safe codec cannot encode or decode; the message names the part and the fix."""


def register_dataclass(cls: type) -> type:
    """Allow instances of dataclass `cls` to be encoded and decoded (usable as a class decorator)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass; only dataclasses can be registered")
    _REGISTERED[_qualified_name(cls)] = cls
    return cls


def dtype_from_name(name: Any, where: str = "dtype") -> torch.dtype:
    """The torch dtype called `name`; anything else (a function name, a typo) is refused."""
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise SafeCodecError(f"{where} = {name!r} is not a torch dtype; expected one of float32, bfloat16, int64, ...")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _dataclass_named(name: Any) -> type:
    if isinstance(name, str):
        if name in _REGISTERED:
            return _REGISTERED[name]
        if name in _ALLOWED_DATACLASS_NAMES:
            module_name, _, class_name = name.rpartition(".")
            cls = getattr(importlib.import_module(module_name), class_name)
            _REGISTERED[name] = cls
            return cls
    raise SafeCodecError(
        f"$dataclass = {name!r} is not on the allow-list; register the class with safe_codec.register_dataclass on both sides"
    )


# -- JSON trees ------------------------------------------------------------------------------------


def to_json_tree(value: Any, tensors: list[torch.Tensor] | None = None, *, where: str = "value") -> Any:
    """`value` as a JSON-encodable tree; tensors are appended to `tensors` (refused when it is None)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, list):
        return [to_json_tree(item, tensors, where=f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"$tuple": [to_json_tree(item, tensors, where=f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, (set, frozenset)):
        items = [to_json_tree(item, tensors, where=f"{where}{{}}") for item in value]
        return {"$frozenset" if isinstance(value, frozenset) else "$set": items}
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: to_json_tree(item, tensors, where=f"{where}[{key!r}]") for key, item in value.items()}
        return {
            "$dict": [
                [to_json_tree(key, tensors, where=f"{where} key"), to_json_tree(item, tensors, where=f"{where}[{key!r}]")]
                for key, item in value.items()
            ]
        }
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise SafeCodecError(f"{where} is a tensor inside a container; put tensors at the top level of the state")
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, PurePath):
        return {"$path": str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = _qualified_name(type(value))
        _dataclass_named(name)  # refuses what the other side would refuse
        fields = {
            field.name: to_json_tree(getattr(value, field.name), tensors, where=f"{where}.{field.name}")
            for field in dataclasses.fields(value)
            if field.init
        }
        return {"$dataclass": name, "fields": fields}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():
        return to_json_tree(value.item(), tensors, where=where)  # a numpy scalar
    raise SafeCodecError(
        f"{where} is a {type(value).__name__}, which is not encoded without pickle; use numbers, strings, lists, dicts, "
        "tensors or a registered dataclass"
    )


def from_json_tree(tree: Any, tensors: list[torch.Tensor] | None = None, *, where: str = "value") -> Any:
    """The value `to_json_tree` encoded as `tree`; raises SafeCodecError for anything else."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [from_json_tree(item, tensors, where=f"{where}[{i}]") for i, item in enumerate(tree)]
    if not isinstance(tree, dict):
        raise SafeCodecError(f"{where}: a {type(tree).__name__} is not part of a JSON tree")
    tag = next((key for key in tree if key.startswith("$")), None)
    if tag is None:
        return {key: from_json_tree(item, tensors, where=f"{where}[{key!r}]") for key, item in tree.items()}
    expected_keys = {"$dataclass", "fields"} if tag == "$dataclass" else {tag}
    if tag not in _TAGS or set(tree) != expected_keys:
        raise SafeCodecError(f"{where}: unknown tagged node with keys {sorted(tree)}; expected one of {', '.join(_TAGS)}")
    body = tree[tag]
    if tag in ("$tuple", "$set", "$frozenset", "$dict"):
        if not isinstance(body, list):
            raise SafeCodecError(f"{where}: {tag} holds a {type(body).__name__}, expected a list")
        items = [from_json_tree(item, tensors, where=f"{where}[{i}]") for i, item in enumerate(body)]
        try:
            if tag == "$tuple":
                return tuple(items)
            if tag == "$set":
                return set(items)
            if tag == "$frozenset":
                return frozenset(items)
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in items):
                raise SafeCodecError(f"{where}: $dict holds items that are not [key, value] pairs")
            return {key: item for key, item in items}
        except TypeError as error:  # an unhashable key or member
            raise SafeCodecError(f"{where}: {tag} has an unhashable member ({error})") from None
    if tag == "$tensor":
        if tensors is None or not isinstance(body, int) or isinstance(body, bool) or not 0 <= body < len(tensors):
            raise SafeCodecError(f"{where}: $tensor = {body!r} names no tensor of this message")
        return tensors[body]
    if tag == "$dtype":
        return dtype_from_name(body, where)
    if tag == "$path":
        if not isinstance(body, str):
            raise SafeCodecError(f"{where}: $path holds a {type(body).__name__}, expected a string")
        return Path(body)
    cls = _dataclass_named(body)
    fields = tree["fields"]
    names = {field.name for field in dataclasses.fields(cls) if field.init}
    if not isinstance(fields, dict) or set(fields) != names:
        found = sorted(fields) if isinstance(fields, dict) else fields
        raise SafeCodecError(f"{where}: fields of {body} are {found!r}, expected {sorted(names)}")
    return cls(**{name: from_json_tree(item, tensors, where=f"{where}.{name}") for name, item in fields.items()})


def json_bytes(tree: Any) -> bytes:
    return json.dumps(tree, separators=(",", ":"), allow_nan=True).encode()


def parse_json(data: bytes | bytearray | memoryview, where: str) -> Any:
    try:
        return json.loads(bytes(data))
    except (ValueError, RecursionError) as error:
        raise SafeCodecError(f"{where}: not valid JSON ({error})") from None


# -- messages --------------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """`value` (see the module docstring for what it may hold) as self-describing bytes."""
    tensors: list[torch.Tensor] = []
    tree = to_json_tree(value, tensors)
    flat = [tensor.detach().to("cpu").contiguous().reshape(-1) for tensor in tensors]
    table = [
        {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": f.numel() * f.element_size()}
        for t, f in zip(tensors, flat)
    ]
    header = json_bytes({"value": tree, "tensors": table})
    parts = [MAGIC, struct.pack("<Q", len(header)), header]
    parts.extend(f.view(torch.uint8).numpy().tobytes() for f in flat if f.numel())
    return b"".join(parts)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value `encode` turned into `data`; raises SafeCodecError for anything malformed."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise SafeCodecError("message: bad magic (not written by safe_codec.encode); refusing to decode it")
    (header_nbytes,) = struct.unpack("<Q", view[len(MAGIC) : _PREFIX_BYTES])
    if _PREFIX_BYTES + header_nbytes > len(view):
        raise SafeCodecError(f"message: header of {header_nbytes} bytes runs past the end ({len(view)} bytes)")
    header = parse_json(view[_PREFIX_BYTES : _PREFIX_BYTES + header_nbytes], "message header")
    if not isinstance(header, dict) or set(header) != {"value", "tensors"} or not isinstance(header["tensors"], list):
        raise SafeCodecError("message header: expected the keys 'value' and 'tensors' (a list)")
    offset = _PREFIX_BYTES + header_nbytes
    tensors = []
    for index, entry in enumerate(header["tensors"]):
        dtype, shape, nbytes = check_tensor_entry(entry, f"message tensor {index}")
        if offset + nbytes > len(view):
            raise SafeCodecError(f"message tensor {index}: {nbytes} bytes run past the end of the message")
        buffer = bytearray(view[offset : offset + nbytes])
        offset += nbytes
        tensors.append(tensor_from_bytes(buffer, dtype, shape))
    if offset != len(view):
        raise SafeCodecError(f"message: {len(view) - offset} trailing bytes after the last tensor")
    return from_json_tree(header["value"], tensors)


def check_tensor_entry(entry: Any, where: str) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, nbytes) of a tensor description, checked: nbytes must equal shape × itemsize."""
    if not isinstance(entry, dict):
        raise SafeCodecError(f"{where}: expected an object with dtype, shape and nbytes")
    dtype = dtype_from_name(entry.get("dtype"), f"{where} dtype")
    shape, nbytes = entry.get("shape"), entry.get("nbytes")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise SafeCodecError(f"{where}: shape = {shape!r}; expected a list of sizes >= 0")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes != math.prod(shape) * dtype.itemsize:
        raise SafeCodecError(f"{where}: nbytes = {nbytes!r} does not match shape {shape} of {dtype_name(dtype)}")
    return dtype, tuple(shape), nbytes


def tensor_from_bytes(buffer: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor over `buffer` (which it keeps alive)."""
    if not buffer:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
