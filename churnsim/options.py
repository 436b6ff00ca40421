"""The options several commands share: their help, and their parsing into what the library takes.

Imports nothing heavy at the top (`--help` stays fast); a bad value raises `InputError` with the
one line the command prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

CALIBRATION_HELP = "Run on a calibrated machine: a file from `churnsim calibrate`, or a built-in calibration's name (cpu-tiny)."
CALIBRATION_MODE_HELP = (
    "With --calibration: full (every measured quantity replaces the scenario's: compute, link, storage, recovery, "
    "convergence) or setbacks (only the measured convergence setbacks)."
)
OVERWRITE_HELP = "Write into --out even though it holds another run's results or other files (churnsim's own old results there are replaced)."
JSON_HELP = "Print the answer as strict JSON on stdout (tables go to stderr), for scripts."
SET_HELP = "FIELD=VALUE override of a scenario field (dotted path, as in `sweep`); repeatable."


def scenario_argument(scenario_path: Optional[Path], preset_name: Optional[str]) -> Path | str:
    """The scenario named on the command line, a file (a `Path`) or a preset (its name): exactly one,
    as `presets.build_scenario` takes it."""
    from churnsim.calibration.errors import InputError

    if (scenario_path is None) == (preset_name is None):
        raise InputError("give a scenario file or --preset NAME (exactly one); `churnsim presets` lists the presets")
    return scenario_path if scenario_path is not None else str(preset_name)


def scenario_source(scenario_path: Optional[Path], preset_name: Optional[str]) -> str:
    """How messages name the scenario: its file, or the preset."""
    return str(scenario_path) if scenario_path is not None else f"preset {preset_name}"


def calibration_option(text: Optional[str], mode: str):
    """The --calibration named (None without one), its --calibration-mode checked."""
    from churnsim.calibration.errors import InputError

    if mode not in ("full", "setbacks"):
        raise InputError(f"--calibration-mode {mode!r}: use full or setbacks")
    if text is None:
        return None
    from churnsim.calibration.builtin import resolve_calibration

    return resolve_calibration(text)


def check_run_flags(*, replications: Optional[int] = None, seed: Optional[int] = None, minimum_replications: int = 1, why: str = "must be >= 1") -> None:
    """--replications and --seed, checked before any work."""
    from churnsim.calibration.errors import InputError

    if replications is not None and replications < minimum_replications:
        raise InputError(f"--replications {replications}: {why}")
    if seed is not None and seed < 0:
        raise InputError(f"--seed {seed}: must be >= 0")


def parse_float_list(text: str, flag: str) -> tuple[float, ...]:
    """Comma-separated failure probabilities per stage-hour, each in [0, 1)."""
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.scenario_overrides import comma_separated

    parts = comma_separated(text, f"{flag} {text!r}", empty="give at least one value")
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0,0.05,0.1") from None
    if any(not 0.0 <= value < 1.0 for value in values):
        raise InputError(f"{flag} {text!r}: failure probabilities per stage-hour must be in [0, 1), e.g. 0.1 for 10 %/h")
    return values
