"""Where the wall-clock time of each method goes: goodput and the badput categories, stacked, and the
goodput share on a scale of its own (it is often well under 1 % of the wall-clock)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from churnsim.calibration.statistics import mean_with_ci95
from churnsim.calibration.tables import RUN_COLUMNS, TIME_CATEGORIES

from .selection import (
    rate_title_suffix,
    require_columns,
    require_rows,
    select_failure_probability,
    select_methods,
    select_scenario,
    time_unit,
)
from .style import (
    CATEGORY_COLORS,
    CATEGORY_DISPLAY_NAMES,
    STOPPED_AT_CAP_TEXT,
    cap_words,
    is_ablation,
    method_alpha,
    method_label,
    ordered_methods,
    style_axes,
    text_alpha,
)

CAPPED_HATCH = "///"
CAPPED_EDGE_COLOR = "#333333"
ABLATION_GAP = 0.6
"""Extra space between the contenders' bars and the ablations' (which are drawn lighter)."""


def plot_badput_breakdown(
    ax: Axes,
    runs: pd.DataFrame,
    *,
    failure_probability: float | None = None,
    scenario: str | None = None,
    as_fraction: bool = True,
    methods: Sequence[str] | None = None,
    legend: bool = True,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw one stacked bar per method: goodput at the bottom, then each badput category.

    How to read it: the taller the bottom (goodput) segment, the more of the wall-clock went into
    useful training; the other segments name where the rest went (bubble, checkpoint stalls, lost
    work, recovery downtime, degraded mode, convergence setback). The black error bar is the 95 %
    confidence interval of the goodput share over replications. Goodput is often a sliver here:
    `plot_goodput_share` draws it on its own scale. A hatched bar holds runs stopped at the
    wall-clock cap (`target.max_wall_clock_s`, `cap_s`) before the target: its time is the cap's,
    not a finished run's; the hours panel draws the cap as a line. Ablations (trait `ablation`) sit
    apart on the right, lighter.

    Segments are means over replications of each run's share of its wall-clock (`as_fraction=True`,
    bars sum to 1) or of wall-clock time in hours, minutes or seconds (`as_fraction=False`).
    Defaults: first scenario, highest failure rate. `legend=False` leaves the legend to the caller.

    Returns {"bars": one BarContainer per category in `calibration.tables.TIME_CATEGORIES` order, each holding
    one bar per method (so methods × categories bars), "errorbars": [the goodput ErrorbarContainer],
    "capped": the patches of methods with a capped run, "cap": [the cap Line2D] or []}.
    """
    rows, probability, methods, positions = _select(runs, failure_probability, scenario, methods)
    capped = _capped_counts(rows, methods, cap_s)
    seconds_per_unit, unit = time_unit(rows["wall_clock_s"])
    divisor = rows["wall_clock_s"].astype(float) if as_fraction else seconds_per_unit
    shares = {category: rows[category].astype(float) / divisor for category in TIME_CATEGORIES}
    bottom = np.zeros(len(methods))
    bars: list[Artist] = []
    hatched: list[Artist] = []
    goodput_ci = np.zeros((3, len(methods)))
    for category in TIME_CATEGORIES:
        per_method = [mean_with_ci95(shares[category][rows["method"] == method]) for method in methods]
        heights = np.nan_to_num(np.array([mean for mean, _, _ in per_method]))
        container = ax.bar(
            positions, heights, bottom=bottom, width=0.7, color=CATEGORY_COLORS[category], edgecolor="white",
            linewidth=0.5, label=CATEGORY_DISPLAY_NAMES[category], gid=category,
        )  # fmt: skip
        hatched += _mark_bars(container, methods, capped)
        bars.append(container)
        if category == "goodput_s":
            goodput_ci = np.nan_to_num(np.array(per_method).T)
        bottom = bottom + heights
    mean, low, high = goodput_ci
    errorbar = ax.errorbar(
        positions, mean, yerr=[mean - np.maximum(low, 0.0), high - mean], fmt="none", ecolor="black", capsize=3, linewidth=1.0
    )
    cap_line: list[Artist] = []
    if not as_fraction and cap_s is not None and math.isfinite(cap_s) and any(capped.values()):
        cap_line.append(ax.axhline(
            cap_s / seconds_per_unit, color="#333333", linestyle=":", linewidth=1.0, gid="reference:cap",
            label=f"wall-clock cap ({cap_words(cap_s).removeprefix('the ').removesuffix(' cap')})",
        ))  # fmt: skip
        # How many runs the cap stopped, above each bar that holds some.
        for position, method, top in zip(positions, methods, bottom):
            stopped, total = capped[method]
            if stopped:
                ax.annotate(
                    f"{stopped}/{total}\ncapped", (position, top), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=7, color="#333333", alpha=text_alpha(method), gid=f"capped_label:{method}",
                )  # fmt: skip
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.16 * cap_s / seconds_per_unit))
    _method_ticks(ax, positions, methods)
    ax.set_ylabel("share of wall-clock time (fraction)" if as_fraction else f"wall-clock time ({unit})")
    if as_fraction:
        ax.set_ylim(0, 1.0)
    what = "Share of the wall-clock" if as_fraction else f"{unit.capitalize()} of wall-clock"
    ax.set_title(f"{what}{rate_title_suffix(probability, rows)}")
    style_axes(ax)
    ax.grid(False, axis="x")
    if legend:
        # Legend outside the bars, top category first, matching the visual stacking order.
        handles, labels = ax.get_legend_handles_labels()
        categories = [(h, l) for h, l in zip(handles, labels) if l in CATEGORY_DISPLAY_NAMES.values()][::-1]
        others = [(h, l) for h, l in zip(handles, labels) if l not in CATEGORY_DISPLAY_NAMES.values()]
        entries = categories + others + ([capped_key(cap_s)] if hatched else [])
        ax.legend([h for h, _ in entries], [l for _, l in entries], loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return {"bars": bars, "errorbars": [errorbar], "capped": hatched, "cap": cap_line}


def plot_goodput_share(
    ax: Axes,
    runs: pd.DataFrame,
    *,
    failure_probability: float | None = None,
    scenario: str | None = None,
    methods: Sequence[str] | None = None,
    cap_s: float | None = None,
) -> dict[str, list[Artist]]:
    """Draw each method's goodput (compute of the iterations that count) as a percentage of its
    wall-clock, on an axis of its own, with its value above each bar and the 95 % interval over
    replications; hatched as in `plot_badput_breakdown` where runs were stopped at the cap.

    Returns {"bars": [the BarContainer], "labels": the value Texts, "capped": hatched patches}."""
    rows, probability, methods, positions = _select(runs, failure_probability, scenario, methods)
    capped = _capped_counts(rows, methods, cap_s)
    share = 100.0 * rows["goodput_s"].astype(float) / rows["wall_clock_s"].astype(float)
    per_method = np.array([mean_with_ci95(share[rows["method"] == method]) for method in methods]).reshape(-1, 3)
    mean, low, high = np.nan_to_num(per_method).T
    container = ax.bar(positions, mean, width=0.7, color=CATEGORY_COLORS["goodput_s"], edgecolor="white", linewidth=0.5, gid="goodput_s")
    hatched = _mark_bars(container, methods, capped)
    ax.errorbar(positions, mean, yerr=[mean - np.maximum(low, 0.0), high - mean], fmt="none", ecolor="black", capsize=3, linewidth=1.0)
    labels = [
        ax.annotate(
            f"{value:.2g} %", (position, max(value, top)), xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
            fontsize=7.5, alpha=text_alpha(method), gid=f"goodput_label:{method}",
        )  # fmt: skip
        for position, value, top, method in zip(positions, mean, high, methods)
    ]
    ax.set_ylim(0, 1.25 * max(float(np.max(high, initial=0.0)), 1e-9))
    _method_ticks(ax, positions, methods)
    ax.set_ylabel("goodput (% of wall-clock)")
    ax.set_title(f"Goodput: useful compute as a share of the wall-clock{rate_title_suffix(probability, rows)}")
    style_axes(ax)
    ax.grid(False, axis="x")
    return {"bars": [container], "labels": labels, "capped": hatched}


def capped_key(cap_s: float | None) -> tuple[Artist, str]:
    """The legend entry of a hatched bar: runs stopped at the cap."""
    handle = Patch(facecolor="white", edgecolor=CAPPED_EDGE_COLOR, hatch=CAPPED_HATCH, linewidth=0.5)
    return handle, f"{STOPPED_AT_CAP_TEXT}: hatched bars hold runs\nthat {cap_words(cap_s)} ended before the target"


def _select(runs: pd.DataFrame, failure_probability: float | None, scenario: str | None, methods: Sequence[str] | None):
    require_columns(runs, RUN_COLUMNS, "runs")
    rows, _ = select_scenario(runs, scenario)
    rows, probability = select_failure_probability(rows, failure_probability)
    rows = select_methods(rows, methods)
    rows = rows[np.isfinite(rows["wall_clock_s"].astype(float)) & (rows["wall_clock_s"].astype(float) > 0)]
    require_rows(rows, "the badput figure")
    ordered = ordered_methods(rows["method"])
    # Contenders first, then the ablations after a gap.
    ordered = [m for m in ordered if not is_ablation(m)] + [m for m in ordered if is_ablation(m)]
    positions = np.arange(len(ordered), dtype=float) + np.array([ABLATION_GAP if is_ablation(m) else 0.0 for m in ordered])
    return rows, probability, ordered, positions


def _capped_counts(rows: pd.DataFrame, methods: list[str], cap_s: float | None) -> dict[str, tuple[int, int]]:
    """(runs stopped at the cap before the target, runs) per method. Without a known cap every run
    that missed the target counts: the cap is what ends such runs."""
    missed = ~rows["reached_target"].astype(bool)
    if cap_s is not None and math.isfinite(cap_s):
        missed &= rows["wall_clock_s"].astype(float) >= cap_s * (1.0 - 1e-9)
    return {method: (int(missed[rows["method"] == method].sum()), int((rows["method"] == method).sum())) for method in methods}


def _mark_bars(container, methods: list[str], capped: dict[str, tuple[int, int]]) -> list[Artist]:
    """Hatch the bars of methods with capped runs; make ablations' bars translucent."""
    hatched = []
    for patch, method in zip(container.patches, methods):
        patch.set_alpha(method_alpha(method))
        if capped[method][0]:
            patch.set_hatch(CAPPED_HATCH)
            patch.set_edgecolor(CAPPED_EDGE_COLOR)
            hatched.append(patch)
    return hatched


def _method_ticks(ax: Axes, positions: np.ndarray, methods: list[str]) -> None:
    ax.set_xticks(positions, [method_label(method) for method in methods], rotation=30, ha="right", rotation_mode="anchor")
    for tick, method in zip(ax.get_xticklabels(), methods):
        if is_ablation(method):
            tick.set_color("#777777")
