"""Start a real pipeline run: S local processes (`launch_local`) or one rank under torchrun (`main`).

Each rank runs `trainer.train_stage`; the per-rank results (iteration rows, spans, failures,
recovery outcomes) are gathered to rank 0 over the process group, merged, and written as a run
record (calibration/run_record.py) when a run directory is given.

Hard failures (`failure_mode = "hard"`) have one code path, on one machine and on many:
torch.distributed.elastic's agent restarts the stage processes (torch's c10d rendezvous) and the stage
policy is real/agent_membership.py's. Under torchrun `main` hands each worker to real/agent_worker.py;
`launch_local` runs one agent in this process (real/agent_launch.py) whose workers stand in for one
machine each: a worker killed by a signal (the failure injector's SIGKILL, or anyone else's) loses its
node's memory and node-local checkpoint level, the agent restarts every worker, the survivors reload
their state from node memory, the lost stage's new process starts after the join delay and the method
recovers the stage (with data parallelism: heals from a surviving replica). A worker that fails with
an error, and a loss that leaves no state anywhere (every stage at once, or before the first group
formed), end the run. Nothing is coordinated through files; `agent_launch.worker_pids()` names the
current worker processes while a run is in flight (tests and operators kill from there).

    CHURNSIM_RUN_TOKEN=$(cat scenario.json.token) PYTHONSAFEPATH=1 torchrun --nproc-per-node 4 -m churnsim.real.launch \
        --scenario scenario.json --method checkfree --run-dir runs/a

Endpoints and code: the run's store listens on loopback unless the user names an address, every key
it holds is under the namespace of the run's secret (run_secret.py, which says what that does and
does not protect against), and every process started here imports only installed code
(`_children_import_installed_code`). Under torchrun each rank needs CHURNSIM_RUN_TOKEN
(`churnsim real run --write-config` writes the token file and prints the command).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as multiprocessing

from churnsim.calibration.errors import InputError

from .cpu_placement import pinning_requested
from .distributed import (
    LOOPBACK_HOST,
    Communicator,
    connect_store,
    destroy_process_group,
    init_process_group,
    keep_connections_on,
    serve_store,
)
from .methods import METHODS
from .run_secret import check_listen_address, check_token, checkpoint_key, new_token, token_from_environment
from .warnings_relay import WARNINGS_FILE, WarningReader, relay_to
from .run_directory import OWN_ENTRIES, RECOVERIES_FILE, RunDirectory, prepare_run_directory
from .safe_codec import decode, encode
from .journal import attempt_directories, new_attempt_directory, read_attempt
from .results import FAILURE_TABLE_COLUMNS, RunResult, join_attempts, merge_rank_results, write_recoveries, write_record  # noqa: F401 - re-exported
from .trainer import RankResult, TrainingConfig, train_stage

# -- generic spawning (also used by the tests) ---------------------------------------------------


FORKSERVER_PRELOAD = (
    "torch", "torch._inductor.config", "churnsim.real.trainer", "churnsim.real.launch", "churnsim.real.agent_worker",
    "churnsim.real.agent_membership", "torch.distributed.elastic.multiprocessing.api",
)
"""What the fork server imports once for every stage process it starts. torch._inductor.config (and
torch._dynamo with it, ≈ 3-5 s on a small CPU) is imported by `torch.use_deterministic_algorithms` and
by creating any optimizer; imported here, a replacement process is up in a fraction of a second."""

HEARTBEAT_INTERVAL_S = 0.5
"""How often each worker's heartbeat thread touches its file (launcher-side stall detection)."""
_MIN_STALL_S = 2.0
_GRACE_S = 2.0


class RunAborted(RuntimeError):
    """The launcher ended a run: a rank stopped making progress (its message is one line)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.rank = rank


def rendezvous_timeout_s(timeout_s: float, join_delay_s: float) -> float:
    """How long a replacement's rendezvous may take: the join delay, a process start (60 s covers a
    slow torch import on a loaded machine) and a peer's longest wait (`timeout_s`)."""
    return timeout_s + join_delay_s + 60.0


def stall_limit_s(timeout_s: float) -> float:
    """Heartbeat age after which the launcher declares a rank stalled: half the peer timeout
    (at least 2 s), so the launcher names the stalled rank before a healthy peer's wait times out."""
    return max(_MIN_STALL_S, timeout_s / 2)


def _heartbeat_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"heartbeat-{rank}")


def _installed_code_path() -> list[str]:
    """This process's `sys.path` without the entries that name where the user stands: "" (the
    current directory), the current directory itself when churnsim is the program (`python -m
    churnsim`, `-m churnsim.real.launch` under torchrun) and the directory of the script that started
    it. A module planted there (`json.py`, `concurrent.py`) must not run in a stage process.

    The current directory stays when the program is not churnsim's (a test runner, a user's script):
    the function a caller hands to `run_distributed` may live there."""
    unsafe = set()
    main = sys.modules.get("__main__")
    main_spec = getattr(main, "__spec__", None)
    if main_spec is not None and str(main_spec.name).startswith("churnsim."):
        unsafe.add(os.path.realpath(os.getcwd()))
    script = sys.argv[0] if sys.argv else ""
    if script and script not in ("-c", "-m") and main_spec is None and os.path.isfile(script):
        unsafe.add(os.path.realpath(os.path.dirname(os.path.abspath(script))))
    return [entry for entry in sys.path if entry and os.path.realpath(entry) not in unsafe]


@contextlib.contextmanager
def _children_import_installed_code() -> Iterator[None]:
    """While processes start: the interpreters multiprocessing starts (the fork server, spawned
    ranks) run `python -c ...`, which puts the current directory first on `sys.path` before the
    parent's path is handed over, so a planted `random.py` would run while they import
    multiprocessing. `-P` (3.11+) leaves it out; Python 3.10 has no `-P`, so it gets `-I`, which also
    ignores PYTHON* variables and the user's site directory for those first imports (the parent's
    path, handed over next, still holds what they added). The path handed over is
    `_installed_code_path()`. Processes started later from the fork server inherit its path."""
    from multiprocessing import util

    original_flags = util._args_from_interpreter_flags
    flag = "-P" if sys.version_info >= (3, 11) else "-I"

    def flags() -> list[str]:
        arguments = list(original_flags())
        return arguments if flag in arguments else [*arguments, flag]

    saved_path = list(sys.path)
    util._args_from_interpreter_flags = flags
    sys.path[:] = _installed_code_path()
    try:
        yield
    finally:
        util._args_from_interpreter_flags = original_flags
        sys.path[:] = saved_path


@contextlib.contextmanager
def _children_leave_interrupts_to_launcher() -> Iterator[None]:
    """While processes start: every interpreter multiprocessing execs (the fork server, spawned
    ranks, its resource tracker) starts with SIGINT ignored, so a Ctrl-C, which the terminal sends to
    the whole process group, reaches only the launcher, which ends them (SIGTERM). Without this the
    fork server, still importing torch for seconds, prints a KeyboardInterrupt traceback; the fork
    server hands its disposition on to every stage process it forks. An ignored disposition survives
    exec, and Python installs its KeyboardInterrupt handler only where SIGINT is not ignored.

    The launcher ignores SIGINT only around the fork and exec, with SIGINT blocked meanwhile, so a
    Ctrl-C in that instant stays pending and reaches the launcher right after."""
    from multiprocessing import util

    original_spawn = util.spawnv_passfds

    def spawn_ignoring_interrupts(path: Any, arguments: Any, passfds: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return original_spawn(path, arguments, passfds)  # handlers can be set only in the main thread
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return original_spawn(path, arguments, passfds)
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    util.spawnv_passfds = spawn_ignoring_interrupts
    try:
        yield
    finally:
        util.spawnv_passfds = original_spawn


@contextlib.contextmanager
def _fork_server_ends_on_interrupt(start_method: str) -> Iterator[None]:
    """An interrupted launcher (Ctrl-C, SIGTERM) also ends the fork server: it ignores SIGINT, and
    while it still imports torch it would outlive the launcher by seconds (it notices its clients
    are gone only when its import ends). A later run starts a new one."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        if start_method == "forkserver":
            _end_fork_server()
        raise


def _end_fork_server() -> None:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGTERM)  # its handlers leave SIGTERM at the default: it ends at once
    except ProcessLookupError:
        pass
    try:
        server._stop()  # reaps it and forgets its address, so the next run starts a new one
    except OSError:
        pass


def _die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _start_heartbeat(directory: str, rank: int, launcher_pid: int) -> None:
    """A daemon thread: touch this rank's heartbeat file every HEARTBEAT_INTERVAL_S, and end the
    process if the launcher is gone (its parent changed or the launcher's pid no longer exists).

    A stopped process (SIGSTOP) runs no threads, so its heartbeat ages: that is how the launcher
    tells which rank stalled.
    """
    path = _heartbeat_path(directory, rank)
    parent = os.getppid()

    def launcher_alive() -> bool:
        if os.getppid() != parent:
            return False
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def beat() -> None:
        while True:
            if not launcher_alive():
                shutil.rmtree(directory, ignore_errors=True)  # the launcher cannot clean up any more
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                os.utime(path)
            except OSError:
                try:
                    with open(path, "w") as file:
                        file.write(str(os.getpid()))  # the file names the rank's process (tests, operators)
                except OSError:
                    pass
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name=f"churnsim-heartbeat-{rank}", daemon=True).start()


@dataclass(frozen=True)
class StoreEndpoint:
    """Where the launcher's store listens and the run's secret, as handed to each stage process in its
    process arguments (never argv); the secret stays out of `repr`."""

    host: str
    port: int
    token: str = dataclasses.field(repr=False)


def _worker(
    rank: int,
    world_size: int,
    endpoint: StoreEndpoint,
    device: str,
    timeout_s: float,
    function: Callable[..., Any],
    arguments: tuple[Any, ...],
    directory: str,
    launcher_pid: int,
) -> None:
    _die_with_parent()
    relay_to(os.path.join(directory, WARNINGS_FILE))
    _start_heartbeat(directory, rank, launcher_pid)
    # Every rank of a local launch is on this host (torchrun's variables, which pick GPU and backend).
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if device == "cuda":
        # Autograd's device thread makes the CUDA context current itself and warns that it did
        # (seen with torch 2.11 on an H200, once per rank); the warning is noise to a user.
        warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    keep_connections_on(endpoint.host)
    store = connect_store(endpoint.host, endpoint.port, endpoint.token, timeout_s)
    communicator = init_process_group(rank=rank, world_size=world_size, device=device, timeout_s=timeout_s, store=store)
    try:
        try:
            value = function(communicator, *arguments)
        except Exception as error:
            _write_stage_error(_stage_error_path(directory, rank), error)
            raise
        gathered = communicator.gather_objects(value, destination=0)
        if rank == 0:
            with open(os.path.join(directory, "results.bin"), "wb") as file:
                file.write(encode(gathered))  # JSON + raw tensors: reading it back runs no code
    finally:
        destroy_process_group()


def _stage_error_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"error-{rank}.json")


def _write_stage_error(path: str, error: BaseException) -> None:
    """When and why a stage process failed, for the launcher's one-line error (and to tell the first
    failure from its peers' "connection closed by peer" that follow it)."""
    record = {"time_s": time.time(), "type": type(error).__name__, "message": " ".join(str(error).split())}
    with open(path, "w") as file:
        json.dump(record, file)


def _read_stage_error(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def _failed_stage_error(rank: int, record: dict[str, Any], after: str = "") -> RunAborted:
    return RunAborted(f"stage/rank {rank} failed: {record['type']}: {record['message']}{after}", rank=rank)


def _stage_failure(directory: str, failure: Exception, processes: list[Any]) -> RunAborted:
    """One line for a run whose stage process failed. A rank a signal ended (the out-of-memory killer)
    without an exception of its own is the cause; else the rank whose exception came first, since
    the others mostly fail because it went away ("connection closed by peer"). The launcher's own
    SIGTERM to the survivors does not count."""
    records = [(record, rank) for rank in range(len(processes)) if (record := _read_stage_error(_stage_error_path(directory, rank)))]
    recorded = {rank for _, rank in records}
    for rank, process in enumerate(processes):
        code = process.exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM and rank not in recorded:
            return RunAborted(
                f"stage/rank {rank} was ended by signal {signal.Signals(-code).name} (the out-of-memory killer or another "
                "process); the launcher ended the run",
                rank=rank,
            )
    if not records:
        return RunAborted(f"a stage process failed: {failure}")
    first, rank = min(records, key=lambda record_and_rank: record_and_rank[0]["time_s"])
    return _failed_stage_error(rank, first, f"; {len(records) - 1} other stage(s) failed after it" if len(records) > 1 else "")


def _stalled_rank(directory: str, processes: list[Any], limit_s: float) -> tuple[int, float] | None:
    """The live rank whose heartbeat is oldest, if older than `limit_s` (ranks not started yet and
    ranks that already exited are skipped; a stopped process is alive)."""
    now = time.time()
    oldest: tuple[int, float] | None = None
    for rank, process in enumerate(processes):
        if not process.is_alive():
            continue
        try:
            age = now - os.stat(_heartbeat_path(directory, rank)).st_mtime
        except OSError:
            continue
        if age > limit_s and (oldest is None or age > oldest[1]):
            oldest = (rank, age)
    return oldest


def _stall_error(rank: int, age_s: float) -> RunAborted:
    return RunAborted(
        f"stage/rank {rank} made no progress for {age_s:.1f} s (stopped or hung); the launcher ended the run", rank=rank
    )


def _end_processes(processes: list[Any]) -> None:
    """SIGTERM every live worker, SIGKILL what is left after a grace period (a stopped process
    ignores SIGTERM until it continues), and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


class _SignalsEndRun:
    """While a run is in flight in the main thread, SIGTERM (and SIGHUP) raise SystemExit(128 + n)
    instead of killing the launcher outright, so the workers are ended and temp files removed;
    SIGINT already raises KeyboardInterrupt."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __enter__(self) -> None:
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for number in self.SIGNALS:
            if signal.getsignal(number) is signal.SIG_DFL:
                self.previous[number] = signal.signal(number, self._raise)

    @staticmethod
    def _raise(number: int, _frame: Any) -> None:
        raise SystemExit(128 + number)

    def __exit__(self, *_: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def run_distributed(
    function: Callable[..., Any],
    world_size: int,
    *arguments: Any,
    device: str = "cpu",
    timeout_s: float = 60.0,
    poll: Callable[[], None] | None = None,
    poll_interval_s: float = 0.25,
    rendezvous_host: str = LOOPBACK_HOST,
    token: str | None = None,
    on_warning: Callable[[str], None] | None = None,
) -> list[Any]:
    """Run `function(communicator, *arguments)` on `world_size` local processes; returns each rank's value.

    Endpoints: the launcher serves the run's TCPStore on `rendezvous_host` only (loopback by default)
    and every stage process names its keys under the namespace of the run's secret `token` (a new
    one when None; run_secret.py), so a process without it can neither read nor change them; gloo
    and NCCL listen on loopback too when the rendezvous does. Stage processes import only installed
    code (`_children_import_installed_code`). Warnings of the stage processes (real/warnings_relay.py)
    go to `on_warning(line)` as they come (default: this process's stderr).

    `function` must be importable by name (a module-level function). Processes start from a fork
    server that imported torch and the trainer once (CPU), so later runs in the same interpreter
    start in a fraction of a second; CUDA runs use plain spawn, since forking after CUDA
    initialisation is unsafe. `poll()` is called every `poll_interval_s` while the ranks run (progress).

    Processes and time: every worker touches a heartbeat file from a daemon thread; a rank whose
    heartbeat is older than `stall_limit_s(timeout_s)` (a stopped or frozen process) ends the run
    with `RunAborted` naming that rank. Workers die with the launcher (PR_SET_PDEATHSIG and a
    watchdog on the launcher's pid); SIGTERM/SIGINT of the launcher end the workers and remove
    the temp directory; any exit from here leaves no worker running. The workers and the fork server
    ignore SIGINT (`_children_leave_interrupts_to_launcher`): one Ctrl-C ends them through the launcher.
    """
    if device == "cpu":
        start_method = "forkserver"
        # Only takes effect before the fork server starts; later calls are harmless no-ops.
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    else:
        start_method = "spawn"
    limit_s = stall_limit_s(timeout_s)
    token = check_token(token, "token") if token is not None else new_token()
    with _fork_server_ends_on_interrupt(start_method), _SignalsEndRun(), tempfile.TemporaryDirectory(prefix="churnsim-real-") as directory:
        relay = _WarningRelay(directory, on_warning)
        poll = relay.around(poll)
        context = None
        # The store lives in the launcher (not in rank 0), bound to the rendezvous host only.
        store = serve_store(rendezvous_host, timeout_s)
        endpoint = StoreEndpoint(rendezvous_host, int(store.port), token)
        try:
            with _children_import_installed_code(), _children_leave_interrupts_to_launcher():
                context = multiprocessing.start_processes(
                    _worker,
                    args=(world_size, endpoint, device, timeout_s, function, arguments, directory, os.getpid()),
                    nprocs=world_size,
                    join=False,
                    start_method=start_method,
                )
            while True:
                connection.wait([process.sentinel for process in context.processes], timeout=poll_interval_s)
                # Stalls first: when a healthy peer's wait times out on a stopped rank, blame the stopped one.
                stalled = _stalled_rank(directory, context.processes, limit_s)
                if stalled is not None:
                    context.processes[stalled[0]].kill()  # a stopped process ignores SIGTERM
                    raise _stall_error(*stalled)
                try:
                    if context.join(timeout=0, grace_period=_GRACE_S):
                        break
                except (multiprocessing.ProcessRaisedException, multiprocessing.ProcessExitedException) as failure:
                    raise _stage_failure(directory, failure, context.processes) from failure
                if poll is not None:
                    poll()
            with open(os.path.join(directory, "results.bin"), "rb") as file:
                return decode(file.read())
        finally:
            if context is not None:
                _end_processes(context.processes)
            relay.drain()


class _WarningRelay:
    """The launcher's end of real/warnings_relay.py: prints what stage processes warned, as it comes."""

    def __init__(self, directory: str, on_warning: Callable[[str], None] | None) -> None:
        self.reader = WarningReader(os.path.join(directory, WARNINGS_FILE))
        self.on_warning = on_warning

    def drain(self) -> None:
        for line in self.reader.new_lines():
            if self.on_warning is not None:
                self.on_warning(line)
            else:
                print(line, file=sys.stderr, flush=True)

    def around(self, poll: Callable[[], None] | None) -> Callable[[], None]:
        def poll_and_drain() -> None:
            self.drain()
            if poll is not None:
                poll()

        return poll_and_drain


def _train(
    communicator: Communicator,
    config: TrainingConfig,
    run_dir: Path | None,
    progress_path: str | None,
    journal_directory: str | None = None,
) -> RankResult:
    report = None
    if progress_path is not None and communicator.rank == config.num_stages - 1:  # the stage with the loss (replica 0)

        def report(row: dict[str, Any]) -> None:
            temporary = f"{progress_path}.tmp"
            with open(temporary, "w") as file:
                json.dump({k: row[k] for k in ("step", "iteration", "train_loss")}, file)
            os.replace(temporary, progress_path)  # the parent never reads a half-written file

    return train_stage(config, communicator, run_dir=run_dir, on_iteration_done=report, journal_directory=journal_directory)


def _prepare(run_dir: Path, config: TrainingConfig, resume: bool, **options: Any) -> tuple[RunDirectory, TrainingConfig]:
    """Check and hold `run_dir` (run_directory.py) and bind `config` to its run id; nothing starts before."""
    lease = prepare_run_directory(
        run_dir,
        config=config.to_dict(),
        method=config.method.name,
        resume=resume,
        resumable=METHODS[config.method.name].resumable if config.method.name in METHODS else False,
        **options,
    )
    return lease, dataclasses.replace(config, run_id=lease.run_id, resume=resume)


def _durable_checkpoints(lease: RunDirectory, config: TrainingConfig) -> Path:
    """Where the run's durable (remote) checkpoint level lives: the run directory, or the scenario's remote dir."""
    if config.remote_checkpoint_dir is not None:
        return Path(config.remote_checkpoint_dir) / lease.run_id
    return lease.checkpoints


def _finish(lease: RunDirectory, result: RunResult, **record_options: Any) -> Path:
    """The run finished: node-local levels go, the record is written beside the checkpoints, run.json says so."""
    lease.remove_node_local_levels()
    durable = _durable_checkpoints(lease, result.config)
    checkpoints = durable if durable.is_dir() else None
    path = write_record(
        result,
        lease.path,
        run_id=lease.run_id,
        checkpoint_directory=str(checkpoints.resolve()) if checkpoints is not None else None,
        extra_entries=OWN_ENTRIES,
        **record_options,
    )
    write_recoveries(result, lease.path / RECOVERIES_FILE)
    lease.mark("finished")
    return path


def _fail(lease: RunDirectory, error: BaseException, config: TrainingConfig | None = None) -> None:
    """The run failed: its durable checkpoints stay (bound to its run id) for `--resume`."""
    lease.remove_node_local_levels()
    lease.mark("failed")
    durable = _durable_checkpoints(lease, config) if config is not None else lease.checkpoints
    if any(durable.glob("stage-*/*.manifest.json")) and hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(
            f"the run's durable checkpoints are kept in {durable}; continue the run with the same command and --resume"
        )


def _check_remote_checkpoint_dir(config: TrainingConfig) -> None:
    """A remote checkpoint directory that cannot hold checkpoints is refused before anything starts."""
    if config.remote_checkpoint_dir is None:
        return
    path = Path(config.remote_checkpoint_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(
            f"training.remote_checkpoint_dir = {str(path)!r}: cannot be created ({error.strerror}); give a writable directory"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"training.remote_checkpoint_dir = {str(path)!r}: not writable; give a writable directory")


UNIX_SOCKET_PATH_MAX_BYTES = 107
"""The longest path of a Unix socket on Linux (sun_path holds 108 bytes with its terminating NUL)."""
_FORK_SERVER_SOCKET_SUFFIX = "/pymp-XXXXXXXX/listener-XXXXXXXX"
"""What Python's fork server appends to the temporary directory for its listening socket."""


def check_temporary_directory_fits_a_socket() -> None:
    """The stage processes come from Python's fork server, which listens on a Unix socket under the
    temporary directory (TMPDIR): refused in one line where that path would be too long."""
    directory = tempfile.gettempdir()
    length = len(os.fsencode(directory + _FORK_SERVER_SOCKET_SUFFIX))
    if length > UNIX_SOCKET_PATH_MAX_BYTES:
        raise InputError(
            f"the temporary directory {directory!r} (TMPDIR) is too long for the stage processes' Unix socket under it "
            f"({length} > {UNIX_SOCKET_PATH_MAX_BYTES} bytes); set TMPDIR to a shorter directory, e.g. TMPDIR=/tmp"
        )


def _run_hard_failures(
    config: TrainingConfig,
    run_dir: Path,
    scratch: Path,
    journal_directory: Path | None,
    progress_path: str | None,
    *,
    token: str,
    rendezvous_host: str,
    poll: Callable[[], None],
    poll_interval_s: float,
    on_warning: Callable[[str], None] | None,
    entrypoint: Callable[..., Any] | None = None,
) -> dict[int, Any]:
    """A hard-failure run: one torch.distributed.elastic agent in this process, one worker per
    (stage, replica) slot (real/agent_launch.py), each running `entrypoint` (real/agent_worker.py's
    `run_local_worker`, or a function that calls it); returns {local rank: what it returned}: local
    rank 0 returns every slot's RankResult."""
    from .agent_launch import AgentRunFailed, launch_with_agent, node_prefix
    from .agent_worker import run_local_worker
    from .node_memory import NodeMemory, default_root

    num_workers = config.num_nodes
    start_method = "forkserver" if config.device == "cpu" else "spawn"  # forking after CUDA initialisation is unsafe
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    journal = journal_directory if journal_directory is not None else scratch / "journal"
    journal.mkdir(parents=True, exist_ok=True)
    prefix, root = node_prefix(), default_root()
    relay = _WarningRelay(str(scratch), on_warning)
    arguments = (config, token, run_dir, str(journal), progress_path, os.path.join(scratch, WARNINGS_FILE), str(root), prefix, os.getpid())
    try:
        with _fork_server_ends_on_interrupt(start_method), _SignalsEndRun(), _children_import_installed_code(), _children_leave_interrupts_to_launcher():
            values = launch_with_agent(
                entrypoint or run_local_worker, arguments, num_workers=num_workers, log_dir=scratch / "agent", rendezvous_host=rendezvous_host,
                start_method=start_method, poll=relay.around(poll), poll_interval_s=poll_interval_s,
                max_restarts=config.max_replacements,
            )  # fmt: skip
    except AgentRunFailed as error:
        raise RunAborted(str(error), rank=error.rank) from None
    finally:
        relay.drain()
        for rank in range(num_workers):  # a run that ended leaves nothing in node memory
            NodeMemory(token, root=root, node_id=f"{prefix}-{rank}").remove()
    return values


def launch_local(
    config: TrainingConfig,
    *,
    run_dir: str | Path | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    failure_rate_per_stage_hour: float | None = None,
    scenario: Any = None,
    replication: int = 0,
    resume: bool = False,
    run_id: str | None = None,
    restart_unfinished: bool = False,
    progress_interval_s: float = 0.25,
    rendezvous_host: str = LOOPBACK_HOST,
    on_warning: Callable[[str], None] | None = None,
) -> RunResult:
    """Run `config` with one local process per stage; writes a run record when `run_dir` is given.

    `run_dir` holds the run from its start (run_directory.py): run.json, the durable checkpoints in
    `run_dir/checkpoints` and node-local levels in `run_dir/local`; the record once the run finishes.
    It must be new, empty, or a churnsim run record, else InputError before any process starts;
    nothing that is not the run's own is ever removed. A failed (or killed) run keeps its durable
    checkpoints, and `resume=True` continues it from the newest one every stage holds, under the
    same run id (`run_id` names a new run; `restart_unfinished` lets it replace an unfinished one).
    Every step's rows reach `run_dir/journal` as the step ends (real/journal.py), so a killed run
    keeps them (`results.kept_metrics`), and a resumed run's record holds every attempt's steps,
    its own appended after the kept ones (`results.join_attempts` says how re-run iterations show).
    `on_progress(row)` gets the latest finished iteration (step, iteration, train_loss) while the
    run goes on, looked for every `progress_interval_s`. The run's secret (run_secret.py; kept in
    `run_dir/run.secret`) guards its store on `rendezvous_host` and binds its checkpoints. Warnings
    of the stage processes (a skipped checkpoint, a restart from scratch) go to `on_warning(line)`
    (default: stderr) as well as into the record.
    """
    if not progress_interval_s > 0:
        raise InputError(f"progress_interval_s = {progress_interval_s!r}: give a positive number of seconds")
    _check_remote_checkpoint_dir(config)
    check_temporary_directory_fits_a_socket()
    check_listen_address(rendezvous_host, "rendezvous_host")
    if pinning_requested():
        config = dataclasses.replace(config, pin_stages_to_cores=True)
    lease = None
    if run_dir is not None:
        lease, config = _prepare(Path(run_dir), config, resume, run_id=run_id, restart_unfinished=restart_unfinished)
    elif resume:
        raise InputError("resume=True: give the run_dir of the run to continue")
    token = lease.token if lease is not None else new_token()
    config = dataclasses.replace(config, checkpoint_key=checkpoint_key(token))
    hard = config.failure_mode == "hard"
    try:
        journal_directory = None
        if lease is not None:  # every step's rows go to the run directory as the step ends (real/journal.py)
            journal_directory = new_attempt_directory(lease.path)
        with tempfile.TemporaryDirectory(prefix="churnsim-progress-") as progress_directory:
            # Hard failures: a replacement process must find its predecessor's checkpoints, so
            # checkpoints live in one directory for all processes (the run's, or a temporary one).
            worker_run_dir = lease.path if lease is not None else (Path(progress_directory) if hard else None)
            progress_path = os.path.join(progress_directory, "progress.json") if on_progress is not None else None
            last_seen: list[Any] = [None]

            def poll() -> None:
                if progress_path is None:
                    return
                try:
                    with open(progress_path) as file:
                        row = json.load(file)
                except (OSError, ValueError):
                    return  # nothing finished yet
                if row != last_seen[0]:
                    last_seen[0] = row
                    on_progress(row)  # type: ignore[misc]

            if hard:
                results = _run_hard_failures(
                    config, worker_run_dir, Path(progress_directory), journal_directory, progress_path, token=token,
                    rendezvous_host=rendezvous_host, poll=poll, poll_interval_s=progress_interval_s, on_warning=on_warning,
                )[0]  # fmt: skip
            else:
                results = run_distributed(
                    _train,
                    config.num_nodes,  # one process per (stage, replica)
                    config,
                    worker_run_dir,
                    progress_path,
                    str(journal_directory) if journal_directory is not None else None,
                    device=config.device,
                    timeout_s=config.timeout_s,
                    poll=poll,
                    poll_interval_s=progress_interval_s,
                    rendezvous_host=rendezvous_host,
                    token=token,
                    on_warning=on_warning,
                )
            poll()
        if journal_directory is not None:  # after a --resume: the earlier attempts' steps first
            results = join_attempts(
                [read_attempt(earlier, config.num_stages) for earlier in attempt_directories(lease.path) if earlier != journal_directory]
                + [results]
            )
        result = merge_rank_results(config, results)
        if lease is not None:
            result.run_dir = _finish(
                lease, result, failure_rate_per_stage_hour=failure_rate_per_stage_hour, scenario=scenario, replication=replication
            )
    except BaseException as error:
        if lease is not None:
            _fail(lease, error, config)
        raise
    finally:
        if lease is not None:
            lease.release()
    return result


def main(argv: list[str] | None = None) -> int:
    """One rank of a run under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by torchrun).

    Rank 0 checks and holds `--run-dir` (as `launch_local` does) and hands its run id to every rank;
    every rank keeps its checkpoints in `<run-dir>/checkpoints/stage-<s>` on its own machine.
    """
    from churnsim.calibration.scenario import load_scenario

    from .scenario_run import training_config

    parser = argparse.ArgumentParser(description="One rank of a churnsim real pipeline run (use with torchrun).")
    parser.add_argument("--scenario", required=True, help="scenario JSON file (`churnsim real run ... --write-config FILE` writes one)")
    parser.add_argument("--method", default=None, help="the method to run, if the scenario lists several")
    parser.add_argument("--replication", type=int, default=0, help="which replication's failure path to inject")
    parser.add_argument("--run-dir", default=None, help="the run's directory: rank 0 writes the record, every rank its checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue the failed run in --run-dir from its durable checkpoints")
    arguments = parser.parse_args(argv)
    try:
        scenario = load_scenario(arguments.scenario).only_method(arguments.method)
        config = training_config(scenario, scenario.methods[0], replication=arguments.replication)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        token = token_from_environment()
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise InputError(f"environment variable {name} is not set: start the ranks with torchrun")
        if config.failure_mode == "hard":
            if arguments.resume:
                raise InputError("--resume: hard-failure runs under torchrun continue through the agent's restarts; start without --resume")
            from .agent_worker import run_worker

            keep_connections_on(os.environ["MASTER_ADDR"])
            # torchrun's agent replaces killed workers; the stage policy is real/agent_membership.py's.
            return run_worker(config, token, Path(arguments.run_dir) if arguments.run_dir else None, scenario=scenario, replication=arguments.replication)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = dataclasses.replace(config, checkpoint_key=checkpoint_key(token))
    store_server, store = _torchrun_store(token, config.timeout_s)
    communicator = init_process_group(device=config.device, timeout_s=config.timeout_s, store=store)
    run_dir = Path(arguments.run_dir) if arguments.run_dir else None
    lease, gathered = None, None
    try:
        decision: dict[str, str] = {"run_id": uuid.uuid4().hex[:12]}
        if communicator.rank == 0 and run_dir is not None:
            try:
                lease, _ = _prepare(run_dir, config, arguments.resume, token=token)
                decision = {"run_id": lease.run_id}
            except InputError as error:
                decision = {"error": str(error)}
        decision = communicator.all_gather_objects(decision)[0]
        if "error" in decision:
            print(f"error: {decision['error']}", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, run_id=decision["run_id"], resume=arguments.resume and run_dir is not None)
        rank_result = train_stage(config, communicator, run_dir=run_dir)
        gathered = communicator.gather_objects(rank_result, destination=0)
        if lease is not None and gathered is not None:
            _finish(lease, merge_rank_results(config, gathered), scenario=scenario, replication=arguments.replication)
    except BaseException as error:
        if lease is not None:
            _fail(lease, error, config)
        raise
    finally:
        if lease is not None:
            lease.release()
        destroy_process_group()
        del store_server  # rank 0's store (when torchrun's agent serves none) lives until every rank is done
    return 0


def _torchrun_store(token: str, timeout_s: float) -> tuple[Any, Any]:
    """(the store server this rank runs, or None; a client under the run's namespace) for a torchrun rank.

    torchrun's agent serves the store its ranks rendezvous through (TORCHELASTIC_USE_AGENT_STORE);
    where and how it listens is torchrun's (`--rdzv-endpoint`, `--master-addr`). Without an agent
    store rank 0 serves it on MASTER_ADDR only. Either way every key churnsim's ranks use lies under
    the run's secret namespace, so a rank started without CHURNSIM_RUN_TOKEN cannot join the group."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    server = None
    if int(os.environ["RANK"]) == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        server = serve_store(host, timeout_s, port=port)
    return server, connect_store(host, port, token, timeout_s)


if __name__ == "__main__":
    raise SystemExit(main())
