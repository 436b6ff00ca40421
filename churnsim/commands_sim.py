"""Commands that need only the simulator and the contract: presets, simulate, whatif, sweep, plot, validate."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from churnsim.cli import app

console = Console(stderr=True)


@app.command("presets")
def presets_command() -> None:
    """List the built-in scenarios."""
    from churnsim.calibration.presets import PRESETS

    table = Table("preset", "model", "stages", "churn", "target", title="built-in scenarios")
    for name in sorted(PRESETS):
        scenario = PRESETS[name]()
        target = f"loss {scenario.target.loss}" if scenario.target.loss is not None else f"{scenario.target.iterations} iterations"
        table.add_row(name, scenario.model.name, str(scenario.pipeline.num_stages), scenario.churn.kind, target)
    Console().print(table)
