"""Build churnsim, with the simulator's closed-form run engine compiled to C by mypyc where it can be.

Why: the closed-form engine (sim/model/closed_form/) books every failure, checkpoint, replica refresh and
snapshot of a run in some twenty small Python calls, and a long run has tens of thousands of them.
Compiled by mypyc from the same typed source (same arithmetic, same order) a run takes about half
the time. Everything else, the event model it is checked against included, stays Python.

- A regular install or a wheel (`pip install .`) compiles it; `CHURNSIM_COMPILE=0` keeps it pure Python.
- An editable install (`pip install -e .`, for working on the code) never compiles it, so that the
  source you edit is what runs (a compiled module beside it would shadow it).
- Where mypyc or a C compiler is missing or fails, the build goes on in pure Python and says so:
  the results are the same, only slower. `churnsim.sim.model.closed_form.COMPILED` tells which one runs.

The metadata and the package list are in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ENGINE_DIRECTORY = "sim/model/closed_form"
COMPILE_VARIABLE = "CHURNSIM_COMPILE"
# Commands that only ask for metadata or set up an editable install: nothing to compile for them.
_NO_COMPILE_COMMANDS = {"egg_info", "dist_info", "sdist", "editable_wheel"}


def _wants_compiled_engine() -> bool:
    setting = os.environ.get(COMPILE_VARIABLE, "").strip()
    if setting not in ("", "0", "1"):
        sys.exit(f"setup.py: {COMPILE_VARIABLE}={setting!r}: use 0 (pure Python) or 1 (compile, the default)")
    return setting != "0" and not set(sys.argv[1:]) & _NO_COMPILE_COMMANDS


def _say(message: str) -> None:
    print(f"churnsim build: {message}", file=sys.stderr)


def _compiled_engine_modules() -> list:
    """mypyc's extension modules for the engine, or none (pure Python) where mypyc cannot make them."""
    try:
        from mypyc.build import mypycify
    except ImportError:
        _say("mypyc is not installed: the closed-form engine stays pure Python (same results, about 2x slower)")
        return []
    # Not `__init__.py`: the twin registry gains nothing from compiling, and a compiled package
    # module would have to import its own compiled modules before it exists.
    sources = sorted(str(path) for path in Path(ENGINE_DIRECTORY).glob("*.py") if path.name != "__init__.py")
    try:
        # mypyc names modules by their path; the engine installs as churnsim.sim.model.closed_form, so it
        # is type-checked and compiled from a view of the tree under that name (see `_package_view`).
        build_directory = str(Path("build", "mypyc").resolve())
        with _package_view() as view_root:
            here = os.getcwd()
            os.chdir(view_root)  # mypyc takes module names and their __file__ from the paths as given
            try:
                modules = mypycify(
                    ["--ignore-missing-imports", "--follow-imports=silent", *(str(Path("churnsim", source)) for source in sources)],
                    opt_level="3",
                    separate=True,  # one extension per module, beside it (no shared library elsewhere)
                    target_dir=build_directory,
                )
            finally:
                os.chdir(here)
    except (SystemExit, Exception) as error:  # mypyc reports type errors by exiting
        _say(f"mypyc could not compile the closed-form engine ({error!r}): it stays pure Python")
        return []
    return modules


@contextlib.contextmanager
def _package_view() -> Iterator[str]:
    """A temporary directory laid out as the install lays out the package (pyproject.toml's
    `package-dir`, links to this tree's folders), so that mypy sees `sim/model/closed_form/engine.py` as
    `churnsim.sim.model.closed_form.engine`."""
    from setuptools.config.pyprojecttoml import read_configuration

    here = Path(__file__).resolve().parent
    package_directories = read_configuration(here / "pyproject.toml")["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="churnsim-mypyc-") as directory:
        package = Path(directory, "churnsim")
        package.mkdir()
        for path in (here / package_directories["churnsim"]).glob("*.py"):
            (package / path.name).symlink_to(path)
        for name, folder in package_directories.items():
            if name != "churnsim":  # churnsim.<subpackage> → churnsim/<subpackage>
                (package / name.split(".", 1)[1]).symlink_to(here / folder, target_is_directory=True)
        yield directory


class BuildExtensionsOrPurePython(build_ext):
    """`build_ext` that falls back to the pure-Python engine when the C build fails (no compiler)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # setuptools' CompileError, LinkError, a missing compiler...
            for output in self.get_outputs():
                Path(output).unlink(missing_ok=True)
            _say(f"compiling the closed-form engine failed ({error!r}): it stays pure Python")


if __name__ == "__main__":  # as setuptools runs it; tests/test_build.py imports the pieces above
    setup(
        ext_modules=_compiled_engine_modules() if _wants_compiled_engine() else [],
        cmdclass={"build_ext": BuildExtensionsOrPurePython},
    )
