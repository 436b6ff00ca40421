"""The directory of a real run (`churnsim real run --out DIR`): what it holds, and when churnsim may touch it.

    DIR/run.json              written before any rank starts, updated when the run ends:
                              {"format": "churnsim-real-run", "format_version": 1, "run_id": "...",
                               "status": "running" | "failed" | "finished", "method": "...",
                               "config": {...}, "started_utc": "...", "updated_utc": "..."}
    DIR/checkpoints/stage-s/  the durable checkpoint tier, every file bound to run_id; kept when
                              the run fails, so that `--resume` continues it
    DIR/local/stage-s/        node-local checkpoint levels: they die with the nodes, so they are
                              removed when the run ends (finished or failed) and when it resumes
    DIR/manifest.json, metrics.csv, spans.csv, failures.csv    the run record, once the run finished
    DIR/recoveries.csv        one row per recovery: what failed, what each stage started from, the
                              seconds of join, rendezvous, transfer, load, rebuild, and the bytes it
                              moved over the network and read from checkpoint files
    DIR/run.secret            the run's secret (mode 0600; run_secret.py): names its rendezvous keys
                              and binds its checkpoints (an HMAC); `--resume` reads it from here
    DIR/journal/attempt-n/stage-s.jsonl
                              every step's rows as the step ends, one folder per attempt (the start,
                              then each --resume; real/journal.py): a killed run keeps its steps
                              here (`results.kept_metrics` reads them), and the record a resumed run
                              writes joins every attempt's (`results.join_attempts`)

`prepare_run_directory` decides, before any process starts, and removes nothing that is not the run's
own: a new or empty DIR starts a run; a finished run's DIR is cleared of its own entries and starts a
new run; an unfinished run's DIR (failed, or killed: status still "running" and nobody holding it) is
continued with `resume=True` (same run id, same configuration) and otherwise refused; any other
non-empty DIR, or one another launcher is using (an flock on DIR), is refused with one line.
This module does not import torch, so the CLI can check `--out` before anything heavy starts.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from churnsim.calibration.errors import InputError

# calibration.run_record imports pandas: imported where used, so spawned ranks never pay for it.
RECORD_FILES = ("manifest.json", "metrics.csv", "spans.csv", "failures.csv")  # = run_record.RECORD_FILES
RUN_FILE = "run.json"
CHECKPOINTS_DIRECTORY = "checkpoints"
LOCAL_DIRECTORY = "local"
RECOVERIES_FILE = "recoveries.csv"
SECRET_FILE = "run.secret"  # = run_secret.SECRET_FILE
JOURNAL_DIRECTORY = "journal"  # = journal.JOURNAL_DIRECTORY
OWN_ENTRIES: tuple[str, ...] = (
    RUN_FILE, CHECKPOINTS_DIRECTORY, LOCAL_DIRECTORY, RECOVERIES_FILE, SECRET_FILE, JOURNAL_DIRECTORY,
)
"""What a real run keeps in its directory beside the record files."""
RUN_FORMAT = "churnsim-real-run"
# Fields a resumed run may change: how long to wait, how many threads, how far to train.
_MAY_CHANGE_ON_RESUME = ("timeout_s", "num_threads", "pin_stages_to_cores", "num_iterations", "run_id", "resume")


def _now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    plain = json.loads(json.dumps(config, default=str))
    return {key: value for key, value in plain.items() if key not in _MAY_CHANGE_ON_RESUME}


def read_run_file(directory: Path) -> dict[str, Any] | None:
    """The run.json of `directory`, or None when there is none; InputError when it is not churnsim's."""
    path = directory / RUN_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: not a churnsim run file ({error}); choose another --out directory") from None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT or not isinstance(data.get("run_id"), str):
        raise InputError(f"{path}: field 'format' is not {RUN_FORMAT!r}; not a churnsim run: choose another --out directory")
    return data


class RunDirectory:
    """A run directory held by this launcher (an exclusive flock) until `release()`."""

    def __init__(self, path: Path, run_file: dict[str, Any], lock_fd: int, token: str = "") -> None:
        self.path = path
        self._run_file = run_file
        self._lock_fd: int | None = lock_fd
        self.token = token
        """The run's secret (run.secret): the same for every attempt of the run, so `--resume` loads its checkpoints."""

    @property
    def run_id(self) -> str:
        return str(self._run_file["run_id"])

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIRECTORY

    def mark(self, status: str) -> None:
        """Record the run's status in run.json (temp file, fsync, rename)."""
        self._run_file = self._run_file | {"status": status, "updated_utc": _now_utc()}
        _write_json(self.path / RUN_FILE, self._run_file)

    def remove_node_local_levels(self) -> None:
        shutil.rmtree(self.path / LOCAL_DIRECTORY, ignore_errors=True)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _lock(directory: Path) -> int:
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise InputError(
            f"--out {directory}: another churnsim run is using this directory; wait for it to end or choose another --out"
        ) from None
    return fd


def check_run_directory(directory: Path, *, resume: bool, restart_unfinished: bool = False) -> dict[str, Any] | None:
    """Refuse (InputError, one line, nothing touched) a `directory` this run may not use; its run.json, if any.

    Cheap and torch-free: the CLI calls it before anything starts; `prepare_run_directory` calls it again.
    """
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--out {directory}: is a file; give a directory")
    if not directory.is_dir() or not any(directory.iterdir()):
        if resume:
            raise InputError(f"--resume: {directory} holds no run to continue; run without --resume to start one")
        return None
    from churnsim.calibration.run_record import check_record_directory

    try:
        check_record_directory(directory, extra_entries=OWN_ENTRIES)
    except InputError:
        raise InputError(
            f"--out {directory}: is not empty and is not a churnsim run record; nothing was written or removed: "
            "choose a new or empty directory"
        ) from None
    run_file = read_run_file(directory)
    finished = run_file.get("status") == "finished" if run_file is not None else (directory / RECORD_FILES[0]).exists()
    if resume and finished:
        raise InputError(f"--resume: the run in {directory} already finished; run without --resume to start a new one there")
    if resume and run_file is None:
        raise InputError(f"--resume: {directory} holds no {RUN_FILE} of an unfinished run; run without --resume to start one")
    if not resume and not finished and not restart_unfinished:
        if run_file is None:
            raise InputError(f"--out {directory}: holds checkpoints of a churnsim run without {RUN_FILE}; delete it to start over")
        run_id = run_file["run_id"]
        raise InputError(
            f"--out {directory}: holds run {run_id} that did not finish (its checkpoints are kept); continue it with "
            "--resume, or delete the directory to start over"
        )
    return run_file


def prepare_run_directory(
    directory: Path,
    *,
    config: dict[str, Any],
    method: str,
    resume: bool,
    resumable: bool,
    run_id: str | None = None,
    restart_unfinished: bool = False,
    token: str | None = None,
) -> RunDirectory:
    """Check and hold `directory` for a run of `config` (TrainingConfig.to_dict()); see the module docstring.

    `run_id` names a new run (default: a random one); `restart_unfinished` lets a new run replace an
    unfinished one (its checkpoints are deleted) instead of refusing it. `token`: the run's secret
    when the caller has one (torchrun: CHURNSIM_RUN_TOKEN); a new run gets a new one otherwise, and a
    resumed run keeps the one in its run.secret (a different `token` is refused).
    """
    from .run_secret import new_token, read_secret_file, write_secret_file

    directory = Path(directory)
    if resume and not resumable:
        raise InputError(f"--resume: method {method!r} keeps no checkpoints of every stage, so it cannot resume a run")
    check_run_directory(directory, resume=resume, restart_unfinished=restart_unfinished)
    directory.mkdir(parents=True, exist_ok=True)
    lock_fd = _lock(directory)
    try:
        # Again, now that no other launcher can change it.
        previous = check_run_directory(directory, resume=resume, restart_unfinished=restart_unfinished)
        if resume:
            assert previous is not None
            differences = sorted(
                key
                for key in set(_comparable(previous.get("config", {}))) | set(_comparable(config))
                if _comparable(previous.get("config", {})).get(key) != _comparable(config).get(key)
            )
            if differences:
                raise InputError(
                    f"--resume: {directory / RUN_FILE} was started with other settings ({', '.join(differences)} differ); "
                    "resume with the same scenario, method and --set options"
                )
            run_file = previous | {"status": "running"}
            kept = read_secret_file(directory / SECRET_FILE)
            if token is not None and token != kept:
                raise InputError(
                    f"--resume: CHURNSIM_RUN_TOKEN is not the token run {previous['run_id']} started with; "
                    f"use the token file written for it (the same as {directory / SECRET_FILE})"
                )
            token = kept
        else:
            for name in (*RECORD_FILES, *OWN_ENTRIES):  # only the earlier run's own entries, all checked above
                path = directory / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            run_file = {
                "format": RUN_FORMAT, "format_version": 1, "run_id": run_id or uuid.uuid4().hex[:12], "status": "running",
                "method": method, "config": json.loads(json.dumps(config, default=str)), "started_utc": _now_utc(),
            }
        if not resume:
            token = token if token is not None else new_token()
            write_secret_file(directory / SECRET_FILE, token)
        assert token is not None
        lease = RunDirectory(directory, run_file, lock_fd, token)
        lease.remove_node_local_levels()  # an earlier attempt's node-local levels died with its nodes
        lease.mark("running")
        return lease
    except BaseException:
        os.close(lock_fd)
        raise
