"""DESIGN.md's dependency rule: real → calibration ← sim, figures → calibration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = {
    "churnsim.calibration": ("torch", "simpy", "churnsim.sim", "churnsim.real", "churnsim.figures"),
    "churnsim.sim": ("torch", "churnsim.real", "churnsim.figures"),
    "churnsim.real": ("simpy", "churnsim.sim", "churnsim.figures"),
    "churnsim.figures": ("torch", "simpy", "churnsim.sim", "churnsim.real"),
}


def _modules_after_importing_everything_in(package: str) -> set[str]:
    code = f"""
import importlib, json, pkgutil, sys
package = importlib.import_module({package!r})
for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(output))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_design_allows(package):
    loaded = _modules_after_importing_everything_in(package)
    for forbidden in FORBIDDEN[package]:
        offenders = sorted(name for name in loaded if name == forbidden or name.startswith(forbidden + "."))
        assert not offenders, f"{package} imports {forbidden}: {offenders[:3]}"


def test_cli_help_does_not_import_torch():
    code = "import sys; from churnsim import cli; print('torch' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "False"


def test_simulator_policies_never_import_the_trainer():
    """Policies get a RunContext, not the run: sim/methods/ imports neither sim/run.py nor names `Run`."""
    import pathlib
    import re

    methods = pathlib.Path(__file__).resolve().parents[1] / "sim" / "model" / "methods"
    for path in sorted(methods.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"from \.\.run import|import churnsim\.sim\.run\b|from churnsim\.sim\.run import", text), path.name
        assert not re.search(r'"Run"|\bRun\b(?!Context|Result)', text), path.name
