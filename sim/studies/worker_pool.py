"""Ending a local process pool at once, on Ctrl-C or an error: nothing queued runs, no worker outlives it.

`ProcessPoolExecutor.shutdown(cancel_futures=True)` drops the queued tasks but lets each worker finish
the one it holds, and the interpreter joins them at exit, so one Ctrl-C left a long replication
running (and a second one orphaned the workers). The workers ignore SIGINT (the parent decides,
`sweep._ignore_interrupts`), so they are ended here with SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

GRACE_S = 2.0
"""How long a worker may take to exit after SIGTERM before it is killed."""


def stop_worker_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel every queued task of `pool` and end its worker processes now."""
    # The executor keeps its workers in `_processes` (CPython 3.8+); read before shutdown clears it.
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(GRACE_S)
        if worker.is_alive():
            worker.kill()
            worker.join(GRACE_S)
