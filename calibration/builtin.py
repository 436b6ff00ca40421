"""Calibrations shipped with churnsim (`data/calibrations/<name>.json`), loaded once and cached.

Loading never raises: a missing or invalid file gives `None` and the reason, so that presets fall
back to their defaults and say why instead of breaking `churnsim presets`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .calibration_file import Calibration, load_calibration
from .errors import InputError

CALIBRATION_DIRECTORY = Path(__file__).resolve().parent / "data" / "calibrations"
"""Where the built-in calibration files live (made by `churnsim calibrate`, provenance inside)."""


def builtin_calibration_path(name: str) -> Path:
    return CALIBRATION_DIRECTORY / f"{name}.json"


def builtin_calibration_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in CALIBRATION_DIRECTORY.glob("*.json"))) if CALIBRATION_DIRECTORY.is_dir() else ()


@lru_cache(maxsize=8)
def load_builtin_calibration(name: str) -> tuple[Calibration | None, str]:
    """(calibration, "") or (None, why it is unavailable); cached per name."""
    path = builtin_calibration_path(name)
    if not path.is_file():
        return None, f"built-in calibration {name!r} is missing ({path.name} not shipped)"
    try:
        return load_calibration(str(path)), ""
    except InputError as error:
        return None, f"built-in calibration {name!r} is invalid: {error}"


def resolve_calibration(text: str) -> Calibration:
    """A calibration file path, or the name of a built-in calibration (e.g. `cpu-tiny`)."""
    path = Path(text)
    if path.is_file():
        return load_calibration(str(path))
    if text in builtin_calibration_names():
        calibration, reason = load_builtin_calibration(text)
        if calibration is None:
            raise InputError(reason)
        return calibration
    raise InputError(
        f"--calibration {text!r}: no such file and no built-in calibration of that name "
        f"(built-in: {', '.join(builtin_calibration_names()) or 'none'}); run `churnsim calibrate --out FILE` first"
    )
