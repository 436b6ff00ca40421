"""`churnsim presets`: the built-in scenarios as a table whose names are never cut, or as JSON for scripts."""

from __future__ import annotations

from typing import Any


def preset_entries() -> list[dict[str, Any]]:
    """Per built-in preset, by name: its name, description and the fields that tell presets apart."""
    from churnsim.calibration.churn import own_rate
    from churnsim.calibration.presets import PRESETS

    entries = []
    for name in sorted(PRESETS):
        scenario = PRESETS[name]()
        own = own_rate(scenario.churn)
        entries.append(
            {
                "name": name,
                "description": scenario.description,
                "model": scenario.model.name,
                "num_parameters": scenario.model.num_parameters,
                "num_stages": scenario.pipeline.num_stages,
                "data_parallel_degree": scenario.pipeline.data_parallel_degree,
                "replicas_fail_together": scenario.pipeline.replicas_fail_together,
                "churn": scenario.churn.kind,
                "churn_rate": None if own is None else {"field": own[0].setting, "value": own[1], "in_words": own[0].words(own[1])},
                "target_loss": scenario.target.loss,
                "target_iterations": scenario.target.iterations,
                "methods": [method.name for method in scenario.methods],
                "replications": scenario.replications,
            }
        )
    return entries


def presets_json() -> str:
    from churnsim.calibration.base import strict_json_dumps

    return strict_json_dumps(preset_entries(), indent=2)


def print_presets_table() -> None:
    """The table on stdout; the name column folds rather than truncates on a narrow terminal."""
    from rich.console import Console
    from rich.table import Table

    entries = preset_entries()
    table = Table(title="built-in scenarios")
    table.add_column("preset", no_wrap=True, overflow="fold", min_width=max(len(entry["name"]) for entry in entries))
    for header in ("model", "stages", "churn", "target"):
        table.add_column(header, overflow="fold")
    for entry in entries:
        target = f"loss {entry['target_loss']}" if entry["target_loss"] is not None else f"{entry['target_iterations']} iterations"
        table.add_row(entry["name"], entry["model"], str(entry["num_stages"]), entry["churn"], target)
    Console(width=max(Console().width, 100)).print(table)
