"""Build a calibration file from real run records: timing (fit_timing.py) + convergence (fit_convergence.py).

`build_calibration` is what `churnsim calibrate` calls once the real runs and the link/storage
micro-benchmarks are done. The records must be real runs; those with failures share one model and pipeline (the calibrated
setup), no-failure runs of other setups measure how compute scales (calibration.compute_cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pandas as pd

from .apply import calibrated_setup_compute
from .calibration_file import Calibration, Provenance, TierBandwidth
from .convergence import ConvergenceSpec
from .errors import InputError
from .hard_failure_costs import agent_recovery_points, fit_hard_failure_costs
from .fit_convergence import (
    DEFAULT_WINDOW_ITERATIONS,
    SetbackSample,
    equivalent_progress,
    estimate_setbacks,
    fit_baseline_curve,
    is_no_failure_run,
    setback_samples_of_run,
    summarize_setbacks,
)
from .fit_timing import (
    DEFAULT_WARMUP_ITERATIONS,
    MethodExtraPredictor,
    Predictor,
    fit_checkpoint_write_latency_s,
    fit_evaluation,
    data_parallel_degree_of,
    fit_allreduce,
    fit_compute_cost_model,
    fit_link_profile,
    fit_replica_heal,
    fit_method_iteration_extra_s,
    fit_optimizer_step,
    fit_recovery_times,
    fit_stage_timings,
    fit_tier_bandwidth,
    fit_warmup_extra_s,
    machine_step_s,
    measured_duration,
    record_setup_key,
    run_speed_factors,
    shared_cores_of,
)
from .scenario import ExplicitCompute
from .run_record import RealRunSettings, RunRecord, provenance_fields, record_failure_mode


def _calibrated_setup(records: Sequence[RunRecord]) -> tuple[RealRunSettings, list[RunRecord], list[RunRecord]]:
    """The calibrated setup (model and pipeline) and its records, and the other setups' records.

    The calibrated setup is that of the runs with failures (they must share one), or of the first
    record. Records of other setups ("shape" runs) must be no-failure runs: they only measure how
    compute scales (the compute cost model), never convergence.
    """
    if not records:
        raise InputError("no run records given; pass the real run records to fit the calibration on")
    for record in records:
        if record.manifest.real_settings is None:
            raise InputError(
                f"run record {record.manifest.run_id!r}: manifest.json field 'real_settings' is missing; "
                "calibrate from real runs (churnsim real run), not simulated ones"
            )
    with_failures = [record for record in records if not is_no_failure_run(record)]
    reference = with_failures[0] if with_failures else records[0]
    key = record_setup_key(reference)
    calibrated = [record for record in records if record_setup_key(record) == key]
    others = [record for record in records if record_setup_key(record) != key]
    for record in others:
        if not is_no_failure_run(record):
            raise InputError(
                f"run record {record.manifest.run_id!r}: its model or pipeline differs from run {reference.manifest.run_id!r} "
                "and it has failures; runs with failures must share one model and pipeline (other setups may only be no-failure runs)"
            )
    return reference.manifest.real_settings, calibrated, others  # type: ignore[return-value]


def _convergence_source(name: str, baseline_runs: Sequence[str], samples: Sequence[SetbackSample]) -> str:
    measured = sorted({(s.method, s.position) for s in samples})
    counts = {key: sum(1 for s in samples if (s.method, s.position) == key) for key in measured}
    measured_text = ", ".join(f"{method}/{position} n={counts[(method, position)]}" for method, position in measured) or "none"
    return (
        f"calibration {name!r}: baseline fitted on runs {', '.join(baseline_runs)}; setbacks measured for {measured_text} "
        "against same-seed no-failure runs; other methods/positions keep the uncalibrated defaults (num_samples=0)"
    )


def build_calibration(
    name: str,
    fit_records: Sequence[RunRecord],
    *,
    link_points: pd.DataFrame,
    tier_bandwidths: Sequence[TierBandwidth] = (),
    device: Literal["cpu", "cuda"] = "cpu",
    command: str = "",
    predict_iteration_s: Predictor,
    predict_method_extra_s: MethodExtraPredictor | None = None,
    num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
    window_iterations: int = DEFAULT_WINDOW_ITERATIONS,
    settle_iterations: int = 0,
) -> Calibration:
    """Fit every part of a calibration and record where it came from.

    `link_points` has columns bytes, seconds (point-to-point transfers); `predict_iteration_s` is
    the simulator's iteration model (see fit_timing.fit_iteration_overhead_s), and
    `predict_method_extra_s`, when given, its extra for a method (`Calibration.method_model_extra_s`).
    """
    all_records = fit_records
    # Data-parallel runs beside D = 1 ones (the suite's data-parallel shape) measure only the
    # all-reduce and the heal; the rest of the calibration is fitted on the D = 1 runs.
    data_parallel_records = [record for record in all_records if data_parallel_degree_of(record) > 1]
    if len(data_parallel_records) < len(all_records):
        fit_records = [record for record in all_records if data_parallel_degree_of(record) == 1]
    settings, fit_records, shape_records = _calibrated_setup(fit_records)
    # Runs with hard failures snapshot every step and restart their processes on every failure: they
    # measure the hard-failure recovery (and setbacks), while the steady timings come from the others.
    steady_records = [record for record in fit_records if is_no_failure_run(record) or record_failure_mode(record) != "hard"]
    timing_records = steady_records or list(fit_records)
    stage_timings = fit_stage_timings(timing_records, num_warmup_iterations=num_warmup_iterations, as_core_seconds=True)
    if len(stage_timings) != settings.pipeline.num_stages:
        raise InputError(
            f"spans cover {len(stage_timings)} stages but real_settings.pipeline.num_stages is {settings.pipeline.num_stages}"
        )
    optimizer_step = fit_optimizer_step(timing_records, num_warmup_iterations=num_warmup_iterations, as_core_seconds=True)
    shared_cores = shared_cores_of(timing_records[0])
    measured_compute = ExplicitCompute(
        block_forward_s=tuple(timing.block_forward.median_s for timing in stage_timings),
        block_backward_s=tuple(timing.block_backward.median_s for timing in stage_timings),
        optimizer_step_s=optimizer_step.median_s,
        shared_cores=shared_cores,
    )
    speed_factors = run_speed_factors(timing_records, num_warmup_iterations=num_warmup_iterations)
    compute_model, overhead_s = fit_compute_cost_model(
        [*timing_records, *shape_records],
        predict_iteration_s,
        calibrated_key=record_setup_key(timing_records[0]),
        calibrated_compute=measured_compute,
        num_warmup_iterations=num_warmup_iterations,
        speed_factors=speed_factors,
    )
    baseline_records = [record for record in fit_records if is_no_failure_run(record)]
    if not baseline_records:
        raise InputError(
            f"none of the runs {[r.manifest.run_id for r in fit_records]} is a no-failure run; "
            "add a reference run with method 'none' (or without failures) to fit the baseline curve"
        )
    curve = fit_baseline_curve([record.metrics for record in baseline_records])
    setbacks, samples = estimate_setbacks(
        fit_records, baseline_records, curve, window_iterations=window_iterations, settle_iterations=settle_iterations
    )
    model = settings.model
    largest_stage_parameters = model.num_layers // settings.pipeline.num_stages * model.parameters_per_layer + max(
        model.embedding_parameters, model.head_parameters
    )
    disk = next((tier for tier in tier_bandwidths if tier.name == "local_disk"), tier_bandwidths[0] if tier_bandwidths else None)
    checkpoint_write_latency_s = fit_checkpoint_write_latency_s(
        timing_records,
        largest_stage_parameters * model.checkpoint_bytes_per_parameter,
        disk.write_bandwidth_bytes_per_s if disk is not None else None,
    )
    activation_bytes = model.boundary_activation_bytes(settings.pipeline.microbatch_size)
    provenance = provenance_fields()
    # The hardware the runs were measured on, when they say; otherwise this machine's.
    provenance["hardware"] = dict(fit_records[0].manifest.hardware) or provenance["hardware"]
    calibration = Calibration(
        name=name,
        device=device,
        provenance=Provenance(
            **provenance,
            command=command,
            fit_run_ids=tuple(record.manifest.run_id for record in all_records),
        ),
        model=settings.model,
        pipeline=settings.pipeline,
        stage_timings=stage_timings,
        optimizer_step=optimizer_step,
        iteration_overhead_s=overhead_s,
        method_iteration_extra_s=fit_method_iteration_extra_s(timing_records, num_warmup_iterations=num_warmup_iterations),
        run_speed_factors=speed_factors,
        compute_model=compute_model,
        machine_step_s=machine_step_s(baseline_records, num_warmup_iterations=num_warmup_iterations),
        checkpoint_write_latency_s=checkpoint_write_latency_s,
        evaluation=fit_evaluation(timing_records),
        warmup_extra_s=fit_warmup_extra_s(timing_records, num_warmup_iterations=num_warmup_iterations),
        activation_bytes=activation_bytes,
        link=fit_link_profile(link_points),
        storage=tuple(tier_bandwidths),
        recovery=fit_recovery_times(fit_records, failure_mode="soft"),
        hard_failure_recovery=fit_recovery_times(fit_records, failure_mode="hard"),
        hard_failure_costs=fit_hard_failure_costs(
            [
                agent_recovery_points(
                    record.recoveries,
                    record.manifest.real_settings.model,
                    record.manifest.real_settings.pipeline,
                    shared_cores_of(record),
                )
                for record in fit_records
                if record.recoveries is not None and record.manifest.real_settings is not None
            ]
        ),
        allreduce=fit_allreduce(data_parallel_records, num_warmup_iterations=num_warmup_iterations),
        replica_heal=fit_replica_heal(data_parallel_records),
        convergence=ConvergenceSpec(
            baseline=curve,
            setbacks=setbacks,
            calibrated=True,
            source=_convergence_source(name, [r.manifest.run_id for r in baseline_records], samples),
        ),
    )
    if predict_method_extra_s is None:
        return calibration
    # The iteration model's own extra of each measured method, on the compute a calibrated scenario
    # of this setup gets.
    methods = {record.manifest.method: record.manifest.real_settings.method for record in fit_records if record.manifest.real_settings is not None}
    compute = calibrated_setup_compute(calibration)
    model_extras = {
        method: predict_method_extra_s(calibration.model, calibration.pipeline, compute, methods[method])
        for method in calibration.method_iteration_extra_s
        if method in methods
    }
    return calibration.model_copy(update={"method_model_extra_s": model_extras})


__all__ = [
    "SetbackSample",
    "build_calibration",
    "equivalent_progress",
    "estimate_setbacks",
    "fit_baseline_curve",
    "fit_checkpoint_write_latency_s",
    "fit_evaluation",
    "fit_compute_cost_model",
    "fit_link_profile",
    "fit_method_iteration_extra_s",
    "fit_optimizer_step",
    "fit_recovery_times",
    "fit_stage_timings",
    "fit_tier_bandwidth",
    "fit_warmup_extra_s",
    "is_no_failure_run",
    "measured_duration",
    "setback_samples_of_run",
    "summarize_setbacks",
]
