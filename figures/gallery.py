"""The documentation's gallery in one command: `python -m churnsim.figures.gallery --out DIR`.

It runs the default what-if (`churnsim whatif`, in a process of its own: this package imports only
the contract, never the simulator) into a temporary directory and draws the gallery's figures from
its tables into DIR. `--results RESULTS` draws them from saved results instead, without simulating.
Only the gallery's PNGs are written, and only into DIR; the repository's copy is
`--out figures/gallery`, run from the repository root.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

from .make_all import FIGURE_DPI, render_figures

GALLERY_FIGURES = (
    "time_to_target",
    "speedup",
    "loss_vs_wallclock",
    "badput_breakdown",
    "optimal_interval",
    "checkpoint_interval",
    "pipeline_gantt",
)
"""The figures of the default what-if shown in docs/gallery.md, in its order."""


def draw_gallery(results_directory: Path, output_directory: Path) -> list[Path]:
    """Draw the gallery's figures from `results_directory` into `output_directory`; returns the PNGs.
    Raises SystemExit(2) with one line when a gallery figure cannot be drawn from those results."""
    figures = {path.stem: figure for path, figure in render_figures(results_directory) if path.parent == Path(".")}
    missing = [name for name in GALLERY_FIGURES if name not in figures]
    if missing:
        _fail(f"{results_directory}: no {', '.join(missing)} figure can be drawn from it; pass the --out directory of `churnsim whatif`")
    output_directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in GALLERY_FIGURES:
        path = output_directory / f"{name}.png"
        figures[name].savefig(path, dpi=FIGURE_DPI)
        written.append(path)
    return written


def run_default_whatif(results_directory: Path) -> None:
    """`churnsim whatif` with its defaults (figures left to the gallery) into `results_directory`."""
    command = [sys.executable, "-m", "churnsim", "whatif", "--out", str(results_directory), "--no-figures"]
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if finished.returncode != 0:
        last_line = (finished.stderr.strip().splitlines() or ["no message"])[-1]
        _fail(f"the default what-if failed ({last_line}); run `churnsim whatif` to see why")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m churnsim.figures.gallery", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the gallery's PNGs (figures/gallery in the repository)")
    parser.add_argument("--results", type=Path, default=None, help="draw from these saved what-if results instead of running the default what-if")
    arguments = parser.parse_args(argv)
    matplotlib.use("Agg")
    if arguments.results is not None:
        if not arguments.results.is_dir():
            _fail(f"--results {arguments.results}: not a directory; pass the --out directory of `churnsim whatif`")
        written = draw_gallery(arguments.results, arguments.out)
    else:
        with tempfile.TemporaryDirectory(prefix="churnsim-gallery-") as scratch:
            results = Path(scratch) / "results"
            run_default_whatif(results)
            written = draw_gallery(results, arguments.out)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
