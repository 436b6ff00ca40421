"""The scenario file's JSON Schema, as published in the docs (`docs/reference/scenario.schema.json`).

pydantic writes the schema. A few things are added here, at generation time only, so that importing
the models stays as fast as it is:
- a field's description is its attribute docstring (the `\"\"\"...\"\"\"` under the field), which
  pydantic reads only with `use_attribute_docstrings`, a source parse on every import;
- `methods` lists every registered method config, selected by `name` (the models validate it
  through the open registry, which pydantic cannot see into);
- a bandwidth may be "Infinity" (unlimited), and a value the models convert on the way in is
  described in the shape files hold.

Refresh the published file with `python -m churnsim.calibration.scenario_schema docs/reference/scenario.schema.json`.
"""

import ast
import inspect
import json
import math
import sys
import textwrap
from functools import lru_cache
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field, create_model
from pydantic.json_schema import GenerateJsonSchema

from .methods import METHOD_CONFIGS
from .scenario import Scenario

SCENARIO_DESCRIPTION = (
    "A churnsim scenario: the model, the pipeline, compute, network, storage, churn, recovery, "
    "the methods to compare, convergence and the target. Units are in the field names "
    "(`_s` seconds, `_bytes` bytes, `_per_s` per second, `_iterations` training iterations)."
)


@lru_cache(maxsize=None)
def _own_attribute_docstrings(model: type) -> dict[str, str]:
    """{field name: the string literal right under its annotated assignment} in `model`'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):  # a class made at run time has no source
        return {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docstrings = {}
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docstrings[statement.target.id] = inspect.cleandoc(following.value.value)
    return docstrings


def attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Field docstrings of `model` and its bases (a subclass's own docstring wins)."""
    merged: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
            merged.update(_own_attribute_docstrings(klass))
    return merged


class _DescribedFields(GenerateJsonSchema):
    """pydantic's generator, with every field's attribute docstring as its description."""

    def function_before_schema(self, schema: Any) -> Any:
        # A value converted on the way in and written back in another shape (`SecondsByMethod`: a
        # tuple of pairs in Python, an object in files) is described by the shape files hold.
        return_schema = (schema.get("serialization") or {}).get("return_schema")
        if self.mode == "validation" and return_schema is not None:
            return self.generate_inner(return_schema)
        return super().function_before_schema(schema)

    def default_schema(self, schema: Any) -> Any:
        if "default_factory" in schema and not schema.get("default_factory_takes_data"):
            # pydantic leaves a factory's default out of the schema; a file without the field gets
            # what the factory makes (e.g. the documented setbacks), so that is its default.
            schema = {**schema, "default": schema["default_factory"]()}
            schema.pop("default_factory")
        json_schema = super().default_schema(schema)
        inner = schema["schema"]
        serializer = (inner.get("serialization") or {}) if inner.get("type") == "function-before" else {}
        if "default" in json_schema and serializer.get("type") == "function-plain" and not serializer.get("info_arg"):
            json_schema["default"] = serializer["function"](schema["default"])  # the default as files hold it
        return json_schema

    def model_schema(self, schema: Any) -> Any:
        json_schema = super().model_schema(schema)
        model = schema["cls"]
        target = self.get_schema_from_definitions(json_schema) if "$ref" in json_schema else json_schema
        docstrings = attribute_docstrings(model)
        properties = (target or {}).get("properties", {})
        for name, field_schema in properties.items():
            if "bandwidth" in name and field_schema.get("type") == "number":
                properties[name] = _unlimited_allowed(field_schema)
        for name, field_schema in properties.items():
            if "description" in field_schema:
                continue
            if name in docstrings:
                field_schema["description"] = docstrings[name]
            elif name in ("kind", "name") and "const" in field_schema:  # the tag (`kind`, `name`) that selects this model in a union
                field_schema["description"] = f"Selects this {model.__name__}: always `{field_schema['const']}`."
        return json_schema


def _unlimited_allowed(field_schema: dict[str, Any]) -> dict[str, Any]:
    """A bandwidth may be unlimited, written "Infinity" in a file (the one kind of number that may
    be infinite, `base.first_non_finite_number`); pydantic's schema says only `number`."""
    annotations = {key: field_schema[key] for key in ("default", "description", "title") if key in field_schema}
    number = {key: value for key, value in field_schema.items() if key not in annotations}
    return {"anyOf": [number, {"const": "Infinity"}], **annotations}


def _published_model() -> type[BaseModel]:
    """Scenario as the schema sees it: `methods` is a tagged union of the registered method configs."""
    method_config = Annotated[Union[tuple(METHOD_CONFIGS.values())], Field(discriminator="name")]  # type: ignore[misc]
    return create_model(
        "Scenario",
        __base__=Scenario,
        __doc__=SCENARIO_DESCRIPTION,
        methods=(tuple[method_config, ...], Field(min_length=1, description="The recovery methods to compare, each selected by `name`.")),
    )


def _json_numbers(value: Any) -> Any:
    """`value` with infinite numbers (an unlimited bandwidth's default) written as scenario files
    write them, "Infinity" (JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "Infinity" if value > 0 else "-Infinity" if value < 0 else "NaN"
    if isinstance(value, dict):
        return {key: _json_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_numbers(item) for item in value]
    return value


def scenario_json_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file (draft 2020-12), as pydantic generates it from the models."""
    schema = _published_model().model_json_schema(mode="validation", schema_generator=_DescribedFields)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **_json_numbers(schema)}


def scenario_json_schema_text() -> str:
    """The schema as the published file holds it: indented JSON, keys in pydantic's order, a final newline."""
    return json.dumps(scenario_json_schema(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def main(arguments: list[str]) -> int:
    text = scenario_json_schema_text()
    if not arguments:
        sys.stdout.write(text)
        return 0
    with open(arguments[0], "w", encoding="utf-8") as out:
        out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
