"""The command-line reference page, generated from the click command tree that typer builds from
`churnsim.app.app`: every command and subcommand with its help, usage, arguments and options (their
types, defaults and help). It reads the command objects, never the text of `--help`."""

from __future__ import annotations

import inspect
import re
from typing import Any, Iterator

PAGE_INTRO = (
    "Every command and option of `churnsim`, generated from the command-line application itself when "
    "this site is built. `churnsim <command> --help` prints the same help in the terminal. Bad input "
    "of any kind ends with one line on stderr and exit code 2; Ctrl-C ends a command with exit code 130."
)


def churnsim_command_tree() -> Any:
    """The root click group of `churnsim`, with every command module registered (as `churnsim.cli.main` does)."""
    import typer

    from churnsim import cli

    cli._register_commands()
    return typer.main.get_command(cli.app)


def _context_class(command: Any) -> Any:
    return getattr(command, "context_class", None) or _click_module().Context


def _click_module() -> Any:
    try:  # typer >= 0.24 vendors its own click
        import typer._click as click
    except ImportError:  # pragma: no cover - older typer uses the click package
        import click
    return click


def walk_commands(command: Any, name: str = "churnsim", parent: Any = None) -> Iterator[tuple[Any, Any]]:
    """(command, its click context) for `command` and every visible subcommand, depth first in
    `--help` order."""
    context = _context_class(command)(command, info_name=name, parent=parent)
    yield command, context
    if hasattr(command, "list_commands"):
        for sub_name in command.list_commands(context):
            sub_command = command.get_command(context, sub_name)
            if sub_command is not None and not sub_command.hidden:
                yield from walk_commands(sub_command, sub_name, context)


def anchor(context: Any) -> str:
    return context.command_path.replace(" ", "-")


def _escape_html(text: str) -> str:
    """Angle brackets outside `code spans` escaped, so that `<name>` in help text shows as written."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;") for part in parts)


def cell(text: str) -> str:
    """Text fit for one table cell: one line, pipes escaped."""
    return _escape_html(" ".join(str(text).split())).replace("|", "\\|")


def help_markdown(text: str | None) -> str:
    """A command's help as markdown paragraphs: wrapped lines joined; a click `\\b` paragraph (not to
    be rewrapped) kept line by line."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text or ""))
    rendered = []
    for paragraph in paragraphs:
        if not paragraph.strip():
            continue
        if paragraph.startswith("\b"):
            rendered.append("\n".join(["```text", paragraph.lstrip("\b").strip("\n"), "```"]))
        else:
            rendered.append(_escape_html(" ".join(paragraph.split())))
    return "\n\n".join(rendered)


def _type_name(parameter: Any, context: Any) -> str:
    if getattr(parameter, "is_flag", False):
        return "flag"
    if hasattr(parameter, "display_type"):  # typer's own parameters (typer >= 0.24)
        name = parameter.display_type(context).strip("<>")
    else:  # pragma: no cover - click parameter types
        parameter_type = parameter.type
        name = "|".join(parameter_type.choices) if hasattr(parameter_type, "choices") else parameter_type.name
    repeatable = getattr(parameter, "multiple", False) or getattr(parameter, "nargs", 1) == -1
    if repeatable and name.startswith("list[") and name.endswith("]"):
        name = name[5:-1]
    shown = "one of " + ", ".join(f"`{choice}`" for choice in name.split("|")) if "|" in name else f"`{name}`"
    return f"{shown}, repeatable" if repeatable else shown


def _default(parameter: Any, context: Any) -> str:
    if isinstance(parameter.show_default, str):
        return cell(parameter.show_default)
    default = parameter.get_default(context, call=False)
    if callable(default):
        return "(computed)"
    if getattr(parameter, "is_flag", False):
        if parameter.secondary_opts:
            return f"`{(parameter.opts if default else parameter.secondary_opts)[0]}`"
        return "on" if default else "off"
    if default is None or default == [] or default == ():
        return "—"
    if isinstance(default, (list, tuple)):
        return ", ".join(f"`{item}`" for item in default)
    return f"`{default}`"


def _range(parameter: Any) -> str:
    low, high = getattr(parameter, "min", None), getattr(parameter, "max", None)
    if low is None and high is None and hasattr(parameter, "type"):
        low, high = getattr(parameter.type, "min", None), getattr(parameter.type, "max", None)
    bounds = [f"≥ {low}" if low is not None else "", f"≤ {high}" if high is not None else ""]
    return " and ".join(bound for bound in bounds if bound)


def _description(parameter: Any) -> str:
    text = cell(getattr(parameter, "help", None) or "")
    if parameter.required:
        text = f"**Required.** {text}"
    if _range(parameter):
        text += f" ({_range(parameter)})"
    return text.strip() or "—"


def _option_names(parameter: Any) -> str:
    return ", ".join(f"`{name}`" for name in [*parameter.opts, *parameter.secondary_opts])


def _argument_name(parameter: Any) -> str:
    return f"`{(parameter.metavar or parameter.name).upper()}`"


def command_markdown(command: Any, context: Any) -> str:
    depth = context.command_path.count(" ")
    heading = "#" * min(depth + 2, 4)
    lines = [f"{heading} `{context.command_path}` {{#{anchor(context)}}}", ""]
    help_text = help_markdown(command.help)
    if help_text:
        lines += [help_text, ""]
    usage = " ".join([context.command_path, *command.collect_usage_pieces(context)])
    lines += ["```text", f"Usage: {usage}", "```", ""]
    parameters = [parameter for parameter in command.params if not getattr(parameter, "hidden", False)]
    arguments = [parameter for parameter in parameters if parameter.param_type_name == "argument"]
    options = [parameter for parameter in parameters if parameter.param_type_name == "option"]
    if arguments:
        lines += ["| Argument | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {_argument_name(parameter)} | {_type_name(parameter, context)} | {_default(parameter, context)} | {_description(parameter)} |"
            for parameter in arguments
        ]
        lines.append("")
    if options:
        lines += ["| Option | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [
            f"| {_option_names(parameter)} | {_type_name(parameter, context)} | {_default(parameter, context)} | {_description(parameter)} |"
            for parameter in options
        ]
        lines.append("")
    if hasattr(command, "list_commands"):
        lines += ["| Command | What it does |", "| --- | --- |"]
        for name in command.list_commands(context):
            sub_command = command.get_command(context, name)
            if sub_command is None or sub_command.hidden:
                continue
            path = f"{context.command_path} {name}"
            summary = sub_command.get_short_help_str(limit=10**6)
            lines.append(f"| [`{path}`](#{path.replace(' ', '-')}) | {cell(summary)} |")
        lines.append("")
    return "\n".join(lines)


def cli_reference_markdown(root: Any = None) -> str:
    """The whole page: an introduction, then one section per command, root first."""
    root = churnsim_command_tree() if root is None else root
    sections = [command_markdown(command, context) for command, context in walk_commands(root)]
    return "\n".join(["# Command line", "", PAGE_INTRO, "", *sections])
