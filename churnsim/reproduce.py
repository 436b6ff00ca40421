"""`churnsim reproduce PAPER`: a report of one paper's published claims against churnsim's numbers.

The claims and churnsim's numbers come from `churnsim.sim.checks.reproduce_checkfree` and
`churnsim.sim.checks.reproduce_datastates`; this module writes them into `--out DIR`:

    report.md            the claims table (claim, source, setting, paper, churnsim, verdict), why each
                         disagreement happens, how churnsim's numbers were made, supporting tables
    claims.csv           the claims table with numeric columns
    <table>.csv          supporting tables (end_to_end, dp_scaling; speedups, speedups_by_layout)
    figures/reproduce_*.png
    manifest.json        what wrote the directory (command "reproduce", the paper)

`--out` follows churnsim/out_directory.py: a new or empty directory, or one holding this same
reproduction, is fine; anything else needs `--overwrite`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import pandas as pd

from churnsim.calibration.base import atomic_write_text, read_json, strict_json_dumps
from churnsim.calibration.errors import InputError
from churnsim.calibration.input_limits import MAX_REPLICATIONS, TOO_MANY_REPLICATIONS, check_workers
from churnsim.calibration.tables import write_table

PAPERS: tuple[str, ...] = ("checkfree", "datastates")
REPORT_FILE = "report.md"
CLAIMS_FILE = "claims.csv"
SUPPORTING_TABLES = ("end_to_end", "dp_scaling", "speedups", "speedups_by_layout")
"""Every supporting table either paper writes (removed before a new reproduction is written)."""


def check_paper(paper: str) -> str:
    if paper not in PAPERS:
        raise InputError(f"unknown paper {paper!r}: use one of {', '.join(PAPERS)} (e.g. churnsim reproduce datastates --out DIR)")
    return paper


def check_arguments(paper: str, *, replications: int | None = None, workers: int | None = None, quick: bool = False) -> None:
    """One-line InputError for any bad argument, before anything runs or is written."""
    check_paper(paper)
    if paper == "datastates" and replications is not None:
        raise InputError("--replications: the DataStates-LLM runs have no failures, so one replication is exact; drop --replications")
    if paper == "datastates" and quick:
        raise InputError("--quick: the DataStates-LLM reproduction has no quicker form (it takes seconds); drop --quick")
    if replications is not None and replications < 2:
        raise InputError(f"--replications {replications}: speed-up intervals need at least 2")
    if replications is not None and replications > MAX_REPLICATIONS:
        raise InputError(f"--replications {replications}: {TOO_MANY_REPLICATIONS}")
    check_workers(workers)


def compute(
    paper: str,
    *,
    quick: bool = False,
    replications: int | None = None,
    workers: int | None = None,
    on_task_done: Callable[[], None] | None = None,
):
    """The `Reproduction` of `paper` (sim/checks/reproduce_claims.py); nothing is written."""
    check_arguments(paper, replications=replications, workers=workers, quick=quick)
    if paper == "datastates":
        from churnsim.sim.checks.reproduce_datastates import reproduce_datastates

        return reproduce_datastates(on_step=on_task_done)
    from dataclasses import replace

    from churnsim.sim.checks import reproduce_checkfree as checkfree

    plan = checkfree.QUICK_PLAN if quick else checkfree.CheckFreePlan()
    if replications is not None:
        plan = replace(plan, replications=replications)
    return checkfree.reproduce_checkfree(plan, workers=workers, on_task_done=on_task_done)


def num_tasks(paper: str, *, quick: bool = False, replications: int | None = None) -> int:
    """Units of progress `compute` reports (for a progress bar)."""
    if paper == "datastates":
        from churnsim.sim.checks.reproduce_datastates import INTERVALS, PAPER_END_TO_END_S

        return len(PAPER_END_TO_END_S) * len(INTERVALS) + 1
    from churnsim.sim.checks import reproduce_checkfree as checkfree

    plan = checkfree.QUICK_PLAN if quick else checkfree.CheckFreePlan()
    reps = replications if replications is not None else plan.replications
    return len(plan.layouts) * len(plan.sizes) * len(plan.rates) * reps


def previous_reproduction(directory: Path) -> bool:
    """Whether `directory` holds a churnsim reproduction (its files may be replaced)."""
    try:
        return read_json(directory / "manifest.json").get("command") == "reproduce"
    except (InputError, AttributeError):
        return False


def write_report(reproduction, out: Path, *, draw_figures: bool = True, extra_setup: tuple[str, ...] = ()) -> list[Path]:
    """Write the report, its tables, figures and manifest into `out` (prepared by the caller)."""
    from churnsim import installed_version
    from churnsim.calibration.run_record import provenance_fields

    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    files += write_table(reproduction.claims_table(), out / CLAIMS_FILE)
    for stem, table in reproduction.tables.items():
        files += write_table(table, out / f"{stem}.csv")
    figures: list[Path] = []
    if draw_figures:
        from churnsim.figures.reproduce import make_reproduce_figures

        figures = make_reproduce_figures(reproduction.paper, out)
        files += figures
    report = render_markdown(reproduction, [path.relative_to(out) for path in figures], extra_setup=extra_setup, version=installed_version())
    atomic_write_text(out / REPORT_FILE, report)
    files.append(out / REPORT_FILE)
    manifest = {
        "command": "reproduce",
        # out_directory.py reads (command, scenario name) to tell whose results a directory holds.
        "scenario": {"name": reproduction.paper},
        "paper": reproduction.citation,
        "counts": reproduction.counts(),
        "files": sorted(str(path.relative_to(out)) for path in files),
        **provenance_fields(),
    }
    atomic_write_text(out / "manifest.json", strict_json_dumps(manifest) + "\n")
    files.append(out / "manifest.json")
    return files


def remove_previous_outputs(out: Path) -> None:
    """Remove the report files of an earlier reproduction in `out` (the caller checked it may)."""
    for name in (REPORT_FILE, CLAIMS_FILE, *(f"{stem}.csv" for stem in SUPPORTING_TABLES)):
        (out / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- markdown
def _cell(value: object) -> str:
    text = "—" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
    return text.replace("|", "/").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, columns: dict[str, str], formats: dict[str, Callable[[object], str]] | None = None) -> str:
    """`frame`'s `columns` (name → header) as a GitHub markdown table."""
    formats = formats or {}
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(_cell(formats.get(name, lambda v: v)(row[name])) for name in columns) + " |")
    return "\n".join(lines)


def claims_markdown(reproduction) -> str:
    """The claims table as the README and report show it."""
    table = reproduction.claims_table()
    return markdown_table(
        table,
        {"id": "#", "claim": "claim", "source": "source", "setting": "setting", "paper": "paper", "churnsim": "churnsim", "verdict": "verdict"},
    )


def _percent(value: object) -> str:
    return "—" if not isinstance(value, float) or math.isnan(value) else f"{100 * value:+.0f} %"


def _ratio(value: object) -> str:
    if not isinstance(value, float) or math.isnan(value):
        return "—"
    return "∞" if math.isinf(value) else f"{value:.2f}×"


def _number(digits: int) -> Callable[[object], str]:
    def show(value: object) -> str:
        if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return "unbounded" if math.isinf(value) else f"{value:,.{digits}f}"

    return show


def _supporting_markdown(reproduction) -> list[str]:
    parts: list[str] = []
    tables = reproduction.tables
    if "end_to_end" in tables:
        parts += [
            "### End-to-end time of 50 iterations [P Figs. 11–12]",
            "",
            markdown_table(
                tables["end_to_end"],
                {"model": "model", "interval_iterations": "f", "engine": "engine", "paper_end_to_end_s": "paper (s)",
                 "churnsim_end_to_end_s": "churnsim (s)", "relative_difference": "difference",
                 "churnsim_blocked_per_checkpoint_s": "churnsim blocked per checkpoint (s)"},
                {"churnsim_end_to_end_s": _number(0), "relative_difference": _percent, "churnsim_blocked_per_checkpoint_s": _number(2)},
            ),
            "",
        ]
    if "dp_scaling" in tables:
        parts += [
            "### 30B checkpoint throughput by data-parallel degree [P Figs. 9–10]",
            "",
            markdown_table(
                tables["dp_scaling"],
                {"data_parallel_degree": "DP", "engine": "engine", "paper_throughput_GB_per_s": "paper (GB/s)",
                 "churnsim_throughput_GB_per_s": "churnsim (GB/s)", "churnsim_blocked_per_checkpoint_s": "churnsim blocked per checkpoint (s)",
                 "churnsim_end_to_end_s": "churnsim end-to-end (s)"},
                {"churnsim_throughput_GB_per_s": _number(0), "churnsim_blocked_per_checkpoint_s": _number(2), "churnsim_end_to_end_s": _number(0)},
            ),
            "",
        ]
    if "speedups_by_layout" in tables and not tables["speedups_by_layout"].empty:
        table = tables["speedups_by_layout"]
        columns = {"model": "model", "failure_probability_per_stage_hour": "failures /stage-hour", "method": "method"}
        for value, words in (("speedup_vs_checkpoint", "vs checkpoint"), ("speedup_vs_redundant", "vs redundant")):
            for layout, layout_words in (("separate_node", "embedding node"), ("edge_stages", "edge stages")):
                if f"{value}_{layout}" in table:
                    columns[f"{value}_{layout}"] = f"{words}, {layout_words}"
        formats = {name: _ratio for name in columns if name.startswith("speedup")}
        formats["failure_probability_per_stage_hour"] = lambda v: f"{100 * float(v):g} %"
        formats["model"] = lambda v: str(v).upper()
        parts += [
            "### Speed-ups of CheckFree and CheckFree+ (mean of paired ratios; — : a method never reached the target)",
            "",
            markdown_table(table, columns, formats),
            "",
        ]
    return parts


def render_markdown(reproduction, figures: list[Path], *, extra_setup: tuple[str, ...] = (), version: str = "") -> str:
    counts = reproduction.counts()
    lines = [
        f"# Reproduction: {reproduction.title}",
        "",
        f"Paper: {reproduction.citation}.",
        "",
        f"Written by `churnsim reproduce {reproduction.paper}`" + (f" (churnsim {version})" if version else "") + ". "
        f"{counts['claims']} claims: {counts['agree']} agree, {counts['disagree']} disagree, {counts['not_checked']} not checked, "
        f"and {counts['fitted']} calibration input(s) churnsim was fitted to (\"fitted\": no test). A value agrees within "
        "10 % or 25 % of the paper's (a speed-up: of its gain, speed-up − 1), or disagrees; a bound is met or not. Every "
        "disagreement is explained under \"Why\".",
        "",
        claims_markdown(reproduction),
        "",
        "## Why",
        "",
    ]
    order = sorted(reproduction.claims, key=lambda claim: (not claim.verdict.startswith("disagrees"), claim.id))
    for claim in order:
        if claim.why:
            lines.append(f"- **{claim.id}** ({claim.verdict}): {claim.why}")
    lines += ["", "## How churnsim's numbers were made", ""]
    lines += [f"- {line}" for line in (*reproduction.setup, *extra_setup)]
    if reproduction.notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {note}" for note in reproduction.notes]
    supporting = _supporting_markdown(reproduction)
    if supporting:
        lines += ["", "## Supporting tables", ""] + supporting
    if figures:
        lines += ["## Figures", ""]
        lines += [f"![{path.stem}]({path.as_posix()})" for path in figures]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["PAPERS", "check_arguments", "check_paper", "claims_markdown", "compute", "render_markdown", "write_report"]
