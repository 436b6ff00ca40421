"""The `churnsim` command: thin commands that load inputs, call a library function and write files.

Bad input of any kind (a file, a flag, a value) ends with one line on stderr and exit code 2. torch
is imported only by the commands that run real pipelines.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Optional

import typer

try:  # typer >= 0.24 vendors its own click; older releases use the click package.
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exceptions

from churnsim.app import app
from churnsim.calibration.errors import InputError
from churnsim.results_report import note_invocation

def _register_commands() -> None:
    # Each module adds its commands to `app` / `real_app`, in the order `churnsim --help` lists them;
    # importing them here keeps this file thin. They import rich, pydantic and the simulator only
    # inside the commands, so that `--help` stays within 0.3 s (benchmarks/import_speed.py).
    from churnsim import commands_sim, commands_calibrate, commands_reproduce, commands_real  # noqa: F401


current_arguments: Optional[list[str]] = None
"""The arguments of the command this process runs, once `main` started."""


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point of the console script."""
    arguments = sys.argv[1:] if argv is None else argv
    global current_arguments
    current_arguments = list(arguments)  # how a held --out names its command (out_directory.lock_out_directory)
    try:
        _main(arguments)
    finally:
        out_directory = sys.modules.get("churnsim.out_directory")  # loaded only by commands that write a directory
        if out_directory is not None:
            out_directory.release_all_out_directories()
        if argv is None:  # the command line, not a caller (a test) that keeps its own Ctrl-C
            _exit_on_late_interrupt()


def _main(arguments: list[str]) -> None:
    try:
        note_invocation(arguments)
        _register_commands()
        returned = app(args=arguments, prog_name="churnsim", standalone_mode=False)
    except InputError as error:
        _fail(str(error))
    except OSError as error:
        # A path the system cannot use at all (too long, a symlink loop) is the user's to fix, wherever
        # it is first touched; any other OSError is a bug and keeps its traceback.
        if error.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
            raise
        name = str(error.filename)
        shown = name if len(name) <= 200 else f"{name[:120]}...({len(name)} characters)"
        _fail(f"{shown}: {'the path is too long for the system' if error.errno == errno.ENAMETOOLONG else 'a symbolic link loop'}; give another path")
    except click_exceptions.NoArgsIsHelpError as no_arguments:
        # `churnsim` or `churnsim real` alone: the group's help, which plain click help only carries in the error.
        typer.echo(no_arguments.format_message())
        sys.exit(0)
    except click_exceptions.UsageError as error:
        command = error.ctx.command_path if error.ctx else "churnsim"
        _fail(f"{error.format_message()} (see: {command} --help)")
    except typer.Exit as exit_:
        sys.exit(exit_.exit_code)
    except typer.Abort as abort:
        # click (older typer) turns Ctrl-C into Abort.
        _interrupted() if isinstance(abort.__context__, KeyboardInterrupt) else _fail("aborted")
    except KeyboardInterrupt:
        _interrupted()
    else:
        # Outside standalone mode typer returns an Exit's code instead of raising it, and turns
        # Ctrl-C inside a command into Exit(130); commands themselves return None.
        if returned == 130:
            _interrupted()
        if isinstance(returned, int) and returned:
            sys.exit(returned)


def _fail(message: str) -> None:
    sys.stderr.write(f"churnsim: error: {' '.join(message.split())}\n")
    sys.exit(2)


def _exit_on_late_interrupt() -> None:
    """After the command, its files written: a Ctrl-C while the interpreter shuts down (joining
    worker pools in exit handlers) ends the process as one during the command does, with one line
    and exit code 130, not with Python's report of an exception in an exit handler."""

    def interrupted_while_exiting(signal_number: int, frame: object) -> None:
        sys.stdout.flush()
        sys.stderr.write("churnsim: interrupted\n")
        sys.stderr.flush()
        os._exit(130)

    # Not where Ctrl-C is ignored (a background job) or from a thread, where handlers cannot be set.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, interrupted_while_exiting)


def _interrupted() -> None:
    # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C.
    hint = ""
    if current_arguments and current_arguments[:2] == ["real", "run"]:
        from churnsim.out_directory import resume_hint

        hint = resume_hint(current_arguments)
    sys.stderr.write(f"churnsim: interrupted{hint}\n")
    sys.exit(130)


if __name__ == "__main__":
    main()
