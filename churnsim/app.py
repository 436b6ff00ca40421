"""The typer applications every command module adds its commands to."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="churnsim",
    help="Which recovery method reaches your target loss first when pipeline stages fail?",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
real_app = typer.Typer(help="Real PyTorch pipeline runs with injected failures.", no_args_is_help=True)
app.add_typer(real_app, name="real")
