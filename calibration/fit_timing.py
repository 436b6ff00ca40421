"""Fit the timing half of a calibration from real run records (simulators.md section 6).

Conventions of the run records read here (calibration/run_record.py):
- a span's `iteration` is the trainer's *step* (executed iterations, never rewinds);
- a "forward"/"backward" span is one hop of one microbatch on one stage, times in seconds since the
  run started;
- `metrics.wall_time_s` is the time since the run started at the end of that step, so a step's
  duration is the difference to the previous step's value.

Every estimate skips the first `num_warmup_iterations` steps of each run (allocator, JIT and cache
warm-up make them slow and unrepresentative).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import pandas as pd

from .cpu_sharing import cores_of_hardware, with_core_seconds, work_outside_spans
from .calibration_file import LinkProfile, MeasuredDuration, RecoveryTimes, StageTimings, TierBandwidth
from .compute_cost import (
    ComputeCostModel,
    fit_linear_non_negative,
    fit_physical_hop_costs,
    hop_features,
    processes_per_core,
    setup_fingerprint,
    setup_key,
    stage_parameters,
)
from .errors import InputError
from .scenario import ExplicitCompute, ModelSpec, PipelineSpec
from .statistics import solve_increasing
from .methods import MethodConfigBase, method_names_where, method_traits
from .run_record import RunRecord, configured_join_delay_s, record_failure_mode

DEFAULT_WARMUP_ITERATIONS = 3

RECOVERY_SPAN_FIELDS: dict[str, str] = {
    "recovery.join": "join_s",
    "recovery.rendezvous": "rendezvous_s",
    "recovery.transfer": "transfer_s",
    "recovery.load": "load_s",
    "recovery.rebuild": "rebuild_s",
}
"""Span kind → RecoveryTimes field."""

# Steps containing any of these spans are not steady-state iterations: they include a recovery,
# checkpoint I/O or an evaluation on top of the training work.
UNSTEADY_SPAN_KINDS: frozenset[str] = frozenset(
    {"save", "load", "snapshot", "flush", "eval", "recovery.wait", *RECOVERY_SPAN_FIELDS}
)


def has_plain_iteration(record: RunRecord) -> bool:
    """The run's method has the `plain_iteration` trait: its healthy iteration is the plain in-order
    route with no extra work, so an iteration predictor that knows only stage timings and the
    optimizer step describes it."""
    return method_traits(record.manifest.method).plain_iteration


Predictor = Callable[[ModelSpec, PipelineSpec, ExplicitCompute], float]
"""The simulator's healthy iteration time of a model and pipeline with given compute (calibration/
may not import sim/, so the model is passed in: sim.model.calibrated.iteration_predictor)."""
MethodExtraPredictor = Callable[[ModelSpec, PipelineSpec, ExplicitCompute, MethodConfigBase], float]
"""How much longer the simulator's iteration model makes a method's healthy iteration than the plain
pipeline's, from compute alone (sim.model.calibrated.method_extra_predictor)."""


def record_name(record: RunRecord) -> str:
    return f"run record {record.manifest.run_id!r}"


def measured_duration(durations_s: Sequence[float] | np.ndarray) -> MeasuredDuration:
    """Median, interquartile range and count of a sample of durations (negative clipped to 0)."""
    values = np.clip(np.asarray(durations_s, dtype=float), 0.0, None)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return MeasuredDuration(median_s=0.0, interquartile_range_s=0.0, num_samples=0)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return MeasuredDuration(median_s=float(median), interquartile_range_s=float(q3 - q1), num_samples=int(values.size))


def _require_columns(frame: pd.DataFrame, columns: Sequence[str], where: str) -> None:
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise InputError(f"{where} lacks column(s) {', '.join(missing)}; expected {', '.join(columns)}")


def shared_cores_of(record: RunRecord) -> int | None:
    """The CPU cores a real run's stage processes shared (None: a device per stage, or not recorded)."""
    settings = record.manifest.real_settings
    device = settings.device if settings is not None else "cuda"
    return cores_of_hardware(record.manifest.hardware, device)


def _steady_spans(
    records: Sequence[RunRecord], kinds: Sequence[str], num_warmup_iterations: int, *, as_core_seconds: bool = False
) -> pd.DataFrame:
    """Spans of `kinds` from every record past warm-up, with a `run` column and a `duration_s`
    column: wall seconds, or with `as_core_seconds` the work of compute spans in core-seconds on the
    cores the run's processes shared (calibration.cpu_sharing)."""
    if num_warmup_iterations < 0:
        raise InputError(f"num_warmup_iterations {num_warmup_iterations} must be >= 0")
    frames = []
    for record in records:
        spans = record.spans
        _require_columns(spans, ("rank", "stage", "iteration", "kind", "microbatch", "start_s", "end_s"), f"{record_name(record)}: spans.csv")
        spans = with_core_seconds(spans, shared_cores_of(record) if as_core_seconds else None)
        chosen = spans[spans["kind"].isin(kinds) & (spans["iteration"] >= num_warmup_iterations)].copy()
        chosen["run"] = record.manifest.run_id
        chosen["duration_s"] = chosen["work_s"]
        frames.append(chosen)
    if not frames:
        raise InputError("no run records given; pass at least one real run record to fit from")
    return pd.concat(frames, ignore_index=True)


def fit_stage_timings(
    records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS, as_core_seconds: bool = False
) -> tuple[StageTimings, ...]:
    """Per stage, median and IQR of forward and backward time per microbatch (wall seconds, or with
    `as_core_seconds` work on the cores the processes shared, see `_steady_spans`).

    Under CheckFree+ swapped routes a stage makes two hops of an odd microbatch (stage 0: embedding,
    then blocks; stage S-1: blocks, then head): the hops of one (run, rank, step, microbatch, stage)
    are summed, so a sample is always the stage's whole work on one microbatch, the quantity the
    in-order route times.
    """
    spans = _steady_spans(records, ("forward", "backward"), num_warmup_iterations, as_core_seconds=as_core_seconds)
    if spans.empty:
        raise InputError(
            f"no forward/backward spans after the first {num_warmup_iterations} iterations in runs "
            f"{[r.manifest.run_id for r in records]}; run more iterations or lower num_warmup_iterations"
        )
    per_microbatch = _work_per_hop(spans).reset_index()
    if as_core_seconds:
        per_microbatch = _with_work_outside_spans(per_microbatch, records)
    stages = sorted(int(stage) for stage in per_microbatch["stage"].unique())
    if stages != list(range(len(stages))):
        raise InputError(f"spans.csv: forward/backward spans cover stages {stages}; every stage 0..S-1 must have spans")
    timings = []
    for stage in stages:
        of_stage = per_microbatch[per_microbatch["stage"] == stage]
        forward = of_stage.loc[of_stage["kind"] == "forward", "duration_s"]
        backward = of_stage.loc[of_stage["kind"] == "backward", "duration_s"]
        if forward.empty or backward.empty:
            raise InputError(f"spans.csv: stage {stage} has no {'forward' if forward.empty else 'backward'} spans; check the run records")
        timings.append(StageTimings(stage=stage, block_forward=measured_duration(forward), block_backward=measured_duration(backward)))
    return tuple(timings)


def _work_per_hop(spans: pd.DataFrame) -> pd.Series:
    """`duration_s` of the hops of one (run, rank, step, microbatch, stage, kind) summed: a stage's
    whole work on one microbatch, also where CheckFree+ swapped routes split it in two hops."""
    return spans.groupby(["run", "rank", "iteration", "microbatch", "stage", "kind"], dropna=False)["duration_s"].sum()


def run_speed_factors(
    records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS, as_core_seconds: bool = True
) -> dict[str, float]:
    """How fast the machine ran each run against all of them pooled, by run id: per (stage,
    forward/backward) the run's median work per hop over the pooled median, and the median of
    those ratios (1.0: typical; 1.1: 10 % slower).

    Runs of one setup do nearly the same forward and backward work per hop whatever the method, so
    these spans measure the machine rather than the method. A whole step moves with them: divided
    by their factors, the plain-method runs' median steady steps of one `calibrate --quick` spread
    far less than they do as measured.

    With `as_core_seconds` (the default, for the fits of the plain route's hops and overhead) a hop
    counts the core-seconds it got on the cores the run's processes shared (`cpu_sharing`); without
    it, its wall seconds. Core-seconds lean by method, because the sharing rule counts only the work
    inside spans: over many calibrations CheckFree+'s runs came out slower in core-seconds than in
    wall seconds and redundant computation's faster, while the plain methods' factors stayed near 1
    either way.
    Runs without steady forward/backward spans get no entry.
    """
    spans = _steady_spans(records, ("forward", "backward"), num_warmup_iterations, as_core_seconds=as_core_seconds)
    if spans.empty:
        return {}
    per_hop = _work_per_hop(spans)
    pooled = per_hop.groupby(level=["stage", "kind"]).median()
    per_run = per_hop.groupby(level=["run", "stage", "kind"]).median()
    ratios = per_run / pooled.reindex(per_run.index.droplevel("run")).to_numpy()
    return {str(run): float(value) for run, value in ratios.groupby(level="run").median().items()}


def speed_normalised_step_s(record: RunRecord, speed_factors: Mapping[str, float], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> float | None:
    """The run's median steady step divided by its speed factor (`run_speed_factors`; 1.0 when it
    has none): its step at the pooled runs' typical speed. None without steady steps."""
    steps = steady_iteration_times_s(record, num_warmup_iterations=num_warmup_iterations)
    if steps.empty:
        return None
    return float(steps.median()) / speed_factors.get(record.manifest.run_id, 1.0)


def _with_work_outside_spans(per_microbatch: pd.DataFrame, records: Sequence[RunRecord]) -> pd.DataFrame:
    """Each hop sample plus an equal share of its process's CPU work outside spans in that step
    (calibration.cpu_sharing.work_outside_spans): work the simulator can only charge to hops."""
    frames = []
    for record in records:
        cores = shared_cores_of(record)
        if cores is None:
            continue
        outside = work_outside_spans(record.spans, cores)
        outside["run"] = record.manifest.run_id
        frames.append(outside)
    if not frames:
        return per_microbatch
    outside = pd.concat(frames, ignore_index=True).rename(columns={"work_s": "outside_work_s"})
    hops = per_microbatch.groupby(["run", "rank", "iteration"])["duration_s"].transform("size")
    merged = per_microbatch.merge(outside, on=["run", "rank", "iteration"], how="left")
    merged["duration_s"] = merged["duration_s"] + merged["outside_work_s"].fillna(0.0) / hops.to_numpy()
    return merged.drop(columns="outside_work_s")


def fit_optimizer_step(
    records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS, as_core_seconds: bool = False
) -> MeasuredDuration:
    """Median and IQR of the "optimizer" spans (one per rank and step; `as_core_seconds` as in `_steady_spans`)."""
    spans = _steady_spans(records, ("optimizer",), num_warmup_iterations, as_core_seconds=as_core_seconds)
    if spans.empty:
        raise InputError("spans.csv: no 'optimizer' spans after warm-up in any run record; the real trainer must record them")
    return measured_duration(spans["duration_s"])


def step_durations_s(record: RunRecord) -> pd.Series:
    """Each step's wall time, indexed by step; step 0 lasts from the run's start (wall time 0)."""
    metrics = record.metrics
    _require_columns(metrics, ("step", "wall_time_s", "eval_loss"), f"{record_name(record)}: metrics.csv")
    metrics = metrics.sort_values("step")
    wall = metrics["wall_time_s"].to_numpy(dtype=float)
    if np.any(np.diff(wall) < 0):
        raise InputError(
            f"{record_name(record)}: metrics.csv wall_time_s decreases; it must be the time since the run start at the end of each step"
        )
    return pd.Series(np.diff(wall, prepend=0.0), index=metrics["step"].to_numpy(dtype=int))


def evaluated_steps(record: RunRecord) -> set[int]:
    """The steps after which a run evaluated (their time includes the evaluation)."""
    metrics = record.metrics
    return set(metrics.loc[metrics["eval_loss"].notna(), "step"].astype(int))


def steady_iteration_times_s(record: RunRecord, *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> pd.Series:
    """Durations of the steps of one run that did nothing but train (no recovery, checkpoint I/O or eval)."""
    durations = step_durations_s(record).iloc[1:]  # the first step includes the run's start-up
    unsteady_steps = set(record.spans.loc[record.spans["kind"].isin(UNSTEADY_SPAN_KINDS), "iteration"].astype(int))
    evaluated = evaluated_steps(record)
    keep = [
        step >= num_warmup_iterations and step not in unsteady_steps and step not in evaluated
        for step in durations.index
    ]
    return durations[keep]


def record_setup_key(record: RunRecord) -> str:
    """The `setup_key` of a real run: its model (but not its display name) and pipeline."""
    settings = record.manifest.real_settings
    if settings is None:
        raise InputError(f"{record_name(record)}: manifest.json field 'real_settings' is missing; fit from real runs")
    return setup_key(settings.model, settings.pipeline)


def optimizer_work_per_stage(records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> dict[int, float]:
    """Per stage, the median optimizer step in core-seconds (`_steady_spans`)."""
    spans = _steady_spans(records, ("optimizer",), num_warmup_iterations, as_core_seconds=True)
    return {int(stage): float(rows["duration_s"].median()) for stage, rows in spans.groupby("stage")}


def fit_compute_cost_model(
    records: Sequence[RunRecord],
    predict_iteration_s: Predictor,
    *,
    calibrated_key: str,
    calibrated_compute: ExplicitCompute,
    num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
    speed_factors: Mapping[str, float] | None = None,
) -> tuple[ComputeCostModel, float]:
    """The compute cost model (calibration.compute_cost) from every record, and the per-iteration
    overhead measured on the calibrated setup.

    Hop and optimizer work come from every (setup, stage) median in core-seconds; the calibrated
    setup's hop medians are `calibrated_compute`'s (the caller measured them from the same records). The overhead is
    what the simulated iteration lacks against a run's median steady step: for each run of a
    `plain_iteration` method, the o that makes the simulator's iteration (its compute with o
    added where the optimizer step sits; `predict_iteration_s`, the simulator's model passed in)
    last as long as the run's median steady step. Other setups take their no-failure runs and their
    own measured hop medians (the hop model's optimizer step): against the fitted hop model's
    compute instead, a shape run made in a faster or slower minute than the rest put its whole
    speed difference into the overhead, and the slope per stage × microbatch varied by an order of
    magnitude between calibrations, leaving the other setups short where it was low.
    The calibrated setup takes its measured per-stage times (`calibrated_compute`,
    pooled over its runs) and every plain-method run, failures or not, each step divided by the
    run's speed factor (`run_speed_factors` of the calibrated setup's runs, computed when not given):
    so the overhead belongs to the pooled runs' typical speed, like the hop times, and not to the
    speed of the one or two no-failure runs. Medians, not means, so that a slow spell of the machine
    during calibration does not become a permanent cost.
    """
    cores = {shared_cores_of(record) for record in records}
    if len(cores) != 1:
        raise InputError(f"the run records were measured on machines with different core counts ({sorted(map(str, cores))}); calibrate each machine separately")
    shared_cores = cores.pop()
    groups: dict[str, list[RunRecord]] = {}
    for record in records:
        groups.setdefault(record_setup_key(record), []).append(record)
    forward_features, backward_features, per_core = [], [], []
    forward_work, backward_work, optimizer_parameters, optimizer_work, fitted_setups = [], [], [], [], []
    measured_hops: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {}
    for key, group in groups.items():
        settings = group[0].manifest.real_settings
        assert settings is not None
        if key == calibrated_key:  # measured already, by the caller
            forward_s, backward_s = calibrated_compute.block_forward_s, calibrated_compute.block_backward_s
        else:
            timings = fit_stage_timings(group, num_warmup_iterations=num_warmup_iterations, as_core_seconds=True)
            forward_s = tuple(timing.block_forward.median_s for timing in timings)
            backward_s = tuple(timing.block_backward.median_s for timing in timings)
        measured_hops[key] = (tuple(forward_s), tuple(backward_s))
        fitted_setups.append(setup_fingerprint(settings.model, settings.pipeline))
        forward_features.extend(hop_features(settings.model, settings.pipeline, "forward"))
        backward_features.extend(hop_features(settings.model, settings.pipeline, "backward"))
        per_core.extend([processes_per_core(settings.pipeline, shared_cores)] * settings.pipeline.num_stages)
        forward_work.extend(forward_s)  # type: ignore[arg-type]
        backward_work.extend(backward_s)  # type: ignore[arg-type]
        parameters = stage_parameters(settings.model, settings.pipeline)
        for stage, work_s in optimizer_work_per_stage(group, num_warmup_iterations=num_warmup_iterations).items():
            optimizer_parameters.append(parameters[stage])
            optimizer_work.append(work_s)
    if len(forward_work) != len(forward_features):
        raise InputError(
            f"the run records' forward/backward spans cover {len(forward_work)} (setup, stage) pairs where their pipelines have "
            f"{len(forward_features)} stages; every run must record every stage's hops"
        )
    hops = fit_physical_hop_costs(forward_features, forward_work, backward_features, backward_work, per_core)
    optimizer_fixed_s, optimizer_per_parameter_s = fit_linear_non_negative(optimizer_parameters, optimizer_work)
    hops_only = ComputeCostModel(
        forward=hops.forward,
        backward=hops.backward,
        slowdown_per_extra_process_per_core=hops.slowdown_per_extra_process_per_core,
        optimizer_fixed_s=optimizer_fixed_s,
        optimizer_seconds_per_parameter=optimizer_per_parameter_s,
        iteration_overhead_s=0.0,
        shared_cores=shared_cores,
        num_configurations=len(groups),
        fitted_setups=tuple(sorted(fitted_setups)),
        fitted_hidden_sizes=tuple(sorted({group[0].manifest.real_settings.model.hidden_size for group in groups.values()})),  # type: ignore[union-attr]
        fitted_sequence_lengths=tuple(sorted({group[0].manifest.real_settings.model.sequence_length for group in groups.values()})),  # type: ignore[union-attr]
        hop_relative_residual=float(np.median([hops.forward_relative_residual, hops.backward_relative_residual])),
    )
    if speed_factors is None:
        speed_factors = run_speed_factors(groups.get(calibrated_key, []), num_warmup_iterations=num_warmup_iterations)
    stage_microbatches, overheads, calibrated_overheads = [], [], []
    for key, group in groups.items():
        settings = group[0].manifest.real_settings
        assert settings is not None
        calibrated = key == calibrated_key
        if calibrated:
            compute = calibrated_compute
        else:
            forward_s, backward_s = measured_hops[key]
            compute = hops_only.compute_for(settings.model, settings.pipeline).model_copy(update={"block_forward_s": forward_s, "block_backward_s": backward_s})
        for record in group:
            if not has_plain_iteration(record) or (len(record.failures.failures) > 0 and not calibrated):
                continue
            step_s = speed_normalised_step_s(record, speed_factors if calibrated else {}, num_warmup_iterations=num_warmup_iterations)
            if step_s is None:
                continue

            def predict(overhead_s: float, settings=settings, compute=compute) -> float:
                charged = compute.model_copy(update={"optimizer_step_s": compute.optimizer_step_s + overhead_s})
                return float(predict_iteration_s(settings.model, settings.pipeline, charged))

            overhead_s = solve_increasing(step_s, predict, 0.0, step_s)
            stage_microbatches.append(settings.pipeline.num_stages * settings.pipeline.num_microbatches)
            overheads.append(overhead_s)
            if calibrated:
                calibrated_overheads.append(overhead_s)
    if not calibrated_overheads:
        raise InputError(
            "no steady iterations of a run to measure the iteration overhead: give at least one run of a method in "
            f"{sorted(method_names_where(plain_iteration=True))} longer than {num_warmup_iterations} warm-up iterations"
        )
    overhead_fixed_s, overhead_per_stage_microbatch_s = fit_linear_non_negative(stage_microbatches, overheads)
    model = hops_only.model_copy(update={"iteration_overhead_s": overhead_fixed_s, "overhead_per_stage_microbatch_s": overhead_per_stage_microbatch_s})
    return model, float(np.median(calibrated_overheads))


def fit_method_iteration_extra_s(
    records: Sequence[RunRecord],
    *,
    num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS,
    speed_factors: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Per non-plain method, its runs' median steady step minus that of the plain-method runs, both
    at the runs' typical speed: each run's median steady step divided by its speed factor
    (`run_speed_factors` of `records`, one setup, in wall seconds; computed when not given), then
    the median over runs.

    Only methods without the `plain_iteration` trait get an entry: for plain methods the pooled
    overhead (`fit_compute_cost_model`) is the better estimate. Signed: noise can make it negative.
    Without the speed factors the extra was a difference between two runs' speeds as much as the
    method's cost: between two calibrations on one machine CheckFree+'s and redundant computation's
    extras moved by a large share of themselves, in opposite directions.
    Wall-second factors, not the core-second ones of the hop fits: the core-second factor of a
    CheckFree+ run leans slow and takes some of its extra away, and its held-out runs were predicted
    fast; with wall-second factors they came closer (the calibrate-and-validate benchmark).
    """
    if speed_factors is None:
        speed_factors = run_speed_factors(records, num_warmup_iterations=num_warmup_iterations, as_core_seconds=False)

    def typical_step_s(chosen: Sequence[RunRecord]) -> float | None:
        steps = [speed_normalised_step_s(record, speed_factors, num_warmup_iterations=num_warmup_iterations) for record in chosen]
        measured = [step for step in steps if step is not None]
        return float(np.median(measured)) if measured else None

    plain_s = typical_step_s([record for record in records if has_plain_iteration(record)])
    if plain_s is None:
        return {}
    extras = {}
    for method in sorted({record.manifest.method for record in records if not has_plain_iteration(record)}):
        own_s = typical_step_s([record for record in records if record.manifest.method == method])
        if own_s is not None:
            extras[method] = own_s - plain_s
    return extras


def fit_checkpoint_write_latency_s(records: Sequence[RunRecord], largest_stage_bytes: float, write_bandwidth_bytes_per_s: float | None) -> float:
    """Median blocking save of a synchronous checkpoint (per step, the slowest rank's summed "save"
    spans) minus the largest stage's bytes / write bandwidth, clipped at 0; 0 without runs of a
    method with the `blocking_checkpoint` trait."""
    samples = []
    for record in records:
        if not method_traits(record.manifest.method).blocking_checkpoint:
            continue
        spans = record.spans
        saves = spans[spans["kind"] == "save"]
        if saves.empty:
            continue
        per_rank = (saves["end_s"] - saves["start_s"]).groupby([saves["iteration"], saves["rank"]]).sum()
        samples.extend(per_rank.groupby(level=0).max().tolist())
    if not samples:
        return 0.0
    streaming_s = largest_stage_bytes / write_bandwidth_bytes_per_s if write_bandwidth_bytes_per_s else 0.0
    return max(0.0, float(np.median(samples)) - streaming_s)


def fit_evaluation(records: Sequence[RunRecord]) -> MeasuredDuration | None:
    """Median and IQR of one held-out evaluation: per (run, step) the longest "eval" span over ranks."""
    samples = []
    for record in records:
        spans = record.spans
        chosen = spans[spans["kind"] == "eval"]
        if not chosen.empty:
            durations = (chosen["end_s"] - chosen["start_s"]).groupby(chosen["iteration"]).max()
            samples.extend(durations.tolist())
    return measured_duration(samples) if samples else None


def machine_step_s(records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> float | None:
    """Median steady step of no-failure runs of a `plain_iteration` method: how fast the machine ran
    them (None without any)."""
    steps = [
        steady_iteration_times_s(record, num_warmup_iterations=num_warmup_iterations)
        for record in records
        if has_plain_iteration(record) and not record.failures.failures
    ]
    pooled = pd.concat([step for step in steps if not step.empty]) if any(not step.empty for step in steps) else pd.Series(dtype=float)
    return float(pooled.median()) if not pooled.empty else None


def fit_warmup_extra_s(records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> float:
    """Median over runs of the first warm-up steps' time minus as many steady steps, clipped at 0.

    Only runs of methods with the `plain_iteration` trait count; step 0 lasts from the run's start (wall time 0).
    """
    extras = []
    for record in records:
        if not has_plain_iteration(record) or num_warmup_iterations == 0:
            continue
        steady = steady_iteration_times_s(record, num_warmup_iterations=num_warmup_iterations)
        metrics = record.metrics.sort_values("step")
        first = metrics[metrics["step"] < num_warmup_iterations]
        if steady.empty or len(first) < num_warmup_iterations:
            continue
        extras.append(float(first["wall_time_s"].iloc[-1]) - num_warmup_iterations * float(steady.median()))
    return max(0.0, float(np.median(extras))) if extras else 0.0


def fit_link_profile(bytes_and_seconds: pd.DataFrame) -> LinkProfile:
    """Least squares of seconds = latency_s + bytes / bandwidth_bytes_per_s, with r².

    Residuals are weighted by 1 / seconds (relative errors): timing noise grows with the transfer's
    duration, and unweighted least squares would let the largest transfers swamp the latency.
    r² is the ordinary, unweighted one of the fitted line.
    """
    _require_columns(bytes_and_seconds, ("bytes", "seconds"), "link measurements")
    frame = bytes_and_seconds[["bytes", "seconds"]].astype(float).dropna()
    if frame["bytes"].nunique() < 2:
        raise InputError("link measurements: need transfers of at least two different sizes (bytes) to separate latency from bandwidth")
    size, seconds = frame["bytes"].to_numpy(), frame["seconds"].to_numpy()
    if np.any(seconds <= 0):
        raise InputError("link measurements: every seconds value must be > 0")
    slope, intercept = np.polyfit(size, seconds, 1, w=1.0 / seconds)
    if slope <= 0:
        raise InputError(
            f"link measurements: time does not grow with bytes (slope {slope:.3g} s/byte); measure larger transfers"
        )
    residual = seconds - (intercept + slope * size)
    total = np.sum((seconds - seconds.mean()) ** 2)
    r_squared = float(1.0 - np.sum(residual**2) / total) if total > 0 else 1.0
    return LinkProfile(
        latency_s=max(0.0, float(intercept)), bandwidth_bytes_per_s=float(1.0 / slope), r_squared=r_squared, num_points=int(len(frame))
    )


def fit_tier_bandwidth(
    name: str,
    num_bytes: float | Sequence[float],
    write_seconds: float | Sequence[float],
    read_seconds: float | Sequence[float],
) -> TierBandwidth:
    """Bandwidths of a storage tier: total bytes over total seconds (scalars or one value per trial)."""
    size = np.asarray(num_bytes, dtype=float)
    bandwidths = {}
    for field, seconds in (("write", write_seconds), ("read", read_seconds)):
        seconds_array = np.asarray(seconds, dtype=float)
        total_bytes = float(np.sum(np.broadcast_to(size, seconds_array.shape)))
        total_s = float(np.sum(seconds_array))
        if total_s <= 0 or total_bytes <= 0:
            raise InputError(f"tier {name!r}: {field} of {total_bytes} bytes took {total_s} s; both must be > 0")
        bandwidths[field] = total_bytes / total_s
    return TierBandwidth(name=name, write_bandwidth_bytes_per_s=bandwidths["write"], read_bandwidth_bytes_per_s=bandwidths["read"])


def recovery_events(
    record: RunRecord, *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS, steady_step_s: float | None = None
) -> pd.DataFrame:
    """One row per recovery event of a run (a step with recovery.* spans), indexed by step: per part
    (`RECOVERY_SPAN_FIELDS`) the longest rank's summed spans of that part (training waits for the
    slowest rank), and `unrecorded_s`, what the step took beyond a steady step of the run and those
    parts (at least 0; NaN where the step also evaluated or the run has no steady step).
    `steady_step_s`: the run's median steady step, where the caller has it already.

    The unrecorded time is the part of a recovery no span records: the processes' own restart
    (process group, optimizer and checkpoint engine rebuilt, Python). In the calibrate-and-validate
    benchmark's held-out runs it was larger for the checkpoint methods than for the rebuild methods,
    and the calibration runs gave the same."""
    spans = record.spans
    chosen = spans[spans["kind"].isin(RECOVERY_SPAN_FIELDS)]
    columns = [*RECOVERY_SPAN_FIELDS.values(), "unrecorded_s"]
    if chosen.empty:
        return pd.DataFrame(columns=columns, dtype=float)
    durations = (chosen["end_s"] - chosen["start_s"]).rename("duration_s")
    per_rank = durations.groupby([chosen["iteration"].astype(int), chosen["kind"], chosen["rank"]]).sum()
    events = per_rank.groupby(level=[0, 1]).max().unstack(1).rename(columns=RECOVERY_SPAN_FIELDS)
    events = events.reindex(columns=list(RECOVERY_SPAN_FIELDS.values())).fillna(0.0)
    events.index.name = "step"
    if steady_step_s is None:
        steady = steady_iteration_times_s(record, num_warmup_iterations=num_warmup_iterations)
        steady_step_s = float(steady.median()) if not steady.empty else math.nan
    evaluated = evaluated_steps(record)
    excess_s = step_durations_s(record).reindex(events.index).to_numpy() - steady_step_s
    excess_s[[step in evaluated for step in events.index]] = math.nan
    events["unrecorded_s"] = np.maximum(excess_s - events.sum(axis=1).to_numpy(), 0.0)
    return events


def fit_recovery_times(
    records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS, failure_mode: Literal["soft", "hard"] | None = None
) -> dict[str, RecoveryTimes]:
    """Median time of each recovery part per method, and of the time no span records
    (`recovery_events`). One sample is one recovery event (one step of one run with recovery
    spans). Parts a method never records stay 0. With `failure_mode`, only the runs whose failures
    struck that way (`record_failure_mode`): a hard failure's replacement process starts, joins and
    meets the survivors at a rendezvous, which a soft failure's reset in place never does, so the
    two are fitted apart. A hard failure's process start is its join less the run's configured
    join delay (`configured_join_delay_s`), where the record says it."""
    frames = []
    for record in records:
        mode = record_failure_mode(record)
        if failure_mode is not None and mode != failure_mode:
            continue
        events = recovery_events(record, num_warmup_iterations=num_warmup_iterations)
        if not events.empty:
            delay_s = configured_join_delay_s(record) if mode == "hard" else None
            process_start_s = np.maximum(events["join_s"] - delay_s, 0.0) if delay_s is not None else math.nan
            frames.append(events.assign(method=record.manifest.method, process_start_s=process_start_s))
    if not frames:
        return {}
    table = pd.concat(frames)
    result = {}
    for method, rows in table.groupby("method"):
        parts = {field: float(np.median(rows[field])) for field in RECOVERY_SPAN_FIELDS.values()}
        unrecorded = rows["unrecorded_s"].dropna()
        process_start = rows["process_start_s"].dropna()
        result[str(method)] = RecoveryTimes(
            **parts,
            process_start_s=float(np.median(process_start)) if not process_start.empty else 0.0,
            unrecorded_s=float(np.median(unrecorded)) if not unrecorded.empty else 0.0,
            num_samples=int(len(rows)),
        )
    return result


def data_parallel_degree_of(record: RunRecord) -> int:
    """D of a real run (1 where its settings do not say)."""
    settings = record.manifest.real_settings
    return int(settings.pipeline.data_parallel_degree) if settings is not None else 1


def _data_parallel_points(records: Sequence[RunRecord], kind: str, num_warmup_iterations: int) -> pd.DataFrame:
    """Median seconds of the `kind` spans that moved bytes, per (D, bytes): columns degree, bytes, seconds, spans."""
    frames = []
    for record in records:
        spans = record.spans
        if "bytes" not in spans.columns or data_parallel_degree_of(record) < 2:
            continue
        moved = pd.to_numeric(spans["bytes"], errors="coerce")
        chosen = spans[(spans["kind"] == kind) & (moved > 0) & (spans["iteration"] >= num_warmup_iterations)]
        if chosen.empty:
            continue
        frames.append(
            pd.DataFrame(
                {
                    "degree": data_parallel_degree_of(record),
                    "bytes": pd.to_numeric(chosen["bytes"]).astype(float),
                    "seconds": (chosen["end_s"] - chosen["start_s"]).astype(float),
                }
            )
        )
    if not frames:
        return pd.DataFrame(columns=["degree", "bytes", "seconds", "spans"])
    points = pd.concat(frames, ignore_index=True)
    points = points[points["seconds"] > 0]
    return points.groupby(["degree", "bytes"], as_index=False).agg(seconds=("seconds", "median"), spans=("seconds", "size"))


SEPARABLE_SIZE_RATIO = 1.5
"""Bytes (per latency) must span at least this ratio for a fit to tell latency from bandwidth."""


def _fit_latency_and_bandwidth(latencies: np.ndarray, scaled_bytes: np.ndarray, seconds: np.ndarray, num_points: int) -> LinkProfile:
    """Least squares of seconds = latencies · latency_s + scaled_bytes / bandwidth, weighted by
    1 / seconds (relative errors, as `fit_link_profile`). Where the points cannot tell latency from
    bandwidth (one size only) or the fit says a latency below zero, the latency is taken as zero
    and the bandwidth is the one through the origin (an approximation the caller's docs state)."""
    weights = 1.0 / seconds
    per_latency = scaled_bytes / np.maximum(latencies, 1e-300)
    # Sizes within a factor SEPARABLE_SIZE_RATIO of each other give a near-singular fit: noise decides the latency.
    distinct = float(per_latency.max()) >= SEPARABLE_SIZE_RATIO * float(per_latency.min())
    latency_s, inverse_bandwidth = 0.0, 0.0
    if distinct:
        design = np.column_stack([latencies, scaled_bytes]) * weights[:, None]
        (latency_s, inverse_bandwidth), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    if not distinct or latency_s < 0 or inverse_bandwidth <= 0:
        latency_s = 0.0
        inverse_bandwidth = float(np.sum(weights**2 * scaled_bytes * seconds) / np.sum(weights**2 * scaled_bytes**2))
    predicted = latencies * latency_s + scaled_bytes * inverse_bandwidth
    total = float(np.sum((seconds - seconds.mean()) ** 2))
    # r² of a line through the origin fitted to one size says nothing: none is given.
    r_squared = float(1.0 - np.sum((seconds - predicted) ** 2) / total) if distinct and total > 0 and len(seconds) > 1 else None
    return LinkProfile(latency_s=float(latency_s), bandwidth_bytes_per_s=float(1.0 / inverse_bandwidth), r_squared=r_squared, num_points=num_points)


def fit_allreduce(records: Sequence[RunRecord], *, num_warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS) -> LinkProfile | None:
    """The gradient all-reduce's latency and bandwidth from the `allreduce` spans (seconds, bytes) of
    runs with D > 1, inverted through the simulator's ring all-reduce: seconds = 2(D-1) · latency_s +
    2(D-1)/D · bytes / bandwidth (sim/model/iteration.py). Each (D, bytes) gives one point, the
    median of its spans past warm-up; `num_points` counts the spans. None without such spans.

    Approximation: a span times the whole collective on one rank, waits for the slowest replica
    included."""
    points = _data_parallel_points(records, "allreduce", num_warmup_iterations)
    if points.empty:
        return None
    degree = points["degree"].to_numpy(dtype=float)
    return _fit_latency_and_bandwidth(
        2.0 * (degree - 1.0),
        2.0 * (degree - 1.0) / degree * points["bytes"].to_numpy(dtype=float),
        points["seconds"].to_numpy(dtype=float),
        int(points["spans"].sum()),
    )


def fit_replica_heal(records: Sequence[RunRecord]) -> LinkProfile | None:
    """A heal's copy: seconds = latency_s + bytes / bandwidth from the `recovery.heal` spans of runs
    with D > 1 (each side of a copy records one: the source its bytes sent, the replacement its
    bytes received). None without heals."""
    points = _data_parallel_points(records, "recovery.heal", 0)
    if points.empty:
        return None
    return _fit_latency_and_bandwidth(
        np.ones(len(points)), points["bytes"].to_numpy(dtype=float), points["seconds"].to_numpy(dtype=float), int(points["spans"].sum())
    )
