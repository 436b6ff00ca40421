"""One torchrun worker of a hard-failure run (`python -m churnsim.real.launch` under torchrun's agent).

The agent (torchrun, c10d rendezvous) starts the worker, restarts it with every other worker when one
dies, and lets an agent started on another machine with the same command join; the worker takes a
stage (real/agent_membership.py), trains it (real/trainer.py, hard failures), and when the run is
over sends its rows to the process that runs stage 0, which writes the run record into *its* node's
`--run-dir`. Each machine's `--run-dir` is its own: checkpoints, journal and node-local levels of the
stages it ran; no directory is shared between machines (a remote checkpoint tier, if the method has
one, is `training.remote_checkpoint_dir`). With data parallelism a worker runs one (stage, replica)
slot, replica × S + stage.

`run_local_worker` is the same worker for a local run (`launch_local`: one agent in the launcher's
process, real/agent_launch.py): each worker stands in for a machine of its own, and the results go
back to the launcher, which writes the record.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .journal import JOURNAL_DIRECTORY
from .run_directory import RunDirectory, prepare_run_directory, read_run_file


def _node_run_directory(run_dir: Path, config: Any, run_id: str, token: str, resumable: bool) -> RunDirectory:
    """This node's run directory for run `run_id`: taken as it is when it already holds that run (an
    earlier round of the agent), prepared as a new run's otherwise (refused as `launch_local` does)."""
    existing = read_run_file(run_dir) if run_dir.is_dir() else None
    if existing is not None and existing.get("run_id") == run_id:
        return RunDirectory(run_dir, existing, None, token)  # type: ignore[arg-type]
    lease = prepare_run_directory(
        run_dir, config=config.to_dict(), method=config.method.name, resume=False, resumable=resumable, run_id=run_id, token=token
    )
    lease.release()  # the agent, not a lock, keeps other runs out of a node's directory while this one runs
    return RunDirectory(run_dir, read_run_file(run_dir) or {}, None, token)  # type: ignore[arg-type]


def _membership(config: Any, token: str, **node: Any) -> Any:
    """This worker's `AgentMembership` for the run `config` describes; `node` names its node's memory
    where one agent stands in for a machine per worker (`run_local_worker`)."""
    from .agent_membership import AgentMembership
    from .launch import rendezvous_timeout_s

    return AgentMembership(
        token=token,
        num_stages=config.num_stages,
        data_parallel_degree=config.data_parallel_degree,
        device=config.device,
        timeout_s=config.timeout_s,
        rendezvous_timeout_s=rendezvous_timeout_s(config.timeout_s, config.join_delay_s),
        join_delay_s=config.join_delay_s,
        **node,
    )


def run_worker(config: Any, token: str, run_dir: Path | None, *, scenario: Any, replication: int) -> int:
    """Train this worker's stage under torchrun's agent; 0 when the run finished."""
    from .launch import _finish
    from .methods import METHODS
    from .results import merge_rank_results
    from .run_secret import checkpoint_key
    from .trainer import train_stage

    membership = _membership(config, token)
    config = dataclasses.replace(config, run_id=membership.run_id, checkpoint_key=checkpoint_key(token))
    lease = None
    journal_directory = None
    if run_dir is not None:
        resumable = METHODS[config.method.name].resumable if config.method.name in METHODS else False
        journal_directory = run_dir / JOURNAL_DIRECTORY / "attempt-0"
        if membership.local_rank == 0:  # one worker per node prepares the node's directory; the others wait
            lease = _node_run_directory(run_dir, config, membership.run_id, token, resumable)
            journal_directory.mkdir(parents=True, exist_ok=True)
            membership.node_ready()
        else:
            membership.wait_node_ready()
    rank_result = train_stage(
        config, None, run_dir=run_dir, membership=membership, journal_directory=str(journal_directory) if journal_directory else None
    )
    gathered = membership.communicator.gather_objects(rank_result, destination=0)
    if run_dir is not None:
        run_file = read_run_file(run_dir) or {}
        node_lease = lease if lease is not None else RunDirectory(run_dir, run_file, None, token)  # type: ignore[arg-type]
        if gathered is not None:
            _finish(node_lease, merge_rank_results(config, gathered), scenario=scenario, replication=replication)
        elif run_file.get("status") == "running":
            node_lease.mark("finished")  # this node's part is done; the record is on stage 0's node
    membership.communicator.barrier()  # nobody leaves while stage 0 may still need a connection
    membership.finish()
    return 0


def _end_with_launcher(launcher_pid: int) -> None:
    """A daemon thread: this worker ends (SIGKILL) when the process that runs the agent is gone."""

    def watch() -> None:
        while True:
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGKILL)
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, name="churnsim-launcher-watch", daemon=True).start()


def _progress_reporter(progress_path: str | None) -> Any:
    """The head of replica 0 writes its latest iteration for the launcher's progress display."""
    if progress_path is None:
        return None

    def report(row: dict[str, Any]) -> None:
        temporary = f"{progress_path}.{os.getpid()}.tmp"
        with open(temporary, "w") as file:
            json.dump({key: row[key] for key in ("step", "iteration", "train_loss")}, file)
        os.replace(temporary, progress_path)  # the launcher never reads a half-written file

    return report


def run_local_worker(
    config: Any,
    token: str,
    run_dir: Path | None,
    journal_directory: str,
    progress_path: str | None,
    warnings_path: str,
    node_memory_root: str,
    node_prefix: str,
    launcher_pid: int,
    after_run: Any = None,
) -> Any:
    """One worker of a local hard-failure run (`launch_local`, one agent, real/agent_launch.py): the
    same membership and trainer as a torchrun worker, each worker standing in for a machine of its
    own. Returns every slot's result on slot 0 (None on the others); `launch_local` writes the record.
    `after_run(parts)`: called with the slot's trained stage when the run is done (tests compare replicas)."""
    from .distributed import keep_connections_on
    from .launch import _die_with_parent
    from .methods.checkpointing import drop_node_local_level
    from .trainer import train_stage
    from .warnings_relay import relay_to

    _die_with_parent()
    _end_with_launcher(launcher_pid)
    relay_to(warnings_path)
    keep_connections_on(os.environ["MASTER_ADDR"])
    membership = _membership(
        config,
        token,
        node_id=f"{node_prefix}-{os.environ.get('LOCAL_RANK', '0')}",
        memory_root=Path(node_memory_root),
        worker_is_node=True,
    )
    if run_dir is not None and membership.is_replacement:
        # A slot whose node died: that node's disk (the node-local checkpoint level) died with it.
        replica, stage = divmod(membership.stage, config.num_stages)
        drop_node_local_level(run_dir, stage, replica)
    rank_result = train_stage(
        config, None, run_dir=run_dir, membership=membership, journal_directory=journal_directory,
        on_iteration_done=_progress_reporter(progress_path), after_run=after_run,
    )  # fmt: skip
    gathered = membership.communicator.gather_objects(rank_result, destination=0)
    membership.communicator.barrier()  # nobody leaves while slot 0 may still need a connection
    membership.finish()
    return gathered
