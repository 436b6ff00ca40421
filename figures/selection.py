"""Row selection and small statistics shared by the plot functions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.churn import RATE_FIELD_OF_KIND, RateField, rate_field_of_setting
from churnsim.calibration.errors import InputError

RATE_COLUMN = "failure_probability_per_stage_hour"
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class RateAxis:
    """A failure rate the figures put on their x axis: a table column, the factor from its values to
    the axis's, the axis label and how a title names one value."""

    column: str
    scale: float
    label: str
    title_format: str

    def title_suffix(self, value: float) -> str:
        return "" if not math.isfinite(value) else self.title_format.format(self.scale * value)


def _axis(rate: RateField, column: str) -> RateAxis:
    return RateAxis(column, rate.display_scale, rate.axis_label, " at " + rate.phrase)


HOURLY_RATE_AXIS = _axis(RATE_FIELD_OF_KIND["stage_hourly"], RATE_COLUMN)
SWEPT_RATE_AXES = tuple(_axis(rate, rate.setting) for kind, rate in RATE_FIELD_OF_KIND.items() if kind != "stage_hourly")
"""Rates of other churn models (`calibration.churn.RATE_FIELD_OF_KIND`), when a sweep or a what-if
under the scenario's own churn varied them (`churnsim sweep --set churn.failures_per_node_hour=0,120,240`)."""
SWEPT_RATE_COLUMNS = frozenset(axis.column for axis in SWEPT_RATE_AXES)


def rate_axis(frame: pd.DataFrame) -> RateAxis:
    """The table's failure rate: the hourly probability per stage where it has one (the paper's
    churn, `whatif`), else a swept rate of another churn model, else the hourly one (all NaN)."""
    for axis in (HOURLY_RATE_AXIS, *SWEPT_RATE_AXES):
        if axis.column in frame.columns and np.isfinite(frame[axis.column].astype(float)).any():
            return axis
    return HOURLY_RATE_AXIS


def time_unit(seconds: pd.Series | np.ndarray) -> tuple[float, str]:
    """The unit wall-clock times read best in, as (seconds per unit, name): hours from 2 h up, minutes
    from 2 min, else seconds (a calibrated tiny model reaches its target in seconds)."""
    values = np.abs(np.asarray(seconds, dtype=float))
    largest = float(values[np.isfinite(values)].max()) if np.isfinite(values).any() else 0.0
    if largest >= 2 * SECONDS_PER_HOUR:
        return SECONDS_PER_HOUR, "hours"
    if largest >= 120.0:
        return 60.0, "minutes"
    return 1.0, "seconds"


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
    """Rows at failure rate `probability` (default: the highest rate in the table, where methods
    differ most), in the table's own rate (`rate_axis`: the hourly probability, or a swept rate of
    another churn model). A table of another churn model without a swept rate carries NaN rates:
    its rows are kept as they are and NaN returned. `rate_title_suffix(rows, value)` names it."""
    column = rate_axis(frame).column
    if column not in frame.columns or frame.empty:
        return frame, math.nan
    rates = frame[column].astype(float)
    finite = sorted(set(rates[np.isfinite(rates)]))
    if not finite:
        return frame, math.nan
    if probability is None:
        probability = finite[-1]
    matches = np.isclose(rates, probability, rtol=1e-9, atol=1e-12)
    if not matches.any():
        raise InputError(
            f"failure_probability = {probability} is not in the table's {column}; use one of {', '.join(f'{r:g}' for r in finite)}"
        )
    return frame[matches], float(probability)


def setting_title_suffix(rate_setting: str | None, value: float) -> str:
    """' at …' for `value` of a scenario's rate field (`churn.failures_per_node_hour`, ...; None or
    an unknown field: the per-stage hourly probability), or '' for NaN."""
    rate = (rate_field_of_setting(rate_setting) if rate_setting else None) or RATE_FIELD_OF_KIND["stage_hourly"]
    return f" at {rate.words(value)}" if math.isfinite(value) else ""


def rate_title_suffix(probability: float, rows: pd.DataFrame | None = None) -> str:
    """How a title names a failure rate, e.g. " at 33 %/h per stage" (in `rows`' own rate when given)."""
    axis = HOURLY_RATE_AXIS if rows is None else rate_axis(rows)
    return axis.title_suffix(probability)


