"""Field checks of a run record read from disk: a record is user input too.

`read_run_record` checks columns; these check values, so that `validate` and `calibrate` never
compute with a span that ends before it starts, a negative iteration or a time that is not finite.
Each problem is one InputError line naming the file, the row and the field (never a whole row).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .errors import InputError


def _numbers(frame: pd.DataFrame, column: str, path: Path, *, allow_missing: bool = False) -> pd.Series:
    values = pd.to_numeric(frame[column], errors="coerce")
    bad = ~np.isfinite(values.to_numpy(dtype=float, na_value=np.nan))
    if allow_missing:
        bad &= frame[column].notna().to_numpy()
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise InputError(f"{path}: row {row} (data rows counted from 0): field '{column}' is not a finite number; fix or re-write the run record")
    return values


def _non_negative(values: pd.Series, column: str, path: Path) -> None:
    negative = (values < 0).to_numpy()
    if negative.any():
        row = int(np.flatnonzero(negative)[0])
        raise InputError(f"{path}: row {row} (data rows counted from 0): field '{column}' = {values.iloc[row]:g} is negative; fix or re-write the run record")


def check_spans(spans: pd.DataFrame, path: Path) -> None:
    """Every span: finite times, the end not before the start, non-negative rank, stage and iteration."""
    start = _numbers(spans, "start_s", path)
    end = _numbers(spans, "end_s", path)
    backwards = (end < start).to_numpy()
    if backwards.any():
        row = int(np.flatnonzero(backwards)[0])
        raise InputError(
            f"{path}: row {row} (data rows counted from 0): the span ends (end_s = {end.iloc[row]:g}) before it starts (start_s = {start.iloc[row]:g}); "
            "fix or re-write the run record"
        )
    for column in ("rank", "stage", "iteration"):
        _non_negative(_numbers(spans, column, path), column, path)


def check_metrics(metrics: pd.DataFrame, path: Path) -> None:
    """Every metrics row: finite, non-negative step, iteration and wall time."""
    for column in ("step", "iteration", "wall_time_s"):
        _non_negative(_numbers(metrics, column, path), column, path)


def check_record_values(record, directory: Path) -> None:
    """The values of a run record just read from `directory` (see the module docstring)."""
    check_spans(record.spans, directory / "spans.csv")
    check_metrics(record.metrics, directory / "metrics.csv")
