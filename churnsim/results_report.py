"""A results folder that stands alone: `report.md` and a self-contained `report.html` beside the tables.

Both hold the question (the scenario in words and the command line that asked it), the answer lines,
the caveats, the tables the command printed and every figure of the folder; the HTML embeds the
figures as base64 data URIs and its style inline, so it opens offline, mailed or archived on its own.
The command line and the run time also go into manifest.json (`sim.outputs.add_to_manifest`).

Formatting only: the answer, its tables and caveats are `churnsim.report`'s, from the verdict the
command computed; this module only lays them out a second time, for a file.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPORT_MARKDOWN = "report.md"
REPORT_HTML = "report.html"
FIGURES_DIRECTORY = "figures"

_invocation: dict[str, Any] = {}


def note_invocation(arguments: list[str]) -> None:
    """Remember the command line and when the command started, for the manifest and the report
    (called by the console script's entry point before the command runs)."""
    _invocation.update(argv=["churnsim", *arguments], started=time.monotonic())


def invocation() -> tuple[list[str], float | None]:
    """The command line (the process's own where no command was noted) and seconds since it started."""
    started = _invocation.get("started")
    return list(_invocation.get("argv", sys.argv)), (time.monotonic() - started if started is not None else None)


@dataclasses.dataclass(frozen=True)
class ReportTable:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    bold_rows: frozenset[int]
    caption: str | None


@dataclasses.dataclass(frozen=True)
class Report:
    heading: str
    question: tuple[str, ...]
    command_line: str
    scenario_json: str | None
    answers: tuple[str, ...]
    caveats: tuple[str, ...]
    tables: tuple[ReportTable, ...]
    table_files: tuple[str, ...]
    figures: tuple[str, ...]
    """Paths of the folder's PNGs, relative to it."""
    provenance: tuple[tuple[str, str], ...]
    package_versions: dict[str, str]


def write_results_report(out: Path, *, verdict=None) -> tuple[Path, Path] | None:
    """Record the command line and run time in `out`'s manifest (where there is one), then, given
    a `verdict` (a `sim.verdict.Verdict`), write `out/report.md` and `out/report.html` for it and
    the files in `out`; returns their paths, or None without a verdict."""
    from churnsim.calibration.base import atomic_write_text
    from churnsim.sim.studies.outputs import MANIFEST_FILE, add_to_manifest

    if not (out / MANIFEST_FILE).is_file():
        return None
    argv, run_time_s = invocation()
    add_to_manifest(out, argv=argv, run_time_s=None if run_time_s is None else round(run_time_s, 3))
    if verdict is None:
        return None
    manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    report = build_report(out, manifest, verdict)
    markdown, page = out / REPORT_MARKDOWN, out / REPORT_HTML
    atomic_write_text(markdown, render_markdown(report))
    atomic_write_text(page, render_html(report, out))
    return markdown, page


def build_report(out: Path, manifest: dict[str, Any], verdict) -> Report:
    from churnsim.report import all_caveats, answer_line, point_title, tuned_answer_line

    scenario = _scenario(manifest.get("scenario"))
    command = str(manifest.get("command", "churnsim"))
    name = scenario.name if scenario is not None else str(manifest.get("calibration", ""))
    answers: list[str] = []
    for point in verdict.points:
        answers.append(answer_line(point))
        tuned = tuned_answer_line(point)
        if tuned:
            answers.append(f"{point_title(point)}, {tuned.strip()}")  # on its own, the line must say where it holds
    run_time_s = manifest.get("run_time_s")
    revision = manifest.get("git_revision")
    provenance = (
        ("source", f"git {revision}" if revision else f"churnsim {manifest.get('churnsim_version') or '?'} (installed, not a git checkout)"),
        ("churnsim version", str(manifest.get("churnsim_version"))),
        ("written", str(manifest.get("updated_utc") or manifest.get("created_utc"))),
        ("run time", "—" if run_time_s is None else f"{float(run_time_s):.1f} s"),
        ("machine", ", ".join(f"{key} {value}" for key, value in (manifest.get("hardware") or {}).items())),
    )
    return Report(
        heading=f"churnsim {command}: {name}",
        question=scenario_in_words(scenario, manifest) if scenario is not None else (),
        command_line=shlex.join(str(part) for part in manifest.get("argv", [])),
        scenario_json=json.dumps(manifest["scenario"], indent=2) if "scenario" in manifest else None,
        answers=tuple(answers),
        caveats=tuple(all_caveats(verdict)),
        tables=tuple(_point_table(point) for point in verdict.points),
        table_files=tuple(sorted(path.name for path in out.glob("*.csv"))),
        figures=tuple(sorted(str(path.relative_to(out).as_posix()) for path in (out / FIGURES_DIRECTORY).rglob("*.png"))),
        provenance=provenance,
        package_versions=dict(manifest.get("package_versions") or {}),
    )


def _scenario(data: Any):
    from churnsim.calibration.scenario import Scenario

    if not isinstance(data, dict):
        return None
    try:
        return Scenario.model_validate(data)
    except ValueError:
        return None  # written by another churnsim version: the JSON below still shows it


def scenario_in_words(scenario, manifest: dict[str, Any]) -> tuple[str, ...]:
    """A few sentences: the scenario, its model, pipeline, churn, target and what the command varied."""
    from churnsim.calibration.churn import RATE_FIELD_OF_KIND, own_rate, rate_field_of_setting

    model, pipeline, target = scenario.model, scenario.pipeline, scenario.target
    own = own_rate(scenario.churn)
    churn = scenario.churn.kind.replace("_", " ") + (f" churn at {own[0].words(own[1])}" if own is not None else " churn")
    goal = f"loss {target.loss:g}" if target.loss is not None else f"{target.iterations:,} iterations of progress"
    sentences = [
        f"Scenario {scenario.name}" + (f": {scenario.description.rstrip('.')}." if scenario.description else "."),
        f"Model {model.name}: {model.num_layers} layers, hidden size {model.hidden_size}, {model.num_parameters:,} parameters.",
        f"Pipeline: {pipeline.num_stages} stages × {pipeline.data_parallel_degree} data-parallel, {pipeline.num_microbatches} "
        f"microbatches of {pipeline.microbatch_size} sequences, {pipeline.schedule} schedule.",
        f"Churn: {churn}. Target: {goal}, runs stopped after {target.max_wall_clock_s / 3600:g} h.",
        f"Methods: {', '.join(manifest.get('methods') or [method.name for method in scenario.methods])}; "
        f"{manifest.get('replications', scenario.replications)} replications, seed {scenario.seed}.",
    ]
    rates = manifest.get("failure_rates")
    if rates:
        rate = rate_field_of_setting(str(manifest.get("rate_setting"))) or RATE_FIELD_OF_KIND["stage_hourly"]
        sentences.append("Asked at failure rates: " + ", ".join(rate.words(float(value)) for value in rates) + ".")
    for path, values in (manifest.get("grid") or {}).items():
        sentences.append(f"Swept {path} over {', '.join(map(str, values))}.")
    return tuple(sentences)


class _TableCapture:
    """Stands in for a rich Console: keeps the tables `churnsim.report.print_point_table` prints."""

    def __init__(self) -> None:
        self.tables: list[Any] = []

    def print(self, renderable: Any, *args: Any, **kwargs: Any) -> None:
        self.tables.append(renderable)


def _plain(markup: Any) -> str:
    from rich.text import Text

    if markup is None:
        return ""
    return Text.from_markup(markup).plain if isinstance(markup, str) else str(markup)


def _point_table(point) -> ReportTable:
    """The table the command printed for `point`, as plain strings."""
    from churnsim.report import print_point_table

    capture = _TableCapture()
    print_point_table(point, capture)  # type: ignore[arg-type]
    (table,) = capture.tables
    columns = [[_plain(cell) for cell in column.cells] for column in table.columns]
    rows = tuple(zip(*columns)) if columns else ()
    bold = frozenset(index for index, row in enumerate(table.rows) if row.style and "bold" in str(row.style))
    return ReportTable(
        title=_plain(table.title), headers=tuple(_plain(column.header) for column in table.columns), rows=rows, bold_rows=bold,
        caption=_plain(table.caption) or None,
    )


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(report: Report) -> str:
    lines = [f"# {report.heading}", "", "## The question", ""]
    lines += [*report.question, ""] if report.question else []
    lines += ["Command:", "", "```bash", report.command_line, "```", ""]
    lines += ["## The answer", "", *(f"- {answer}" for answer in report.answers), ""]
    if report.caveats:
        lines += ["## Caveats", "", *(f"- {caveat}" for caveat in report.caveats), ""]
    lines += ["## Tables", ""]
    for table in report.tables:
        lines += [f"### {table.title}", "", "| " + " | ".join(map(_markdown_cell, table.headers)) + " |", "|" + "---|" * len(table.headers)]
        for index, row in enumerate(table.rows):
            cells = [f"**{_markdown_cell(cell)}**" if index in table.bold_rows and cell else _markdown_cell(cell) for cell in row]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", *([f"*{table.caption}*", ""] if table.caption else [])]
    if report.table_files:
        lines += ["Tables in this folder: " + ", ".join(f"[{name}]({name})" for name in report.table_files), ""]
    if report.figures:
        lines += ["## Figures", ""]
        for figure in report.figures:
            lines += [f"![{figure}]({figure})", ""]
    lines += ["## Provenance", "", *(f"- {name}: {value}" for name, value in report.provenance)]
    lines += ["- packages: " + ", ".join(f"{name} {version}" for name, version in report.package_versions.items()), ""]
    return "\n".join(lines)


_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2rem; border-bottom: 1px solid #ccc; } h3 { font-size: 1.05rem; }
pre, code { background: #f4f4f4; padding: 0.2rem 0.4rem; overflow-x: auto; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #bbb; padding: 0.25rem 0.6rem; text-align: left; white-space: nowrap; }
th { background: #eee; } tr.winner td { font-weight: bold; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-size: 0.85rem; color: #555; } .caption { font-size: 0.85rem; color: #555; }
li.caveat { margin-bottom: 0.3rem; }
"""


def render_html(report: Report, out: Path) -> str:
    """One HTML page with its style inline and every figure as a base64 PNG data URI: no file it
    refers to, so it opens anywhere, offline."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', f"<title>{e(report.heading)}</title>",
        f"<style>{_STYLE}</style>", "</head>", "<body>", f"<h1>{e(report.heading)}</h1>", "<h2>The question</h2>",
        *(f"<p>{e(sentence)}</p>" for sentence in report.question),
        f"<p>Command:</p><pre><code>{e(report.command_line)}</code></pre>",
    ]
    if report.scenario_json is not None:
        parts.append(f"<details><summary>The scenario as JSON</summary><pre><code>{e(report.scenario_json)}</code></pre></details>")
    parts += ["<h2>The answer</h2>", "<ul>", *(f"<li>{e(answer)}</li>" for answer in report.answers), "</ul>"]
    if report.caveats:
        parts += ["<h2>Caveats</h2>", "<ul>", *(f'<li class="caveat">{e(caveat)}</li>' for caveat in report.caveats), "</ul>"]
    parts.append("<h2>Tables</h2>")
    for table in report.tables:
        parts += [f"<h3>{e(table.title)}</h3>", "<table>", "<thead><tr>" + "".join(f"<th>{e(header)}</th>" for header in table.headers) + "</tr></thead>", "<tbody>"]
        for index, row in enumerate(table.rows):
            row_class = ' class="winner"' if index in table.bold_rows else ""
            parts.append(f"<tr{row_class}>" + "".join(f"<td>{e(cell)}</td>" for cell in row) + "</tr>")
        parts += ["</tbody>", "</table>", *([f'<p class="caption">{e(table.caption)}</p>'] if table.caption else [])]
    if report.table_files:
        parts.append("<p>Tables in this folder: " + ", ".join(f"<code>{e(name)}</code>" for name in report.table_files) + "</p>")
    if report.figures:
        parts.append("<h2>Figures</h2>")
        for figure in report.figures:
            encoded = base64.b64encode((out / figure).read_bytes()).decode("ascii")
            parts.append(f'<figure><img src="data:image/png;base64,{encoded}" alt="{e(figure)}"><figcaption>{e(figure)}</figcaption></figure>')
    parts += ["<h2>Provenance</h2>", "<ul>", *(f"<li>{e(name)}: {e(value)}</li>" for name, value in report.provenance), "</ul>"]
    packages = ", ".join(f"{name} {version}" for name, version in report.package_versions.items())
    parts += [f"<details><summary>Package versions</summary><p>{e(packages)}</p></details>", "</body>", "</html>", ""]
    return "\n".join(parts)
