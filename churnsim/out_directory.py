"""`--out DIR` never mixes two runs' results: the check every writing command makes before it starts.

A results directory names what it holds in its manifest.json (`command`, and the scenario or the
calibration it is about). Writing into it is fine when it is new, empty, or holds results of the same
command on the same scenario (a re-run replaces them). Anything else — another command's or another
scenario's results, or files churnsim did not write — is refused with one line unless the user
passes `--overwrite`. In a churnsim results directory the previous outputs are removed first, so
it ends up holding one run's results and never stale tables or records of another; in a directory
that is not churnsim's (no manifest) nothing is removed: `--overwrite` only lets churnsim write its
files beside the others, replacing same-named ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from churnsim.calibration.errors import InputError

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
        manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
        command = manifest["command"]
        subject = manifest["scenario"]["name"] if "scenario" in manifest else manifest["calibration"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (command, subject) if isinstance(command, str) and isinstance(subject, str) else None


def prepare_out_directory(directory: Path, *, command: str, subject: str, overwrite: bool) -> None:
    """Check that `directory` may take the results of `command` on `subject`, then clear churnsim's old outputs.

    Raises InputError (one line) before anything is written or removed when the directory holds
    another run's results or foreign files and `overwrite` is False.
    """
    if directory.exists() and not directory.is_dir():
        raise InputError(f"--out {directory}: is a file; give a directory")
    check_writable_directory(directory, flag="--out")
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    found = _identity(directory)
    if not overwrite and found != (command, subject):
        if found is None:
            problem = "is not empty and holds no churnsim results"
        else:
            problem = f"holds churnsim {found[0]} results for {found[1]!r}"
        raise InputError(
            f"--out {directory}: {problem}; this {command} of {subject!r} would mix with them: "
            "choose a new or empty directory, or pass --overwrite to replace churnsim's results there"
        )
    if found is None:
        return  # not churnsim's directory: write beside the user's files, and remove none of them
    for path in churnsim_outputs(directory):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_writable_directory(directory: Path, *, flag: str) -> None:
    """Refuse (one line, before any work) a directory that cannot be created or written.

    Probes by creating and removing a temporary directory in `directory`, or in its nearest existing
    ancestor when it does not exist yet: permission bits alone miss read-only mounts and /proc.
    """
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


def check_writable_file(path: Path, *, flag: str) -> None:
    """Refuse (one line, before any work) a file path that is a directory or cannot be written."""
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    try:
        check_writable_directory(path.parent, flag=flag)
    except InputError:
        raise InputError(f"{flag} {path}: cannot write a file in {path.parent}; choose a writable path") from None
