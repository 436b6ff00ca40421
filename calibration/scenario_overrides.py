"""Overrides of scenario fields by dotted path (`pipeline.num_stages=6`): one mechanism for every command.

`churnsim sweep --set FIELD=V1,V2` makes a grid of them, `churnsim real run --set FIELD=V` changes one
field of the scenario a real run takes; both go through `apply_settings`, which validates the result
as a whole Scenario, so an override gets the same one-line errors as a scenario file.
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import ValidationError

from .base import validate_model
from .errors import InputError
from .scenario import ModelSpec, PipelineSpec, Scenario, method_pipeline_problem

GridSetting = tuple[str, tuple[Any, ...]]


def _top_level_parts(text: str) -> list[str]:
    """`text` split at the commas outside JSON brackets and strings: `[6,6],[4,8]` → `[6,6]`, `[4,8]`."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for index, char in enumerate(text):
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = char == "\\", char != '"'
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return [*parts, text[start:]]


def comma_separated(text: str, label: str, *, empty: str) -> list[str]:
    """The values of a comma-separated flag (`_top_level_parts`), stripped; `label: empty` when there
    is none, and a value left empty is refused rather than dropped: a doubled or trailing comma is a
    typo more often than a wish to drop a value."""
    values = [value.strip() for value in _top_level_parts(text)]
    if values == [""]:
        raise InputError(f"{label}: {empty}")
    if "" in values:
        raise InputError(f"{label}: value {values.index('') + 1} is empty; remove the extra comma")
    return values


def parse_grid_setting(text: str) -> GridSetting:
    """`churn.failure_probability_per_stage_hour=0.05,0.1` → (path, (0.05, 0.1)); values are JSON
    values (a list keeps its commas: `pipeline.layers_per_stage=[6,6],[4,8]` is two values) or bare strings."""
    if "=" not in text:
        raise InputError(f"--set {text!r}: expected FIELD=VALUE[,VALUE...], e.g. pipeline.num_stages=4,8")
    path, _, values_text = text.partition("=")
    path = path.strip()
    if not path:
        raise InputError(f"--set {text!r}: no field before '='; e.g. pipeline.num_stages=4,8")
    values = comma_separated(values_text, f"--set {text!r}", empty="the grid is empty; give at least one value after '='")
    from .safe_files import json_value_or_text

    return path, tuple(json_value_or_text(value, source=f"--set {path}") for value in values)


def repeated_value(values: Sequence[Any]) -> Any | None:
    """The first value given twice in `values` (`0.1` and `0.10` are one value), else None. A grid or a
    list of failure rates must not repeat one: its runs would be counted twice as if independent."""
    for index, value in enumerate(values):
        if any(value == earlier for earlier in values[:index]):
            return value
    return None


def _assign(data: Any, path: str, value: Any) -> None:
    parts = path.split(".")
    node = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            # A list of named entries (methods, storage tiers) is addressed by name as well as by index:
            # `methods.checkpoint.interval_iterations=20`.
            names = [entry.get("name") for entry in node if isinstance(entry, dict)]
            if part in names:
                key: Any = names.index(part)
            elif part.isdigit() and int(part) < len(node):
                key = int(part)
            else:
                choices = ", ".join(str(name) for name in names if name) or f"0..{len(node) - 1}"
                raise InputError(f"--set {path}: '{part}' is not an entry of that list; use one of {choices}")
        elif isinstance(node, dict):
            if part not in node:
                raise InputError(f"--set {path}: the scenario has no field '{part}' there; fields: {', '.join(sorted(node))}")
            key = part
        else:
            raise InputError(f"--set {path}: '{part}' goes below a plain value")
        if last:
            node[key] = value
        else:
            node = node[key]


def apply_settings(scenario: Scenario, settings: dict[str, Any]) -> Scenario:
    """A copy of `scenario` with dotted-path fields replaced, validated, named after the settings."""
    data = scenario.model_dump(mode="json")
    for path, value in settings.items():
        _assign(data, path, value)
    if settings:
        data["name"] = f"{scenario.name}[" + ",".join(f"{path}={value}" for path, value in settings.items()) + "]"
    return validate_model(Scenario, data, f"scenario {scenario.name} with {settings}")


def methods_that_fit(scenario: Scenario, settings: dict[str, Any]) -> tuple[str, ...]:
    """The names of `scenario`'s methods that can run on the model and pipeline `settings` make of
    its own (`scenario.method_pipeline_problem`: CheckFree+ needs 4 stages, rebuilds equal stages),
    when some cannot; () when every one can, or the settings' model or pipeline is itself invalid
    (the scenario's validation then says why). The commands narrow an unchosen method list to these,
    and the outputs say which were left out (sim/studies/outputs.py)."""
    shape = {path: value for path, value in settings.items() if path.split(".", 1)[0] in ("model", "pipeline")}
    if not shape:
        return ()
    data = {"model": scenario.model.model_dump(mode="json"), "pipeline": scenario.pipeline.model_dump(mode="json")}
    try:
        for path, value in shape.items():
            _assign(data, path, value)
        model, pipeline = ModelSpec.model_validate(data["model"]), PipelineSpec.model_validate(data["pipeline"])
    except (InputError, ValidationError):
        return ()
    fitting = tuple(method.name for method in scenario.methods if method_pipeline_problem(method, model, pipeline) is None)
    return fitting if 0 < len(fitting) < len(scenario.methods) else ()


def parse_settings(texts: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`--set FIELD=VALUE` flags (one value each) → {path: value}; a field named twice is an error."""
    settings: dict[str, Any] = {}
    for text in texts:
        path, values = parse_grid_setting(text)
        if len(values) != 1:
            raise InputError(f"--set {text!r}: give one value (a list of values makes a grid: use `churnsim sweep`)")
        if path in settings:
            raise InputError(f"--set names {path} twice; give it once")
        settings[path] = values[0]
    return settings
