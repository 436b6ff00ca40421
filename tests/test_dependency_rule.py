"""DESIGN.md's dependency rule (real → calibration ← sim, figures → calibration), the storeys of
section 3, and no import cycle."""

from __future__ import annotations

import ast
import json
import pathlib
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
    """Policies get a RunContext, not the run: sim/model/methods/ imports neither sim/model/run.py nor names `Run`."""
    import pathlib
    import re

    methods = pathlib.Path(__file__).resolve().parents[1] / "sim" / "model" / "methods"
    for path in sorted(methods.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"from \.\.run import|import churnsim\.sim\.run\b|from churnsim\.sim\.run import", text), path.name
        assert not re.search(r'"Run"|\bRun\b(?!Context|Result)', text), path.name


# ----------------------------------------------------------------- storeys and cycles (DESIGN.md section 3)
ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRECTORIES = {"churnsim.calibration": "calibration", "churnsim.sim": "sim", "churnsim": "churnsim"}
"""The packages whose modules the storey and cycle checks read, and their folders (pyproject.toml's package-dir)."""

STOREYS = ("churnsim.calibration", "churnsim.sim.model", "churnsim.sim.studies", "churnsim.sim.checks", "churnsim")
"""From the bottom up: a module imports only modules of its own storey or of storeys below it. A
module belongs to the storey of the longest name it starts with (the CLI and the API, `churnsim`,
are the top storey)."""


def _module_files() -> dict[str, pathlib.Path]:
    modules = {}
    for package, folder in PACKAGE_DIRECTORIES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "churnsim" and len(parts) > 0 and parts[0] in ("sim", "calibration", "real", "figures"):
                continue  # mapped folders beside churnsim/, read under their own entry
            modules.setdefault(name, path)
    return modules


def _is_type_checking_block(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path, name: str, known: set[str], *, module_level_only: bool) -> set[str]:
    """The known modules `name` (the module at `path`) imports: at module level (outside `if
    TYPE_CHECKING:`) when `module_level_only`, else anywhere; `from package import submodule` counts
    the submodule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    statements = []

    def visit(body) -> None:
        """The imports that run when the module is imported: not in functions, not for type checkers."""
        for node in body:
            if _is_type_checking_block(node) or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                statements.append(node)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, None) or [])

    if module_level_only:
        visit(tree.body)
    else:
        statements = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and not _inside_type_checking(tree, node)]
    found = set()
    for node in statements:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c` names a.b.c; a name inside a module names the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _inside_type_checking(tree, target) -> bool:
    for node in ast.walk(tree):
        if _is_type_checking_block(node) and any(child is target for child in ast.walk(node)):
            return True
    return False


def _storey_of(module: str) -> int | None:
    matches = [index for index, storey in enumerate(STOREYS) if module == storey or module.startswith(storey + ".")]
    return max(matches, key=lambda index: len(STOREYS[index])) if matches else None


def test_no_module_imports_a_storey_above_its_own():
    modules = _module_files()
    known = set(modules)
    assert {"churnsim.sim.model.run", "churnsim.sim.studies.whatif", "churnsim.sim.checks.validate"} <= known  # the walk sees the storeys
    upward = []
    for name, path in modules.items():
        storey = _storey_of(name)
        if storey is None:
            continue
        for target in _imports(path, name, known, module_level_only=False):
            target_storey = _storey_of(target)
            if target_storey is not None and target_storey > storey:
                upward.append(f"{name} ({STOREYS[storey]}) imports {target} ({STOREYS[target_storey]})")
    assert not upward, "an import goes up a storey (DESIGN.md section 3):\n" + "\n".join(upward)


def test_the_cli_library_never_imports_a_command():
    """The commands (cli.py, app.py, commands_*.py) sit on top of churnsim/: they parse, call the
    library (jobs.py, the reports, the API) and print; no library module imports one of them."""
    modules = _module_files()
    known = set(modules)
    commands = {name for name in known if name in ("churnsim.cli", "churnsim.app", "churnsim.__main__") or name.startswith("churnsim.commands_")}
    offenders = []
    for name, path in modules.items():
        if name in commands or STOREYS[_storey_of(name) or 0] != "churnsim":
            continue
        offenders += [f"{name} imports {target}" for target in _imports(path, name, known, module_level_only=False) if target in commands]
    assert not offenders, "\n".join(offenders)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle (as a path that returns to its start) per strongly connected component of `graph` that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            step = min(target for target in graph[path[-1]] if target in component)
            if step in seen:
                cycles.append(path[path.index(step):] + [step])
                break
            path.append(step)
            seen.add(step)
    return cycles


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_modules_of_sim_calibration_and_the_cli():
    """Module-level imports (those a module runs when it is imported; not `if TYPE_CHECKING:`) form no
    cycle: each module can be read knowing only the ones below it."""
    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    modules = _module_files()
    known = set(modules)
    graph = {name: _imports(path, name, known, module_level_only=True) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(cycle) for cycle in cycles)
