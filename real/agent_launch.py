"""Hard failures on this machine: one torch.distributed.elastic agent, the multi-machine code path with one node.

`launch_local` (real/launch.py) runs every hard-failure run through `launch_with_agent`: one
torch.distributed.elastic agent in this process (`LocalElasticAgent`, torch's c10d rendezvous with its
store listening on `rendezvous_host` only, real/agent_rendezvous.py, a port the kernel picks) with one
worker per (stage, replica) slot, each running real/agent_worker.py's `run_local_worker`: the same
membership (real/agent_membership.py) and trainer as a torchrun worker on a cluster. Every worker
stands in for a machine of its own (`worker_is_node`), so a worker killed by a signal loses its node:
its snapshot in node memory and its node-local checkpoint level. When a worker dies by a signal the
agent stops every other worker and starts them all again (torch's restart of the worker group); the
survivors reload their state from node memory (real/node_memory.py), the restarted worker of the lost
slot takes it after the scenario's join delay, and the method recovers it (or, with data
parallelism, it heals from a surviving replica). A worker that fails with an error (not a kill) ends
the run, as under soft failures. Nothing is coordinated through files: membership, rounds and the
stage policy go through the rendezvous store and the workers' process group; the workers' results
come back as the return value of slot 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .agent_membership import STOPPED_EXIT_CODE
from .run_secret import check_listen_address

_RUNNING: dict[str, Any] = {}
"""The agent running in this process, while it runs (`worker_pids`)."""


class AgentRunFailed(RuntimeError):
    """The agent gave up: a worker failed with an error, or no state was left to recover from."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.rank = rank


def worker_pids() -> dict[int, int]:
    """{local rank: pid} of the workers of the agent running in this process ({} when none runs):
    tests and operators kill a worker from here, as `kill` would on a cluster."""
    agent = _RUNNING.get("agent")
    context = getattr(agent, "_pcontext", None) if agent is not None else None
    if context is None:
        return {}
    try:
        return {int(rank): int(pid) for rank, pid in context.pids().items()}
    except (AttributeError, AssertionError, ValueError):
        return {}


@contextlib.contextmanager
def _torch_elastic_logs_quiet() -> Iterator[None]:
    """torch's agent logs every restart and every worker it stops; the run record says what happened."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    names = {name for name in logging.root.manager.loggerDict if name.startswith(prefixes)} | set(prefixes)
    loggers = [logging.getLogger(name) for name in sorted(names)]  # torch sets a level on each module's logger
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _agent_class() -> Any:
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class KillsOnlyAgent(LocalElasticAgent):
        """torch's local agent, restarting the workers only when one was killed by a signal; a worker
        that failed with an error (an exception, exit code > 0) ends the run at once."""

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and any(
                failure.exitcode >= 0 and failure.exitcode != STOPPED_EXIT_CODE for failure in result.failures.values()
            ):
                self._remaining_restarts = 0
            return result

    return KillsOnlyAgent


_SHUTDOWN_TIMEOUT_S = 5
"""How long an interrupted agent waits for its workers to stop before it SIGKILLs them."""


def _failure_message(failures: dict[int, Any], max_restarts: int) -> AgentRunFailed:
    """One line for the run's end: the worker's own error where it had one, else how it ended."""
    for rank, failure in sorted(failures.items()):
        message = failure.message if isinstance(failure.message, str) else str(failure.message.get("message", ""))
        if failure.exitcode > 0 and failure.exitcode != STOPPED_EXIT_CODE and message and not message.startswith("To enable traceback"):
            return AgentRunFailed(f"stage/rank {rank} failed: {message}", rank=rank)
    rank, failure = min(failures.items())
    return AgentRunFailed(
        f"stage/rank {rank} ended with exit code {failure.exitcode} after the agent had restarted the workers {max_restarts} "
        "times, the most it may (recovery.max_replacements); the run ends: raise recovery.max_replacements or lower the failure rate",
        rank=rank,
    )


def launch_with_agent(
    entrypoint: Callable[..., Any],
    arguments: tuple[Any, ...],
    *,
    num_workers: int,
    log_dir: Path,
    max_restarts: int = 64,
    rendezvous_host: str = "127.0.0.1",
    start_method: str = "forkserver",
    poll: Callable[[], None] | None = None,
    poll_interval_s: float = 0.25,
) -> dict[int, Any]:
    """Run `entrypoint(*arguments)` on `num_workers` workers of one torch.distributed.elastic agent in
    this process (module docstring); returns {local rank: return value} of the round that finished.
    `poll()` is called every `poll_interval_s` from a thread while the workers run (progress).
    AgentRunFailed when the agent gives up."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry

    from .agent_rendezvous import BACKEND_NAME, register

    check_listen_address(rendezvous_host, "rendezvous_host")
    register()  # torch's c10d rendezvous with its store on `rendezvous_host` only
    parameters = RendezvousParameters(
        backend=BACKEND_NAME, endpoint=f"{rendezvous_host}:0", run_id=f"churnsim-{uuid.uuid4().hex[:12]}",
        min_nodes=1, max_nodes=1, local_addr=rendezvous_host, is_host=True,
    )  # fmt: skip
    saved = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    # The workers' store is slot 0's, bound to the rendezvous host (real/agent_membership.py).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    stop = threading.Event()
    poller = None
    try:
        spec = WorkerSpec(
            role="churnsim", local_world_size=num_workers, entrypoint=entrypoint, args=arguments,
            rdzv_handler=registry.get_rendezvous_handler(parameters), max_restarts=max_restarts, monitor_interval=0.05,
            local_addr=rendezvous_host,
        )  # fmt: skip
        agent = _agent_class()(
            spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)), start_method=start_method, exit_barrier_timeout=30,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )  # fmt: skip
        if poll is not None:

            def keep_polling() -> None:
                while not stop.wait(poll_interval_s):
                    poll()

            poller = threading.Thread(target=keep_polling, name="churnsim-progress", daemon=True)
            poller.start()
        _RUNNING["agent"] = agent
        try:
            with _torch_elastic_logs_quiet():
                result = agent.run()
        except SignalException as error:  # torch's agent turns SIGTERM/SIGINT into this after stopping the workers
            raise KeyboardInterrupt if error.sigval == 2 else SystemExit(128 + int(error.sigval)) from None
        finally:
            _RUNNING.pop("agent", None)
            spec.rdzv_handler.shutdown()
        if result.is_failed():
            raise _failure_message(result.failures, max_restarts)
        return dict(result.return_values)
    finally:
        stop.set()
        if poller is not None:
            poller.join()
        if saved is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = saved


def node_prefix() -> str:
    """The name under which this launch's workers keep node memory: host and launcher, so that two
    launches on one machine never share a node."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
