"""What a wheel holds: every package of the tree, under the name pyproject.toml maps it to; and what a
process started in the checkout finds.

An editable install (`pip install -e .`, the README's test command) finds a package that `[tool.setuptools]
packages` leaves out through its source directory, so only a wheel or `pip install .` would miss it,
with a ModuleNotFoundError at the first run that needs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def _settings() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_in_the_tree() -> set[str]:
    """Dotted names of every directory with an `__init__.py` below a mapped package directory."""
    found = set()
    for package, directory in _settings()["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / directory)
            found.add(".".join((package, *relative.parts)))
    return found


def test_every_package_of_the_tree_is_listed_for_the_wheel():
    listed = set(_settings()["packages"])
    in_tree = _packages_in_the_tree()
    assert "churnsim.sim.model.closed_form" in in_tree  # the walk sees nested packages
    missing = sorted(in_tree - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


def _directory_of(package: str) -> Path:
    """Where setuptools looks for `package`: its longest prefix in `package-dir`, then the rest as folders."""
    directories = _settings()["package-dir"]
    parts = package.split(".")
    for length in range(len(parts), 0, -1):
        prefix = ".".join(parts[:length])
        if prefix in directories:
            return ROOT / directories[prefix] / Path(*parts[length:])
    return ROOT / Path(*parts)


def test_every_listed_package_exists():
    for package in _settings()["packages"]:
        directory = _directory_of(package)
        assert (directory / "__init__.py").is_file(), f"{package} is listed in pyproject.toml but {directory} holds no package"


def test_a_process_started_in_the_checkout_finds_the_subpackages_beside_churnsim():
    """`python -m churnsim`, or a process that multiprocessing starts, in the checkout's root imports
    its `churnsim/` folder first even where churnsim is installed; the subpackages beside that folder
    must be found (without site-packages here, so no install can supply them)."""
    code = (
        "import importlib.util, json; "
        "print(json.dumps([importlib.util.find_spec('churnsim.' + name).origin for name in ('calibration', 'sim', 'real', 'figures')]))"
    )
    completed = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origins = [Path(origin) for origin in json.loads(completed.stdout)]
    assert origins == [ROOT / name / "__init__.py" for name in ("calibration", "sim", "real", "figures")]
