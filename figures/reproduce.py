"""Figures of `churnsim reproduce`: the paper's published numbers (markers) against churnsim's (lines).

Inputs are the tables `churnsim reproduce` writes beside its report (end_to_end.csv and
dp_scaling.csv for DataStates-LLM, speedups.csv for CheckFree); each function takes the table as a
DataFrame and returns a `matplotlib.figure.Figure` rendered by Agg (pyplot is never imported).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from churnsim.calibration.tables import read_table

from .style import FIGURE_DPI, FIGURE_RC, method_color, method_label, method_marker, percent, shared_legend_below, style_axes

ENGINE_METHODS = {"DeepSpeed": "checkpoint", "DataStates-LLM": "async_checkpoint"}
LAYOUT_STYLES = {"separate_node": "-", "edge_stages": (0, (5, 3))}
LAYOUT_WORDS = {"separate_node": "separate embedding node", "edge_stages": "embedding on edge stages"}


def plot_end_to_end(table: pd.DataFrame) -> Figure:
    """End-to-end time of 50 iterations against the checkpoint interval, per model (Figs. 11–12 of DataStates-LLM)."""
    models = list(dict.fromkeys(table["model"]))
    figure = Figure(figsize=(5.2 * len(models), 4.6), layout="constrained")
    axes = figure.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        rows = table[table["model"] == model]
        for engine, method in ENGINE_METHODS.items():
            engine_rows = rows[rows["engine"] == engine].sort_values("interval_iterations")
            color = method_color(method)
            ax.plot(engine_rows["interval_iterations"], engine_rows["churnsim_end_to_end_s"], color=color, linestyle="-",
                    label=f"{engine}: churnsim")
            ax.plot(engine_rows["interval_iterations"], engine_rows["paper_end_to_end_s"], color=color, linestyle="none",
                    marker=method_marker(method), markersize=7, markerfacecolor="white", label=f"{engine}: paper")
        ax.set_title(f"{model}: 50 iterations, a checkpoint every f")
        ax.set_xlabel("checkpoint interval f (iterations)")
        ax.set_ylabel("end-to-end time (s)")
        ax.set_xticks(sorted(rows["interval_iterations"].unique()))
        ax.set_ylim(bottom=0)
        style_axes(ax)
    shared_legend_below(figure, axes)
    return figure


def plot_dp_scaling(table: pd.DataFrame) -> Figure:
    """30B checkpoint throughput against the data-parallel degree (Figs. 9–10 of DataStates-LLM)."""
    figure = Figure(figsize=(7.6, 4.8), layout="constrained")
    ax = figure.add_subplot()
    unbounded = []
    for engine, method in ENGINE_METHODS.items():
        rows = table[table["engine"] == engine].sort_values("data_parallel_degree")
        color = method_color(method)
        ax.plot(rows["data_parallel_degree"], rows["paper_throughput_GB_per_s"], color=color, linestyle="none",
                marker=method_marker(method), markersize=7, markerfacecolor="white", label=f"{engine}: paper")
        finite = rows[np.isfinite(rows["churnsim_throughput_GB_per_s"])]
        if len(finite):
            ax.plot(finite["data_parallel_degree"], finite["churnsim_throughput_GB_per_s"], color=color, label=f"{engine}: churnsim")
        if len(finite) < len(rows):
            unbounded.append(engine)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(table["data_parallel_degree"].unique()), [str(d) for d in sorted(table["data_parallel_degree"].unique())])
    ax.set_xlabel("data-parallel degree (30B, 32 GPUs per replica)")
    ax.set_ylabel("checkpoint throughput (GB/s, size / blocked time)")
    ax.set_title("30B: checkpoint throughput as replicas are added")
    if unbounded:
        ax.text(0.02, 0.98, f"churnsim {', '.join(unbounded)}: unbounded (never blocks)", transform=ax.transAxes,
                va="top", ha="left", fontsize=8.5)
    style_axes(ax)
    shared_legend_below(figure, [ax])
    return figure


def plot_checkfree_speedups(table: pd.DataFrame) -> Figure:
    """CheckFree and CheckFree+ speed-ups over checkpointing and redundant computation, by failure rate,
    per model, with the paper's claims as reference lines."""
    models = list(dict.fromkeys(table["model"]))
    baselines = (("checkpoint", "checkpointing", (1.12, 1.6)), ("redundant", "redundant computation", (1.12, 1.2)))
    figure = Figure(figsize=(4.4 * len(models), 7.6), layout="constrained")
    axes = figure.subplots(len(baselines), len(models), squeeze=False)
    for row, (baseline, words, claims) in enumerate(baselines):
        for column, model in enumerate(models):
            ax = axes[row][column]
            rows = table[table["model"] == model]
            for (method, layout), group in rows.groupby(["method", "layout"], sort=False):
                group = group.sort_values("failure_probability_per_stage_hour")
                values = group[f"speedup_vs_{baseline}"].to_numpy(dtype=float)
                if not np.isfinite(values).any():
                    continue
                ax.plot(100 * group["failure_probability_per_stage_hour"], values, color=method_color(method),
                        marker=method_marker(method), linestyle=LAYOUT_STYLES.get(layout, ":"),
                        label=f"{method_label(method)}, {LAYOUT_WORDS.get(layout, layout)}")
            plotted = rows[np.isfinite(rows[f"speedup_vs_{baseline}"].to_numpy(dtype=float))]
            missing = "\n(missing points: a method did not reach the target in time)" if len(plotted) < len(rows) else ""
            ax.axhline(1.0, color="black", linewidth=0.8)
            for level, style in zip(claims, ("--", ":")):
                ax.axhline(level, color="#555555", linewidth=0.9, linestyle=style, label=f"paper: {level:g}×" if level != 1.12 else "paper: > 1.12× at 5–10 %/h")
            ax.set_title(f"{model.upper()}: over {words}{missing}", fontsize=FIGURE_RC["axes.titlesize"] if not missing else 9.5)
            ax.set_xlabel("failure probability per stage-hour (%)")
            ax.set_ylabel(f"speed-up over {baseline}")
            rates = sorted(rows["failure_probability_per_stage_hour"].unique())
            ax.set_xticks([100 * r for r in rates], [percent(r) for r in rates])
            style_axes(ax)
    shared_legend_below(figure, [ax for row in axes for ax in row], handlelength=4, ncols=3)  # dashes visible
    return figure


FIGURES = {
    "datastates": (
        ("end_to_end", plot_end_to_end, ("model", "interval_iterations", "engine", "paper_end_to_end_s", "churnsim_end_to_end_s")),
        ("dp_scaling", plot_dp_scaling, ("data_parallel_degree", "engine", "paper_throughput_GB_per_s", "churnsim_throughput_GB_per_s")),
    ),
    "checkfree": (
        ("speedups", plot_checkfree_speedups,
         ("model", "layout", "method", "failure_probability_per_stage_hour", "speedup_vs_checkpoint", "speedup_vs_redundant")),
    ),
}
"""Per paper: (table stem, figure function, columns it needs); saved as figures/reproduce_<stem>.png."""


def make_reproduce_figures(paper: str, directory: str | Path) -> list[Path]:
    """Draw the figures of a `churnsim reproduce PAPER` directory into its figures/ folder."""
    directory = Path(directory)
    written = []
    for stem, build, columns in FIGURES[paper]:
        path = directory / f"{stem}.csv"
        if not path.is_file():
            continue
        table = read_table(path, columns)
        if table.empty:
            continue
        with matplotlib.rc_context(FIGURE_RC):
            figure = build(table)
            target = directory / "figures" / f"reproduce_{stem}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(target, dpi=FIGURE_DPI)
        written.append(target)
    return written


__all__ = ["FIGURES", "make_reproduce_figures", "plot_checkfree_speedups", "plot_dp_scaling", "plot_end_to_end"]
