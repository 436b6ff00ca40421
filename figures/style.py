"""One look for every figure: a fixed colour, marker and display name per method, and readable defaults.

Colours are the Okabe–Ito palette (distinguishable with the common colour-vision deficiencies); the
markers differ too, so a figure still reads in grayscale. A method keeps its colour and marker in
every figure, whichever subset of methods a table holds. Display names and line styles come from
the methods' traits (calibration/methods.py); a method without a palette entry gets a spare look.
"""

from __future__ import annotations

from matplotlib.axes import Axes

from churnsim.calibration.methods import METHOD_CONFIGS, METHOD_NAMES, MethodConfigBase
from churnsim.calibration.tables import COMMUNICATION_SPAN_KINDS

FIGURE_DPI = 150

METHOD_COLORS: dict[str, str] = {
    "none": "#000000",
    "checkpoint": "#E69F00",
    "async_checkpoint": "#56B4E9",
    "redundant": "#009E73",
    "checkfree": "#0072B2",
    "checkfree_plus": "#D55E00",
    "copy": "#CC79A7",
    "uniform": "#7F7F7F",
    "random": "#8C564B",
}

METHOD_MARKERS: dict[str, str] = {
    "none": ".",
    "checkpoint": "s",
    "async_checkpoint": "D",
    "redundant": "^",
    "checkfree": "o",
    "checkfree_plus": "P",
    "copy": "v",
    "uniform": "<",
    "random": "X",
}

UNKNOWN_COLOR = "#BBBBBB"
UNKNOWN_MARKER = "x"

# ColorBrewer Set2: muted, so category bars are not mistaken for method colours.
CATEGORY_COLORS: dict[str, str] = {
    "goodput_s": "#66C2A5",
    "bubble_s": "#B3B3B3",
    "communication_s": "#D9D9D9",
    "method_overhead_s": "#8DA0CB",
    "checkpoint_stall_s": "#FC8D62",
    "lost_work_s": "#E78AC3",
    "recovery_downtime_s": "#A6D854",
    "degraded_slowdown_s": "#FFD92F",
    "convergence_setback_s": "#E5C494",
}

CATEGORY_DISPLAY_NAMES: dict[str, str] = {
    "goodput_s": "goodput",
    "bubble_s": "pipeline bubble",
    "communication_s": "communication wait",
    "method_overhead_s": "method overhead",
    "checkpoint_stall_s": "checkpoint stall",
    "lost_work_s": "lost work",
    "recovery_downtime_s": "recovery downtime",
    "degraded_slowdown_s": "degraded-mode slowdown",
    "convergence_setback_s": "convergence setback",
}

# Span kinds of sim/ (sim.iteration.SPAN_KINDS) and of real runs' spans.csv.
SPAN_KIND_COLORS: dict[str, str] = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "redundant_forward": "#8172B3",
    "allreduce": "#55A868",
    "optimizer": "#C44E52",
    "checkpoint": "#937860",
    "send": "#6F6F6F",
    "receive": "#A0A0A0",
    "send_wait": "#D0D0D0",
    "step_sync": "#E4E4E4",
}
# Communication spans overlap compute on the same stage, so they are drawn as thin bars under it.
COMMUNICATION_KINDS: frozenset[str] = COMMUNICATION_SPAN_KINDS
_EXTRA_KIND_COLORS = ("#DA8BC3", "#CCB974", "#64B5CD", "#8C8C8C")

# Readable defaults for the figure-making entry points (used in a matplotlib.rc_context, never set globally).
FIGURE_RC: dict[str, object] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8.5,
    "legend.framealpha": 0.85,
    "lines.linewidth": 1.8,
    "lines.markersize": 5.5,
    "savefig.dpi": FIGURE_DPI,
}


def method_color(method: str) -> str:
    return METHOD_COLORS.get(method, UNKNOWN_COLOR)


def method_marker(method: str) -> str:
    return METHOD_MARKERS.get(method, UNKNOWN_MARKER)


def _traits(method: str) -> type[MethodConfigBase] | None:
    # Saved results may name a method this installation does not register: it is drawn, not refused.
    return METHOD_CONFIGS.get(method)


def method_linestyle(method: str) -> str:
    # The no-failure reference is dotted so that it reads as a bound, not a competitor.
    traits = _traits(method)
    return ":" if traits is not None and traits.family == "reference" else "-"


def method_label(method: str) -> str:
    traits = _traits(method)
    return traits.label if traits is not None else method


def is_ablation(method: str) -> bool:
    traits = _traits(method)
    return traits is not None and traits.ablation


def method_style(method: str) -> dict[str, object]:
    """Keyword arguments for `Axes.plot` that give `method` its fixed look and legend label."""
    return dict(
        color=method_color(method),
        marker=method_marker(method),
        linestyle=method_linestyle(method),
        label=method_label(method),
        gid=method,
    )


def ordered_methods(methods) -> list[str]:
    """Unique methods in METHOD_NAMES order (legend order is the same in every figure); unknown names last."""
    unique = {str(method) for method in methods}
    known = [name for name in METHOD_NAMES if name in unique]
    return known + sorted(unique - set(METHOD_NAMES))


def span_kind_color(kind: str, other_kinds_seen: list[str] | None = None) -> str:
    """Fixed colour of a span kind; kinds not listed get a spare colour by order of appearance."""
    if kind in SPAN_KIND_COLORS:
        return SPAN_KIND_COLORS[kind]
    position = other_kinds_seen.index(kind) if other_kinds_seen and kind in other_kinds_seen else 0
    return _EXTRA_KIND_COLORS[position % len(_EXTRA_KIND_COLORS)]


def style_axes(ax: Axes) -> None:
    """Light grid behind the data and no top/right frame: the shared look of every panel."""
    ax.grid(True, which="major", alpha=0.3, linewidth=0.6)
    ax.set_axisbelow(True)
    ax.spines["top"].set_visible(False)
    ax.spines["right"].set_visible(False)


def percent(probability: float) -> str:
    """0.1 → '10 %'; trims needless decimals."""
    return f"{100.0 * probability:.3g} %"


def legend_outside(ax: Axes, **keywords) -> None:
    """The legend to the right of the axes, top-aligned, so it never covers data (constrained layout
    makes room for it)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **keywords)


def shared_legend_below(figure, axes, **legend_options) -> None:
    """One legend under all `axes` for the entries they draw (each label once, in drawing order);
    `legend_options` go to matplotlib (e.g. a longer `handlelength` so dashed lines read as dashed)."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    # Methods in their fixed order whichever panel drew them first; other entries after them.
    order = {name: index for index, name in enumerate(METHOD_NAMES)}
    entries = dict(sorted(entries.items(), key=lambda item: order.get(str(item[1].get_gid()), len(order))))
    if entries:
        # About 2 inches an entry, so that a one-panel figure's legend is not cut off at its sides.
        columns = min(len(entries), 5, max(2, int(figure.get_figwidth() // 2.0)))
        options = {"ncols": columns, **legend_options}
        figure.legend(list(entries.values()), list(entries), loc="outside lower center", **options)


NOT_REACHED_TEXT = "did not reach target"


NOT_REACHED_ROW_HEIGHT = 0.055
"""Axes fraction per row of × marks in the strip `make_room_for_not_reached` adds above the data."""


def mark_not_reached(ax: Axes, x_values, method: str, *, row: int = 0) -> list:
    """An × in the method's colour near the top of the axes above each of `x_values` (data units):
    the method did not reach the target there. `row` stacks the marks of several methods downwards;
    call `make_room_for_not_reached` once all data is drawn so the marks sit above it."""
    if len(x_values) == 0:
        return []
    transform = ax.get_xaxis_transform()  # x in data, y in axes fraction
    y = 1.0 - NOT_REACHED_ROW_HEIGHT * (row + 0.5)
    (marks,) = ax.plot(
        list(x_values), [y] * len(x_values), transform=transform, linestyle="none", marker="x", markersize=8,
        markeredgewidth=2.0, color=method_color(method), gid=f"not_reached:{method}", clip_on=False, label="_not_reached",
    )  # fmt: skip
    return [marks]


def make_room_for_not_reached(ax: Axes, rows: int) -> None:
    """Raise the top of the y axis so that `rows` rows of × marks fit above every data point."""
    low, high = ax.get_ylim()
    strip = NOT_REACHED_ROW_HEIGHT * rows + 0.03
    # No value ticks in the strip (the × are not values) and a rule under it.
    ticks = [tick for tick in ax.get_yticks() if low <= tick <= high]
    ax.set_ylim(low, high + (high - low) * strip / (1.0 - strip))
    ax.set_yticks(ticks)
    ax.axhline(high, color="#BBBBBB", linewidth=0.8, linestyle="-", zorder=0.5, gid="not_reached_rule")


def add_not_reached_key(ax: Axes) -> None:
    """One legend entry for every × of `mark_not_reached` (their colour names the method)."""
    ax.plot([], [], linestyle="none", marker="x", markersize=8, markeredgewidth=2.0, color="#444444", label=f"× {NOT_REACHED_TEXT}")
