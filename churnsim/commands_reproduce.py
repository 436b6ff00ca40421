"""`churnsim reproduce PAPER`: each published claim of a paper, churnsim's number for it, a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from churnsim.app import app
from churnsim.console import progress_bar, stderr_console
from churnsim.options import OVERWRITE_HELP


@app.command("reproduce")
def reproduce_command(
    paper: str = typer.Argument(..., metavar="PAPER", help="checkfree (CheckFree/CheckFree+, arXiv 2506.15461) or datastates (DataStates-LLM, HPDC'24)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Directory for report.md, its tables and figures (default: churnsim-reproduce-PAPER)."),
    overwrite: bool = typer.Option(False, "--overwrite", help=OVERWRITE_HELP),
    quick: bool = typer.Option(False, "--quick", help="checkfree: 2 replications, the authors' layout only (a smoke run; every claim is still listed)."),
    replications: Optional[int] = typer.Option(None, "--replications", help="checkfree: replications per setting (default 5)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: one per core)."),
    figures: bool = typer.Option(True, "--figures/--no-figures", help="Draw the figures."),
) -> None:
    """Reproduce a paper's published claims with churnsim's presets of its setup: a report with a verdict per claim."""
    from churnsim.out_directory import prepare_out_directory
    from churnsim.reproduce import check_arguments, compute, num_tasks, previous_reproduction, remove_previous_outputs, write_report

    check_arguments(paper, replications=replications, workers=workers, quick=quick)
    out = out if out is not None else Path(f"churnsim-reproduce-{paper}")
    replace_reproduction = previous_reproduction(out)
    prepare_out_directory(out, command="reproduce", subject=paper, overwrite=overwrite)
    with progress_bar(num_tasks(paper, quick=quick, replications=replications), f"reproducing {paper}") as advance:
        reproduction = compute(paper, quick=quick, replications=replications, workers=workers, on_task_done=advance)
    if replace_reproduction:
        remove_previous_outputs(out)
    write_report(reproduction, out, draw_figures=figures)
    counts = reproduction.counts()
    console = stderr_console()
    console.print(
        f"{counts['claims']} claims: {counts['agree']} agree, {counts['fitted']} fitted, "
        f"{counts['disagree']} disagree, {counts['not_checked']} not checked"
    )
    console.print(f"wrote {out / 'report.md'}")
