"""Strict, versioned file models and the one place that turns validation errors into one line.

Every contract file (scenario, calibration, failure schedule, run-record manifest) is a pydantic
model that forbids unknown keys, is immutable once built, and is read through `load_model`, which
reports the first problem as `<file>: <field path> = <value>: <what is wrong>; <fix>`.
"""

import json
import math
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar, Iterator, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import InputError

SCHEMA_VERSION = 1


class StrictModel(BaseModel):
    """Base of every contract model: unknown keys are errors, values are immutable.

    Modules that define models do without `from __future__ import annotations`: pydantic would turn
    every string annotation back into a type when the class is created, which was half of the
    models' share of `import churnsim.sim.model.run` (tests/calibration/test_model_modules.py keeps it so).
    """

    # Infinite bandwidths are legal values; JSON has no literal for them, so they travel as "Infinity".
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, ser_json_inf_nan="strings")


def _leaf_numbers(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """Every number in `value` (a model's `model_dump()`) with the keys that lead to it."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value
        return
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, child in children:
        yield from _leaf_numbers(child, (*path, str(key)))


def _is_bandwidth(path: tuple[str, ...]) -> bool:
    return any("bandwidth" in key for key in path)


def _is_duration(path: tuple[str, ...]) -> bool:
    """Under a key ending in `_s` (a mapping of them too, such as per-method seconds), bandwidths
    (`_per_s`) excepted."""
    return any(key.endswith("_s") and not key.endswith("_per_s") for key in path)


def first_non_finite_number(value: Any) -> str | None:
    """The dotted path of the first NaN or infinite number in `value` (a model's `model_dump()`),
    leaving out bandwidths, which may be Infinity (no limit); None when every number is finite."""
    return next((".".join(path) for path, number in _leaf_numbers(value) if not math.isfinite(number) and not _is_bandwidth(path)), None)


LONGEST_DURATION_S = 1e9
"""No duration a calibration measured, and no compute time, latency or single transfer the simulator
is given, may exceed this (31.7 years): sums of such times must stay finite (an iteration of 10^308 s
overflowed the simulator's clock to inf), and a figure's axis must be able to hold them."""


def first_endless_duration(value: Any) -> str | None:
    """The dotted path of the first duration in `value` (a `model_dump()`) longer than
    LONGEST_DURATION_S either way; None when there is none."""
    return next((".".join(path) for path, number in _leaf_numbers(value) if _is_duration(path) and abs(number) > LONGEST_DURATION_S), None)


def endless_transfer(what: str, bandwidth_bytes_per_s: float, size_bytes: float, carrying: str, fix: str = "give it a larger bandwidth") -> str | None:
    """Why moving `size_bytes` over `what` would outlast LONGEST_DURATION_S ("`what` (its bandwidth)
    would take more than ... to `carrying`; `fix`"), or None when it ends: the one rule for links,
    the all-reduce and storage tiers."""
    if size_bytes / bandwidth_bytes_per_s <= LONGEST_DURATION_S:
        return None
    return f"{what} ({bandwidth_bytes_per_s:g} B/s) would take more than {LONGEST_DURATION_S:g} s (31.7 years) to {carrying}; {fix}"


class FiniteNumbersModel(StrictModel):
    """A contract file whose every number is finite, bandwidths excepted (Infinity: no limit).

    Its check runs before the subclass's own validators, which, like the simulator, may assume it.
    """

    how_to_fix: ClassVar[str] = "give a number"
    durations_are_measured: ClassVar[bool] = False
    """True (a calibration): every duration also lies within LONGEST_DURATION_S either way, since
    runs measured them (a warm-up of 1e300 s got past the finite check and broke validate's figure)."""

    @model_validator(mode="after")
    def _numbers_are_finite(self) -> "FiniteNumbersModel":
        numbers = self.model_dump()
        where = first_non_finite_number(numbers)
        if where is not None:
            raise ValueError(f"{where} is not a finite number; only a bandwidth may be Infinity (no limit): {self.how_to_fix}")
        where = first_endless_duration(numbers) if self.durations_are_measured else None
        if where is not None:
            raise ValueError(f"{where} is more than {LONGEST_DURATION_S:g} s (31.7 years) either way, which no run measures: {self.how_to_fix}")
        return self


ModelT = TypeVar("ModelT", bound=BaseModel)

_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "missing": "add it",
    "greater_than": "use a larger value",
    "greater_than_equal": "use a larger value",
    "less_than": "use a smaller value",
    "less_than_equal": "use a smaller value",
    "literal_error": "use one of the allowed values",
    "union_tag_invalid": "use one of the allowed values",
    "union_tag_not_found": "add the field that selects the kind (e.g. 'kind' or 'name')",
}


def describe_validation_error(error: ValidationError, source: str) -> str:
    """The first error of `error` as one line naming the source, the field, the value and the fix."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    value = first.get("input")
    # pydantic prefixes our own validators' messages with "Value error, "; they already name the fields.
    message = first["msg"].removeprefix("Value error, ")
    fix = _FIXES.get(first["type"], "")
    more = len(error.errors()) - 1
    suffix = f" ({more} more problem{'s' if more > 1 else ''})" if more else ""
    if isinstance(value, dict):  # a whole section (a model validator): its message names the fields
        text = f"{source}: field '{location}': {message}" if location else f"{source}: {message}"
    else:
        shown = json.dumps(value, default=str)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        text = f"{source}: field '{location or '(top level)'}' = {shown}: {message}"
    return text + (f"; {fix}" if fix else "") + suffix


def validate_model(model_type: type[ModelT], data: Any, source: str) -> ModelT:
    """Build `model_type` from plain data, raising `InputError` with a one-line message."""
    try:
        return model_type.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(error, source)) from None


def read_json(path: str | Path) -> Any:
    """Parse a JSON file, raising `InputError` naming the file on any problem (safe_files: regular
    files only, a size limit, bounded nesting and integers)."""
    from .safe_files import read_json_file

    return read_json_file(path)


def load_model(model_type: type[ModelT], path: str | Path) -> ModelT:
    """Read and validate one JSON contract file."""
    return validate_model(model_type, read_json(path), str(path))


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask (reading it means setting it, so briefly, under a lock)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def output_mode(*, directory: bool = False) -> int:
    """The mode `open()` or `mkdir()` would give a new file or directory (0644 / 0755 under umask 022).

    tempfile.mkstemp and mkdtemp create 0600 / 0700 on purpose (private scratch space); an output
    renamed into place from them must get the ordinary mode, or other users cannot read results.
    """
    return (0o777 if directory else 0o666) & ~current_umask()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so no half-written file remains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, output_mode())
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json_loads(text: str) -> Any:
    """`json.loads` that refuses the NaN/Infinity/-Infinity literals Python's json accepts by default."""
    return json.loads(text, parse_constant=_refuse_constant)


def strict_json_dumps(data: Any, *, indent: int | None = 2) -> str:
    """JSON every parser reads: a NaN or infinity in `data` is a programming error here, not a bare literal
    in a file (write None, or a string such as "Infinity" that the contract models read back)."""
    return json.dumps(data, indent=indent, allow_nan=False)


def save_model(model: BaseModel, path: str | Path) -> None:
    """Write a contract model as indented JSON, atomically.

    pydantic writes non-finite floats as null (its default) or, for `StrictModel`, as the strings
    "Infinity"/"NaN" that validation reads back, never as bare literals; the strict parse checks it.
    """
    text = model.model_dump_json(indent=2)
    strict_json_loads(text)
    atomic_write_text(path, text + "\n")
