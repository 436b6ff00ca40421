"""The scenario reference page, generated from the scenario file's JSON Schema
(`churnsim.calibration.scenario_schema`, which pydantic writes from the models): one table per
model, top-level fields first, each field with its type, default, unit and description.

Units come from the field names, the project's convention (`join_delay_s`, `capacity_bytes`): the
longest matching suffix of `UNIT_SUFFIXES` names the unit."""

from __future__ import annotations

import json
import re
from collections import deque
from typing import Any, Iterator

PAGE_INTRO = """\
A scenario is a JSON file that says everything a simulated or real run needs.
`churnsim presets --show NAME` prints a built-in one to start from; `--set FIELD=VALUE` changes one
field on the command line by its dotted path (for example `--set pipeline.num_microbatches=8`).
Unknown keys are errors. This page is generated from the models when the site is built; the same schema is published
as [scenario.schema.json](scenario.schema.json) for editors and validators.

Units are in the field names: `_s` seconds, `_bytes` bytes, `_per_s` per second, `_iterations`
training iterations. Each table lists a model's fields; a field whose type is another model links
to that model's table, and a union (`compute`, `network`, `churn`, `methods`) is chosen by its tag
field (`kind` or `name`)."""

# (suffix of a field name, its unit); the longest matching suffix wins.
UNIT_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("_bytes_per_s", "bytes/s"),
    ("_flops_per_s", "FLOP/s"),
    ("_per_s", "per second"),
    ("_bytes_per_parameter", "bytes per parameter"),
    ("_bytes_per_element", "bytes per element"),
    ("_probability_per_stage_hour", "probability per stage per hour"),
    ("_per_stage_hour", "per stage per hour"),
    ("_per_node_hour", "per node per hour"),
    ("_per_hour", "per hour"),
    ("_tokens_per_iteration", "tokens per iteration"),
    ("_tokens", "tokens"),
    ("_s_by_method", "s (per method)"),
    ("_s", "s"),
    ("_bytes", "bytes"),
    ("_iterations", "iterations"),
    ("_parameters", "parameters"),
)


def unit_of(field_name: str) -> str:
    matches = [(suffix, unit) for suffix, unit in UNIT_SUFFIXES if field_name.endswith(suffix) or field_name == suffix.lstrip("_")]
    return max(matches, key=lambda match: len(match[0]))[1] if matches else ""


def _definition_name(reference: str) -> str:
    return reference.rsplit("/", 1)[-1]


def anchor(name: str) -> str:
    return name.lower()


def _link(name: str) -> str:
    return f"[{name}](#{anchor(name)})"


def _escape(text: str) -> str:
    """One table cell: one line, pipes escaped, angle brackets outside `code spans` shown as written."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;") for part in parts).replace("|", "\\|")


def _constraints(schema: dict[str, Any]) -> list[str]:
    words = {"minimum": "≥ {}", "exclusiveMinimum": "> {}", "maximum": "≤ {}", "exclusiveMaximum": "< {}"}
    found = [template.format(schema[key]) for key, template in words.items() if key in schema]
    if "minLength" in schema:
        found.append(f"at least {schema['minLength']} character{'s' if schema['minLength'] != 1 else ''}")
    if "minItems" in schema:
        found.append(f"at least {schema['minItems']} item{'s' if schema['minItems'] != 1 else ''}")
    return found


def type_markdown(schema: dict[str, Any]) -> str:
    """A field's type in words, with links to the models it holds."""
    if "$ref" in schema:
        return _link(_definition_name(schema["$ref"]))
    if "oneOf" in schema or "anyOf" in schema:
        options = schema.get("oneOf") or schema["anyOf"]
        shown = [type_markdown(option) for option in options if option.get("type") != "null"]
        text = " or ".join(shown)
        if "discriminator" in schema:
            text = f"one of {', '.join(shown)} (chosen by `{schema['discriminator']['propertyName']}`)"
        if any(option.get("type") == "null" for option in options):
            text += " or `null`"
        return text
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(type_markdown(item) for item in schema["prefixItems"]) + "]"
        text = f"list of {type_markdown(schema.get('items', {}))}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        text = f"map of name → {type_markdown(schema['additionalProperties'])}"
    elif kind:
        text = f"`{kind}`" if isinstance(kind, str) else " or ".join(f"`{each}`" for each in kind)
    else:
        text = "any"
    constraints = _constraints(schema)
    return f"{text} ({', '.join(constraints)})" if constraints else text


def default_markdown(name: str, schema: dict[str, Any], required: set[str]) -> str:
    if name in required:
        return "required"
    if "default" not in schema:
        return "computed"
    text = json.dumps(schema["default"], ensure_ascii=False)
    if len(text) <= 60:
        return f"`{text}`"
    return "each field's default" if "$ref" in schema else "long: see [scenario.schema.json](scenario.schema.json)"


def reachable_definitions(schema: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(definition name, the dotted paths where a scenario holds it), breadth first from the top
    level, in field order: the order of the page's tables."""
    paths: dict[str, list[str]] = {}
    queue: deque[tuple[dict[str, Any], str]] = deque([(schema, "")])
    while queue:
        model, prefix = queue.popleft()
        for field, field_schema in model.get("properties", {}).items():
            for reference, path in _references(field_schema, f"{prefix}{field}"):
                name = _definition_name(reference)
                if name not in paths:
                    paths[name] = []
                    queue.append((schema["$defs"][name], f"{path}."))
                if path not in paths[name]:
                    paths[name].append(path)
    return list(paths.items())


def _references(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str]]:
    if "$ref" in schema:
        yield schema["$ref"], path
    for key in ("oneOf", "anyOf"):
        for option in schema.get(key, []):
            yield from _references(option, path)
    if isinstance(schema.get("items"), dict):
        yield from _references(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _references(schema["additionalProperties"], f"{path}.<name>")


def model_table(model: dict[str, Any], definitions: dict[str, Any]) -> list[str]:
    required = set(model.get("required", ()))
    lines = ["| Field | Type | Default | Unit | Description |", "| --- | --- | --- | --- | --- |"]
    for name, field_schema in model.get("properties", {}).items():
        description = field_schema.get("description", "")
        if not description and "$ref" in field_schema:  # a nested model: its own description
            description = definitions[_definition_name(field_schema["$ref"])].get("description", "").split("\n\n")[0]
        cells = (f"`{name}`", type_markdown(field_schema), default_markdown(name, field_schema, required), unit_of(name) or "—", _escape(description) or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def scenario_reference_markdown(schema: dict[str, Any] | None = None) -> str:
    if schema is None:
        from churnsim.calibration.scenario_schema import scenario_json_schema

        schema = scenario_json_schema()
    definitions = schema["$defs"]
    lines = ["# Scenario file", "", PAGE_INTRO, "", f"## {schema['title']} {{#{anchor(schema['title'])}}}", ""]
    if schema.get("description"):
        lines += [schema["description"], ""]
    lines += [*model_table(schema, definitions), ""]
    for name, paths in reachable_definitions(schema):
        model = definitions[name]
        lines += [f"## {name} {{#{anchor(name)}}}", ""]
        if model.get("description"):
            lines += [model["description"], ""]
        shown = ", ".join(f"`{path}`" for path in paths[:4]) + (" and others" if len(paths) > 4 else "")
        lines += [f"Found at {shown}.", "", *model_table(model, definitions), ""]
    return "\n".join(lines)
