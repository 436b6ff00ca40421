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


def _version(value: bool) -> None:
    if value:
        from churnsim import installed_version

        typer.echo(f"churnsim {installed_version()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Which recovery method reaches your target loss first when pipeline stages fail?"""


real_app = typer.Typer(help="Real PyTorch pipeline runs with injected failures.", no_args_is_help=True)
app.add_typer(real_app, name="real")
