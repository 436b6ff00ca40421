"""Hard-failure recovery costs fitted per component from real runs' recoveries.csv, in a form that
carries to other scenarios.

Under torch.distributed.elastic's agent a worker's death makes the agent restart every local worker:
the survivors read their stage back from node memory, the lost stage is recovered by the method.
A real run's recoveries.csv (real/results.py `RECOVERY_TABLE_COLUMNS`) names each part of one such
recovery; `fit_hard_failure_costs` fits each part on its own:

    detection_s         seconds: from the kill to the agent stopping its workers
    agent_restart_s     seconds: the agents' stop, torch's rendezvous round, the spawn
    process_start_s     core-seconds: a restarted process to ready, less its snapshot reload
                        (interpreter, imports, model build), as it would take with a core to
                        itself: where the run's processes outnumbered the host's cores
                        (`compute.shared_cores`, every process on one host) they started at once
                        and shared the cores, so a measured start is deflated by the processes
                        per core, and inflated again by those of the scenario predicted
    survivor_reload     latency + bytes / bandwidth: the largest survivor's snapshot read back
    rendezvous_s        seconds: the group formed once every process is up
    state_transfer      latency + bytes / bandwidth: the bytes the method's recovery received
                        over the process group

so that the survivors' restart on another scenario is detection + agent restart + process start +
the reload of that scenario's largest stage (`HardFailureCosts.survivor_restart_s`). Bytes of a stage's
snapshot are its parameters times the snapshot bytes per parameter the runs measured (weights,
optimizer moments, the method's own state), so a wider model reloads more.

Fits say how many recoveries they stand on; a line of seconds against bytes is fitted only where the
bytes varied (at least `MINIMUM_SIZES_FOR_BANDWIDTH` sizes), otherwise it is total bytes over total
seconds with no latency (the note says so), as a storage tier's bandwidth is. The composed survivors' restart is
checked against the measured `survivor_restart_s` of every recovery (`survivor_restart_check`).
"""

import json
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from .base import StrictModel
from .compute_cost import processes_per_core
from .scenario import ModelSpec, PipelineSpec, stage_parameter_counts

if TYPE_CHECKING:  # pandas is imported where a fit runs: a simulation that only reads a calibration never needs it
    import pandas as pd

MINIMUM_SIZES_FOR_BANDWIDTH = 3
"""Distinct byte counts a line of seconds against bytes needs before its slope is trusted."""
FEW_POINTS = 3
"""Below this many recoveries a component's median is flagged as resting on few points."""

AGENT_COLUMNS: tuple[str, ...] = (
    "detection_s", "agent_restart_s", "process_start_s", "survivor_reload_s", "survivor_reload_bytes", "survivor_restart_s",
)  # fmt: skip
"""recoveries.csv columns only a recovery under torchrun's agent fills (real/results.py)."""


class FittedSeconds(StrictModel):
    """A component that does not scale with the scenario: its median over the recoveries."""

    median_s: float = Field(ge=0)
    interquartile_range_s: float = Field(0.0, ge=0)
    num_points: int = Field(ge=0)


class FittedTransfer(StrictModel):
    """A component fitted as latency_s + bytes / bandwidth_bytes_per_s."""

    latency_s: float = Field(ge=0)
    bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    """None: nothing to scale by (no time measured)."""
    r_squared: float | None = None
    num_points: int = Field(ge=0)
    note: str = ""

    def seconds_for(self, num_bytes: float) -> float:
        if self.bandwidth_bytes_per_s is None:
            return self.latency_s
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


class FitCheck(StrictModel):
    """How well a composed prediction matches what was measured."""

    r_squared: float | None = None
    """None where the measured values did not vary (or fewer than `FEW_POINTS`)."""
    median_relative_error: float | None = None
    num_points: int = Field(0, ge=0)


class HardFailureCosts(StrictModel):
    """Components of a hard failure's recovery under an agent that restarts every worker (module docstring)."""

    launch: Literal["agent"] = "agent"
    num_recoveries: int = Field(ge=1)
    detection: FittedSeconds
    agent_restart: FittedSeconds
    process_start: FittedSeconds
    """A restarted process from its start to ready, less its snapshot reload, in core-seconds (as
    with a core to itself; `process_start_s` scales it to a scenario's processes per core)."""
    rendezvous: FittedSeconds
    survivor_reload: FittedTransfer
    """Seconds against the bytes of the largest surviving stage's snapshot (survivors reload in parallel)."""
    snapshot_bytes_per_parameter: float = Field(gt=0)
    """Bytes of a stage's snapshot per parameter of the stage, as the runs measured it."""
    state_transfer: FittedTransfer | None = None
    """The method's recovery received over the process group; None where no recovery moved bytes.
    Reported beside the calibration's link: the simulator charges transfers over the scenario's network."""
    survivor_restart_check: FitCheck = FitCheck()
    """detection + agent restart + process start + reload against each recovery's measured
    survivors' restart (from the kill, where detection was measured)."""
    notes: tuple[str, ...] = ()

    def process_start_s(self, pipeline: PipelineSpec | None, shared_cores: int | None) -> float:
        """Seconds a process takes to start when every process of `pipeline` starts at once on a host
        of `shared_cores` cores (None: a core or device each)."""
        if pipeline is None:
            return self.process_start.median_s
        return self.process_start.median_s * max(1.0, processes_per_core(pipeline, shared_cores))

    def replacement_start_s(self, pipeline: PipelineSpec | None = None, shared_cores: int | None = None) -> float:
        """From a kill to the lost stage's new process ready, beyond any join delay: detection, the
        agent's restart and a process start (a replacement has no snapshot to reload)."""
        return self.detection.median_s + self.agent_restart.median_s + self.process_start_s(pipeline, shared_cores)

    def survivor_restart_s(self, model: ModelSpec, pipeline: PipelineSpec, shared_cores: int | None = None) -> float:
        """Seconds from a kill until the survivors are ready again on this model and pipeline."""
        largest = max(stage_parameter_counts(model, pipeline))
        return (
            self.detection.median_s
            + self.agent_restart.median_s
            + self.process_start_s(pipeline, shared_cores)
            + self.survivor_reload.seconds_for(largest * self.snapshot_bytes_per_parameter)
        )


def _failed_stages(text: object) -> list[int]:
    try:
        value = json.loads(str(text))
    except ValueError:
        return []
    return [int(stage) for stage in value] if isinstance(value, list) else []


def agent_recovery_points(
    recoveries: "pd.DataFrame", model: ModelSpec, pipeline: PipelineSpec, shared_cores: int | None = None
) -> "pd.DataFrame":
    """The agent-path rows of one run's recoveries.csv with the bytes of its largest survivor, the
    snapshot bytes per parameter and the processes per core the run's processes started at
    (`shared_cores`: the cores of the one host they shared, None: their own); empty where the run
    did not recover under the agent."""
    import pandas as pd

    if recoveries is None or recoveries.empty or not {"failure_mode", *AGENT_COLUMNS} <= set(recoveries.columns):
        return pd.DataFrame()
    rows = recoveries[(recoveries["failure_mode"] == "hard") & recoveries["survivor_restart_s"].notna()]
    if "degraded" in rows.columns:
        rows = rows[~rows["degraded"].astype(str).str.lower().eq("true")]
    if rows.empty:
        return pd.DataFrame()
    parameters = stage_parameter_counts(model, pipeline)
    out = []
    for row in rows.to_dict("records"):
        failed = set(_failed_stages(row.get("failed_stages")))
        survivors = [parameters[stage] for stage in range(len(parameters)) if stage not in failed]
        reload_bytes = float(row["survivor_reload_bytes"]) if pd.notna(row["survivor_reload_bytes"]) else math.nan
        per_parameter = reload_bytes / sum(survivors) if survivors and reload_bytes > 0 else math.nan
        out.append(
            {
                **{column: float(row[column]) if pd.notna(row.get(column)) else math.nan for column in AGENT_COLUMNS},
                "rendezvous_s": float(row["rendezvous_s"]) if pd.notna(row.get("rendezvous_s")) else math.nan,
                "transfer_s": float(row["transfer_s"]) if pd.notna(row.get("transfer_s")) else math.nan,
                "network_bytes": float(row["network_bytes"]) if pd.notna(row.get("network_bytes")) else math.nan,
                "bytes_per_parameter": per_parameter,
                "largest_survivor_bytes": max(survivors) * per_parameter if survivors else math.nan,
                "processes_per_core": max(1.0, processes_per_core(pipeline, shared_cores)),
            }
        )
    return pd.DataFrame(out)


def _seconds(values: "pd.Series") -> FittedSeconds:
    values = values.dropna()
    values = values[values >= 0]
    if values.empty:
        return FittedSeconds(median_s=0.0, num_points=0)
    quartiles = np.percentile(values, [25, 75])
    return FittedSeconds(median_s=float(np.median(values)), interquartile_range_s=float(quartiles[1] - quartiles[0]), num_points=int(len(values)))


def _r_squared(measured: np.ndarray, predicted: np.ndarray) -> float | None:
    total = float(np.sum((measured - measured.mean()) ** 2))
    if len(measured) < FEW_POINTS or total <= 0:
        return None
    return float(1.0 - np.sum((measured - predicted) ** 2) / total)


def fit_transfer(num_bytes: Iterable[float], seconds: Iterable[float], what: str) -> FittedTransfer | None:
    """latency + bytes / bandwidth by least squares where the bytes took at least
    `MINIMUM_SIZES_FOR_BANDWIDTH` values and time grows with them; else total bytes over total
    seconds with no latency (said in `note`); None without a point that moved bytes."""
    import pandas as pd

    frame = pd.DataFrame({"bytes": list(num_bytes), "seconds": list(seconds)}).dropna()
    frame = frame[(frame["bytes"] > 0) & (frame["seconds"] >= 0)]
    if frame.empty:
        return None
    size, time_s = frame["bytes"].to_numpy(float), frame["seconds"].to_numpy(float)
    if frame["bytes"].nunique() >= MINIMUM_SIZES_FOR_BANDWIDTH:
        slope, intercept = np.polyfit(size, time_s, 1)
        if slope > 0:
            latency_s = max(0.0, float(intercept))
            return FittedTransfer(
                latency_s=latency_s,
                bandwidth_bytes_per_s=float(1.0 / slope),
                r_squared=_r_squared(time_s, latency_s + slope * size),
                num_points=int(len(frame)),
            )
        reason = f"time did not grow with bytes over {frame['bytes'].nunique()} sizes"
    else:
        reason = f"only {frame['bytes'].nunique()} distinct size(s), {MINIMUM_SIZES_FOR_BANDWIDTH} needed"
    if time_s.sum() <= 0:
        return FittedTransfer(latency_s=0.0, num_points=int(len(frame)), note=f"{what}: measured as no time at all")
    # As a storage tier's bandwidth (fit_timing.fit_tier_bandwidth): total bytes over total seconds,
    # no latency separated, so that it still scales with another scenario's bytes.
    return FittedTransfer(
        latency_s=0.0,
        bandwidth_bytes_per_s=float(size.sum() / time_s.sum()),
        num_points=int(len(frame)),
        note=f"{what}: latency not separated from bandwidth ({reason}); fitted as total bytes over total seconds",
    )


def fit_hard_failure_costs(per_run_points: "Sequence[pd.DataFrame]") -> HardFailureCosts | None:
    """The components of `agent_recovery_points` pooled over runs; None where no recovery ran under the agent."""
    import pandas as pd

    frames = [frame for frame in per_run_points if frame is not None and not frame.empty]
    if not frames:
        return None
    table = pd.concat(frames, ignore_index=True)
    notes = []
    if len(table) < FEW_POINTS:
        notes.append(f"only {len(table)} hard-failure recover{'y' if len(table) == 1 else 'ies'} under the agent: medians of few points, no r²")
    reload = fit_transfer(table["largest_survivor_bytes"], table["survivor_reload_s"], "survivors' snapshot reload")
    if reload is None:
        reload = FittedTransfer(latency_s=0.0, num_points=0, note="no survivor reloaded a snapshot")
    per_parameter = table["bytes_per_parameter"].dropna()
    transfer = fit_transfer(table["network_bytes"], table["transfer_s"], "the method's state transfer")
    for fitted in (reload, transfer):
        if fitted is not None and fitted.note:
            notes.append(fitted.note)
    costs = HardFailureCosts(
        num_recoveries=int(len(table)),
        detection=_seconds(table["detection_s"]),
        agent_restart=_seconds(table["agent_restart_s"]),
        process_start=_seconds(
            (table["process_start_s"] - table["survivor_reload_s"].fillna(0.0)) / table.get("processes_per_core", 1.0)
        ),
        rendezvous=_seconds(table["rendezvous_s"]),
        survivor_reload=reload,
        snapshot_bytes_per_parameter=float(np.median(per_parameter)) if not per_parameter.empty else 16.0,
        state_transfer=transfer,
        notes=tuple(notes),
    )
    if per_parameter.empty:
        costs = costs.model_copy(update={"notes": (*costs.notes, "no snapshot bytes recorded: 16 bytes per parameter assumed")})
    return costs.model_copy(update={"survivor_restart_check": _check_survivor_restart(costs, table)})


def _check_survivor_restart(costs: HardFailureCosts, table: "pd.DataFrame") -> FitCheck:
    import pandas as pd

    rows = table.dropna(subset=["survivor_restart_s", "detection_s", "largest_survivor_bytes"])
    if rows.empty:
        return FitCheck()
    # survivor_restart_s is measured from the detection: the check compares from the kill on both sides.
    measured = (rows["survivor_restart_s"] + rows["detection_s"]).to_numpy(float)
    fixed_s = costs.detection.median_s + costs.agent_restart.median_s
    per_core = rows["processes_per_core"] if "processes_per_core" in rows.columns else pd.Series(1.0, index=rows.index)
    predicted = np.array(
        [
            fixed_s + costs.process_start.median_s * processes + costs.survivor_reload.seconds_for(size)
            for size, processes in zip(rows["largest_survivor_bytes"], per_core)
        ]
    )
    relative = np.abs(predicted - measured) / np.where(measured > 0, measured, np.nan)
    return FitCheck(
        r_squared=_r_squared(measured, predicted),
        median_relative_error=float(np.nanmedian(relative)) if np.isfinite(relative).any() else None,
        num_points=int(len(rows)),
    )
