"""mkdocs hook (`hooks:` in mkdocs.yml): the pages and files of the site that are made from the
repository when it is built, so that none of them is written by hand or goes stale:

- `reference/cli.md` from the typer app (cli_reference.py);
- `reference/scenario.md` from the scenario JSON Schema (scenario_reference.py);
- `reference/method-losses.md`, what every method does on a replica loss and a stage loss, from the
  methods' traits (method_losses.py);
- `gallery/<name>.png` for every `figures/gallery/*.png`;
- `reports/<file>.md` for every `benchmarks/reports/*.md`, and `reports/index.md` listing them
  (reports_index.py).

`reference/scenario.schema.json` is a committed file instead (published for editors and
validators); tests/test_docs_reference.py checks that it is what the models generate.
"""

from __future__ import annotations

from pathlib import Path

from cli_reference import cli_reference_markdown
from method_losses import method_losses_markdown
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from reports_index import ReportNameError, reports_index_markdown
from scenario_reference import scenario_reference_markdown

REPOSITORY = Path(__file__).resolve().parents[2]
GALLERY = REPOSITORY / "figures" / "gallery"
REPORTS = REPOSITORY / "benchmarks" / "reports"


def report_files() -> list[Path]:
    return sorted(REPORTS.glob("*.md")) if REPORTS.is_dir() else []


def generated_pages() -> dict[str, str]:
    """{site path: markdown} of the generated pages."""
    try:
        reports_index = reports_index_markdown(report_files())
    except ReportNameError as error:
        raise PluginError(str(error)) from None
    return {
        "reference/cli.md": cli_reference_markdown(),
        "reference/scenario.md": scenario_reference_markdown(),
        "reference/method-losses.md": method_losses_markdown(),
        "reports/index.md": reports_index,
    }


def copied_files() -> dict[str, Path]:
    """{site path: repository file} of the files taken into the site as they are."""
    copied = {f"gallery/{png.name}": png for png in sorted(GALLERY.glob("*.png"))}
    copied.update({f"reports/{report.name}": report for report in report_files()})
    return copied


def on_files(files: Files, config) -> Files:
    additions = [File.generated(config, uri, content=text) for uri, text in generated_pages().items()]
    additions += [File.generated(config, uri, abs_src_path=str(path)) for uri, path in copied_files().items()]
    for file in additions:
        if files.get_file_from_path(file.src_uri) is not None:
            raise PluginError(f"docs/{file.src_uri} is generated when the site is built; delete the file under docs/")
        files.append(file)
    return files


def on_serve(server, config, builder):
    """`mkdocs serve` rebuilds when what the generated pages are made from changes."""
    for source in (REPOSITORY / "churnsim", REPOSITORY / "calibration", GALLERY, REPORTS, REPOSITORY / "DESIGN.md"):
        if source.exists():
            server.watch(str(source))
    return server
