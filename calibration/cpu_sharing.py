"""Work of a span in core-seconds, when a run's stage processes shared fewer CPU cores than they were.

A local CPU run starts one single-threaded process per stage; with more processes computing than
there are cores, each computes at a fraction of a core, so a span's wall time overstates its work.
The simulator models the sharing itself (sim.iteration, `shared_cores`), so it needs the work:
under fair processor sharing a span that is open while n processes of its run use a core
progresses at min(1, cores / n) core-seconds per second, and its work is the integral of that rate
over the span.

A process counts as using a core from its first span to its last except while it waits (a
receive, a send's completion, a replacement's join): its Python work between operations competes
for the cores too. That work is measured per step (`work_outside_spans`) and spread over the
stage's hops by the fit, so that the simulator, which shares cores among hops only, charges it.
Approximation: the scheduler is taken as fair, and a wait inside a compute span (none is recorded)
would count as busy.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .tables import STEP_SYNC_SPAN

COMPUTE_SPAN_KINDS: frozenset[str] = frozenset({"forward", "backward", "optimizer", "eval", "redundant_forward"})
"""Span kinds during which a stage process computes."""
WAITING_SPAN_KINDS: frozenset[str] = frozenset({"receive", "send_wait", STEP_SYNC_SPAN, "recovery.join"})
"""Span kinds during which a stage process is blocked (a message, a send's completion, the step
boundary's all-reduce, a replacement); outside these and between its first and last span a process is taken to use a core."""


def _merged(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(zip(starts.tolist(), ends.tolist())):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def busy_process_changes(spans: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(times, +1/−1 changes) of the number of processes using a core: a rank from its first span's
    start to its last span's end, except while it is in a waiting span."""
    times: list[float] = []
    changes: list[int] = []
    for _, rows in spans.groupby("rank", sort=False):
        times += [float(rows["start_s"].min()), float(rows["end_s"].max())]
        changes += [1, -1]
        waiting = rows[rows["kind"].isin(WAITING_SPAN_KINDS)]
        for start, end in _merged(waiting["start_s"].to_numpy(dtype=float), waiting["end_s"].to_numpy(dtype=float)):
            times += [start, end]
            changes += [-1, 1]
    return np.asarray(times, dtype=float), np.asarray(changes, dtype=int)


def core_seconds(starts_s: np.ndarray, ends_s: np.ndarray, cores: int, busy: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Core-seconds of each interval [start, end) on `cores` shared fairly: by the intervals
    themselves, or by the processes `busy` says use a core (`busy_process_changes`)."""
    starts_s = np.asarray(starts_s, dtype=float)
    ends_s = np.asarray(ends_s, dtype=float)
    if starts_s.size == 0:
        return np.zeros(0)
    if busy is None:
        busy = (np.concatenate([starts_s, ends_s]), np.concatenate([np.ones(starts_s.size, int), -np.ones(ends_s.size, int)]))
    change_times, changes = busy
    boundaries = np.unique(np.concatenate([starts_s, ends_s, change_times]))
    order = np.argsort(change_times, kind="stable")
    cumulative_changes = np.cumsum(changes[order])
    # Processes busy on each elementary piece [boundaries[k], boundaries[k+1]): every change at or before its start.
    index = np.searchsorted(change_times[order], boundaries, side="right") - 1
    num_busy = np.where(index >= 0, cumulative_changes[np.maximum(index, 0)], 0)[:-1]
    rate = np.minimum(1.0, cores / np.maximum(num_busy, 1))
    cumulative = np.concatenate([[0.0], np.cumsum(rate * np.diff(boundaries))])
    return cumulative[np.searchsorted(boundaries, ends_s)] - cumulative[np.searchsorted(boundaries, starts_s)]


def with_core_seconds(spans: pd.DataFrame, cores: int | None) -> pd.DataFrame:
    """`spans` of one run with a `work_s` column: for compute spans, when `cores` is given, their
    work in core-seconds among the processes using a core at the time (`busy_process_changes`);
    otherwise, and for every other span, the wall duration."""
    result = spans.copy()
    result["work_s"] = result["end_s"] - result["start_s"]
    if cores is None or result.empty:
        return result
    computing = result["kind"].isin(COMPUTE_SPAN_KINDS).to_numpy()
    if computing.any():
        chosen = result.loc[computing]
        result.loc[computing, "work_s"] = core_seconds(
            chosen["start_s"].to_numpy(), chosen["end_s"].to_numpy(), cores, busy_process_changes(result)
        )
    return result


def work_outside_spans(spans: pd.DataFrame, cores: int) -> pd.DataFrame:
    """Per (rank, iteration): the core-seconds a process used outside its compute and waiting spans
    (Python between operations, sends, bookkeeping), from the start of its first span of the
    iteration to the start of its next iteration; columns rank, iteration, work_s."""
    busy = busy_process_changes(spans)
    rows = []
    for rank, of_rank in spans.groupby("rank", sort=False):
        # A step lasts until the rank's next step begins: the work between steps (the batch, metrics) is its.
        first_start = of_rank.groupby("iteration")["start_s"].min().sort_index()
        step_end = dict(zip(first_start.index[:-1], first_start.to_numpy()[1:]))
        for iteration, group in of_rank.groupby("iteration", sort=False):
            rows.append(_outside_work_of_step(rank, iteration, group, step_end.get(iteration), cores, busy))
    return pd.DataFrame(rows, columns=["rank", "iteration", "work_s"])


def _outside_work_of_step(rank, iteration, group: pd.DataFrame, next_start_s: float | None, cores: int, busy) -> dict:
    start = float(group["start_s"].min())
    end = max(float(group["end_s"].max()), next_start_s if next_start_s is not None else -np.inf)
    total = float(core_seconds(np.array([start]), np.array([end]), cores, busy)[0])
    inside = group[group["kind"].isin(COMPUTE_SPAN_KINDS | WAITING_SPAN_KINDS)]
    # Waiting spans use no core; compute spans' work is counted as theirs.
    covered = core_seconds(inside["start_s"].to_numpy(dtype=float), inside["end_s"].to_numpy(dtype=float), cores, busy).sum()
    return dict(rank=rank, iteration=iteration, work_s=max(total - float(covered), 0.0))


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
