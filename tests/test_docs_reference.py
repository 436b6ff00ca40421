"""The docs site's generated reference (docs/hooks/) and published schema: complete and current."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pytest

from churnsim.calibration.methods import METHOD_CONFIGS
from churnsim.calibration.presets import PRESETS, preset
from churnsim.calibration.scenario_schema import scenario_json_schema, scenario_json_schema_text

REPOSITORY = Path(__file__).resolve().parents[1]
HOOKS = REPOSITORY / "docs" / "hooks"
PUBLISHED_SCHEMA = REPOSITORY / "docs" / "reference" / "scenario.schema.json"
README_MAX_LINES = 250


def _hook_module(name: str):
    """A module of docs/hooks/, loaded as mkdocs loads the hook (its folder on sys.path)."""
    sys.path.insert(0, str(HOOKS))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOKS))


def test_published_scenario_schema_is_what_the_models_generate():
    assert PUBLISHED_SCHEMA.read_text(encoding="utf-8") == scenario_json_schema_text(), (
        "docs/reference/scenario.schema.json is stale; refresh it with "
        "`python -m churnsim.calibration.scenario_schema docs/reference/scenario.schema.json`"
    )


def test_schema_is_strict_json_and_lists_every_registered_method():
    schema = json.loads(scenario_json_schema_text())  # "Infinity" defaults are strings, not bare Infinity
    mapping = schema["properties"]["methods"]["items"]["discriminator"]["mapping"]
    assert sorted(mapping) == sorted(METHOD_CONFIGS)
    assert schema["$defs"]["UniformNetwork"]["properties"]["allreduce_bandwidth_bytes_per_s"]["default"] == "Infinity"


def test_every_preset_is_valid_under_the_published_schema():
    validator = jsonschema.Draft202012Validator(scenario_json_schema())
    for name in PRESETS:
        document = json.loads(preset(name).model_dump_json())
        errors = sorted(validator.iter_errors(document), key=str)
        assert not errors, f"preset {name}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_schema_rejects_what_the_models_reject():
    validator = jsonschema.Draft202012Validator(scenario_json_schema())
    document = json.loads(preset(next(iter(PRESETS))).model_dump_json())
    assert not list(validator.iter_errors(document))
    for broken in ({**document, "unknown_key": 1}, {**document, "methods": [{"name": "no-such-method"}]}, {**document, "seed": -1}):
        assert list(validator.iter_errors(broken)), broken


def test_field_descriptions_come_from_attribute_docstrings():
    pipeline = scenario_json_schema()["$defs"]["PipelineSpec"]["properties"]
    assert pipeline["layers_per_stage"]["description"].startswith("Transformer blocks of each stage")


def test_every_field_of_every_scenario_model_has_a_description():
    schema = scenario_json_schema()
    models = [(schema["title"], schema), *schema["$defs"].items()]
    assert {"Scenario", "ModelSpec", "SetbackSpec", "CheckFreeConfig", "StageHourlyChurn"} <= {name for name, _ in models}
    undescribed = [
        f"{model_name}.{field}"
        for model_name, model in models
        for field, field_schema in model.get("properties", {}).items()
        if not str(field_schema.get("description", "")).strip()
    ]
    assert not undescribed, (
        f"fields without a description (write a docstring right under each field in its model): {', '.join(undescribed)}"
    )


def test_scenario_reference_has_every_field_of_every_model_with_its_unit():
    reference = _hook_module("scenario_reference")
    schema = scenario_json_schema()
    page = reference.scenario_reference_markdown(schema)
    sections = page.split("\n## ")
    for model_name, model in [(schema["title"], schema), *schema["$defs"].items()]:
        section = next((text for text in sections if text.startswith(f"{model_name} ")), None)
        assert section is not None, f"no section for {model_name}"
        for field in model["properties"]:
            row = next((line for line in section.splitlines() if line.startswith(f"| `{field}` |")), None)
            assert row is not None, f"{model_name}.{field} is missing from the scenario reference"
            assert row.count(" | ") == 4, row  # field, type, default, unit, description
    assert "| `join_delay_s` | `number` (≥ 0) | `30.0` | s |" in page
    assert "| `write_bandwidth_bytes_per_s` |" in page and "| bytes/s |" in page


def test_units_follow_the_field_name_suffixes():
    unit_of = _hook_module("scenario_reference").unit_of
    assert [unit_of(name) for name in ("join_delay_s", "bandwidth_bytes_per_s", "capacity_bytes", "interval_iterations", "seed")] == [
        "s", "bytes/s", "bytes", "iterations", "",
    ]
    assert unit_of("failure_probability_per_stage_hour") == "probability per stage per hour"


def test_cli_reference_has_every_command_and_option():
    reference = _hook_module("cli_reference")
    root = reference.churnsim_command_tree()
    page = reference.cli_reference_markdown(root)
    commands = list(reference.walk_commands(root))
    assert {"churnsim whatif", "churnsim calibrate", "churnsim real run"} <= {context.command_path for _, context in commands}
    for command, context in commands:
        heading = f"`{context.command_path}` {{#{context.command_path.replace(' ', '-')}}}"
        assert heading in page, f"{context.command_path} is missing from the CLI reference"
        section = page.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
        for parameter in command.params:
            if parameter.param_type_name == "option" and not parameter.hidden:
                assert f"| `{parameter.opts[0]}`" in section, f"{context.command_path} {parameter.opts[0]} is missing"
    assert "| `--figures`, `--no-figures` | flag | `--figures` |" in page


def _write_report(folder: Path, name: str, title: str) -> Path:
    path = folder / name
    path.write_text(f"# {title}\n\nCommand: `python benchmarks/example.py`\n", encoding="utf-8")
    return path


def test_reports_index_lists_the_latest_report_of_each_benchmark_first(tmp_path):
    index = _hook_module("reports_index")
    reports = [
        _write_report(tmp_path, "2026-01-05-sim-run-speed.md", "Simulator speed, January"),
        _write_report(tmp_path, "2026-03-01-sim-run-speed.md", "Simulator speed, March"),
        _write_report(tmp_path, "2026-02-10-calibrate-and-validate.md", "Calibrate and validate, 2026-02-10"),
        _write_report(tmp_path, "2025-12-31-sim-run-speed.md", "Simulator speed, December"),
    ]
    page = index.reports_index_markdown(reports)
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `calibrate-and-validate` | [Calibrate and validate, 2026-02-10](2026-02-10-calibrate-and-validate.md) | — |",
        "| `sim-run-speed` | [2026-03-01: Simulator speed, March](2026-03-01-sim-run-speed.md) | "
        "[2026-01-05](2026-01-05-sim-run-speed.md), [2025-12-31](2025-12-31-sim-run-speed.md) |",
    ]
    assert "No reports yet." in index.reports_index_markdown([])
    with pytest.raises(index.ReportNameError, match="notes.md: a report's name must be <YYYY-MM-DD>-<benchmark-name>.md"):
        index.reports_index_markdown([_write_report(tmp_path, "notes.md", "Notes")])


def test_the_hook_adds_the_generated_pages_gallery_and_reports(tmp_path, monkeypatch):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    config = load_config(str(REPOSITORY / "mkdocs.yml"))
    hook = config.plugins["docs/hooks/reference.py"]  # the hook module as mkdocs.yml loads it
    reports = tmp_path / "reports"
    reports.mkdir()
    _write_report(reports, "2026-01-05-sim-run-speed.md", "Simulator speed")
    monkeypatch.setattr(hook, "REPORTS", reports)
    files = config.plugins.on_files(get_files(config), config=config)
    uris = {file.src_uri for file in files}
    assert {"reference/cli.md", "reference/scenario.md", "reports/index.md", "reports/2026-01-05-sim-run-speed.md"} <= uris
    assert {f"gallery/{png.name}" for png in (REPOSITORY / "figures" / "gallery").glob("*.png")} <= uris
    assert "[2026-01-05: Simulator speed](2026-01-05-sim-run-speed.md)" in files.get_file_from_path("reports/index.md").content_string
    assert not any(uri.startswith("hooks/") for uri in uris if files.get_file_from_path(uri).inclusion.is_included())



def test_readme_is_at_most_250_lines():
    lines = (REPOSITORY / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES} and move the rest to docs/"
