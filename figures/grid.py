"""A sweep's grid points in a result table: one figure per point instead of only the first.

A sweep writes one column per swept field (a dotted scenario path such as
`pipeline.num_microbatches`) beside the columns `calibration/tables.py` names; every other column
is known. The failure rate is every figure's x axis, so a swept rate
(`churn.failure_probability_per_stage_hour`, or another churn model's such as
`churn.failures_per_node_hour`: `selection.rate_axis`) does not split figures: its points share one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pandas as pd

from churnsim.calibration.churn import RATE_FIELD_OF_KIND

from .selection import SWEPT_RATE_COLUMNS

RATE_SETTING = RATE_FIELD_OF_KIND["stage_hourly"].setting
RATE_SETTINGS = frozenset({RATE_SETTING, *SWEPT_RATE_COLUMNS})


@dataclass(frozen=True, kw_only=True)
class GridPoint:
    directory: str | None
    """Sub-directory of the figures for this point; None when the table holds a single point."""
    title: str | None
    """What the figure's title says about the point; None for a single point."""
    rows: pd.DataFrame


def grid_columns(frame: pd.DataFrame, known_columns: tuple[str, ...]) -> list[str]:
    """Swept fields of `frame`: its columns that the table's schema does not name, the rates aside."""
    return [column for column in frame.columns if column not in known_columns and column not in RATE_SETTINGS]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "point"


def grid_points(frame: pd.DataFrame, known_columns: tuple[str, ...]) -> list[GridPoint]:
    """The table split by grid point, each part's `scenario` column set to one name so that the plot
    functions (which draw one scenario) draw all of its failure rates."""
    if "scenario" not in frame.columns or frame.empty:
        return [GridPoint(directory=None, title=None, rows=frame)]
    swept = grid_columns(frame, known_columns)
    if swept:
        groups = [
            (", ".join(f"{column} = {value}" for column, value in zip(swept, key if isinstance(key, tuple) else (key,))), rows)
            for key, rows in frame.groupby(swept, sort=False, dropna=False)
        ]
    elif RATE_SETTINGS & set(frame.columns):
        groups = [("", frame)]  # only the rate was swept: one figure with every rate on its x axis
    else:
        groups = [(str(name), rows) for name, rows in frame.groupby("scenario", sort=False)]
    if len(groups) == 1:
        if frame["scenario"].nunique() == 1:
            return [GridPoint(directory=None, title=None, rows=frame)]
        name = str(frame["scenario"].iloc[0]).split("[", 1)[0]
        return [GridPoint(directory=None, title=None, rows=frame.assign(scenario=name))]
    base = str(frame["scenario"].iloc[0]).split("[", 1)[0]
    return [
        GridPoint(directory=_slug(label.replace(" = ", "=")), title=f"{base}: {label}" if swept else label, rows=rows.assign(scenario=label))
        for label, rows in groups
    ]
