"""Snapshot jobs and the copy of live tensors into the host pool (the blueprint's CopyWorker).

On CUDA the copy runs on a side stream that first waits on the event `save()` recorded on the
training stream, so it never reads values the training stream has not produced yet; each chunk gets
a completion event the flush thread waits on before reading the host region; the stream is synced
before the live tensors are let go (only then may the optimizer mutate them). On CPU the same
sequence is a plain `copy_` with no events.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .format import Layout, tensor_bytes_view
from .host_pool import HostPool, Region


@dataclass(kw_only=True, eq=False)
class Snapshot:
    sequence: int
    iteration: int
    stem: str
    layout: Layout
    tensors: dict[str, torch.Tensor] | None  # live references, dropped once copied
    metadata_bytes: bytes
    ready_event: Any  # torch.cuda.Event on the training stream, or None on CPU
    save_time_s: float


@dataclass(frozen=True, kw_only=True, eq=False)
class Begin:
    snapshot: Snapshot


@dataclass(frozen=True, kw_only=True, eq=False)
class Chunk:
    snapshot: Snapshot
    key: str
    offset_in_tensor: int
    region: Region
    copied_event: Any  # torch.cuda.Event on the copy stream, or None on CPU


@dataclass(frozen=True, kw_only=True, eq=False)
class End:
    snapshot: Snapshot


def copy_to_host_pool(
    snapshot: Snapshot,
    pool: HostPool,
    *,
    chunk_bytes: int,
    device: torch.device,
    copy_stream: Any,
    should_stop: Callable[[], bool],
    emit: Callable[[Chunk], None],
) -> None:
    """Copy every tensor of `snapshot` into pool regions of at most `chunk_bytes`, emitting chunks.

    Blocks while the pool is full (back-pressure); returns once every copy has completed and the
    snapshot no longer references the live tensors.
    """
    cuda = device.type == "cuda"
    with contextlib.ExitStack() as context:
        if cuda:
            context.enter_context(torch.cuda.device(device))
            context.enter_context(torch.cuda.stream(copy_stream))
            copy_stream.wait_event(snapshot.ready_event)
        assert snapshot.tensors is not None
        for entry in snapshot.layout.tensors:
            if entry.nbytes == 0:
                continue
            source = tensor_bytes_view(snapshot.tensors[entry.key])
            for offset in range(0, entry.nbytes, chunk_bytes):
                nbytes = min(chunk_bytes, entry.nbytes - offset)
                region = pool.allocate(nbytes, should_stop)
                region.view.copy_(source[offset : offset + nbytes], non_blocking=cuda)
                copied_event = None
                if cuda:
                    copied_event = torch.cuda.Event()
                    copied_event.record(copy_stream)
                emit(Chunk(snapshot=snapshot, key=entry.key, offset_in_tensor=offset,
                           region=region, copied_event=copied_event))
        if cuda:
            copy_stream.synchronize()
    snapshot.tensors = None  # the live tensors are free to change from here on
