"""Hard failures: the rendezvous by which stage processes (re-)form their process group.

A hard failure kills a stage's process. The launcher (launch.py, `ElasticSupervisor`) starts a
replacement with the same stage after the join delay, and every live process joins a new
*generation* of the process group. Everything runs on one machine, through two channels:

- a TCPStore served by the launcher on the rendezvous host (loopback unless the user names an
  address); every key lives under the run's secret namespace (run_secret.py), and
  `init_process_group` of generation g adds the prefix `generation-<g>/`, so the old group's keys
  can never be confused with the new one's:

      generation-<g>/arrived/<stage>   a stage reached generation g's barrier (signed with the secret)
      generation-<g>/outcome           "formed" or "abandoned" (signed with the secret)

- files in the launcher's run directory (`directory`), written atomically (temp file + rename):

      generation            the newest announced generation, a decimal number
      generation-<g>.json   {"generation": g, "members": [stages in rank order], "full": bool,
                             "deaths": [{"id", "stage", "detected_perf_s", "exit"}, ...]}  (every
                             death so far; `detected_perf_s` on the machine's monotonic clock)
      abort-<g>             generation g is abandoned: one of its members died
      journal-<stage>.jsonl the stage's results so far (real/journal.py), across incarnations
      result-<stage>.bin    the stage's final result (safe_codec bytes)
      started               the first group formed and training began

Joining generation g: wait until some generation newer than the current one is announced, read its
members, write its signed arrival to the store and wait (the join handshake: a value that does not
verify with the run's secret counts for nobody). Generation g then either forms or is given
up, decided once for all its members by the store (`compare_set` of `generation-<g>/outcome`): the
first member to see every member's mark sets "formed", the first to see `abort-<g>` or a newer
generation (a member may skip g: a replacement that was still starting when g+1 came) sets
"abandoned"; whoever loses the race follows the winner. "formed": `init_process_group` through the
store; "abandoned": on to the newest generation. Only a death writes `abort-<g>`; a planned change (a
degraded group of the survivors giving way to the full group once the replacement is up) is
announced without one, and the ranks of a formed group switch together at an iteration boundary
(the trainer's boundary all-reduce carries "a newer generation exists").

A rank notices that its group lost a member in one of three ways: the failure injector told every
rank (a scheduled kill), a connection to the dead peer closed (gloo raises at once), or the launcher
wrote `abort-<g>` while the rank waited on a live peer (`Communicator.interrupted`, polled).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .distributed import Communicator, backend_for, connect_store, destroy_process_group, init_process_group
from .run_secret import sign, verify

GENERATION_FILE = "generation"
STARTED_FILE = "started"
"""Written by stage 0 once the first group formed: a death before it ends the run (nothing to keep)."""
_POLL_S = 0.005
"""How often a rank looks for an announcement or a barrier mark while it waits (files on one machine)."""


class RendezvousFailed(RuntimeError):
    """No generation this rank could join formed within the rendezvous timeout."""


def announcement_path(directory: str, generation: int) -> str:
    return os.path.join(directory, f"generation-{generation}.json")


def abort_path(directory: str, generation: int) -> str:
    return os.path.join(directory, f"abort-{generation}")


def arrival_key(generation: int, stage: int) -> str:
    """The store key (under the run's namespace) of a stage's arrival at generation `generation`."""
    return f"generation-{generation}/arrived/{stage}"


def journal_path(directory: str, stage: int) -> str:
    return os.path.join(directory, f"journal-{stage}.jsonl")


def result_path(directory: str, stage: int) -> str:
    return os.path.join(directory, f"result-{stage}.bin")


def write_atomically(path: str, data: bytes) -> None:
    """Readers see the old file or the whole new one (same directory, rename)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        file.write(data)
    os.replace(temporary, path)


def announce(directory: str, generation: int, *, members: list[int], full: bool, deaths: list[dict[str, Any]]) -> None:
    """Launcher: publish generation `generation` (its file first, then the pointer to it)."""
    body = {"generation": generation, "members": sorted(members), "full": full, "deaths": deaths}
    write_atomically(announcement_path(directory, generation), json.dumps(body).encode())
    write_atomically(os.path.join(directory, GENERATION_FILE), str(generation).encode())


def abandon(directory: str, generation: int) -> None:
    """Launcher: generation `generation` lost a member; its ranks stop waiting on each other."""
    with open(abort_path(directory, generation), "wb"):
        pass


def newest_generation(directory: str) -> int:
    """The newest announced generation, -1 before the first."""
    try:
        with open(os.path.join(directory, GENERATION_FILE), "rb") as file:
            return int(file.read().decode() or -1)
    except (OSError, ValueError):
        return -1


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    """What the launcher tells one stage process about the rendezvous (picklable: process arguments)."""

    directory: str
    store_port: int
    store_host: str = "127.0.0.1"
    token: str = dataclasses.field(repr=False, default="")
    """The run's secret (run_secret.py): names the store's keys and signs this process's arrivals."""
    stage: int
    num_stages: int
    incarnation: int
    """0 for a process of the first generation, n for the n-th replacement of this stage."""
    rendezvous_timeout_s: float
    """Longest wait for a generation to form (covers the join delay and a replacement's start)."""
    run_started_unix_ns: int
    """When the launcher started the run (checkpoints older than that belong to an earlier run)."""
    death_detected_perf_s: float | None = None
    """Replacement: when the launcher saw the death it replaces (time.perf_counter, machine-wide)."""


@dataclass(frozen=True, kw_only=True)
class Announcement:
    generation: int
    members: tuple[int, ...]
    full: bool
    deaths: tuple[dict[str, Any], ...]
    arrived_perf_s: float
    """When this rank reached the generation's barrier."""
    formed_perf_s: float
    """When its process group was formed on this rank."""


class Membership:
    """One stage process's view of the generations (worker side)."""

    def __init__(self, settings: ElasticSettings, *, device: str, timeout_s: float) -> None:
        import torch.distributed as dist

        import torch

        self.settings = settings
        self.device = device
        self.timeout_s = timeout_s
        self.generation = -1
        torch_device = wire_device = torch.device("cpu")
        if device == "cuda":
            gpus_on_host = torch.cuda.device_count()
            torch_device = torch.device("cuda", settings.stage % gpus_on_host)
            if backend_for(device, ranks_on_host=settings.num_stages, gpus_on_host=gpus_on_host) == "nccl":
                wire_device = torch_device
        # One communicator for the process's life: each generation re-binds it to the new group.
        self.communicator = Communicator(
            rank=settings.stage,
            world_size=settings.num_stages,
            device=torch_device,
            timeout_s=timeout_s,
            wire_device=wire_device,
            members=tuple(range(settings.num_stages)),
            interrupted=self.abandoned,
        )
        self.communicator.rebind(tuple(range(settings.num_stages)))
        # Every key under the run's secret namespace: a process without the secret can neither read
        # nor write them (run_secret.py says what this does not protect against).
        self._store = connect_store(settings.store_host, settings.store_port, settings.token, settings.rendezvous_timeout_s)

    @property
    def stage(self) -> int:
        return self.settings.stage

    @property
    def is_replacement(self) -> bool:
        return self.settings.incarnation > 0

    def abandoned(self) -> bool:
        """Whether the launcher abandoned the generation this rank is in (a member died)."""
        return self.generation >= 0 and os.path.exists(abort_path(self.settings.directory, self.generation))

    def newer_generation_announced(self) -> bool:
        return newest_generation(self.settings.directory) > self.generation

    def mark_started(self) -> None:
        with open(os.path.join(self.settings.directory, STARTED_FILE), "wb"):
            pass

    def leave(self) -> None:
        destroy_process_group()

    def join(self) -> Announcement:
        """Leave the current group and join the next generation that forms with this stage in it."""
        import torch.distributed as dist

        directory, stage = self.settings.directory, self.settings.stage
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s
        self.leave()
        tried = self.generation
        while True:
            generation = newest_generation(directory)
            if generation <= tried:
                self._sleep_before(deadline, "no new generation was announced")
                continue
            with open(announcement_path(directory, generation), "rb") as file:
                body = json.loads(file.read())
            members = tuple(int(member) for member in body["members"])
            tried = generation
            if stage not in members:
                continue  # a group of the others (this stage's replacement is still starting)
            if os.path.exists(abort_path(directory, generation)):
                # Abandoned before this rank came: a replacement started while another stage's
                # replacement was still pending finds the newest generation one that formed before
                # its predecessor died. Every member's mark is there, and the generation's outcome
                # says "formed": joining it would wait on a group that is gone. A newer one follows.
                continue
            arrived_perf_s = time.perf_counter()
            self._store.set(arrival_key(generation, stage), self._signed(arrival_key(generation, stage), str(self.settings.incarnation)))
            if not self._barrier(generation, members, deadline):
                continue  # a member died before everyone arrived: a newer generation follows
            try:
                init_process_group(
                    rank=members.index(stage),
                    world_size=len(members),
                    device=self.device,
                    timeout_s=self.timeout_s,
                    store=dist.PrefixStore(f"generation-{generation}/", self._store),
                )
            except RuntimeError:
                # A member died between the barrier and the group's connections: its peers time out
                # here, and the launcher announces a newer generation.
                destroy_process_group()
                if time.monotonic() > deadline:
                    raise
                continue
            self.generation = generation
            self.communicator.rebind(members)
            return Announcement(
                generation=generation,
                members=members,
                full=bool(body["full"]),
                deaths=tuple(body["deaths"]),
                arrived_perf_s=arrived_perf_s,
                formed_perf_s=time.perf_counter(),
            )

    def _barrier(self, generation: int, members: tuple[int, ...], deadline: float) -> bool:
        """Wait until the generation forms (every member arrived: True) or is given up (False)."""
        directory = self.settings.directory
        outcome_key = f"generation-{generation}/outcome"
        while True:
            if all(self._arrived(generation, member) for member in members):
                wanted = b"formed"
            elif os.path.exists(abort_path(directory, generation)) or newest_generation(directory) > generation:
                wanted = b"abandoned"
            else:
                self._sleep_before(deadline, f"generation {generation} did not form (members {list(members)})")
                continue
            # The first member to decide decides for all: no member forms a group another gave up.
            decided = self._store.compare_set(outcome_key, "", self._signed(outcome_key, wanted.decode()).decode())
            outcome = verify(self.settings.token, outcome_key, bytes(decided))
            if outcome is None:
                raise RendezvousFailed(
                    f"stage {self.settings.stage}: the outcome of generation {generation} in the rendezvous store is not "
                    "signed with the run's token (someone else wrote it); the run cannot go on safely"
                )
            return outcome == b"formed"

    def _signed(self, key: str, value: str) -> bytes:
        return sign(self.settings.token, key, value.encode())

    def _arrived(self, generation: int, member: int) -> bool:
        """Whether `member` wrote a valid arrival for `generation` (an unsigned one does not count)."""
        key = arrival_key(generation, member)
        if not self._store.check([key]):
            return False
        return verify(self.settings.token, key, bytes(self._store.get(key))) is not None

    def _sleep_before(self, deadline: float, why: str) -> None:
        if time.monotonic() > deadline:
            raise RendezvousFailed(
                f"stage {self.settings.stage}: {why} within the rendezvous timeout of "
                f"{self.settings.rendezvous_timeout_s:g} s"
            )
        time.sleep(_POLL_S)
