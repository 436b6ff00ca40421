"""A Gantt chart of one pipeline iteration; the same function draws simulated and real spans."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb

from churnsim.calibration.errors import InputError
from churnsim.calibration.tables import GANTT_COLUMNS

from .selection import require_columns, require_rows
from .style import COMMUNICATION_KINDS, SPAN_KIND_COLORS, method_label, ordered_methods, span_kind_color, style_axes

# A row spans stage ± 0.4: compute bars on the upper part, communication in a thin strip under them.
COMPUTE_HEIGHT = 0.62
COMPUTE_CENTRE = -0.09
COMMUNICATION_HEIGHT = 0.16
COMMUNICATION_CENTRE = 0.31
MIN_EDGE_WIDTH_FRACTION = 0.004  # narrower bars get no white separator, which would hide them
MIN_LABEL_WIDTH_FRACTION = 0.025  # a bar narrower than this share of the iteration gets no microbatch number
MIN_VISIBLE_WIDTH_FRACTION = 0.005
"""Compute spans narrower than this share of the iteration are drawn this wide (a WAN iteration's
compute is a hairline against its communication); the legend says so when it happens."""


def plot_pipeline_gantt(
    ax: Axes,
    spans: pd.DataFrame,
    *,
    iteration: int | None = None,
    method: str | None = None,
    label_microbatches: bool = True,
) -> dict[str, list[Artist]]:
    """Draw one pipeline iteration: a row per stage, a bar per span coloured by its kind.

    How to read it: time runs left to right from the iteration's first span; white gaps in a row
    are the pipeline bubble (the stage waits), numbers inside bars are microbatches, and thin grey
    bars under a row are its sends and receives.

    `spans` has the columns `stage, kind, microbatch, start_s, end_s` (`calibration.tables.GANTT_COLUMNS`;
    extra columns are ignored except these): `iteration` — the iteration drawn is `iteration`
    (default: the last one in the table); `method` — rows of `method` (default: the first method);
    `rank` — with data parallelism only the lowest rank of each stage is drawn.

    Returns {"bars": one BarContainer per span kind (one Rectangle per span, each with gid = kind),
    "labels": the microbatch Text artists}.
    """
    require_columns(spans, GANTT_COLUMNS, "spans")
    rows, method = _select(spans, iteration=iteration, method=method)
    require_rows(rows, "the Gantt chart")

    origin_s = float(rows["start_s"].min())
    length_s = float(rows["end_s"].max()) - origin_s
    # Milliseconds when the iteration is short, so tick labels stay readable.
    unit, scale = ("ms", 1e3) if length_s < 2.0 else ("s", 1.0)
    start = (rows["start_s"].to_numpy(dtype=float) - origin_s) * scale
    width = (rows["end_s"].to_numpy(dtype=float) - rows["start_s"].to_numpy(dtype=float)) * scale
    stage = rows["stage"].to_numpy(dtype=int)
    kinds = rows["kind"].astype(str).to_numpy()
    microbatch = pd.to_numeric(rows["microbatch"], errors="coerce").to_numpy(dtype=float)

    known = [kind for kind in SPAN_KIND_COLORS if kind in set(kinds)]
    others = sorted(set(kinds) - set(SPAN_KIND_COLORS))
    bars: list[Artist] = []
    labels: list[Artist] = []
    total_width = max(length_s * scale, 1e-12)
    widened = False
    right = total_width
    for kind in known + others:
        chosen = kinds == kind
        communication = kind in COMMUNICATION_KINDS
        height = COMMUNICATION_HEIGHT if communication else COMPUTE_HEIGHT
        # Rows grow downwards (y inverted), so a positive centre is under the row's middle.
        centre = COMMUNICATION_CENTRE if communication else COMPUTE_CENTRE
        colour = span_kind_color(kind, others)
        drawn_width = width[chosen] if communication else np.maximum(width[chosen], MIN_VISIBLE_WIDTH_FRACTION * total_width)
        widened |= bool(np.any(drawn_width > width[chosen]))
        right = max(right, float(np.max(start[chosen] + drawn_width, initial=0.0)))
        wide = width[chosen] >= MIN_EDGE_WIDTH_FRACTION * total_width
        container = ax.barh(
            stage[chosen] + centre,
            drawn_width,
            left=start[chosen],
            height=height,
            color=colour,
            edgecolor=np.where(wide, "white", colour).tolist(),
            linewidth=0.5,
            label=kind.replace("_", " "),
            gid=kind,
        )
        bars.append(container)
        if not label_microbatches or communication:
            continue
        for left, span_width, row, number in zip(start[chosen], width[chosen], stage[chosen], microbatch[chosen]):
            if np.isfinite(number) and number >= 0 and span_width >= MIN_LABEL_WIDTH_FRACTION * total_width:
                labels.append(
                    ax.text(left + span_width / 2, row + COMPUTE_CENTRE, f"{int(number)}", ha="center", va="center", fontsize=7, color=_ink_on(colour))
                )

    stages = sorted(set(stage.tolist()))
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.5, min(stages) - 0.5)  # stage 0 on top
    ax.set_xlim(0, right)
    ax.set_xlabel(f"time since the iteration's first span ({unit})")
    ax.set_ylabel("pipeline stage")
    title = "One pipeline iteration"
    if method is not None:
        title += f": {method_label(method)}"
    ax.set_title(title)
    style_axes(ax)
    ax.grid(False, axis="y")
    minimum = f"{MIN_VISIBLE_WIDTH_FRACTION * total_width:.3g} {unit}"
    ax.legend(
        loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
        title=f"compute spans shorter\nthan {minimum} are\ndrawn {minimum} wide" if widened else None, title_fontsize=8,
    )  # fmt: skip
    return {"bars": bars, "labels": labels}


def _ink_on(colour: str) -> str:
    """Black numbers on a light bar, white on a dark one (relative luminance, WCAG's weights)."""
    red, green, blue = (channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4 for channel in to_rgb(colour))
    return "black" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.3 else "white"


def gantt_methods(spans: pd.DataFrame) -> list[str | None]:
    """The methods a spans table holds, in the fixed method order ([None] without a method column)."""
    if "method" not in spans.columns or spans.empty:
        return [None]
    return ordered_methods(spans["method"].astype(str))


def _select(spans: pd.DataFrame, *, iteration: int | None, method: str | None) -> tuple[pd.DataFrame, str | None]:
    rows = spans
    if "method" in rows.columns and not rows.empty:
        methods = ordered_methods(rows["method"].astype(str))
        method = methods[0] if method is None else method
        if method not in methods:
            raise InputError(f"method = {method!r} has no spans; use one of {', '.join(methods)}")
        rows = rows[rows["method"].astype(str) == method]
    present = sorted(set(pd.to_numeric(rows["iteration"], errors="coerce").dropna().astype(int))) if "iteration" in rows else []
    if present:
        chosen = present[-1] if iteration is None else iteration
        if chosen not in present:
            raise InputError(f"iteration = {iteration} has no spans; the table holds iterations {present[0]}–{present[-1]}")
        rows = rows[pd.to_numeric(rows["iteration"], errors="coerce") == chosen]
    if "rank" in rows.columns and not rows.empty:
        lowest_rank = rows.groupby("stage")["rank"].transform("min")
        rows = rows[rows["rank"] == lowest_rank]
    return rows, method
