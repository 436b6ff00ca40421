"""The docs page of what every method does on a replica loss and a stage loss is generated from the
methods' traits when the site is built, so it lists every registered method and says what the code says."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from churnsim.calibration.methods import METHOD_CONFIGS

REPOSITORY = Path(__file__).resolve().parents[1]
HOOKS = REPOSITORY / "docs" / "hooks"


def _hook_module(name: str):
    """A module of docs/hooks/, loaded as mkdocs loads the hook (its folder on sys.path)."""
    sys.path.insert(0, str(HOOKS))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_hooks_{name}", HOOKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOKS))


def table_rows(markdown: str) -> dict[str, list[str]]:
    """{method name: its cells} of the page's table."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split(" | ")]
            rows[cells[0].split("`")[1]] = cells
    return rows


def test_the_table_has_every_method_with_its_own_sentences():
    rows = table_rows(_hook_module("method_losses").method_losses_markdown())
    assert list(rows) == list(METHOD_CONFIGS)
    for name, config in METHOD_CONFIGS.items():
        _, on_replica_loss, on_stage_loss, shard = rows[name]
        assert on_replica_loss == " ".join(config.on_replica_loss().split())
        assert on_stage_loss == " ".join(config.on_stage_loss.split())
        assert shard == ("—" if config.ignores_failures else f"`{config.lost_optimizer_shard}`")


def test_a_method_whose_sentence_has_a_bar_keeps_the_table_whole(monkeypatch):
    from churnsim.calibration.methods import CheckpointConfig

    monkeypatch.setattr(CheckpointConfig, "on_stage_loss", "rolls back | then\ntrains again")
    rows = table_rows(_hook_module("method_losses").method_losses_markdown())
    assert len(rows["checkpoint"]) == 4 and rows["checkpoint"][2] == "rolls back \\| then trains again"


def test_the_site_hook_adds_the_page_and_the_methods_page_links_it(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    config = load_config(str(REPOSITORY / "mkdocs.yml"))
    files = config.plugins.on_files(get_files(config), config=config)
    page = files.get_file_from_path("reference/method-losses.md")
    assert page is not None and "checkfree_plus" in page.content_string
    assert "../reference/method-losses.md" in (REPOSITORY / "docs" / "concepts" / "methods.md").read_text(encoding="utf-8")
