"""`--out` never destroys or mixes results: the checks every writing command makes before it starts.

A results directory names what it holds in its manifest.json (`command`, and the scenario or the
calibration it is about). Writing into it is fine when it is new or empty. Anything else — earlier
results, even of the same command on the same scenario, another command's, or files churnsim did not
write — is refused with one line unless the user passes `--overwrite`. In a churnsim results directory
the previous outputs are removed first, so it ends up holding one run's results and never stale tables
or records of another; in a directory that is not churnsim's (no manifest) nothing is removed:
`--overwrite` only lets churnsim write its files beside the others, replacing same-named ones. An
output entry that is a symbolic link is refused: churnsim removes and writes only its own files.

While a command writes a directory it holds it (`lock_out_directory`): a lock file with the owner's
pid and command line, flock'ed, so a second command on the same `--out` is refused naming the live
one, and the lock of a process that died (its flock went with it) is taken over.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from churnsim.calibration.errors import InputError
from churnsim.calibration.safe_files import check_path_text, describe_os_error, read_input_text, read_json_file

MANIFEST_FILE = "manifest.json"
TABLE_STEMS = (
    "runs", "summary", "trajectories", "checkpoint_intervals", "iteration_spans", "validation",
    "setback_sensitivity", "setback_crossovers", "tuned_intervals",
)
OUTPUT_DIRECTORIES = ("figures", "records", "timelines")
"""What churnsim writes in a results directory (sim/studies/simulate.py, sim/studies/whatif.py, sim/studies/sweep.py, validate)."""
REPORT_FILES = ("report.md", "report.html")  # churnsim/results_report.py


def churnsim_outputs(directory: Path) -> list[Path]:
    """The entries of `directory` that churnsim writes."""
    names = [MANIFEST_FILE, *REPORT_FILES, *(f"{stem}{suffix}" for stem in TABLE_STEMS for suffix in (".csv", ".parquet")), *OUTPUT_DIRECTORIES]
    return [directory / name for name in names if (directory / name).exists()]


def _identity(directory: Path) -> tuple[str, str] | None:
    """(command, subject) from the manifest of a churnsim results directory, or None."""
    try:
        manifest = read_json_file(directory / MANIFEST_FILE)
        command = manifest["command"]
        subject = manifest["scenario"]["name"] if "scenario" in manifest else manifest["calibration"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (command, subject) if isinstance(command, str) and isinstance(subject, str) else None


def prepare_out_directory(directory: Path, *, command: str, subject: str, overwrite: bool) -> None:
    """Check that `directory` may take the results of `command` on `subject`, hold it for this process
    (`lock_out_directory`), then clear churnsim's old outputs.

    Raises InputError (one line) before anything is written or removed when the directory holds
    results or foreign files and `overwrite` is False, or another churnsim command holds it.
    """
    check_out_path(directory, flag="--out")
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--out {directory}: is a file; give a directory")
    check_writable_directory(directory, flag="--out")
    lock_out_directory(directory, command=command)
    try:
        _check_contents(directory, command=command, subject=subject, overwrite=overwrite)
    except BaseException:
        release_out_directory(directory)
        raise


def _entries(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name != LOCK_FILE] if directory.is_dir() else []


def _check_contents(directory: Path, *, command: str, subject: str, overwrite: bool) -> None:
    if not _entries(directory):
        return
    found = _identity(directory)
    if not overwrite:
        if found is None:
            problem = "is not empty and holds no churnsim results"
        elif found == (command, subject):
            problem = f"holds the results of an earlier churnsim {command} of {subject!r}"
        else:
            problem = f"holds churnsim {found[0]} results for {found[1]!r}"
        raise InputError(
            f"--out {directory}: {problem}; this {command} of {subject!r} would mix with them: "
            "choose a new or empty directory, or pass --overwrite to replace churnsim's results there"
        )
    outputs = churnsim_outputs(directory)
    linked = [path.name for path in outputs if path.is_symlink()]
    if linked:
        raise InputError(
            f"--out {directory}: {', '.join(linked)} is a symbolic link; churnsim removes and writes only its own files: "
            "remove the link or choose another directory"
        )
    if found is None:
        return  # not churnsim's directory: write beside the user's files, and remove none of them
    for path in outputs:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


# -- holding a directory while a command writes it ---------------------------------------------------

LOCK_FILE = ".churnsim.lock"
_held: dict[Path, tuple[int, bool]] = {}
"""Directories this process holds: their lock file's descriptor, and whether this process created the directory."""


def _command_line() -> str:
    cli = sys.modules.get("churnsim.cli")
    arguments = getattr(cli, "current_arguments", None)
    if arguments is None and sys.argv and "churnsim" in sys.argv[0]:
        arguments = sys.argv[1:]
    text = " ".join(["churnsim", *arguments]) if arguments is not None else "churnsim (from Python)"
    return text if len(text) <= 200 else text[:197] + "..."


def _owner(path: Path) -> str:
    """How the refusal names the live holder: its command and pid, from the lock file."""
    try:
        data = json.loads(read_input_text(path, limit=64 * 1024))
        return f"{data['command']} (pid {int(data['pid'])}, since {data['started_utc']})"
    except (InputError, ValueError, KeyError, TypeError):
        return "another churnsim command"


def lock_out_directory(directory: Path, *, command: str) -> None:
    """Hold `directory` for this process until `release_out_directory` (or the process ends).

    Creates the directory when it does not exist. The lock is an flock on DIR/.churnsim.lock, which
    the kernel drops when its holder dies, so a stale lock file of a killed run is taken over.
    """
    directory = Path(directory)
    key = directory.absolute()
    if key in _held:
        return
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as error:
            _remove_if_created(directory, created)
            if error.errno == errno.ELOOP:
                raise InputError(f"--out {directory}: {LOCK_FILE} is a symbolic link; remove it") from None
            raise InputError(f"--out {directory}: cannot hold the directory: {describe_os_error(error)}") from None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            _remove_if_created(directory, created)
            raise InputError(f"--out {directory}: {LOCK_FILE} is not a regular file; remove it")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise InputError(
                f"--out {directory}: {_owner(path)} is writing there; wait for it to end or choose another --out"
            ) from None
        # The holder before us may have removed the file between our open and our flock: hold the file
        # that is there now, or try again.
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(descriptor)
    record = {"pid": os.getpid(), "command": _command_line(), "churnsim_command": command,
              "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    os.ftruncate(descriptor, 0)
    os.write(descriptor, (json.dumps(record) + "\n").encode())
    _held[key] = (descriptor, created)


def _remove_if_created(directory: Path, created: bool) -> None:
    if created:
        try:
            directory.rmdir()
        except OSError:
            pass


def release_out_directory(directory: Path) -> None:
    """Let go of a directory `lock_out_directory` holds: its lock file removed, and the directory too
    when this process created it and left it empty (a command refused after the lock wrote nothing)."""
    key = Path(directory).absolute()
    held = _held.pop(key, None)
    if held is None:
        return
    descriptor, created = held
    try:
        os.unlink(key / LOCK_FILE)  # while still holding the flock, so nobody takes a file about to vanish
    except OSError:
        pass
    os.close(descriptor)
    if created:
        try:
            key.rmdir()
        except OSError:
            pass  # not empty: the results


def release_all_out_directories() -> None:
    """At the end of a command (cli.main) and of the process."""
    for directory in list(_held):
        release_out_directory(directory)


atexit.register(release_all_out_directories)


# -- paths ---------------------------------------------------------------------------------------------


def check_out_path(path: Path, *, flag: str) -> None:
    """Refuse an output path that is too long, holds a NUL byte, or runs into a symbolic link loop."""
    check_path_text(path, what=flag)
    try:
        Path(path).resolve(strict=False)
    except RuntimeError:  # a symlink loop before Python 3.13
        raise InputError(f"{flag} {path}: a symbolic link loop (a link that points back to itself); fix or remove the link") from None
    except OSError as error:
        raise InputError(f"{flag} {path}: {describe_os_error(error)}") from None
    if os.path.islink(path) and not os.path.exists(path):
        raise InputError(f"{flag} {path}: a symbolic link to nothing (or a link loop); fix or remove the link")


def check_no_links_inside(directory: Path, *, flag: str = "--out", max_entries: int = 100_000) -> None:
    """Refuse (one line, nothing touched) a run directory holding a symbolic link anywhere below it:
    churnsim deletes and replaces files there, and must never do so through a link into other files."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    seen = 0
    for root, directories, files in os.walk(directory, followlinks=False):
        for name in (*directories, *files):
            seen += 1
            entry = Path(root) / name
            if entry.is_symlink():
                raise InputError(
                    f"{flag} {directory}: {entry.relative_to(directory)} is a symbolic link; churnsim writes and removes files "
                    "there and never through a link: remove the link, or choose a new directory"
                )
            if seen > max_entries:
                raise InputError(f"{flag} {directory}: holds more than {max_entries:,} entries; choose a new directory")


def check_real_run_inputs(scenario, out: Path, *, overwrite: bool, resume: bool) -> None:
    """What `real run` checks before any process starts: the corpus, the remote checkpoint directory,
    no link inside --out, and a finished run there replaced only with --overwrite."""
    from churnsim.calibration.safe_files import check_corpus

    if scenario.training.corpus is not None:
        check_corpus(scenario.training.corpus)
    remote = scenario.training.remote_checkpoint_dir
    if remote is not None:
        remote_path = Path(remote)
        if remote_path.exists() and not remote_path.is_dir():
            raise InputError(f"training.remote_checkpoint_dir = {remote!r}: is a file; give a directory")
        check_writable_directory(remote_path, flag="training.remote_checkpoint_dir")
    check_out_path(out, flag="--out")
    check_no_links_inside(out)
    if not resume and not overwrite and out.is_dir() and _real_run_finished(out):
        raise InputError(
            f"--out {out}: holds a finished real run; pass --overwrite to replace it (its record and checkpoints are removed), "
            "or choose a new directory"
        )
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        foreign = sorted(name for name in os.listdir(checkpoints) if not (name.startswith("stage-") and (checkpoints / name).is_dir()))
        if foreign:
            raise InputError(
                f"--out {out}: checkpoints/ holds {', '.join(foreign[:3])}, which churnsim did not write; nothing was removed: "
                "move those files out, or choose a new directory"
            )


def resume_hint(arguments: list[str]) -> str:
    """After an interrupted `real run`: how to continue it, where its --out holds an unfinished run
    with checkpoints ("" otherwise)."""
    try:
        out = Path(arguments[arguments.index("--out") + 1])
        run = read_json_file(out / "run.json")
        stages = [path for path in (out / "checkpoints").iterdir() if path.is_dir() and any(path.iterdir())]
    except (ValueError, IndexError, OSError, InputError):
        return ""
    if not isinstance(run, dict) or run.get("status") == "finished":
        return ""
    num_stages = run.get("config", {}).get("num_stages") if isinstance(run.get("config"), dict) else None
    if not isinstance(num_stages, int) or len(stages) < num_stages:
        return ""  # not every stage has checkpoints: the method cannot resume
    return "; its checkpoints are kept: continue it with the same command and --resume" if "--resume" not in arguments else "; continue it again with --resume"


def _real_run_finished(out: Path) -> bool:
    try:
        run = read_json_file(out / "run.json")
    except InputError:
        return (out / MANIFEST_FILE).exists()
    return isinstance(run, dict) and run.get("status") == "finished"


def check_figure_directory(results: Path, out: Path | None) -> None:
    """`plot`'s paths: the results directory readable, its --out a directory that can be written."""
    check_out_path(results, flag="RESULTS")
    if out is not None:
        check_out_path(out, flag="--out")
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {out}: is a file; give a directory for the figures")
        check_writable_directory(out, flag="--out")


def check_existing_file(path: Path, *, flag: str, overwrite: bool) -> None:
    """Refuse replacing a file (or a link) the user has at `path` unless `overwrite`."""
    if os.path.lexists(path) and not overwrite:
        kind = "a symbolic link" if os.path.islink(path) else "a file"
        raise InputError(f"{flag} {path}: {kind} is already there; pass --overwrite to replace it, or choose a new name")


def check_writable_directory(directory: Path, *, flag: str) -> None:
    """Refuse (one line, before any work) a directory that cannot be created or written.

    Probes by creating and removing a temporary directory in `directory`, or in its nearest existing
    ancestor when it does not exist yet: permission bits alone miss read-only mounts and /proc.
    """
    check_out_path(directory, flag=flag)
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise InputError(f"{flag} {directory}: {existing} is a file, so the directory cannot be created; choose another path")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".churnsim-probe-").cleanup()
    except OSError as error:
        where = "" if existing == directory else f" (its nearest existing parent {existing} is not writable)"
        raise InputError(f"{flag} {directory}: cannot write there{where}: {error.strerror or error}; choose a writable directory") from None


def check_writable_file(path: Path, *, flag: str, overwrite: bool | None = None) -> None:
    """Refuse (one line, before any work) a file path that is a directory or cannot be written, and,
    unless `overwrite` is None (not asked), an existing file without `overwrite`."""
    check_out_path(path, flag=flag)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    if overwrite is not None:
        check_existing_file(path, flag=flag, overwrite=overwrite)
    try:
        check_writable_directory(path.parent, flag=flag)
    except InputError:
        raise InputError(f"{flag} {path}: cannot write a file in {path.parent}; choose a writable path") from None
