"""What the commands show on stderr while they work: progress bars, the caveats, where results went.

rich is imported on first use: importing it takes ~50 ms that `--help` must not pay.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from rich.console import Console


@functools.cache
def stderr_console() -> Console:
    """The console for progress, notes and messages on stderr, made on first use."""
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def progress_bar(total: int, description: str) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr; yields the function that advances it by one."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=stderr_console(), transient=False) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def finish(out: Path, notes, *, draw_figures: bool, wrote: Path | None = None, verdict=None) -> None:
    """The end of every command that writes results: figures, report.md and report.html, the caveats, where it all went."""
    console = stderr_console()
    if draw_figures:
        from churnsim.figures.make_all import make_all_figures

        drawn = make_all_figures(out)
        console.print(f"drew {len(drawn)} figure(s) in {out / 'figures'}")
    from churnsim.results_report import write_results_report

    write_results_report(out, verdict=verdict)
    for note in notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(f"wrote {wrote or out}")
