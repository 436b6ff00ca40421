"""The typer applications every command module adds its commands to.

`--help` must come back within 0.3 s (benchmarks/import_speed.py), so help is plain click text
(`rich_markup_mode=None`: rich's help panels import rich.markdown and more, ~0.1 s), and the groups
below keep typer from importing pydantic just to read an absent `--help` flag.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup


class Group(TyperGroup):
    """A typer group with fast plain help: no pydantic for an absent `--help`, whole command summaries."""

    def get_help_option(self, ctx):
        # typer (0.29) coerces a flag value that is not a bool through pydantic, ~0.15 s of imports;
        # a group's absent `--help` reads as None, so `churnsim simulate --help` paid that on the
        # group before reaching the command's own help. False is what the absent flag means anyway.
        option = super().get_help_option(ctx)
        if option is not None and option.default is None:
            option.default = False
        return option

    def format_commands(self, ctx, formatter) -> None:
        # click cuts each command's summary to what fits on one line ("..."); the list of commands
        # is the overview of churnsim, so every summary is shown whole, wrapped.
        commands = [(name, self.get_command(ctx, name)) for name in self.list_commands(ctx)]
        rows = [(name, command.get_short_help_str(limit=sys.maxsize)) for name, command in commands if command is not None and not command.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    name="churnsim",
    help="Which recovery method reaches your target loss first when pipeline stages fail?",
    cls=Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
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


real_app = typer.Typer(help="Real PyTorch pipeline runs with injected failures.", cls=Group, no_args_is_help=True, rich_markup_mode=None)
app.add_typer(real_app, name="real")
