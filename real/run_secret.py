"""The run's secret: who may take part in a run's rendezvous, and which checkpoints are the run's.

One secret per run, `secrets.token_hex(32)` (256 bits). A run with a directory keeps it in
`<run dir>/run.secret` (mode 0600, beside run.json, outside the checkpoint directories), so that
`--resume` binds to the same checkpoints; a run without a directory keeps it in memory. The launcher
hands it to the processes it starts in their process arguments (the fork server's Unix socket, not
argv, which `ps` shows); under torchrun every rank reads it from the environment variable
`CHURNSIM_RUN_TOKEN` (`churnsim real run --write-config` writes it to a 0600 file and prints a
command that reads it from there).

What the secret does (every use is an HMAC-SHA256 keyed by it, one label per use):

- Store namespace. torch's TCPStore has no authentication: anyone who reaches its port can read and
  write any key whose name they know. Every key of a run lives under `store_namespace(secret)`, a
  prefix derived from the secret, so the names of the run's keys cannot be guessed: a process
  without the secret can neither read nor overwrite them (the store has no call that lists keys).
- Join handshake. A stage process is counted at a rendezvous only when the value it wrote there is
  `sign(secret, label, value)` for that generation and stage (`verify`): someone who saw the key
  names on the wire but not the secret cannot make up a member or an outcome.
- Checkpoint binding. Every checkpoint manifest carries an HMAC keyed by the secret over its fields
  (which hold the data file's header checksum, which holds every tensor's checksum): a checkpoint
  from anywhere else, with every checksum recomputed, is refused.

What it does not do: the store and the process group's connections are plain TCP, neither
encrypted nor authenticated per message. Someone who can watch the traffic (root on this machine,
or on the network between machines) learns the key names and can then write garbage under them
(the run fails rather than going wrong) or read what is exchanged; someone who can reach the port
can still fill the store with keys of their own, or connect to a rank's gloo port and break a
connection. So endpoints bind to loopback by default, and across machines the network must be one
you trust. The secret file protects against other users, not against the same user or root.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from churnsim.calibration.errors import InputError

TOKEN_VARIABLE = "CHURNSIM_RUN_TOKEN"
"""Environment variable that carries the run's secret to the ranks of a torchrun launch."""
SECRET_FILE = "run.secret"
_TOKEN_HEX_CHARACTERS = 64
_MIN_TOKEN_HEX_CHARACTERS = 32
SIGNATURE_SEPARATOR = b"|hmac-sha256="


def new_token() -> str:
    """A fresh secret: 256 random bits as 64 hex digits."""
    return secrets.token_hex(_TOKEN_HEX_CHARACTERS // 2)


def check_token(token: object, where: str) -> str:
    """`token` if it is a secret churnsim made (hex digits, at least 128 bits); else InputError naming `where`."""
    if (
        not isinstance(token, str)
        or len(token) < _MIN_TOKEN_HEX_CHARACTERS
        or any(character not in "0123456789abcdef" for character in token)
    ):
        raise InputError(
            f"{where}: not a churnsim run token (at least {_MIN_TOKEN_HEX_CHARACTERS} lower-case hex digits); "
            "use the token file `churnsim real run --write-config` wrote"
        )
    return token


def token_from_environment() -> str:
    """The run's secret from `CHURNSIM_RUN_TOKEN` (torchrun launches); InputError when unset or malformed."""
    token = os.environ.get(TOKEN_VARIABLE)
    if not token:
        raise InputError(
            f"environment variable {TOKEN_VARIABLE} is not set: every rank needs the run's token; start the ranks "
            f"with the command `churnsim real run --write-config` printed ({TOKEN_VARIABLE}=$(cat TOKEN_FILE) torchrun ...)"
        )
    return check_token(token.strip(), TOKEN_VARIABLE)


def derive(token: str, label: str) -> str:
    """HMAC-SHA256 of `label` keyed by the secret, as hex: one independent value per use."""
    return hmac.new(token.encode(), label.encode(), hashlib.sha256).hexdigest()


def store_namespace(token: str) -> str:
    """The prefix of every store key of the run; unguessable without the secret."""
    return f"churnsim-{derive(token, 'store-namespace')[:32]}/"


def sign(token: str, label: str, value: bytes) -> bytes:
    """`value` followed by its HMAC under `label` (the label binds it to one key: no replay elsewhere)."""
    return value + SIGNATURE_SEPARATOR + hmac.new(token.encode(), label.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()


def verify(token: str, label: str, signed: bytes) -> bytes | None:
    """The value `sign(token, label, value)` produced, or None when `signed` is anything else."""
    value, separator, mac = bytes(signed).rpartition(SIGNATURE_SEPARATOR)
    if not separator:
        return None
    expected = hmac.new(token.encode(), label.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()
    return value if hmac.compare_digest(mac, expected) else None


def check_listen_address(host: str, flag: str = "--rendezvous-host") -> str:
    """`host` if this machine can listen there (an address of its own); InputError naming `flag` otherwise.

    Here, without torch, so that the CLI refuses a wrong address before anything is written or started."""
    import socket

    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.bind(address[:2])
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise InputError(
            f"{flag} {host!r}: this machine cannot listen there ({reason}); give one of its own addresses, or leave it out for 127.0.0.1"
        ) from None
    return host


def checkpoint_key(token: str) -> bytes:
    """The key of the checkpoints' HMAC (independent of the store's names)."""
    return bytes.fromhex(derive(token, "checkpoint-binding"))


def write_secret_file(path: Path, token: str) -> None:
    """Write the secret to `path`, readable by this user only (created 0600, never world-readable)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(descriptor, 0o600)
        os.write(descriptor, f"{token}\n".encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


def read_secret_file(path: Path) -> str:
    """The secret in `path`; InputError when it is missing, readable by others, or malformed."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise InputError(
            f"{path}: the run's secret is missing, so its checkpoints cannot be told from foreign ones; "
            "start a new run in another --out directory"
        ) from None
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror}); it must be a regular file of this user") from None
    try:
        status = os.fstat(descriptor)
        if status.st_mode & 0o077:
            raise InputError(
                f"{path}: readable or writable by other users (mode {status.st_mode & 0o777:o}); "
                f"run `chmod 600 {path}` if nobody else could have changed it"
            )
        data = os.read(descriptor, 1024)
    finally:
        os.close(descriptor)
    return check_token(data.decode(errors="replace").strip(), str(path))
