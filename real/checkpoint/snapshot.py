"""Snapshot jobs and the copy of live tensors into the host pool (the blueprint's CopyWorker).

Tensors are coalesced (DataStates-LLM's shard coalescing, reference "what matters most" 3): the pool
holds the data file's payload bytes as laid out in the file, padding zeroed, cut into regions of at
most `chunk_bytes`, so the flush writes each region with a single pwrite however many small tensors
it holds (an AdamW state has one 4-byte `step` tensor per parameter).

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
    """File bytes [file_offset, file_offset + len(region.view)) in one pool region."""

    snapshot: Snapshot
    file_offset: int
    pieces: tuple[tuple[str, int, int], ...]
    """(tensor key, start in the region, nbytes): each the next bytes of that tensor; the rest of
    the region is zero padding."""
    region: Region
    copied_event: Any  # torch.cuda.Event on the copy stream, or None on CPU


@dataclass(frozen=True, kw_only=True)
class _PlannedChunk:
    file_offset: int
    nbytes: int
    # (key, offset in tensor, start in chunk, nbytes)
    pieces: tuple[tuple[str, int, int, int], ...]
    gaps: tuple[tuple[int, int], ...]  # (start, end) in the chunk: zero padding


def plan_chunks(layout: Layout, chunk_bytes: int) -> list[_PlannedChunk]:
    """Cut the payload (first tensor byte to last tensor byte) into chunks of ≤ chunk_bytes."""
    entries = [entry for entry in layout.tensors if entry.nbytes]
    if not entries:
        return []
    payload_start = entries[0].offset
    payload_end = entries[-1].offset + entries[-1].nbytes
    chunks = []
    index = 0
    for chunk_start in range(payload_start, payload_end, chunk_bytes):
        chunk_end = min(payload_end, chunk_start + chunk_bytes)
        pieces, gaps, position = [], [], chunk_start
        while index < len(entries):
            entry = entries[index]
            start, end = max(entry.offset, chunk_start), min(entry.offset + entry.nbytes, chunk_end)
            if start >= chunk_end:
                break
            if start > position:
                gaps.append((position - chunk_start, start - chunk_start))
            pieces.append((entry.key, start - entry.offset, start - chunk_start, end - start))
            position = end
            if end < entry.offset + entry.nbytes:
                break  # the tensor continues in the next chunk
            index += 1
        if chunk_end > position:
            gaps.append((position - chunk_start, chunk_end - chunk_start))
        chunks.append(_PlannedChunk(file_offset=chunk_start, nbytes=chunk_end - chunk_start,
                                    pieces=tuple(pieces), gaps=tuple(gaps)))
    return chunks


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
        sources = {
            entry.key: tensor_bytes_view(snapshot.tensors[entry.key])
            for entry in snapshot.layout.tensors if entry.nbytes
        }
        if not cuda:
            # numpy slice assignment is a plain memcpy (GIL released for large ones) at a tenth of
            # the cost of a torch slice + copy_ dispatch, which dominates for small tensors.
            sources = {key: source.numpy() for key, source in sources.items()}
        for planned in plan_chunks(snapshot.layout, chunk_bytes):
            region = pool.allocate(planned.nbytes, should_stop)
            host_bytes = region.view.numpy()
            # Pool regions are reused: padding must be written as the zeros the file holds.
            for gap_start, gap_end in planned.gaps:
                host_bytes[gap_start:gap_end] = 0
            for key, offset_in_tensor, start, nbytes in planned.pieces:
                source = sources[key][offset_in_tensor : offset_in_tensor + nbytes]
                if cuda:
                    region.view[start : start + nbytes].copy_(source, non_blocking=True)
                else:
                    host_bytes[start : start + nbytes] = source
            copied_event = None
            if cuda:
                copied_event = torch.cuda.Event()
                copied_event.record(copy_stream)
            emit(Chunk(snapshot=snapshot, file_offset=planned.file_offset,
                       pieces=tuple((key, start, nbytes)
                                    for key, _, start, nbytes in planned.pieces),
                       region=region, copied_event=copied_event))
        if cuda:
            copy_stream.synchronize()
    snapshot.tensors = None  # the live tensors are free to change from here on
