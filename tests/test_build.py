"""setup.py's choices: when the closed-form engine is compiled, and the pure-Python fallback when
the C build fails. (CI builds and tests the compiled engine itself: .ci/run.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_module():
    specification = importlib.util.spec_from_file_location("churnsim_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(module)  # defines the pieces; `setup()` runs only as __main__
    return module


@pytest.mark.parametrize(
    ("arguments", "setting", "compiled"),
    [
        (["bdist_wheel"], None, True),  # a regular install or a wheel
        (["bdist_wheel"], "1", True),
        (["bdist_wheel"], "0", False),
        (["editable_wheel", "--dist-dir", "x"], None, False),  # pip install -e .
        (["editable_wheel"], "1", False),
        (["dist_info", "--output-dir", "x"], None, False),  # metadata only
        (["egg_info"], None, False),
    ],
)
def test_the_engine_is_compiled_for_a_regular_build_unless_told_not_to(setup_module, monkeypatch, arguments, setting, compiled):
    monkeypatch.setattr(sys, "argv", ["setup.py", *arguments])
    if setting is None:
        monkeypatch.delenv(setup_module.COMPILE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(setup_module.COMPILE_VARIABLE, setting)
    assert setup_module._wants_compiled_engine() is compiled


def test_an_unknown_compile_setting_stops_the_build_with_one_line(setup_module, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel"])
    monkeypatch.setenv(setup_module.COMPILE_VARIABLE, "yes")
    with pytest.raises(SystemExit, match="CHURNSIM_COMPILE='yes': use 0"):
        setup_module._wants_compiled_engine()


def test_a_failed_c_build_leaves_the_pure_python_package(setup_module, tmp_path, monkeypatch, capsys):
    """An extension that does not compile (as on a machine without a working C compiler): the build
    goes on, says so, and leaves no extension module behind."""
    from setuptools import Distribution, Extension

    (tmp_path / "broken.c").write_text("this is not C;\n")
    monkeypatch.chdir(tmp_path)
    distribution = Distribution({"name": "broken", "ext_modules": [Extension("broken", ["broken.c"])]})
    command = setup_module.BuildExtensionsOrPurePython(distribution)
    command.build_lib = str(tmp_path / "lib")
    command.build_temp = str(tmp_path / "temp")
    command.ensure_finalized()
    command.run()
    assert "it stays pure Python" in capsys.readouterr().err
    assert not [path for path in tmp_path.rglob("broken*") if path.suffix in (".so", ".pyd")]
