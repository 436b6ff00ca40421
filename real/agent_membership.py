"""Hard failures under torchrun's agent: membership from torch.distributed.elastic, the stage policy here.

torchrun (`--rdzv-backend=c10d`) runs one agent per machine; the agents meet at the c10d rendezvous
(a TCPStore on the `--rdzv-endpoint` host) and start their workers. When a worker dies, its agent
stops every local worker and joins a new rendezvous round; the other agents see it waiting and
restart theirs too (torch's "membership change"), and an agent started on any machine with the same
command joins the next round. So torch.distributed.elastic decides who is in the run and when the
group re-forms; churnsim decides only which stage each worker of a round runs, and which state it
starts from:

- A worker that finds its stage's snapshot in its node's memory (real/node_memory.py: written after
  every update, dropped when the stage's node dies) is a *survivor*: it reloads it.
- After every round the workers say over the store which stages their node holds; the holders keep
  theirs (`assign_stages`), the others (a restarted worker whose stage died, a new agent's workers)
  take the missing stages in rank order, and the method recovers them (`recover`), as always.
- With data parallelism a "stage" here is a worker slot, replica × S + stage: a lost slot whose
  stage keeps a replica heals from it (real/replica_heal.py), the trainer decides.
- One agent on one machine (`launch_local`, `worker_is_node`): every worker is a node of its own,
  so a worker that died without its agent stopping it (no `stopped-<s>.json` beside its snapshot)
  lost its node's memory, and its restarted process drops the snapshot it finds.

The store (the agent's TCPStore: MASTER_ADDR:MASTER_PORT) holds, under the run's secret namespace
(run_secret.py), values signed with the run's secret:

    worker-starts              a counter: round r = (n - 1) // WORLD_SIZE for the n-th worker started
    run                        {"run_id", "started_unix_ns"}: fixed by the first worker of the run
    round-<r>/holding/<rank>   what worker `rank` holds: {"node", "local_rank", "held": {stage: the
                               snapshot's header}, "started_unix_s", "stopped_unix_s", "restart_count"}
    round-<r>/node-ready/<node>  the node's run directory is prepared (by its first local worker)
    round-<r>/ready/<stage>    the stage's process is built and at the barrier (unix seconds)
    round-<r>/group/...        the round's process group (torch's own keys)

The workers' store is the one torchrun's agents give them (MASTER_ADDR:MASTER_PORT); with
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (the printed command sets it) the rank-0 agent starts a new one
for every round, so nothing of an earlier round is read: what outlives a round is in the snapshots'
headers (the run's id and start, when a kill was decided).

One key lies outside the namespace: `churnsim/token-proof`, the run's proof of its token, fixed by
the first worker. A worker whose token does not verify it stops with one line (exit 2): a process
without the run's token cannot join the run or write its keys.

Trust boundary: torch's c10d rendezvous keeps its own state in the same store as pickled Python
objects, and torch's agents unpickle it. churnsim never unpickles anything and signs its own keys,
but whoever can reach the store's port can change torch's state, and with it run code in the agents.
Keep the rendezvous endpoint on loopback (one machine) or on a network only the run's machines reach.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from churnsim.calibration.errors import InputError

from .node_memory import NodeMemory
from .run_secret import sign, store_namespace, verify

TOKEN_PROOF_KEY = "churnsim/token-proof"
_PROOF_LABEL = "token-proof"
STOPPED_EXIT_CODE = 143
"""128 + SIGTERM: the exit code of a worker stopped for a new round, as of a process the signal ended."""


def unix_offset_s() -> float:
    """time.time() - time.perf_counter(): turns this process's perf_counter into wall-clock seconds."""
    return time.time() - time.perf_counter()


def process_start_unix_s() -> float:
    """When this process started, to the kernel's clock tick (Linux: /proc and the boot-time clock;
    elsewhere: now, which leaves the interpreter's start out of the measured process start)."""
    try:
        with open("/proc/self/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
        started_after_boot_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5)
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class RendezvousFailed(RuntimeError):
    """The run cannot go on: no state to recover from, or the rendezvous store holds values not signed by the run."""


@dataclass(frozen=True, kw_only=True)
class Announcement:
    """A round's group, as the hard-failure trainer (real/trainer.py) reads it."""

    generation: int
    members: tuple[int, ...]
    full: bool
    deaths: tuple[dict[str, Any], ...]
    arrived_perf_s: float
    """When this rank reached the round's barrier."""
    formed_perf_s: float
    """When its process group was formed on this rank."""


@dataclass(frozen=True)
class Holding:
    """What one worker of a round reported: where it runs and which stages its node holds."""

    rank: int
    node: str
    local_rank: int
    held: dict[int, int]
    """stage -> the step its snapshot was taken after."""


def assign_stages(num_stages: int, workers: list[Holding]) -> dict[int, int]:
    """{rank: stage} for one round. Each held stage stays on the node holding its newest snapshot
    (ties: the node name, then the rank), given to that node's workers in local-rank order; the
    workers left take the stages nobody holds, in rank order. Every worker computes the same answer."""
    best: dict[int, tuple[int, str]] = {}
    for worker in workers:
        for stage, step in worker.held.items():
            if 0 <= stage < num_stages:
                current = best.get(stage)
                if current is None or (-step, worker.node) < (-current[0], current[1]):
                    best[stage] = (step, worker.node)
    by_node: dict[str, list[Holding]] = {}
    for worker in sorted(workers, key=lambda each: (each.local_rank, each.rank)):
        by_node.setdefault(worker.node, []).append(worker)
    assignment: dict[int, int] = {}
    for node, node_workers in by_node.items():
        kept = sorted(stage for stage, (_, holder) in best.items() if holder == node)
        for worker, stage in zip(node_workers, kept):
            assignment[worker.rank] = stage
    missing = [stage for stage in range(num_stages) if stage not in assignment.values()]
    free = sorted(worker.rank for worker in workers if worker.rank not in assignment)
    for rank, stage in zip(free, missing):
        assignment[rank] = stage
    return assignment


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """What the hard-failure trainer reads of `settings`."""

    stage: int
    """This worker's process slot: the stage, or with data parallelism replica × S + stage."""
    num_stages: int
    """How many slots the run has (S × D)."""
    incarnation: int
    """The rendezvous round (0 for the run's first)."""
    rendezvous_timeout_s: float
    run_started_unix_ns: int
    death_detected_perf_s: float | None = None
    directory: str = ""


class AgentMembership:
    """One torchrun worker's view of the run: its stage, its snapshot, the round's group (module docstring).

    Implements what the hard-failure trainer (real/trainer.py) asks of a membership; `join` forms
    the round's group once; a broken group is never re-formed in the same process: the worker waits
    for its agent to stop it (the agent restarts every worker when one dies), and its snapshot
    carries the state into the next round."""

    def __init__(
        self,
        *,
        token: str,
        num_stages: int,
        device: str,
        timeout_s: float,
        rendezvous_timeout_s: float,
        join_delay_s: float = 0.0,
        data_parallel_degree: int = 1,
        node_id: str | None = None,
        memory_root: Any = None,
        worker_is_node: bool = False,
    ) -> None:
        """`data_parallel_degree` D: the run has S × D slots (a slot is a (stage, replica) node).
        `worker_is_node`: every worker is a node of its own (one agent standing in for a machine per
        worker, as `launch_local` runs it): a worker that died without its agent stopping it (a
        SIGKILL, the failure injector's or anyone's) lost its node, memory and node-local disk."""
        import torch.distributed as dist

        from .distributed import connect_store, serve_store

        self.token = token
        self.device = device
        self.timeout_s = timeout_s
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        num_pipeline_stages, num_stages = num_stages, num_stages * data_parallel_degree  # from here on: slots
        if self.world_size != num_stages:
            raise InputError(
                f"torchrun started {self.world_size} workers in all but the scenario has {num_pipeline_stages} stages × "
                f"{data_parallel_degree} replica(s): make --nnodes × --nproc-per-node equal pipeline.num_stages × pipeline.data_parallel_degree"
            )
        self.num_pipeline_stages = num_pipeline_stages
        self.started_unix_s = process_start_unix_s()
        self.memory = NodeMemory(token, root=memory_root, node_id=node_id)
        if worker_is_node and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            for stage in self.memory.held_stages():
                if self.memory.stopped_unix_s(stage) is None:  # not stopped by the agent: killed, node and all
                    self.memory.drop(stage)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._server = None
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # The round's store is the rank-0 worker's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), bound to
            # MASTER_ADDR only; it lives as long as this process, which is as long as the round.
            self._server = serve_store(host, rendezvous_timeout_s, port=port)
        self._raw = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=rendezvous_timeout_s))
        check_token_proof(self._raw, token)
        self._store = connect_store(host, port, token, rendezvous_timeout_s)
        self._stop_requested = False
        self._saving = False
        signal.signal(signal.SIGTERM, self._stopped_by_agent)
        signal.signal(signal.SIGINT, self._stopped_by_agent)  # an interrupted agent passes on its SIGINT
        # A fork server started with SIGINT blocked (real/launch.py) hands the mask on to its workers.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.round = (int(self._store.add("worker-starts", 1)) - 1) // self.world_size
        held = self.memory.held_stages()
        node_stopped = [value for stage in held if (value := self.memory.stopped_unix_s(stage)) is not None]
        self._publish(f"round-{self.round}/holding/{self.rank}", {
            "node": self.memory.node_id, "local_rank": self.local_rank, "held": {str(s): header for s, header in held.items()},
            "started_unix_s": self.started_unix_s, "stopped_unix_s": min(node_stopped) if node_stopped else None,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        })  # fmt: skip
        reports = {rank: self._read(f"round-{self.round}/holding/{rank}") for rank in range(self.world_size)}
        workers = [
            Holding(rank=rank, node=str(body["node"]), local_rank=int(body["local_rank"]),
                    held={int(s): int(header["step"]) for s, header in body["held"].items()})
            for rank, body in reports.items()
        ]  # fmt: skip
        headers = [header for body in reports.values() for header in body["held"].values()]
        # A later round: some node holds a stage's state, or an agent restarted its workers (torch's
        # workers' store may be new in each round, so the round counter alone does not tell).
        self.is_restart = bool(headers) or any(int(body["restart_count"]) > 0 for body in reports.values())
        if self.is_restart and not headers:
            raise RendezvousFailed(
                "the agent restarted the workers but no node holds any stage's state: every stage process died with its "
                "node, or one died before the run's first group formed; nothing is left to recover from, so the run "
                "ends (start it again, or continue it from its durable checkpoints with --resume)"
            )
        # The run's identity: the holders' (the store may be new), else the one the first worker fixed.
        run = headers[0] if headers else self._run_identity()
        self.run_id, run_started_unix_ns = str(run["run_id"]), int(run["started_unix_ns"])
        assignment = assign_stages(num_stages, workers)
        stage = assignment[self.rank]
        held_anywhere = {s for worker in workers for s in worker.held}
        self.lost_stages = frozenset(range(num_stages)) - held_anywhere
        self.restored: dict[str, Any] | None = None
        self.restore_s = 0.0
        self.restore_bytes = 0
        if stage in held:
            started = time.perf_counter()
            self.restored, self.restore_bytes = self.memory.load(stage)
            self.restore_s = time.perf_counter() - started
        node_stages = {assignment[worker.rank] for worker in workers if worker.node == self.memory.node_id}
        for other in set(held) - node_stages:
            self.memory.drop(other)  # another node's snapshot of that stage is newer: this one is stale
        self.memory.forget_stopped(stage)
        # What the restart cost, from the reports (the same numbers on every worker). The survivors
        # noted when the injector's kill was decided; a kill from outside has no such time.
        kills = [float(header["kill_unix_s"]) for header in headers if header.get("kill_unix_s") is not None]
        stops = [float(body["stopped_unix_s"]) for body in reports.values() if body.get("stopped_unix_s") is not None]
        starts = [float(body["started_unix_s"]) for body in reports.values()]
        killed_unix_s = min(kills) if kills else None
        detected_unix_s = min(stops) if stops else killed_unix_s
        self.restart_costs: dict[str, Any] = {}
        if self.is_restart:
            self.restart_costs = {
                "restart_round": 1 + max(int(body["restart_count"]) for body in reports.values()),
                "detection_s": (detected_unix_s - killed_unix_s) if killed_unix_s is not None and detected_unix_s is not None else None,
                "agent_restart_s": (max(starts) - detected_unix_s) if detected_unix_s is not None else None,
            }
        death_unix_s = killed_unix_s if killed_unix_s is not None else detected_unix_s
        if self.is_restart and stage not in held and join_delay_s > 0 and death_unix_s is not None:
            # The replacement machine arrives after the scenario's join delay, counted from the death.
            time.sleep(max(0.0, death_unix_s + join_delay_s - time.time()))
        offset = unix_offset_s()
        # A death's id must differ from every earlier one's (the trainer keeps the ids it recorded).
        death_id = int((death_unix_s or time.time()) * 1000) * num_stages
        self.deaths = tuple(
            {"id": death_id + s, "stage": s, "detected_perf_s": (detected_unix_s or time.time()) - offset, "exit": "SIGKILL"}
            for s in sorted(self.lost_stages)
        ) if self.is_restart else ()  # fmt: skip
        self._run_header = {"run_id": self.run_id, "started_unix_ns": run_started_unix_ns}
        self.generation = int(self.restart_costs.get("restart_round", 0))
        self.settings = AgentSettings(
            stage=stage,
            num_stages=num_stages,
            incarnation=self.generation,
            rendezvous_timeout_s=rendezvous_timeout_s,
            run_started_unix_ns=run_started_unix_ns,
            death_detected_perf_s=(death_unix_s - offset) if death_unix_s is not None and stage not in held else None,
            directory=str(self.memory.path),  # the stage's journal when the run has no --run-dir: node memory too
        )
        self.memory.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.communicator = self._communicator(stage, num_stages)
        self._joined = False

    # -- what the trainer asks -----------------------------------------------------------------

    @property
    def stage(self) -> int:
        return self.settings.stage

    @property
    def is_replacement(self) -> bool:
        """A worker of a later round without its stage's state: it takes a lost stage."""
        return self.is_restart and self.restored is None

    def abandoned(self) -> bool:
        return self._stop_requested

    def newer_generation_announced(self) -> bool:
        return False  # torchrun re-forms the group by restarting the workers, never under them

    def mark_started(self) -> None:
        """Nothing to mark: a death before the first group formed finds no snapshot anywhere."""

    def leave(self) -> None:
        from .distributed import destroy_process_group

        destroy_process_group()

    def join(self) -> Announcement:
        """The round's group, once; a second call means the group broke: wait for the agent's restart."""
        import torch.distributed as dist

        from .distributed import init_process_group

        if self._joined:
            self.leave()
            self._wait_for_agent()
        stage, num_stages = self.settings.stage, self.settings.num_stages
        arrived_perf_s = time.perf_counter()
        self._publish(f"round-{self.round}/ready/{stage}", {"ready_unix_s": time.time()})
        for other in range(num_stages):
            self._read(f"round-{self.round}/ready/{other}")  # the barrier: every stage is built and here
        init_process_group(
            rank=stage,
            world_size=num_stages,
            device=self.device,
            timeout_s=self.timeout_s,
            store=dist.PrefixStore(f"round-{self.round}/group/", self._store),
        )
        self._joined = True
        self.communicator.rebind(tuple(range(num_stages)))
        return Announcement(
            generation=self.generation,
            members=tuple(range(num_stages)),
            full=True,
            deaths=self.deaths,
            arrived_perf_s=arrived_perf_s,
            formed_perf_s=time.perf_counter(),
        )

    def node_ready(self) -> None:
        """This node's run directory is prepared for the round (its first local worker did it)."""
        self._publish(f"round-{self.round}/node-ready/{self.memory.node_id}", {})

    def wait_node_ready(self) -> None:
        self._read(f"round-{self.round}/node-ready/{self.memory.node_id}")

    # -- snapshots -----------------------------------------------------------------------------

    def save_snapshot(self, step: int, payload: dict[str, Any], *, kill_unix_s: float | None = None) -> int:
        """`kill_unix_s`: when the failure injector decided a kill this snapshot is taken for (the
        next round reads it from the header: the start of the detection it measures)."""
        self._saving = True
        try:
            return self.memory.save(self.settings.stage, step, payload, header=self._run_header | {"kill_unix_s": kill_unix_s})
        finally:
            self._saving = False
            if self._stop_requested:
                self._stopped_by_agent(signal.SIGTERM, None)  # the agent's stop came during the save

    def before_own_kill(self) -> None:
        """The failure injector is about to kill this stage's process: its node dies, memory and all."""
        self.memory.drop(self.settings.stage)

    def finish(self) -> None:
        """The run finished: this stage's snapshot is no longer needed."""
        self.memory.drop(self.settings.stage)
        from .journal import memory_journal_path

        Path(memory_journal_path(self.memory.path, self.settings.stage)).unlink(missing_ok=True)
        try:
            os.rmdir(self.memory.path)  # the last stage of the node removes the folder
        except OSError:
            pass
        self.leave()

    # -- internals -----------------------------------------------------------------------------

    def _communicator(self, stage: int, num_stages: int) -> Any:
        import torch

        from .distributed import Communicator, backend_for

        torch_device = wire_device = torch.device("cpu")
        if self.device == "cuda":
            gpus_on_host = torch.cuda.device_count()
            torch_device = torch.device("cuda", self.local_rank % gpus_on_host)
            ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            if backend_for(self.device, ranks_on_host=ranks_on_host, gpus_on_host=gpus_on_host) == "nccl":
                wire_device = torch_device
        return Communicator(
            rank=stage,
            world_size=num_stages,
            device=torch_device,
            timeout_s=self.timeout_s,
            wire_device=wire_device,
            members=tuple(range(num_stages)),
            interrupted=self.abandoned,
        )

    def _stopped_by_agent(self, _number: int, _frame: Any) -> None:
        """SIGTERM: the agent restarts the workers. The snapshot is on the node already; say when. A
        stop during a save waits for it to end: the snapshot then holds the failures just decided."""
        self._stop_requested = True
        if self._saving:
            return
        try:
            if hasattr(self, "settings"):
                self.memory.note_stopped(self.settings.stage)
        finally:
            os._exit(STOPPED_EXIT_CODE)

    def _wait_for_agent(self) -> None:
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.05)  # the agent's SIGTERM ends this process (`_stopped_by_agent`)
        raise RendezvousFailed(
            f"stage {self.settings.stage}: the process group broke and torchrun's agent did not restart the workers within "
            f"{self.settings.rendezvous_timeout_s:g} s; start torchrun with --max-restarts above 0"
        )

    def _run_identity(self) -> dict[str, Any]:
        import uuid

        proposal = self._signed("run", {"run_id": uuid.uuid4().hex[:12], "started_unix_ns": time.time_ns()})
        decided = bytes(self._store.compare_set("run", "", proposal.decode()))
        value = verify(self.token, "run", decided)
        if value is None:
            raise RendezvousFailed("the run's identity in the rendezvous store is not signed with the run's token; the run cannot go on safely")
        return json.loads(value)

    def _signed(self, key: str, body: dict[str, Any]) -> bytes:
        return sign(self.token, key, json.dumps(body).encode())

    def _publish(self, key: str, body: dict[str, Any]) -> None:
        self._store.set(key, self._signed(key, body))

    def _read(self, key: str) -> dict[str, Any]:
        """The value under `key` once it is there (waits up to the store's timeout); verified."""
        value = verify(self.token, key, bytes(self._store.get(key)))
        if value is None:
            raise RendezvousFailed(f"the rendezvous key {key!r} is not signed with the run's token (someone else wrote it); the run cannot go on safely")
        return json.loads(value)



def check_token_proof(raw_store: Any, token: str) -> None:
    """The first worker of the run fixes the run's proof of its token; every later one must verify it."""
    proof = sign(token, _PROOF_LABEL, store_namespace(token).encode())
    decided = bytes(raw_store.compare_set(TOKEN_PROOF_KEY, "", proof.decode()))
    if verify(token, _PROOF_LABEL, decided) is None:
        raise InputError(
            "CHURNSIM_RUN_TOKEN is not the token of the run this rendezvous serves: this worker may not join it; "
            "use the token file written with the run's scenario (`churnsim real run --write-config`)"
        )
