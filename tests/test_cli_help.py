"""`--help` is plain click text that lists every command and option, and stays fast (≤ 0.3 s,
benchmarks/import_speed.py): printing it imports neither rich, pydantic, the contract nor the simulator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer

from churnsim.app import app
from churnsim.cli import _register_commands, main

_register_commands()
ROOT = typer.main.get_command(app)


def _commands(group, path=()):
    """(command path, click command) of every command below `group`, groups included."""
    for name, command in group.commands.items():
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))


COMMANDS = dict(_commands(ROOT))


def _help(arguments: list[str], capsys) -> str:
    main([*arguments, "--help"])  # help returns normally: exit status 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_help_lists_every_option_and_argument(path, capsys):
    text = _help(list(path), capsys)
    assert text.startswith(f"Usage: churnsim {' '.join(path)} ")
    for parameter in COMMANDS[path].params:
        if parameter.param_type_name == "option":
            for flag in (*parameter.opts, *parameter.secondary_opts):
                assert flag in text, f"{flag} missing from `churnsim {' '.join(path)} --help`"
        else:  # arguments are listed with their help, which click wraps
            assert " ".join(parameter.help.split()) in " ".join(text.split())
    assert "--help" in text


def test_group_help_lists_every_command_with_its_whole_summary(capsys):
    text = " ".join(_help([], capsys).split())
    for (name, *rest), command in COMMANDS.items():
        if not rest:
            summary = " ".join(command.get_short_help_str(limit=sys.maxsize).split())
            assert f"{name} {summary}" in text
            assert not summary.endswith("...")


def test_bare_group_prints_its_help(capsys):
    expected = _help([], capsys)
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("arguments", [["--help"], ["simulate", "--help"], ["real", "run", "--help"]])
def test_help_imports_nothing_heavy(arguments):
    code = f"""
import json, sys
from churnsim.cli import main
try:
    main({arguments!r})
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(completed.stderr))
    heavy = ("rich", "pydantic", "torch", "simpy", "numpy", "pandas", "churnsim.sim", "churnsim.calibration.scenario")
    offenders = sorted(name for name in loaded if any(name == root or name.startswith(root + ".") for root in heavy))
    assert not offenders, f"`churnsim {' '.join(arguments)}` imports {offenders[:5]}"


def test_a_simulated_run_of_a_preset_imports_neither_pandas_nor_scipy():
    # pandas is for writing tables and scipy for fits and intervals; one run needs neither (issue 11).
    code = """
import json, sys
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.sim.model.run import simulate_run
scenario = preset("checkfree-500m-geo-16pct", {"target.loss": None, "target.iterations": 200})
simulate_run(scenario, method_from_name("checkfree"), failures_for_replication(scenario))
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(completed.stderr))
    offenders = sorted(name for name in loaded if name.split(".")[0] in ("pandas", "scipy"))
    assert not offenders, f"a simulated run imports {offenders[:5]}"


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_every_option_has_help_text(path):
    undocumented = [
        parameter.opts[0]
        for parameter in COMMANDS[path].params
        if parameter.param_type_name == "option" and not parameter.hidden and not (parameter.help or "").strip()
    ]
    assert not undocumented, f"`churnsim {' '.join(path)}` options without help: {', '.join(undocumented)}"
