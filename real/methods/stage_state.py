"""A stage's full training state as one flat dict, and its transfer as bytes over the process group.

The flat form is what the checkpoint engines save (tensors at the top level, everything else small
and JSON-encodable: numbers, strings, lists, tuples, dicts) and what `redundant` sends to a replica holder:

    module.<name>               every weight of the stage (module.state_dict(); RoPE tables are not
                                persistent, so only weights)
    optimizer.<index>.<key>     per-parameter optimizer tensors (AdamW: step, exp_avg, exp_avg_sq)
    optimizer.param_groups      hyperparameters (metadata)
    optimizer.scalars           non-tensor per-parameter entries, if an optimizer has any (metadata)

Restoring copies into the existing parameters (`load_state_dict` copies in place), so the bytes
are exactly the saved ones and the optimizer built over `module.parameters()` stays valid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..distributed import Communicator
from ..safe_codec import dtype_from_name, dtype_name, from_json_tree, json_bytes, parse_json, to_json_tree
from .base import StageRuntime

MODULE_PREFIX = "module."
OPTIMIZER_PREFIX = "optimizer."
PARAM_GROUPS_KEY = "optimizer.param_groups"
SCALARS_KEY = "optimizer.scalars"


def capture_stage_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The live tensors of `module` and `optimizer` (not copies) plus their small metadata."""
    state: dict[str, Any] = {MODULE_PREFIX + name: tensor for name, tensor in module.state_dict().items()}
    optimizer_state = optimizer.state_dict()
    scalars: dict[str, Any] = {}
    for index, per_parameter in optimizer_state["state"].items():
        for key, value in per_parameter.items():
            if isinstance(value, torch.Tensor):
                state[f"{OPTIMIZER_PREFIX}{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    state[PARAM_GROUPS_KEY] = optimizer_state["param_groups"]
    state[SCALARS_KEY] = scalars
    return state


def restore_stage_state(
    runtime: StageRuntime, make_optimizer: Callable[[float], torch.optim.Optimizer], state: dict[str, Any]
) -> None:
    """Load `state` into `runtime` in place: weights copied, a new optimizer holding the saved state."""
    weights = {key[len(MODULE_PREFIX) :]: value for key, value in state.items() if key.startswith(MODULE_PREFIX)}
    runtime.module.load_state_dict(weights, strict=True)
    per_parameter: dict[int, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith(OPTIMIZER_PREFIX) and key not in (PARAM_GROUPS_KEY, SCALARS_KEY):
            index, name = key[len(OPTIMIZER_PREFIX) :].split(".", 1)
            per_parameter.setdefault(int(index), {})[name] = value
    for key, value in state.get(SCALARS_KEY, {}).items():
        index, name = key.split(".", 1)
        per_parameter.setdefault(int(index), {})[name] = value
    optimizer = make_optimizer(1.0)
    runtime.optimizer = optimizer
    runtime.lr_scale = 1.0
    if PARAM_GROUPS_KEY not in state:
        return  # weights only (a replica from before the owner's first step): a fresh optimizer
    # Optimizer.load_state_dict casts moments to the parameters' device and dtype; `step` stays as saved.
    optimizer.load_state_dict({"state": per_parameter, "param_groups": state[PARAM_GROUPS_KEY]})


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(value.numel() * value.element_size() for value in state.values() if isinstance(value, torch.Tensor))


# -- transfer over the process group ---------------------------------------------------------------


def _pack(state: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(layout as JSON bytes, all tensors' bytes concatenated) — both uint8 tensors on `device`.

    No pickle: the receiver decodes data (names, dtypes, shapes, the metadata's JSON tree), never code."""
    layout: list[tuple[str, str, list[int]]] = []
    metadata: dict[str, Any] = {}
    pieces: list[torch.Tensor] = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            layout.append((key, dtype_name(value.dtype), list(value.shape)))
            pieces.append(value.detach().contiguous().reshape(-1).view(torch.uint8).to(device))
        else:
            metadata[key] = value
    encoded = json_bytes({"layout": layout, "metadata": to_json_tree(metadata, where="state metadata")})
    header = torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(device)
    payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    return header, payload


def _unpack(header: torch.Tensor, payload: torch.Tensor) -> dict[str, Any]:
    decoded = parse_json(header.cpu().numpy().tobytes(), "received state header")
    layout, metadata = decoded["layout"], from_json_tree(decoded["metadata"], where="received state metadata")
    state: dict[str, Any] = {}
    offset = 0
    for key, name, shape in layout:
        dtype = dtype_from_name(name, f"received tensor {key!r} dtype")
        element_size = dtype.itemsize
        nbytes = element_size * int(torch.Size(shape).numel())
        # clone first: a fresh storage starts aligned for any dtype
        state[key] = payload[offset : offset + nbytes].clone().view(dtype).reshape(shape)
        offset += nbytes
    assert offset == payload.numel(), "payload size matches the layout"
    state.update(metadata)
    return state


class StateSender:
    """Sends one flat state to one peer without blocking (sizes, layout, bytes on tags tag..tag+2)."""

    def __init__(self, communicator: Communicator, state: dict[str, Any], destination: int, tag: int) -> None:
        self.communicator = communicator
        header, payload = _pack(state, communicator.device)
        sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64, device=communicator.device)
        self._keep_alive = (sizes, header, payload)
        self._works = [
            communicator.isend(sizes, destination, tag),
            communicator.isend(header, destination, tag + 1),
            communicator.isend(payload, destination, tag + 2),
        ]
        self.nbytes = int(payload.numel())

    def wait(self) -> None:
        for work in self._works:
            self.communicator.wait(work)


def receive_state(communicator: Communicator, source: int, tag: int) -> dict[str, Any]:
    """The state a `StateSender(…, tag)` on `source` sends; tensors come back on this rank's device."""
    sizes = communicator.recv((2,), torch.int64, source, tag)
    header = communicator.recv((int(sizes[0]),), torch.uint8, source, tag + 1)
    payload = communicator.recv((int(sizes[1]),), torch.uint8, source, tag + 2)
    return _unpack(header, payload)
