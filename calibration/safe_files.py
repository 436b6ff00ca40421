"""Opening what a user names: the one place every reader of an input file goes through.

A path on the command line or in a scenario may be anything: a FIFO that never ends (a read blocks
forever), `/dev/zero` (a read fills memory), a symlink loop, a name longer than the system allows,
a directory, a file of gigabytes. `read_input_bytes` opens it without blocking and without following
it when it is a FIFO or a device (`O_NONBLOCK`, then `fstat` on the open descriptor, so the check and
the read see the same file), refuses anything but a regular file, and reads at most a limit; every
problem is one `InputError` line naming the file, never its content.

`parse_json_bounded` parses JSON with its nesting depth and the length of its integers bounded
(Python's parser raises RecursionError for a document nested a few thousand deep, and ValueError for
an integer of more than 4,300 digits).
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import InputError

MAX_PATH_CHARACTERS = 4096
"""Linux's PATH_MAX: a longer path cannot be opened anyway."""
MAX_NAME_CHARACTERS = 255
"""NAME_MAX of the common Linux file systems: one path component."""
MAX_JSON_FILE_BYTES = 64 * 2**20
"""A scenario, calibration or manifest is kilobytes; 64 MiB is far beyond any real one."""
MAX_TABLE_FILE_BYTES = 1024 * 2**20
"""A trace, failure schedule, run-record or result table; the largest shipped trace is well under 1 MiB."""
MAX_JSON_DEPTH = 64
"""A contract file nests a few levels (scenario → methods → config → field)."""
MAX_JSON_INTEGER_DIGITS = 40
"""Seeds and counts fit 64 bits (20 digits); a longer integer is a typo or an attack."""
MAX_CORPUS_FILES = 100_000


def _shown(path: str | Path) -> str:
    """The path as a message shows it: a very long one cut, so the message stays one readable line."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:120]}...({len(text)} characters)"


def check_path_text(path: str | Path, *, what: str) -> None:
    """Refuse a path too long for the system, or with a NUL byte, before any system call sees it."""
    text = str(path)
    if "\x00" in text:
        raise InputError(f"{what} {_shown(text)!r}: contains a NUL byte; give a plain path")
    if len(text) > MAX_PATH_CHARACTERS:
        raise InputError(f"{what} {_shown(text)}: the path has {len(text):,} characters, more than the limit of {MAX_PATH_CHARACTERS}; give a shorter path")
    longest = max((len(part) for part in text.split(os.sep)), default=0)
    if longest > MAX_NAME_CHARACTERS:
        raise InputError(f"{what} {_shown(text)}: a name in the path has {longest} characters, more than the limit of {MAX_NAME_CHARACTERS}; give a shorter name")


def describe_os_error(error: OSError) -> str:
    """A one-phrase reason for an OSError, with the fix where there is one."""
    if error.errno == errno.ELOOP:
        return "a symbolic link loop (a link that points back to itself); fix or remove the link"
    if error.errno == errno.ENAMETOOLONG:
        return "the path is too long for the system; give a shorter path"
    if error.errno == errno.ENOENT:
        return "no such file; check the path"
    if error.errno == errno.EACCES:
        return "permission denied; check the file's permissions"
    if error.errno == errno.ENOTDIR:
        return "a part of the path is not a directory; check the path"
    return f"cannot be opened ({error.strerror or error.__class__.__name__})"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_input_bytes(path: str | Path, *, what: str = "", limit: int = MAX_TABLE_FILE_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; InputError for anything else.

    `what` names the input in messages ("churn.path", "--calibration"); the path is always named.
    """
    label = f"{what} {_shown(path)}" if what else _shown(path)
    check_path_text(path, what=what or "file")
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.EISDIR:
            raise InputError(f"{label}: is a directory; give a file") from None
        raise InputError(f"{label}: {describe_os_error(error)}") from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise InputError(f"{label}: is {_kind(status.st_mode)}, not a regular file; give a file")
        if status.st_size > limit:
            raise InputError(f"{label}: {status.st_size / 2**20:.1f} MiB, more than the limit of {limit / 2**20:.0f} MiB for this input; give a smaller file")
        os.set_blocking(descriptor, True)
        chunks, total = [], 0
        while True:  # a file can grow after fstat; never read past the limit
            chunk = os.read(descriptor, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise InputError(f"{label}: more than the limit of {limit / 2**20:.0f} MiB for this input; give a smaller file")
        return b"".join(chunks)
    except OSError as error:
        raise InputError(f"{label}: {describe_os_error(error)}") from None
    finally:
        os.close(descriptor)


def read_input_text(path: str | Path, *, what: str = "", limit: int = MAX_TABLE_FILE_BYTES) -> str:
    """`read_input_bytes` decoded as UTF-8 (a BOM is dropped); InputError for bytes that are not UTF-8."""
    data = read_input_bytes(path, what=what, limit=limit)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        label = f"{what} {_shown(path)}" if what else _shown(path)
        raise InputError(f"{label}: not UTF-8 text (a bad byte at offset {error.start}); check the file") from None


def input_stream(path: str | Path, *, what: str = "", limit: int = MAX_TABLE_FILE_BYTES) -> io.BytesIO:
    """The file's bytes as a stream for a parser that wants one (pandas, csv)."""
    return io.BytesIO(read_input_bytes(path, what=what, limit=limit))


def _bounded_integer(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INTEGER_DIGITS:
        raise ValueError(f"an integer of {digits} digits, more than the limit of {MAX_JSON_INTEGER_DIGITS}")
    return int(text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth_beyond(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (a quick scan, before parsing)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth, inside_string, escaped = 0, False, False
    for character in text:
        if inside_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                inside_string = False
        elif character == '"':
            inside_string = True
        elif character in "[{":
            depth += 1
            if depth > limit:
                return True
        elif character in "]}":
            depth -= 1
    return False


def parse_json_bounded(text: str, *, source: str, strict: bool = False, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON text, refusing (InputError naming `source`) a nesting deeper than `max_depth`,
    integers longer than MAX_JSON_INTEGER_DIGITS and, with `strict`, NaN/Infinity literals."""
    if _depth_beyond(text, max_depth):
        raise InputError(f"{_shown(source)}: JSON nested more than {max_depth} levels deep; a churnsim file nests a few levels, check the file")
    try:
        return json.loads(text, parse_int=_bounded_integer, **({"parse_constant": _refuse_constant} if strict else {}))
    except json.JSONDecodeError as error:
        raise InputError(f"{_shown(source)}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    except RecursionError:
        raise InputError(f"{_shown(source)}: JSON nested too deeply; check the file") from None
    except ValueError as error:
        raise InputError(f"{_shown(source)}: not valid JSON: {error}") from None


def json_value_or_text(text: str, *, source: str) -> Any:
    """A command-line value as JSON where it is JSON (bounded as `parse_json_bounded`), else the text itself."""
    if _depth_beyond(text, MAX_JSON_DEPTH):
        raise InputError(f"{source}: the value is nested more than {MAX_JSON_DEPTH} levels deep; give a plain value")
    try:
        return json.loads(text, parse_int=_bounded_integer)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise InputError(f"{source}: the value is nested too deeply; give a plain value") from None
    except ValueError as error:
        raise InputError(f"{source}: {error}; give a smaller value") from None


def read_json_file(path: str | Path, *, what: str = "", strict: bool = False) -> Any:
    """A JSON file read with `read_input_text` (MAX_JSON_FILE_BYTES) and `parse_json_bounded`."""
    text = read_input_text(path, what=what, limit=MAX_JSON_FILE_BYTES)
    return parse_json_bounded(text, source=f"{what} {path}" if what else str(path), strict=strict)


def resolve_inside(base: Path, relative: str | Path, *, what: str) -> Path | None:
    """`base / relative` when it names an existing regular file that stays inside `base` once links
    and `..` are resolved; None when there is no such file. A path that leaves `base` is refused
    (InputError) without opening what it reaches."""
    check_path_text(relative, what=what)
    candidate = base / relative
    try:
        resolved = candidate.resolve(strict=True)
        base_resolved = base.resolve(strict=True)
    except FileNotFoundError:
        return None
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop before Python 3.13
        reason = describe_os_error(error) if isinstance(error, OSError) else "a symbolic link loop; fix or remove the link"
        raise InputError(f"{what} {_shown(relative)!r}: {reason}") from None
    if not resolved.is_relative_to(base_resolved):
        raise InputError(
            f"{what} {_shown(relative)!r}: leads outside {base} (through '..' or a link); "
            "a relative path must stay inside the folder it is resolved against: give an absolute path to use a file elsewhere"
        )
    return candidate if resolved.is_file() else None


def check_corpus(corpus: str | Path, *, what: str = "training.corpus") -> None:
    """Refuse, before any process starts, a corpus that is not a readable text file or a directory of
    them: missing, a FIFO or device, a symlink loop, empty, a file over MAX_TABLE_FILE_BYTES or a
    directory of more than MAX_CORPUS_FILES files."""
    check_path_text(corpus, what=what)
    path = Path(corpus)
    try:
        status = path.stat()
    except OSError as error:
        raise InputError(f"{what} = {_shown(corpus)!r}: {describe_os_error(error)}; give a text file or a directory of text files") from None
    except RuntimeError:
        raise InputError(f"{what} = {_shown(corpus)!r}: a symbolic link loop; fix or remove the link") from None
    if stat.S_ISDIR(status.st_mode):
        try:
            files = [entry for entry in sorted(path.rglob("*")) if entry.is_file()]
        except (OSError, RuntimeError) as error:
            raise InputError(f"{what} = {_shown(corpus)!r}: cannot list the directory ({error.__class__.__name__}); check it") from None
        if not files:
            raise InputError(f"{what} = {_shown(corpus)!r}: the directory holds no files; put text files in it")
        if len(files) > MAX_CORPUS_FILES:
            raise InputError(f"{what} = {_shown(corpus)!r}: {len(files):,} files, more than the limit of {MAX_CORPUS_FILES:,}; use fewer, larger files")
        return
    if not stat.S_ISREG(status.st_mode):
        raise InputError(f"{what} = {_shown(corpus)!r}: is {_kind(status.st_mode)}; give a text file or a directory of text files")
    if status.st_size == 0:
        raise InputError(f"{what} = {_shown(corpus)!r}: the file is empty; give a text file with text in it")
    if status.st_size > MAX_TABLE_FILE_BYTES:
        raise InputError(f"{what} = {_shown(corpus)!r}: {status.st_size / 2**20:.0f} MiB, more than the limit of {MAX_TABLE_FILE_BYTES / 2**20:.0f} MiB; use a smaller corpus")
    try:
        with open(path, "rb") as stream:
            head = stream.read(64 * 1024)
    except OSError as error:
        raise InputError(f"{what} = {_shown(corpus)!r}: {describe_os_error(error)}") from None
    if b"\x00" in head:
        # The stage processes skip files holding NUL bytes (binary): a corpus of one such file has no text.
        raise InputError(f"{what} = {_shown(corpus)!r}: a binary file (it holds NUL bytes), not text; give a text file")
