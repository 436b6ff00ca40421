"""A hard-failure run on this machine through torchrun's agent: the multi-machine code path with one node.

`launch_with_agent` starts one torch.distributed.elastic agent in this process
(`torch.distributed.launcher.api.elastic_launch`, torch's c10d rendezvous with its store listening on
`rendezvous_host` only, real/agent_rendezvous.py, a port the kernel picks) with one worker per stage, each `python -m churnsim.real.launch` as under torchrun
(real/agent_worker.py): a killed worker is restarted by the agent, the other workers too, and the
survivors come back from node memory. Nothing is coordinated through files; the workers' store is
served by the rank-0 worker on the rendezvous host.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from churnsim.calibration.errors import InputError

from .run_secret import TOKEN_VARIABLE, check_listen_address


class AgentRunFailed(RuntimeError):
    """The agent gave up (a worker failed more often than `max_restarts`, or failed before the run started)."""


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """The agent hands its environment to the workers it starts."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_with_agent(
    scenario_file: Path,
    *,
    num_stages: int,
    token: str,
    run_dir: Path,
    replication: int = 0,
    max_restarts: int = 64,
    rendezvous_host: str = "127.0.0.1",
) -> None:
    """Run the (one-method) scenario in `scenario_file` with one agent and `num_stages` workers; the run
    record is written to `run_dir`. AgentRunFailed when the agent gives up."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .agent_rendezvous import BACKEND_NAME, register

    check_listen_address(rendezvous_host, "rendezvous_host")
    register()  # torch's c10d rendezvous with its store on `rendezvous_host` only
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_stages,
        run_id=f"churnsim-{uuid.uuid4().hex[:12]}",
        rdzv_backend=BACKEND_NAME,
        rdzv_endpoint=f"{rendezvous_host}:0",
        rdzv_configs={"is_host": True},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=rendezvous_host,
    )
    arguments = ("-P", "-m", "churnsim.real.launch", "--scenario", str(scenario_file), "--replication", str(replication), "--run-dir", str(run_dir))
    try:
        with _environment(**{TOKEN_VARIABLE: token, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONSAFEPATH": "1"}):
            elastic_launch(config, sys.executable)(*arguments)
    except ChildFailedError as error:
        failures = getattr(error, "failures", {})
        codes = sorted({failure.exitcode for failure in failures.values()}) if failures else []
        if codes == [2]:
            raise InputError("a stage process refused the run's input; its message is above") from None
        raise AgentRunFailed(f"torchrun's agent gave up after {max_restarts} restarts: stage process exit codes {codes}") from None
