"""Process-group setup and the point-to-point helpers the pipeline and the recovery methods use.

One process per pipeline stage (rank == stage). Rendezvous is `env://`, the torchrun convention
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so the same code runs under
`launch_local` on one machine and under `torchrun` across machines. The backend follows the
device: gloo on CPU, NCCL on CUDA. Every wait has a timeout so that a lost peer ends the run
with an error instead of a hang.

Gloo matches point-to-point messages on (source, tag), so receives may be posted in any order.
NCCL ignores tags and matches in issue order per (source, destination) pair; the pipeline
therefore receives from each peer in that peer's send order and holds early messages back
(pipeline.PipelineStage._receive), which works under both backends.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from churnsim.calibration.errors import InputError

from .safe_codec import decode, encode

DEVICES = ("cpu", "cuda")


def backend_for(device: str, *, ranks_on_host: int = 1, gpus_on_host: int = 1) -> str:
    """gloo on CPU or when ranks must share a GPU (NCCL forbids that); NCCL otherwise."""
    if device not in DEVICES:
        raise InputError(f"device {device!r} is not supported: use one of {', '.join(DEVICES)}")
    if device == "cpu" or ranks_on_host > gpus_on_host:
        return "gloo"
    return "nccl"


def find_free_port() -> int:
    """A TCP port that was free a moment ago on this machine (for a local MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Communicator:
    """Point-to-point and collective helpers bound to the default process group."""

    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    # Where tensors travel: the compute device under NCCL, host memory under gloo (whose
    # point-to-point operations take CPU tensors only).
    wire_device: torch.device = torch.device("cpu")

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    # -- tensors -------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, destination: int, tag: int) -> dist.Work:
        """Start sending `tensor`; the caller keeps it alive and waits on the returned work."""
        work = dist.isend(self._to_wire(tensor), dst=destination, tag=tag)
        assert work is not None
        return work

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        # The returned work holds the staged copy until it completes, so no caller must keep it.
        return tensor.detach().to(self.wire_device).contiguous()

    def wait(self, work: dist.Work) -> None:
        work.wait(self._timeout)

    def send(self, tensor: torch.Tensor, destination: int, tag: int) -> None:
        self.wait(self.isend(tensor, destination, tag))

    def recv_into(self, buffer: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        """Receive into `buffer` (shape and dtype known to both sides) and return it."""
        staged = buffer if buffer.device == self.wire_device else torch.empty_like(buffer, device=self.wire_device)
        work = dist.irecv(staged, src=source, tag=tag)
        assert work is not None
        work.wait(self._timeout)
        if staged is not buffer:
            buffer.copy_(staged)
        return buffer

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, source: int, tag: int) -> torch.Tensor:
        return self.recv_into(torch.empty(shape, dtype=dtype, device=self.device), source, tag)

    # -- small objects -------------------------------------------------------------------------
    # Objects travel as safe_codec bytes (JSON + raw tensors), never pickle: a message from whoever
    # reaches a rank's port can only describe data.
    def send_object(self, value: Any, destination: int, tag: int) -> None:
        """Encode `value` and send its length, then its bytes (tags `tag` and `tag + 1`)."""
        payload = torch.frombuffer(bytearray(encode(value)), dtype=torch.uint8)
        self.send(torch.tensor([payload.numel()], dtype=torch.int64), destination, tag)
        self.send(payload, destination, tag + 1)

    def recv_object(self, source: int, tag: int) -> Any:
        length = int(self.recv_into(torch.empty(1, dtype=torch.int64, device=self.wire_device), source, tag).item())
        payload = self.recv_into(torch.empty(length, dtype=torch.uint8, device=self.wire_device), source, tag + 1)
        return decode(payload.cpu().numpy().tobytes())

    # -- collectives ---------------------------------------------------------------------------
    def barrier(self) -> None:
        # monitored_barrier (gloo) names the rank that did not arrive; NCCL has only barrier().
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=self._timeout)
        else:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place."""
        staged = self._to_wire(tensor)
        work = dist.all_reduce(staged, op=dist.ReduceOp.SUM, async_op=True)
        assert work is not None
        work.wait(self._timeout)
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    def gather_objects(self, value: Any, destination: int = 0) -> list[Any] | None:
        """Every rank's `value` on `destination` (None elsewhere), over point-to-point messages."""
        tag = 1 << 29
        if self.rank != destination:
            self.send_object(value, destination, tag)
            return None
        return [value if rank == destination else self.recv_object(rank, tag) for rank in range(self.world_size)]

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` on every rank (safe_codec bytes padded to the longest, one all-gather)."""
        wire = self.wire_device
        payload = torch.frombuffer(bytearray(encode(value)), dtype=torch.uint8).to(wire)
        lengths = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(self.world_size)]
        self._all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=wire))
        longest = max(int(length.item()) for length in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=wire)
        padded[: payload.numel()] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8, device=wire) for _ in range(self.world_size)]
        self._all_gather(gathered, padded)
        return [decode(g[: int(n.item())].cpu().numpy().tobytes()) for g, n in zip(gathered, lengths)]

    def _all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        work = dist.all_gather(outputs, tensor, async_op=True)
        assert work is not None
        work.wait(self._timeout)


def init_process_group(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device: str = "cpu",
    timeout_s: float = 120.0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Communicator:
    """Join the default process group through `env://`; arguments override the torchrun variables."""
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise InputError(f"environment variable {name} is not set: launch with torchrun or pass {name.lower()}")
    backend = backend_for(device)
    torch_device = torch.device("cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device 'cuda' was requested but CUDA is not available: use device 'cpu'")
        gpus_on_host = torch.cuda.device_count()
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        backend = backend_for(device, ranks_on_host=ranks_on_host, gpus_on_host=gpus_on_host)
        torch_device = torch.device("cuda", local_rank % gpus_on_host)
        torch.cuda.set_device(torch_device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    wire_device = torch_device if backend == "nccl" else torch.device("cpu")
    return Communicator(rank=rank, world_size=world_size, device=torch_device, timeout_s=timeout_s, wire_device=wire_device)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
