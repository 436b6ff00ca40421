"""Figures from saved results: each plot function draws on the Axes it is given and returns its artists.

`make_all_figures(results_directory)` writes every figure whose input table exists;
`python -m churnsim.figures.gallery --out DIR` draws the documentation's gallery (docs/gallery.md).
"""

from .badput import plot_badput_breakdown, plot_goodput_share
from .checkpoint_interval import plot_checkpoint_interval, plot_optimal_interval
from .gantt import plot_pipeline_gantt
from .loss import plot_loss_vs_wallclock
from .make_all import FigureReport, make_all_figures, make_figures
from .setback_sensitivity import plot_setback_sensitivity
from .time_to_target import plot_speedup, plot_time_to_target
from .validation import plot_validation

__all__ = [
    "FigureReport",
    "make_all_figures",
    "make_figures",
    "plot_badput_breakdown",
    "plot_checkpoint_interval",
    "plot_goodput_share",
    "plot_loss_vs_wallclock",
    "plot_optimal_interval",
    "plot_pipeline_gantt",
    "plot_setback_sensitivity",
    "plot_speedup",
    "plot_time_to_target",
    "plot_validation",
]
