"""Warnings a stage process must show on the terminal: a skipped checkpoint, a restart from scratch.

A stage process shares the launcher's stderr, but the launcher's progress bar redraws its line in
place, so a line a stage wrote there would be glued to a stale bar. A stage process of a local launch
appends its warning lines to a file in the launcher's private work directory (`relay_to`); the
launcher reads new lines while it polls (`WarningReader`) and prints them itself, above the bar. A
process that relays to nowhere (a rank under torchrun, a test) writes them to its stderr.
"""

from __future__ import annotations

import os
import sys

WARNINGS_FILE = "warnings.log"
_PREFIX = "churnsim: warning: "
_relay_path: str | None = None


def relay_to(path: str | None) -> None:
    """Send this process's warnings to `path` (appended, one line each); None: to stderr."""
    global _relay_path
    _relay_path = path


def warn(line: str) -> None:
    """One line on the terminal (and, where the caller records it, in the run record too)."""
    text = f"{_PREFIX}{' '.join(line.split())}\n"
    if _relay_path is None:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    # One write of one line with O_APPEND: lines of several stage processes never interleave.
    descriptor = os.open(_relay_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


class WarningReader:
    """The launcher's side: the complete lines appended to `path` since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return complete.decode(errors="replace").splitlines()
