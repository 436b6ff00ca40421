"""Work of a span in core-seconds, when a run's stage processes shared fewer CPU cores than they were.

A local CPU run starts one single-threaded process per stage; with more processes computing than
there are cores, each computes at a fraction of a core, so a span's wall time overstates its work.
The simulator models the sharing itself (sim.iteration, `shared_cores`), so it needs the work:
under fair processor sharing a span that is open while n compute spans of its run are open
progresses at min(1, cores / n) core-seconds per second, and its work is the integral of that rate
over the span.

Approximation: only recorded compute spans count as busy; the processes' Python work between spans
(bookkeeping, the send/receive calls) also takes CPU but is not seen here, so n is a lower bound
and the work an upper bound when that work is large.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

COMPUTE_SPAN_KINDS: frozenset[str] = frozenset({"forward", "backward", "optimizer", "eval", "redundant_forward"})
"""Span kinds during which a stage process computes (the others wait on a peer or on storage)."""


def core_seconds(starts_s: np.ndarray, ends_s: np.ndarray, cores: int) -> np.ndarray:
    """Core-seconds of each interval [start, end) among all of them sharing `cores` fairly."""
    starts_s = np.asarray(starts_s, dtype=float)
    ends_s = np.asarray(ends_s, dtype=float)
    if starts_s.size == 0:
        return np.zeros(0)
    boundaries = np.unique(np.concatenate([starts_s, ends_s]))
    # Open intervals on each elementary piece [boundaries[k], boundaries[k+1]).
    opened = np.searchsorted(np.sort(starts_s), boundaries, side="right")
    closed = np.searchsorted(np.sort(ends_s), boundaries, side="right")
    num_open = (opened - closed)[:-1]
    rate = np.minimum(1.0, cores / np.maximum(num_open, 1))
    cumulative = np.concatenate([[0.0], np.cumsum(rate * np.diff(boundaries))])
    return cumulative[np.searchsorted(boundaries, ends_s)] - cumulative[np.searchsorted(boundaries, starts_s)]


def with_core_seconds(spans: pd.DataFrame, cores: int | None) -> pd.DataFrame:
    """`spans` of one run with a `work_s` column: core-seconds for compute spans when `cores` is
    given, otherwise (and for every other span) the wall duration."""
    result = spans.copy()
    result["work_s"] = result["end_s"] - result["start_s"]
    if cores is None:
        return result
    computing = result["kind"].isin(COMPUTE_SPAN_KINDS).to_numpy()
    if computing.any():
        chosen = result.loc[computing]
        result.loc[computing, "work_s"] = core_seconds(chosen["start_s"].to_numpy(), chosen["end_s"].to_numpy(), cores)
    return result


def cores_of_hardware(hardware: dict[str, str], device: str) -> int | None:
    """The cores a local CPU run's processes shared (`cpu_count` of a run record's hardware); None
    for CUDA runs or when the record does not say."""
    if device != "cpu":
        return None
    try:
        cores = int(hardware.get("cpu_count", ""))
    except ValueError:
        return None
    return cores if cores >= 1 else None
