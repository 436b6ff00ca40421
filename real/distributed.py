"""Process-group setup and the point-to-point helpers the pipeline and the recovery methods use.

One process per pipeline stage (rank == stage); with data parallelism one per node of the S × D
grid (rank = replica × S + stage), each rank holding a communicator of its replica's pipeline (peers
named by stage, as in a one-pipeline run) and one of its stage's replicas (peers named by replica:
the gradient all-reduce and the heals), over process groups made with `new_group`
(`data_parallel_communicators`). Ranks rendezvous through a TCPStore under the
run's secret namespace (`connect_store`, run_secret.py): the launcher's (`serve_store`, bound to
one address, loopback by default) on one machine, torchrun's (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK) across machines, so the same code runs under both. The backend follows the
device: gloo on CPU, NCCL on CUDA. Every wait has a timeout so that a lost peer ends the run
with an error instead of a hang.

Gloo matches point-to-point messages on (source, tag), so receives may be posted in any order.
NCCL ignores tags and matches in issue order per (source, destination) pair; the pipeline
therefore receives from each peer in that peer's send order and holds early messages back
(pipeline.PipelineStage._receive), which works under both backends.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from churnsim.calibration.errors import InputError

from .safe_codec import decode, encode

DEVICES = ("cpu", "cuda")

_INTERRUPT_CHECK_INTERVAL_S = 0.02
"""Hard failures: how often a waiting rank asks whether its process group was abandoned."""
_COLLECTIVE_TAG_BASE = 1 << 28
"""Hard failures: tags of the point-to-point collectives (above the methods' tags, below gather_objects')."""
_COLLECTIVE_SEQUENCES = 1 << 20


class GroupBroken(RuntimeError):
    """Hard failures: this rank's process group lost a member (a peer's connection closed, or the
    launcher declared the group abandoned); the trainer re-forms the group and recovers."""


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


LOOPBACK_HOST = "127.0.0.1"
"""Where a run's endpoints listen unless the user names an address (`--rendezvous-host`)."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def serve_store(host: str, timeout_s: float, *, port: int = 0) -> Any:
    """A TCPStore server listening on `host` only (an address of this machine; `port` 0: the kernel picks one).

    torch's TCPStore binds every interface when it opens its own socket; given a socket that is
    already listening (`master_listen_fd`) it serves on that one. The caller keeps the returned store
    alive as long as the run; names its keys under the run's namespace (run_secret.py)."""
    try:
        address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as error:
        raise InputError(f"rendezvous host {host!r}: cannot be resolved ({error}); give an address of this machine") from None
    listener = socket.socket(address[0], socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address[4][:2])
        listener.listen(128)
    except OSError as error:
        listener.close()
        raise InputError(f"rendezvous host {host!r}: cannot listen there ({error.strerror}); give an address of this machine") from None
    port = int(listener.getsockname()[1])
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
    finally:
        listener.detach()  # the store owns the descriptor now: Python must not close it under the server


def connect_store(host: str, port: int, token: str, timeout_s: float) -> Any:
    """A client of the run's store that reads and writes under the run's namespace only."""
    from .run_secret import store_namespace

    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(store_namespace(token), client)


def keep_connections_on(host: str) -> None:
    """gloo and NCCL listen for their peers on the interface of the machine's host name unless told
    otherwise: a run whose rendezvous is on loopback keeps them there too (unless the user set them)."""
    if not is_loopback(host):
        return
    name = loopback_interface()
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), if it has one."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


@dataclass
class Communicator:
    """Point-to-point and collective helpers bound to the default process group.

    Peers are named by their *stage*. In a full group a stage's rank is the stage itself; after a
    hard failure the group may re-form without some stages (`members`: the stages present, in rank
    order), and every operation maps stages to ranks. `rank` is always this process's stage.

    Hard failures (`interrupted` set): a rank waiting on a live peer must still notice, within
    `_INTERRUPT_CHECK_INTERVAL_S`, that the launcher abandoned the group after another rank died.
    gloo offers no way to interrupt a wait (`abort()` does not wake it, `is_completed()` of a
    point-to-point operation stays False until someone waits, and a wait with a short timeout
    closes the connection), so the blocking wait runs on a helper thread and this thread waits for
    it in slices, looking at the launcher's mark between them; an abandoned wait is left to end
    with its group. Such waits, and the errors of a closed connection, raise `GroupBroken`. The
    collectives (all-reduce, all-gather, barrier) are made of point-to-point messages then: a gloo
    collective left pending blocks the destruction of its group until it times out, a pending
    point-to-point operation does not.
    """

    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    # Where tensors travel: the compute device under NCCL, host memory under gloo (whose
    # point-to-point operations take CPU tensors only).
    wire_device: torch.device = torch.device("cpu")
    members: tuple[int, ...] | None = None
    """Stages in the group, in rank order; None: every stage, rank == stage."""
    interrupted: Callable[[], bool] | None = None
    """Hard failures: whether the launcher abandoned the current group (checked while waiting)."""
    peer_ranks: tuple[int, ...] | None = None
    """Data parallelism: the global rank of each peer, indexed by the peer's name (its stage in a
    replica's pipeline, its replica in a stage's group); None: a peer's name is its rank."""
    group: Any = None
    """The process group the collectives run over (a replica's pipeline, a stage's replicas); None:
    the default group."""
    collective_tag_offset: int = 0
    """Hard failures: added to the tags of this communicator's point-to-point collectives, so that
    communicators over the same default group (the grid, a pipeline, a stage's replicas) never share one."""
    bytes_sent: int = 0
    """Bytes this rank sent point to point (tensors and objects), since it started."""
    bytes_received: int = 0
    _rank_of_stage: dict[int, int] = field(default_factory=dict, repr=False)
    _waiter: futures.ThreadPoolExecutor | None = field(default=None, repr=False)
    _collective_sequence: int = field(default=0, repr=False)

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def rebind(self, members: tuple[int, ...]) -> None:
        """The default group was re-formed with `members` (stages in rank order)."""
        self.members = tuple(members)
        self.world_size = len(members)
        self._rank_of_stage = {stage: rank for rank, stage in enumerate(members)}
        self._collective_sequence = 0  # every member starts the new group's collectives at 0
        if self._waiter is not None:
            # Waits abandoned in the old group end with it; the new group gets threads of its own.
            self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None

    def restart(self) -> None:
        """Hard failures, data parallelism: the default group was re-formed with every rank in place
        (`peer_ranks` still hold); collectives start again at sequence 0, waits of the old group end with it."""
        self._collective_sequence = 0
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None

    def _group_rank(self, stage: int) -> int:
        if self.members is None:
            return stage if self.peer_ranks is None else self.peer_ranks[stage]
        return self._rank_of_stage[stage]

    @property
    def group_stages(self) -> tuple[int, ...]:
        """The stages in the group, in rank order (all-gathers return values in this order)."""
        return self.members if self.members is not None else tuple(range(self.world_size))

    # -- tensors -------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, destination: int, tag: int) -> dist.Work:
        """Start sending `tensor` to stage `destination`; the caller waits on the returned work."""
        staged = self._to_wire(tensor)
        work = self._call(dist.isend, staged, dst=self._group_rank(destination), tag=tag)
        assert work is not None
        self.bytes_sent += staged.numel() * staged.element_size()
        return work

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        # The returned work holds the staged copy until it completes, so no caller must keep it.
        return tensor.detach().to(self.wire_device).contiguous()

    def _call(self, operation: Callable[..., Any], *arguments: Any, **options: Any) -> Any:
        """Start a torch.distributed operation; under hard failures a closed connection is GroupBroken."""
        if self.interrupted is None:
            return operation(*arguments, **options)
        try:
            return operation(*arguments, **options)
        except RuntimeError as error:
            raise GroupBroken(f"stage {self.rank}: {' '.join(str(error).split())[:300]}") from error

    def wait(self, work: dist.Work) -> None:
        if self.interrupted is None:
            work.wait(self._timeout)
            return
        if self._waiter is None:
            self._waiter = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="churnsim-wait")
        pending = self._waiter.submit(work.wait, self._timeout)  # the operation's own timeout still applies
        while not futures.wait([pending], timeout=_INTERRUPT_CHECK_INTERVAL_S).done:
            if self.interrupted():
                raise GroupBroken(f"stage {self.rank}: the launcher abandoned the process group (a stage process died)")
        self._call(pending.result)  # raises the operation's own error, if any

    def send(self, tensor: torch.Tensor, destination: int, tag: int) -> None:
        self.wait(self.isend(tensor, destination, tag))

    def recv_into(self, buffer: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        """Receive into `buffer` (shape and dtype known to both sides) from stage `source` and return it."""
        staged = buffer if buffer.device == self.wire_device else torch.empty_like(buffer, device=self.wire_device)
        work = self._call(dist.irecv, staged, src=self._group_rank(source), tag=tag)
        assert work is not None
        self.wait(work)
        self.bytes_received += staged.numel() * staged.element_size()
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
        if self.interrupted is not None:
            # Hard failures: an all-reduce is a barrier whose wait can be polled (monitored_barrier's cannot).
            self.all_reduce_sum(torch.zeros(1, dtype=torch.int64, device=self.wire_device))
            return
        # monitored_barrier (gloo) names the rank that did not arrive; NCCL has only barrier().
        if dist.get_backend(self.group) == "gloo":
            dist.monitored_barrier(group=self.group, timeout=self._timeout)
        else:
            dist.barrier(group=self.group)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Hard failures: every rank's `tensor` (same shape and dtype everywhere), in rank order, over
        point-to-point messages (not counted as transferred bytes: they are the protocol's own)."""
        tag = _COLLECTIVE_TAG_BASE + self.collective_tag_offset + self._collective_sequence
        self._collective_sequence = (self._collective_sequence + 1) % _COLLECTIVE_SEQUENCES
        staged = self._to_wire(tensor)
        sends = [
            self._call(dist.isend, staged, dst=self._group_rank(stage), tag=tag) for stage in self.group_stages if stage != self.rank
        ]
        gathered = []
        for stage in self.group_stages:
            if stage == self.rank:
                gathered.append(staged)
                continue
            buffer = torch.empty_like(staged)
            self.wait(self._call(dist.irecv, buffer, src=self._group_rank(stage), tag=tag))
            gathered.append(buffer)
        for work in sends:
            self.wait(work)
        return gathered

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place."""
        if self.interrupted is not None:
            total = torch.stack(self._exchange(tensor)).sum(dim=0)  # rank order: the same bits everywhere
            tensor.copy_(total)
            return tensor
        staged = self._to_wire(tensor)
        work = self._call(dist.all_reduce, staged, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        assert work is not None
        self.wait(work)
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    def gather_objects(self, value: Any, destination: int = 0) -> list[Any] | None:
        """Every rank's `value` on `destination` (None elsewhere), over point-to-point messages."""
        tag = 1 << 29
        if self.rank != destination:
            self.send_object(value, destination, tag)
            return None
        return [value if stage == destination else self.recv_object(stage, tag) for stage in self.group_stages]

    def all_gather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` on every rank, in rank order (= stage order in a full group); safe_codec
        bytes padded to the longest, one all-gather."""
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
        if self.interrupted is not None:
            for output, received in zip(outputs, self._exchange(tensor)):
                output.copy_(received)
            return
        work = self._call(dist.all_gather, outputs, tensor, group=self.group, async_op=True)
        assert work is not None
        self.wait(work)


def init_process_group(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    device: str = "cpu",
    timeout_s: float = 120.0,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: Any = None,
) -> Communicator:
    """Join the default process group through `env://`; arguments override the torchrun variables.

    `store` (a torch.distributed Store, with `rank` and `world_size`): rendezvous through it instead
    (hard failures form each round's group under one store prefix per round, real/agent_membership.py)."""
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if store is None and name not in os.environ:
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
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    wire_device = torch_device if backend == "nccl" else torch.device("cpu")
    return Communicator(rank=rank, world_size=world_size, device=torch_device, timeout_s=timeout_s, wire_device=wire_device)


def data_parallel_communicators(
    world: Communicator, num_stages: int, data_parallel_degree: int, *, make_groups: bool = True
) -> tuple[Communicator, Communicator]:
    """(this rank's replica pipeline, this rank's stage group) in an S × D grid, rank = replica × S + stage.

    The pipeline communicator names its peers by stage (the methods and the pipeline run on it as on a
    one-pipeline run); the stage group names them by replica (gradient all-reduce, heals). Collective:
    every rank creates every group, in the same order, as torch.distributed.new_group requires.

    `make_groups=False` (hard failures): no process groups; the collectives run point to point over
    the default group, whichever generation of it is current (`world.interrupted` polled while waiting),
    with tags of their own."""
    if world.world_size != num_stages * data_parallel_degree:
        raise InputError(
            f"world size {world.world_size} differs from {num_stages} stages × {data_parallel_degree} replicas: "
            "start one process per (stage, replica)"
        )
    replica, stage = divmod(world.rank, num_stages)
    pipelines = [tuple(r * num_stages + s for s in range(num_stages)) for r in range(data_parallel_degree)]
    stages = [tuple(r * num_stages + s for r in range(data_parallel_degree)) for s in range(num_stages)]
    common = {"device": world.device, "timeout_s": world.timeout_s, "wire_device": world.wire_device, "interrupted": world.interrupted}
    if make_groups:
        pipeline_group = [dist.new_group(list(ranks)) for ranks in pipelines][replica]
        stage_group_of = [dist.new_group(list(ranks)) for ranks in stages][stage]
    else:
        pipeline_group = stage_group_of = None
    pipeline = Communicator(
        rank=stage, world_size=num_stages, peer_ranks=pipelines[replica], group=pipeline_group, collective_tag_offset=1 << 20, **common
    )
    stage_group = Communicator(
        rank=replica, world_size=data_parallel_degree, peer_ranks=stages[stage], group=stage_group_of, collective_tag_offset=2 << 20, **common
    )
    return pipeline, stage_group


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
