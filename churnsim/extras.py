"""Optional dependencies: torch comes with the `real` extra, and only the commands that run real
pipelines need it, so they check for it before importing anything from real/."""

from __future__ import annotations

import importlib.util

from churnsim.calibration.errors import InputError

REAL_EXTRA_HINT = 'install the real-run extra: pip install "churnsim[real]"'


def has_torch() -> bool:
    # find_spec looks torch up without importing it (seconds saved on every command that does not need it).
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as missing
        return False


def require_torch(what: str) -> None:
    """Raise one clear InputError when torch is missing; `what` names the work that needs it."""
    if not has_torch():
        raise InputError(f"{what} needs PyTorch, which is not installed; {REAL_EXTRA_HINT}")
