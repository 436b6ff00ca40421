"""The one exception type for bad user input.

Every problem with a file, a flag or a value that a user can fix raises `InputError` with a single
line that names what is wrong and how to fix it. The CLI prints that line to stderr and exits with
code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class InputError(ValueError):
    """A user-fixable problem with a config, a trace, a calibration file, a run record or a flag."""

    def __init__(self, message: str) -> None:
        # One line: a newline would split the message the CLI promises to print on a single line.
        super().__init__(" ".join(message.split()))
