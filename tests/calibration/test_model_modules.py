"""The modules that define contract models keep their annotations evaluated (calibration/base.py)."""

import ast
from pathlib import Path

import churnsim.calibration

CALIBRATION = Path(churnsim.calibration.__file__).parent


def _defines_a_model(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ClassDef) and any(isinstance(base, ast.Name) and base.id.endswith("Model") for base in node.bases)
        for node in tree.body
    )


def _postpones_annotations(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.ImportFrom) and node.module == "__future__" and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )


def test_no_model_module_postpones_its_annotations():
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(CALIBRATION.glob("*.py"))}
    model_modules = [name for name, tree in trees.items() if _defines_a_model(tree)]
    assert "scenario.py" in model_modules and "methods.py" in model_modules  # the scan sees the models
    offenders = [name for name in model_modules if _postpones_annotations(trees[name])]
    assert not offenders, f"{offenders}: drop `from __future__ import annotations` (pydantic re-evaluates string annotations at import)"
