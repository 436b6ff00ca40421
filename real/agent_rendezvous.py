"""torch's c10d rendezvous, its store bound to the address the user names (one-machine agent launches).

torch's c10d backend opens its TCPStore on every interface of the endpoint's host, whatever address
the endpoint names. `create_handler` builds the same rendezvous (torch's `C10dRendezvousBackend` and
`DynamicRendezvousHandler`) over a store listening on the endpoint's address only
(real/distributed.py's `serve_store`); `register` makes it the backend `churnsim-c10d` of this
process's torch.distributed.elastic registry (real/agent_launch.py uses it). A second agent on the
same machine finds the port taken and joins as a client, as torch's does.
"""

from __future__ import annotations

import datetime
from typing import Any

from churnsim.calibration.errors import InputError

BACKEND_NAME = "churnsim-c10d"
DEFAULT_PORT = 29400


def _bound_backend_class() -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    class BoundC10dBackend(C10dRendezvousBackend):
        """torch's c10d backend under the name it is registered as (torch checks the two agree)."""

        @property
        def name(self) -> str:
            return BACKEND_NAME

    return BoundC10dBackend


def create_handler(params: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as create_dynamic_handler
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    from .distributed import serve_store

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    configured = params.get_as_bool("is_host")
    is_host = configured if configured is not None else _matches_machine_hostname(host)
    read_timeout_s = int(params.get_as_int("read_timeout", 60))
    store = None
    if is_host:
        try:
            store = serve_store(host, read_timeout_s, port=port)
        except InputError as error:
            if configured:
                raise RendezvousConnectionError(str(error)) from None
            # Another agent on this machine serves it already: join as a client.
    if store is None:
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=read_timeout_s))
    return create_dynamic_handler(store, _bound_backend_class()(store, params.run_id), params)

def register() -> None:
    """Make `churnsim-c10d` a rendezvous backend of this process (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
    except ValueError:
        pass  # registered already
