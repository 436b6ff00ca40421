"""The calibration file: what short real runs measured on one machine, as simulator parameters.

JSON, validated like every contract file. Durations are medians with a spread (the interquartile
range) and the number of samples behind them, so a reader can judge how much to trust them.
"""

from typing import ClassVar, Literal

from pydantic import Field

from .base import SCHEMA_VERSION, FiniteNumbersModel, StrictModel, load_model, save_model
from .compute_cost import ComputeCostModel
from .convergence import ConvergenceSpec
from .hard_failure_costs import HardFailureCosts
from .scenario import ModelSpec, PipelineSpec


class MeasuredDuration(StrictModel):
    median_s: float = Field(ge=0)
    interquartile_range_s: float = Field(0.0, ge=0)
    num_samples: int = Field(ge=0)


class StageTimings(StrictModel):
    stage: int = Field(ge=0)
    block_forward: MeasuredDuration
    """Forward of the stage's blocks (plus embedding/head parts on edge stages) per microbatch."""
    block_backward: MeasuredDuration


class LinkProfile(StrictModel):
    """Point-to-point time against bytes, fitted as latency + bytes / bandwidth."""

    latency_s: float = Field(ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)
    r_squared: float | None = None
    num_points: int = Field(0, ge=0)


class TierBandwidth(StrictModel):
    name: str
    write_bandwidth_bytes_per_s: float = Field(gt=0)
    read_bandwidth_bytes_per_s: float = Field(gt=0)


class RecoveryTimes(StrictModel):
    """Median seconds of each recovery part for one method and failure mode (0 where the method has no
    such part), from the run records' recovery spans (calibration.fit_timing.recovery_events)."""

    join_s: float = Field(0.0, ge=0)
    """`recovery.join`: soft failures, the failed stage's state reset in place; hard failures, from the
    launcher seeing the death to the replacement process ready (the configured join delay, the
    process start, the model build)."""
    process_start_s: float = Field(0.0, ge=0)
    """Hard failures: the join less the run's configured join delay (the process start and model
    build), where the run record says its delay; 0 for soft failures and in older calibrations."""
    rendezvous_s: float = Field(0.0, ge=0)
    """`recovery.rendezvous`: hard failures, the barrier and process-group formation once the
    replacement is up; 0 for soft failures and in older calibrations (which counted it in
    `unrecorded_s`)."""
    transfer_s: float = Field(0.0, ge=0)
    load_s: float = Field(0.0, ge=0)
    rebuild_s: float = Field(0.0, ge=0)
    unrecorded_s: float = Field(0.0, ge=0)
    """What a recovery step took beyond a steady step and the parts above: the processes' own
    restart, which no span records (calibration.fit_timing.recovery_events). The simulator charges
    it as the method's restart (`RecoverySpec.restart_s_by_method`). Calibrations made before it
    was fitted have none (0)."""
    num_samples: int = Field(0, ge=0)

    @property
    def total_s(self) -> float:
        return self.join_s + self.rendezvous_s + self.transfer_s + self.load_s + self.rebuild_s + self.unrecorded_s


class SpeedReference(StrictModel):
    """The machine's speed on a fixed probe workload (real/speed_probe.py) when the calibration was
    made: `churnsim validate` on the same machine runs the probe again, and the ratio of the two says
    how much faster or slower the machine runs now, apart from how well the model predicts."""

    workload: str = Field(min_length=1)
    """Names the probe's workload and version; a probe of another workload is not compared with it."""
    probe_s: float = Field(gt=0)
    """Median seconds of one pass of the workload over `num_repeats` passes."""
    interquartile_range_s: float = Field(0.0, ge=0)
    num_repeats: int = Field(ge=1)
    device: Literal["cpu", "cuda"] = "cpu"
    measured_utc: str
    """When the probe ran: at calibration, or at the last `churnsim calibrate --refresh-speed-reference`."""


class Provenance(StrictModel):
    hardware: dict[str, str]
    package_versions: dict[str, str]
    created_utc: str
    git_revision: str = "unknown"
    command: str = ""
    fit_run_ids: tuple[str, ...] = ()
    """Run records the parameters were fitted on (never the ones validated against)."""


class Calibration(FiniteNumbersModel):
    how_to_fix: ClassVar[str] = "re-run churnsim calibrate or fix the value"
    durations_are_measured: ClassVar[bool] = True

    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = Field(min_length=1)
    device: Literal["cpu", "cuda"] = "cpu"
    provenance: Provenance
    model: ModelSpec
    pipeline: PipelineSpec
    stage_timings: tuple[StageTimings, ...] = Field(min_length=1)
    """Of the calibrated model and pipeline; in core-seconds when `compute_model.shared_cores` is set
    (the processes shared the machine's cores, calibration.cpu_sharing), else wall seconds."""
    optimizer_step: MeasuredDuration
    iteration_overhead_s: float = Field(0.0, ge=0)
    """Per-iteration time outside forward, backward and optimizer (loss gathering, bookkeeping) of the
    calibrated model and pipeline."""
    method_iteration_extra_s: dict[str, float] = Field(default_factory=dict)
    """Per method whose healthy iteration is not the plain route (redundant forwards, CheckFree+ swaps,
    lazy snapshot copies): its median steady step minus the plain methods' median steady step, measured,
    both divided by their runs' speed factors in wall seconds (calibration.fit_timing.fit_method_iteration_extra_s)."""
    method_model_extra_s: dict[str, float] = Field(default_factory=dict)
    """Per method in `method_iteration_extra_s`, the extra the simulator's iteration model itself gives
    it on the calibrated setup, from compute alone: on another setup the measured extra is scaled by
    the model's extra there over this (sim.model.method_extras.with_measured_method_extra). Empty in
    calibrations made before it existed, whose extras are then carried unscaled."""
    compute_model: ComputeCostModel | None = None
    """Compute of other models and pipelines of this machine (calibration.compute_cost); None in
    calibrations made before it existed, which describe only their own model and pipeline."""
    run_speed_factors: dict[str, float] = Field(default_factory=dict)
    """Per calibrated-setup run id, how fast the machine ran it against all of them pooled (1.1: its
    forward and backward hops took 10 % longer, in core-seconds; calibration.fit_timing.run_speed_factors).
    The overhead is fitted at the typical speed (the methods' extras at the typical wall-second speed);
    the spread says how much the machine's speed moved while calibrating. Empty in calibrations made before it existed."""
    machine_step_s: float | None = Field(None, gt=0)
    """The machine's speed while calibrating: the median steady step of the calibrated setup's
    no-failure runs, against which a later run's own no-failure step tells how loaded it was."""
    checkpoint_write_latency_s: float = Field(0.0, ge=0)
    """Fixed time of one stage's checkpoint write beyond bytes / bandwidth (serialisation, checksums,
    fsync, rename), from the synchronous checkpoint runs' save spans."""
    evaluation: MeasuredDuration | None = None
    """One held-out evaluation (the slowest rank's); the simulator has no evaluations, the validator adds them."""
    warmup_extra_s: float = Field(0.0, ge=0)
    """Extra time of a run's first warm-up steps over steady ones (allocator and cache warm-up)."""
    activation_bytes: float = Field(gt=0)
    link: LinkProfile
    storage: tuple[TierBandwidth, ...] = ()
    recovery: dict[str, RecoveryTimes] = Field(default_factory=dict)
    """Per method, its recovery parts under soft failures (the stage re-initialised in its own
    process). Calibrations made before `hard_failure_recovery` pooled every run's here."""
    hard_failure_recovery: dict[str, RecoveryTimes] = Field(default_factory=dict)
    """Per method, its recovery parts under hard failures (the process killed, a replacement started,
    a rendezvous): what a run of `training.failure_mode = "hard"` is charged (calibration.apply).
    Empty where no calibration run had hard failures."""
    hard_failure_costs: HardFailureCosts | None = None
    """Hard failures under an agent that restarts every worker: detection, the agent's restart,
    process start, rendezvous, the survivors' snapshot reload and the method's state transfer, each
    fitted from the runs' recoveries.csv in a form that carries to other scenarios
    (calibration.hard_failure_costs); what sets a hard-failure scenario's
    `recovery.survivor_restart_s`. None where no calibration run recovered under the agent, and in
    calibrations made before it existed (which then charge no survivors' restart, as they did)."""
    allreduce: LinkProfile | None = None
    """Data parallelism: the gradient all-reduce's link, fitted from data-parallel runs' `allreduce`
    spans as the simulator's ring all-reduce (2(D-1) latencies + 2(D-1)/D of the bytes over the
    bandwidth); what `network.allreduce_*` of a D > 1 scenario gets. None where no calibration run
    had D > 1 (older calibrations too)."""
    replica_heal: LinkProfile | None = None
    """Data parallelism: a replica heal's copy (seconds against the stage state's bytes, from the
    `recovery.heal` spans), fitted as latency + bytes / bandwidth. Kept beside `allreduce` to show
    how far the simulator's heal, charged over the all-reduce link, is from the measured one. None
    where no calibration run healed a replica."""
    convergence: ConvergenceSpec
    speed_reference: SpeedReference | None = None
    """The machine's speed on the probe workload at calibration time (`SpeedReference`); None in
    calibrations made before the probe existed, in built-in ones and where it was not measured."""



def load_calibration(path: str) -> Calibration:
    return load_model(Calibration, path)


def save_calibration(calibration: Calibration, path: str) -> None:
    save_model(calibration, path)
