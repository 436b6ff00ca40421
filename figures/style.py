"""One look for every figure: a fixed colour, marker and display name per method, and readable defaults.

Contenders take the Okabe–Ito palette (Okabe & Ito, "Color Universal Design", 2008), chosen so
that no two sit close under deuteranopia or protanopia (the test simulates both); ablations take
three of Paul Tol's colours and are drawn thin and translucent, so that the contenders stand out.
Markers differ too, so a figure still reads in grayscale. A method keeps its colour and marker in
every figure, whichever subset of methods a table holds. Display names, line styles and which
methods are ablations come from the methods' traits (calibration/methods.py); a method without a
palette entry gets a spare look.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from churnsim.calibration.methods import METHOD_CONFIGS, METHOD_NAMES, MethodConfigBase
from churnsim.calibration.tables import COMMUNICATION_SPAN_KINDS

FIGURE_DPI = 150

METHOD_COLORS: dict[str, str] = {
    "none": "#000000",
    "checkpoint": "#E69F00",  # orange
    "async_checkpoint": "#56B4E9",  # sky blue
    "redundant": "#009E73",  # bluish green
    "checkfree": "#0072B2",  # blue
    "checkfree_plus": "#CC79A7",  # reddish purple: not beside the orange, as vermilion would be
    "copy": "#999933",  # Tol's olive
    "uniform": "#332288",  # Tol's indigo
    "random": "#882255",  # Tol's wine
}

# Up and down triangles are kept for bounds (BOUND_MARKERS), so no method has one.
METHOD_MARKERS: dict[str, str] = {
    "none": ".",
    "checkpoint": "s",
    "async_checkpoint": "D",
    "redundant": "h",
    "checkfree": "o",
    "checkfree_plus": "P",
    "copy": "p",
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
    "replica_heal_s": "#80B1D3",
    "survivor_restart_s": "#BC80BD",
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
    "replica_heal_s": "replica heal",
    "survivor_restart_s": "survivors' restart",
}

# Span kinds of sim/ (sim.iteration.SPAN_KINDS) and of real runs' spans.csv: compute kinds in Paul
# Tol's bright scheme (apart under deuteranopia and protanopia), communication in greys.
SPAN_KIND_COLORS: dict[str, str] = {
    "forward": "#4477AA",
    "backward": "#CCBB44",
    "redundant_forward": "#66CCEE",
    "allreduce": "#228833",
    "optimizer": "#AA3377",
    "checkpoint": "#EE6677",
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


def is_reference(method: str) -> bool:
    """The no-failure run (trait family 'reference'): a bound to read the others against."""
    traits = _traits(method)
    return traits is not None and traits.family == "reference"


def split_ablations(methods) -> tuple[list[str], list[str]]:
    """(contenders, ablations) in the fixed order; the reference run goes with the contenders, and
    with the ablations too (for scale) when there are any."""
    ordered = ordered_methods(methods)
    ablations = [method for method in ordered if is_ablation(method)]
    contenders = [method for method in ordered if not is_ablation(method)]
    if ablations:
        ablations = [method for method in contenders if is_reference(method)] + ablations
    return contenders, ablations


def is_ablation(method: str) -> bool:
    traits = _traits(method)
    return traits is not None and traits.ablation


ABLATION_ALPHA = 0.45
"""Opacity of an ablation's lines, markers and bars: present for the curious, quiet beside the contenders."""
ABLATION_TEXT_ALPHA = 0.8
"""Opacity of an ablation's labels: lighter than a contender's, still readable."""
ABLATION_LINEWIDTH = 1.0
BAND_ALPHA = 0.2
ABLATION_BAND_ALPHA = 0.06


def method_alpha(method: str) -> float:
    return ABLATION_ALPHA if is_ablation(method) else 1.0


def text_alpha(method: str) -> float:
    return ABLATION_TEXT_ALPHA if is_ablation(method) else 1.0


def band_alpha(method: str) -> float:
    """Opacity of a method's 95 % band (an ablation's barely shows, so it does not cover a contender's)."""
    return ABLATION_BAND_ALPHA if is_ablation(method) else BAND_ALPHA


def method_style(method: str) -> dict[str, object]:
    """Keyword arguments for `Axes.plot` that give `method` its fixed look and legend label; an
    ablation's (trait `ablation`) is thin and translucent and sits under the contenders."""
    style: dict[str, object] = dict(
        color=method_color(method),
        marker=method_marker(method),
        linestyle=method_linestyle(method),
        label=method_label(method),
        gid=method,
    )
    if is_ablation(method):
        style |= dict(alpha=ABLATION_ALPHA, linewidth=ABLATION_LINEWIDTH, markersize=4.0, zorder=1.5)
    return style


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


def add_not_reached_key(ax: Axes, words: str | None = None) -> None:
    """One legend entry for every × of `mark_not_reached` (their colour names the method)."""
    ax.plot([], [], linestyle="none", marker="x", markersize=8, markeredgewidth=2.0, color="#444444", label=f"× {words or NOT_REACHED_TEXT}")


def cap_words(cap_s: float | None) -> str:
    """'the 720 h cap' for a wall-clock cap (`target.max_wall_clock_s`), or 'the wall-clock cap' when unknown."""
    if cap_s is None or not math.isfinite(cap_s):
        return "the wall-clock cap"
    if cap_s >= 2 * 3600.0:
        return f"the {cap_s / 3600.0:.0f} h cap"
    if cap_s >= 120.0:
        return f"the {cap_s / 60.0:.0f} min cap"
    return f"the {cap_s:.0f} s cap"


STOPPED_AT_CAP_TEXT = "stopped at cap"
"""The legend's words for a run that the wall-clock cap ended before it reached the target."""

BOUND_MARKERS = {"at_least": "^", "at_most": "v"}
"""Open triangles pointing the way the truth lies from a bound: up for 'at least', down for 'at most'."""


def add_bound_key(ax: Axes, direction: str, cap_s: float | None) -> None:
    """One legend entry for every bound triangle of `draw_bound`."""
    words = "at least" if direction == "at_least" else "at most"
    ax.plot(
        [], [], linestyle="none", marker=BOUND_MARKERS[direction], markersize=7, markerfacecolor="none",
        markeredgecolor="#444444", markeredgewidth=1.4, label=f"{words}: some runs {STOPPED_AT_CAP_TEXT}\n({cap_words(cap_s)}) before the target",
    )  # fmt: skip


# Label placement ------------------------------------------------------------------------------

LABEL_PAD_PX = 2.0


class LabelPlacer(Artist):
    """Keeps the annotations it is given apart: at every draw, after the layout is final and before
    the labels are drawn (its zorder is just under theirs), it measures them with the renderer and
    moves each label vertically, lowest first, until its box overlaps neither a label placed
    before it nor a horizontal reference line (`reference_lines`), within the axes. Labels start
    from their own offsets at every draw, so saving twice places them the same way."""

    def __init__(self, ax: Axes, labels: list, reference_lines: list | None = None, markers: list | None = None):
        super().__init__()
        self.axes_of_labels = ax
        self.labels = list(labels)
        self.reference_lines = list(reference_lines or [])
        self.markers = list(markers or [])
        self.home = [label.xyann for label in self.labels]
        for label in self.labels:
            label.set_in_layout(False)  # the layout must not depend on where they end up
        self.set_zorder(min((label.get_zorder() for label in self.labels), default=3.0) - 0.01)
        self.set_in_layout(False)

    def add_label(self, label) -> None:
        label.set_in_layout(False)
        self.labels.append(label)
        self.home.append(label.xyann)

    def draw(self, renderer) -> None:
        for label, home in zip(self.labels, self.home):
            label.xyann = home
        frame = self.axes_of_labels.get_window_extent(renderer)
        points_per_pixel = 1.0 / renderer.points_to_pixels(1.0)
        obstacles = [(line_y, x0, x1) for line_y, x0, x1 in self._reference_rows(renderer)]
        placed: list = self._marker_boxes(renderer)
        visible = [label for label in self.labels if label.get_visible() and label.get_text()]
        for label in sorted(visible, key=lambda text: _text_box(text, renderer).y0):
            box = _text_box(label, renderer)
            shift = _free_shift(box, placed, obstacles, frame)
            if shift:
                dx, dy = label.xyann
                label.xyann = (dx, dy + shift * points_per_pixel)
                box = _text_box(label, renderer)
            placed.append(box)
        self.stale = False

    def _marker_boxes(self, renderer) -> list:
        """A box around every marker of `markers` (Line2D), which labels keep clear of too."""
        boxes = []
        for line in self.markers:
            half = renderer.points_to_pixels(line.get_markersize()) / 2.0
            for x, y in line.get_transform().transform(np.column_stack([line.get_xdata(), line.get_ydata()])):
                if np.isfinite(x) and np.isfinite(y):
                    boxes.append(Bbox([[x - half, y - half], [x + half, y + half]]))
        return boxes

    def _reference_rows(self, renderer) -> list[tuple[float, float, float]]:
        """(y, x0, x1) in display pixels of every horizontal reference line."""
        rows = []
        for line in self.reference_lines:
            if not line.get_visible():
                continue
            path = line.get_transform().transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
            if len(path) and np.ptp(path[:, 1]) < 0.5:
                rows.append((float(path[0, 1]), float(path[:, 0].min()), float(path[:, 0].max())))
        return rows


def _text_box(label, renderer):
    """The box of a label's words (an Annotation's own extent also spans its leader line)."""
    if hasattr(label, "update_positions"):
        label.update_positions(renderer)  # where its offset puts it now
    return Text.get_window_extent(label, renderer)


def _blocks(box, y0: float, placed: list, obstacles: list) -> float | None:
    """The top of whatever the box moved to bottom `y0` would overlap, else None."""
    y1 = y0 + box.height
    for other in placed:
        if other.x0 < box.x1 and box.x0 < other.x1 and other.y0 < y1 + LABEL_PAD_PX and y0 - LABEL_PAD_PX < other.y1:
            return other.y1 + LABEL_PAD_PX
    for line_y, x0, x1 in obstacles:
        if x0 < box.x1 and box.x0 < x1 and y0 - LABEL_PAD_PX < line_y < y1 + LABEL_PAD_PX:
            return line_y + LABEL_PAD_PX
    return None


def _blocks_below(box, y1: float, placed: list, obstacles: list) -> float | None:
    """The bottom of whatever the box moved to top `y1` would overlap, else None."""
    y0 = y1 - box.height
    for other in placed:
        if other.x0 < box.x1 and box.x0 < other.x1 and other.y0 < y1 + LABEL_PAD_PX and y0 - LABEL_PAD_PX < other.y1:
            return other.y0 - LABEL_PAD_PX
    for line_y, x0, x1 in obstacles:
        if x0 < box.x1 and box.x0 < x1 and y0 - LABEL_PAD_PX < line_y < y1 + LABEL_PAD_PX:
            return line_y - LABEL_PAD_PX
    return None


def _free_shift(box, placed: list, obstacles: list, frame) -> float:
    """The smallest vertical move (pixels) to a place free of `placed` boxes and `obstacles`, up or
    down, whichever is shorter and stays inside the axes (up when neither does)."""
    y0 = box.y0
    for _ in range(len(placed) + len(obstacles) + 1):
        top = _blocks(box, y0, placed, obstacles)
        if top is None:
            break
        y0 = top
    up = y0 - box.y0
    y1 = box.y1
    for _ in range(len(placed) + len(obstacles) + 1):
        bottom = _blocks_below(box, y1, placed, obstacles)
        if bottom is None:
            break
        y1 = bottom
    down = y1 - box.y1
    up_fits = box.y1 + up <= frame.y1
    down_fits = box.y0 + down >= frame.y0
    if up_fits and (not down_fits or up <= -down):
        return up
    return down if down_fits else up


def place_labels(ax: Axes, labels: list, reference_lines: list | None = None, markers: list | None = None) -> LabelPlacer | None:
    """Keep `labels` (annotations with offsets in points) apart from each other, off the horizontal
    `reference_lines` and clear of the points of `markers` at every draw (`LabelPlacer`). Returns
    the placer, or None without labels."""
    if not labels:
        return None
    placer = LabelPlacer(ax, labels, reference_lines, markers)
    ax.add_artist(placer)
    return placer


LABEL_BACKGROUND = dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.75)
"""Behind a data label, so that a line passing under it does not strike it through."""
