"""One torchrun worker of a hard-failure run (`python -m churnsim.real.launch` under torchrun's agent).

The agent (torchrun, c10d rendezvous) starts the worker, restarts it with every other worker when one
dies, and lets an agent started on another machine with the same command join; the worker takes a
stage (real/agent_membership.py), trains it (real/trainer.py, hard failures), and when the run is
over sends its rows to the process that runs stage 0, which writes the run record into *its* node's
`--run-dir`. Each machine's `--run-dir` is its own: checkpoints, journal and node-local levels of the
stages it ran; no directory is shared between machines (a remote checkpoint tier, if the method has
one, is `training.remote_checkpoint_dir`).
"""

from __future__ import annotations

import dataclasses
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


def run_worker(config: Any, token: str, run_dir: Path | None, *, scenario: Any, replication: int) -> int:
    """Train this worker's stage under torchrun's agent; 0 when the run finished."""
    from .agent_membership import AgentMembership
    from .launch import _finish, rendezvous_timeout_s
    from .methods import METHODS
    from .results import merge_rank_results
    from .run_secret import checkpoint_key
    from .trainer import train_stage

    if getattr(config, "data_parallel_degree", 1) > 1:
        from churnsim.calibration.errors import InputError

        raise InputError(
            "data_parallel_degree > 1 with hard failures under torchrun is not supported yet; run it on one machine "
            "with `churnsim real run` (without --agent), or use training.failure_mode = 'soft'"
        )
    membership = AgentMembership(
        token=token,
        num_stages=config.num_stages,
        device=config.device,
        timeout_s=config.timeout_s,
        rendezvous_timeout_s=rendezvous_timeout_s(config.timeout_s, config.join_delay_s),
        join_delay_s=config.join_delay_s,
    )
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

