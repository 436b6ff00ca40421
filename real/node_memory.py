"""A stage's training state kept in its node's host memory, so that it outlives a restart of the process.

torchrun's agent restarts every local worker when one of them fails (and when a node joins): the
processes go, the machine stays. Each stage process therefore keeps a copy of its state in the
node's shared memory (`/dev/shm` on Linux) after every update, and a process the agent starts in
its place on the same node reloads it (real/agent_membership.py). A node that dies takes its
copies with it, which is what a hard failure means: the stage's state is lost and the method
recovers it.

    <root>/churnsim-<run label>-<node>/stage-<s>.bin   one stage's snapshot (safe_codec bytes + HMAC)
    <root>/churnsim-<run label>-<node>/stopped-<s>.json  when the agent stopped the process (unix s)

`<root>`: `CHURNSIM_NODE_MEMORY_DIR`, else `/dev/shm`, else the temporary directory. `<run label>`
derives from the run's secret (nobody else's run shares it); `<node>`: `CHURNSIM_NODE_ID`, else the
host name and the agent's process id (a new agent on the same machine is a new node, as a
replacement machine would be). The directory is the user's only (mode 0700). A finished run removes
its snapshots; a run the agents gave up on leaves them (`rm -r /dev/shm/churnsim-*` frees them),
and agents started again with the same token on the same machines continue from them. A snapshot carries an
HMAC keyed by the run's secret and is decoded with the safe codec (JSON + raw tensors, no code).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .run_secret import derive
from .safe_codec import decode, encode

ROOT_VARIABLE = "CHURNSIM_NODE_MEMORY_DIR"
NODE_VARIABLE = "CHURNSIM_NODE_ID"
_MAC_BYTES = 32


class SnapshotRefused(RuntimeError):
    """A snapshot in node memory that is not this run's (wrong HMAC) or is damaged."""


def default_root() -> Path:
    chosen = os.environ.get(ROOT_VARIABLE)
    if chosen:
        return Path(chosen)
    shared = Path("/dev/shm")
    return shared if shared.is_dir() and os.access(shared, os.W_OK) else Path(tempfile.gettempdir())


def default_node_id() -> str:
    chosen = os.environ.get(NODE_VARIABLE)
    if chosen:
        return "".join(character if character.isalnum() or character in "-_." else "_" for character in chosen)
    return f"{socket.gethostname()}-{os.getppid()}"


class NodeMemory:
    """This node's snapshots of the run's stages."""

    def __init__(self, token: str, *, root: Path | None = None, node_id: str | None = None) -> None:
        self.token = token
        self.node_id = node_id if node_id is not None else default_node_id()
        self.path = (root if root is not None else default_root()) / f"churnsim-{derive(token, 'node-memory')[:16]}-{self.node_id}"

    def _stage_path(self, stage: int) -> Path:
        return self.path / f"stage-{stage}.bin"

    def _mac(self, stage: int, body: bytes) -> bytes:
        return hmac.new(self.token.encode(), f"node-memory/stage-{stage}".encode() + b"\0" + body, hashlib.sha256).digest()

    def held_stages(self) -> dict[int, dict[str, Any]]:
        """{stage: header} of every snapshot on this node (the header's "step" and what `save` was given)."""
        held: dict[int, dict[str, Any]] = {}
        if not self.path.is_dir():
            return held
        for entry in self.path.iterdir():
            name = entry.name
            if name.startswith("stage-") and name.endswith(".bin"):
                try:
                    stage = int(name[len("stage-") : -len(".bin")])
                    with open(entry, "rb") as file:
                        header = json.loads(file.readline(4096))
                    int(header["step"])
                    held[stage] = header
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # a damaged or half-written file holds nothing
        return held

    def save(self, stage: int, step: int, payload: dict[str, Any], header: dict[str, Any] | None = None) -> int:
        """Write `payload` (safe_codec-encodable) as stage `stage`'s snapshot at `step`, with `header`
        (small JSON, readable without loading the snapshot); returns its bytes."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        body = encode(payload)
        header_bytes = json.dumps((header or {}) | {"step": int(step)}).encode() + b"\n"
        data = header_bytes + self._mac(stage, header_bytes + body) + body
        target = self._stage_path(stage)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, target)  # a reader sees the previous snapshot or this one, whole
        return len(data)

    def load(self, stage: int) -> tuple[dict[str, Any], int]:
        """(payload, bytes) of stage `stage`'s snapshot; SnapshotRefused if it is not this run's or damaged."""
        with open(self._stage_path(stage), "rb") as file:
            data = file.read()
        header, separator, rest = data.partition(b"\n")
        if not separator or len(rest) < _MAC_BYTES:
            raise SnapshotRefused(f"the snapshot of stage {stage} in {self.path} is truncated")
        mac, body = rest[:_MAC_BYTES], rest[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(stage, header + separator + body)):
            raise SnapshotRefused(f"the snapshot of stage {stage} in {self.path} is not this run's (its HMAC does not verify)")
        return decode(body), len(data)

    def drop(self, stage: int) -> None:
        """The stage's node died: its memory goes with it."""
        self._stage_path(stage).unlink(missing_ok=True)
        self.forget_stopped(stage)

    def forget_stopped(self, stage: int) -> None:
        (self.path / f"stopped-{stage}.json").unlink(missing_ok=True)

    def note_stopped(self, stage: int) -> None:
        """The agent is stopping this stage's process (SIGTERM): when, for the restart's cost."""
        if not self.path.is_dir():
            return
        target = self.path / f"stopped-{stage}.json"
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(temporary, "w") as file:
            json.dump({"stopped_unix_s": time.time()}, file)
        os.replace(temporary, target)

    def stopped_unix_s(self, stage: int) -> float | None:
        try:
            with open(self.path / f"stopped-{stage}.json") as file:
                return float(json.load(file)["stopped_unix_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
