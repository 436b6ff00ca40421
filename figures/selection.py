"""Row selection and small statistics shared by the plot functions."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.errors import InputError

RATE_COLUMN = "failure_probability_per_stage_hour"
SECONDS_PER_HOUR = 3600.0


class NothingToPlot(InputError):
    """The table is valid but holds no rows this figure can draw (e.g. an empty interval study)."""


def require_columns(frame: pd.DataFrame, columns: tuple[str, ...] | list[str], table: str) -> None:
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise InputError(f"{table} table lacks column(s) {', '.join(missing)}; pass the table named in calibration/tables.py")


def require_rows(frame: pd.DataFrame, what: str) -> None:
    if frame.empty:
        raise NothingToPlot(f"no rows to plot for {what}")


def select_scenario(frame: pd.DataFrame, scenario: str | None) -> tuple[pd.DataFrame, str | None]:
    """Rows of `scenario` (default: the first scenario in the table) and the name chosen."""
    if "scenario" not in frame.columns or frame.empty:
        return frame, scenario
    names = list(dict.fromkeys(frame["scenario"].astype(str)))
    if scenario is None:
        scenario = names[0]
    if scenario not in names:
        raise InputError(f"scenario = {scenario!r} is not in the table; use one of {', '.join(names)}")
    return frame[frame["scenario"].astype(str) == scenario], scenario


def select_methods(frame: pd.DataFrame, methods: Sequence[str] | None) -> pd.DataFrame:
    """Rows of `methods` (all rows when None); naming a method the table lacks is an error."""
    if methods is None:
        return frame
    present = set(frame["method"].astype(str))
    missing = [method for method in methods if method not in present]
    if missing:
        raise InputError(f"methods {', '.join(missing)} have no rows in the table; it holds {', '.join(sorted(present))}")
    return frame[frame["method"].astype(str).isin(list(methods))]


def select_failure_probability(frame: pd.DataFrame, probability: float | None) -> tuple[pd.DataFrame, float]:
    """Rows at `probability` (default: the highest rate in the table, where methods differ most).

    Tables of non-hourly churn models carry NaN rates; those rows are kept as they are and NaN returned.
    """
    if RATE_COLUMN not in frame.columns or frame.empty:
        return frame, math.nan
    rates = frame[RATE_COLUMN].astype(float)
    finite = sorted(set(rates[np.isfinite(rates)]))
    if not finite:
        return frame, math.nan
    if probability is None:
        probability = finite[-1]
    matches = np.isclose(rates, probability, rtol=1e-9, atol=1e-12)
    if not matches.any():
        raise InputError(
            f"failure_probability = {probability} is not in the table; use one of {', '.join(f'{r:g}' for r in finite)}"
        )
    return frame[matches], float(probability)


def rate_title_suffix(probability: float) -> str:
    return "" if not math.isfinite(probability) else f" at {100.0 * probability:.3g} %/h per stage"


