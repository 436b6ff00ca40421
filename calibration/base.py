"""Strict, versioned file models and the one place that turns validation errors into one line.

Every contract file (scenario, calibration, failure schedule, run-record manifest) is a pydantic
model that forbids unknown keys, is immutable once built, and is read through `load_model`, which
reports the first problem as `<file>: <field path> = <value>: <what is wrong>; <fix>`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import InputError

SCHEMA_VERSION = 1


class StrictModel(BaseModel):
    """Base of every contract model: unknown keys are errors, values are immutable."""

    # Infinite bandwidths are legal values; JSON has no literal for them, so they travel as "Infinity".
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, ser_json_inf_nan="strings")


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
    location = ".".join(str(part) for part in first["loc"]) or "(top level)"
    value = first.get("input")
    shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
    if len(shown) > 60:
        shown = shown[:57] + "..."
    message = first["msg"]
    fix = _FIXES.get(first["type"], "")
    more = len(error.errors()) - 1
    suffix = f" ({more} more problem{'s' if more > 1 else ''})" if more else ""
    text = f"{source}: field '{location}' = {shown}: {message}"
    return text + (f"; {fix}" if fix else "") + suffix


def validate_model(model_type: type[ModelT], data: Any, source: str) -> ModelT:
    """Build `model_type` from plain data, raising `InputError` with a one-line message."""
    try:
        return model_type.model_validate(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(error, source)) from None


def read_json(path: str | Path) -> Any:
    """Parse a JSON file, raising `InputError` naming the file on any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; check the path") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: cannot be read ({error.__class__.__name__}); check the file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None


def load_model(model_type: type[ModelT], path: str | Path) -> ModelT:
    """Read and validate one JSON contract file."""
    return validate_model(model_type, read_json(path), str(path))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename, so no half-written file remains."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def save_model(model: BaseModel, path: str | Path) -> None:
    """Write a contract model as indented JSON, atomically."""
    atomic_write_text(path, model.model_dump_json(indent=2) + "\n")
