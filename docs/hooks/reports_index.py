"""The index of the dated benchmark reports (`benchmarks/reports/<YYYY-MM-DD>-<benchmark-name>.md`):
one row per benchmark, its latest report first, then the earlier ones, newest first."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

REPORT_NAME = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})-(?P<benchmark>[a-z0-9][a-z0-9-]*)\.md$")

PAGE_INTRO = (
    "Each benchmark writes a dated report: the command, the machine, the commit and the spread of "
    "its results. The numbers the other pages refer to live here, in the latest report of each "
    "benchmark; earlier reports stay for comparison."
)


class ReportNameError(ValueError):
    """A file in benchmarks/reports/ whose name is not `<YYYY-MM-DD>-<benchmark-name>.md`."""


def parse_report_name(path: Path) -> tuple[str, str]:
    """(date, benchmark name) of a report file, or ReportNameError saying what the name must be."""
    match = REPORT_NAME.match(path.name)
    if match is None:
        raise ReportNameError(
            f"benchmarks/reports/{path.name}: a report's name must be <YYYY-MM-DD>-<benchmark-name>.md "
            "(lower-case words joined by hyphens); rename it"
        )
    return match["date"], match["benchmark"]


def report_title(path: Path) -> str:
    """The report's first level-one heading, or its file name when it has none."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def reports_by_benchmark(paths: list[Path]) -> list[tuple[str, list[tuple[str, Path]]]]:
    """[(benchmark, [(date, path), ...] newest first)], benchmarks by name."""
    grouped: dict[str, list[tuple[str, Path]]] = defaultdict(list)
    for path in paths:
        date, benchmark = parse_report_name(path)
        grouped[benchmark].append((date, path))
    return [(benchmark, sorted(grouped[benchmark], key=lambda entry: entry[0], reverse=True)) for benchmark in sorted(grouped)]


def reports_index_markdown(paths: list[Path]) -> str:
    lines = ["# Benchmark reports", "", PAGE_INTRO, ""]
    grouped = reports_by_benchmark(paths)
    if not grouped:
        return "\n".join([*lines, "No reports yet.", ""])
    lines += ["| Benchmark | Latest report | Earlier reports |", "| --- | --- | --- |"]
    for benchmark, reports in grouped:
        (latest_date, latest), earlier = reports[0], reports[1:]
        title = report_title(latest).replace("|", "\\|")
        shown = title if latest_date in title else f"{latest_date}: {title}"
        earlier_links = ", ".join(f"[{date}]({path.name})" for date, path in earlier) or "—"
        lines.append(f"| `{benchmark}` | [{shown}]({latest.name}) | {earlier_links} |")
    return "\n".join([*lines, ""])
