"""Carry a calibration into a scenario.

Two modes:

- `full`: the scenario runs on the calibrated machine (e.g. the tiny CPU model on this CPU), so
  every measured quantity replaces its assumption:
    compute     ExplicitCompute (`calibrated_compute`): on the calibrated model and pipeline the
                per-stage block forward/backward medians (edge stages' embedding and head time are
                inside the block times, as measured) and optimizer_step_s = the measured optimizer
                step + `iteration_overhead_s` (the per-iteration time outside forward, backward and
                optimizer is charged once per iteration, where the optimizer step sits); on any
                other model or pipeline the same quantities from the compute cost model
                (calibration.compute_cost), which scales them with layers, sizes and microbatches;
                `run_speed_log_sd` from the calibration's run speeds (calibration/speed_uncertainty.py).
                Local CPU calibrations set `shared_cores`: the times are core-seconds and the
                simulator shares the machine's cores among the stage processes.
    network     UniformNetwork(latency, bandwidth) from the link profile; with D > 1 and a
                calibration that measured the all-reduce (`Calibration.allreduce`, from
                data-parallel runs), its latency and bandwidth, which the simulator also charges a
                replica heal's copy over; otherwise the scenario's all-reduce latency/bandwidth are
                kept (not measured). The measured heal (`Calibration.replica_heal`) is not applied:
                the simulator has no heal link of its own (approximation)
    storage     tiers named in the calibration take its read/write bandwidths; their capacity and
                survival flags, and the bandwidths of tiers the calibration lacks, stay as they were
                (a calibration tier absent from the scenario is ignored: whether it survives node
                loss is not measured); every tier's fixed cost (`StorageTier.fixed_cost_s`, on top
                of its latency) is the measured fixed cost of a checkpoint write
                (`checkpoint_write_latency_s`: serialisation, checksums, fsync, rename happen
                whatever the tier), set rather than added, so a second calibration replaces it
    recovery    of the scenario's `training.failure_mode` (`recovery_for_failure_mode`). Soft:
                join_delay_s = the measured `recovery.join` time (a real run's replacement coming up:
                fresh state on the failed stage), sample-weighted over the methods that measured
                it; restart_s_by_method = each measured method's `unrecorded_s`, what its recovery
                steps took beyond a steady step and their recorded parts (the processes' own
                restart: process group, optimizer and checkpoint engine rebuilt); restart_s stays
                for methods the calibration did not measure. Hard, where the calibration measured
                hard failures: join_delay_s = the configured join delay + the measured process start
                (a replacement process built from nothing), restart = the measured rendezvous +
                `unrecorded_s`; and, where the calibration fitted the components of a hard failure
                under the agent (`hard_failure_costs`), survivor_restart_s = detection + the
                agent's restart + process start + the reload of this scenario's largest stage's
                snapshot (charged by the simulator when `training.hard_failure_launch` is "agent"),
                a process start no run told apart from its join delay is the replacement's start
                from those components, and a method measured only under soft failures gets the
                fitted rendezvous on top of its soft restart.
                Transfer, load and rebuild times are
                not copied: the simulator derives them from bytes, the link and the tiers, which the
                calibration sets. Under redundant computation the simulator's restart is the
                replacement's, off the training path: the stall of a failover is not charged
                (approximation: the stall is short against a step).
    convergence the calibration's (baseline and setbacks, calibrated=True)
- `setbacks`: for scenarios of other models (the paper presets keep their cited constants): only
  the measured setbacks are taken, in optimizer steps, unchanged (setback_scale = 1). This is an
  ASSUMPTION: a rebuilt stage re-learns at a rate set by the number of steps and the learning rate,
  not by the model's width. `setback_scale` is the knob for a different transfer. The scenario's
  baseline curve is kept, and so are its setbacks for positions the calibration did not measure.
"""

from __future__ import annotations

from typing import Literal

from .base import LONGEST_DURATION_S, first_endless_duration, validate_model
from .calibration_file import Calibration, RecoveryTimes
from .convergence import MethodSetbacks
from .errors import InputError
from .compute_cost import setup_description
from .scenario import ExplicitCompute, ModelSpec, PipelineSpec, RecoverySpec, Scenario, UniformNetwork, seconds_by_method
from .speed_uncertainty import run_speed_log_sd

ApplyMode = Literal["full", "setbacks"]

SETBACK_TRANSFER_ASSUMPTION = (
    "setbacks carried over in optimizer steps unchanged (setback_scale 1): assumes a rebuilt stage "
    "re-learns at a rate set by steps and learning rate, not model width"
)


def _first_difference(left: dict, right: dict) -> str | None:
    for key in sorted(set(left) | set(right)):
        if left.get(key) != right.get(key):
            return f"{key} = {left.get(key)!r} in the scenario, {right.get(key)!r} in the calibration"
    return None


def _setup_difference(scenario: Scenario, calibration: Calibration) -> str | None:
    """The first model or pipeline field in which the scenario differs from the calibrated setup."""
    # The model's display name does not change timings; every other field does.
    for part in ("model", "pipeline"):
        left = getattr(scenario, part).model_dump(exclude={"name"})
        right = getattr(calibration, part).model_dump(exclude={"name"})
        difference = _first_difference(left, right)
        if difference:
            return f"{part}.{difference}"
    return None


def calibrated_compute(scenario: Scenario, calibration: Calibration) -> ExplicitCompute:
    """Compute of the scenario's model and pipeline on the calibrated machine: the measured per-stage
    times on the calibrated setup, the compute cost model on any other; either with the spread of
    the calibration's run speeds (calibration/speed_uncertainty.py) and the methods' measured steady
    extras (charged by sim.model.method_extras.with_measured_method_extra)."""
    compute = _calibrated_compute_times(scenario, calibration)
    return compute.model_copy(
        update={
            "run_speed_log_sd": run_speed_log_sd(calibration.run_speed_factors.values()),
            "method_iteration_extra_s": seconds_by_method(calibration.method_iteration_extra_s),
            "method_model_extra_s": seconds_by_method(calibration.method_model_extra_s),
        }
    )


def calibrated_setup_compute(calibration: Calibration) -> ExplicitCompute:
    """Compute of the calibrated setup itself: its measured per-stage times, the optimizer step plus
    the per-iteration overhead, on the cores the runs shared."""
    timings = sorted(calibration.stage_timings, key=lambda timing: timing.stage)
    compute_model = calibration.compute_model
    return ExplicitCompute(
        block_forward_s=tuple(t.block_forward.median_s for t in timings),
        block_backward_s=tuple(t.block_backward.median_s for t in timings),
        optimizer_step_s=calibration.optimizer_step.median_s + calibration.iteration_overhead_s,
        shared_cores=compute_model.shared_cores if compute_model is not None else None,
    )


def _calibrated_compute_times(scenario: Scenario, calibration: Calibration) -> ExplicitCompute:
    compute_model = calibration.compute_model
    difference = _setup_difference(scenario, calibration)
    if difference is None:
        return calibrated_setup_compute(calibration)
    if compute_model is None:
        raise InputError(
            f"scenario {scenario.name!r} does not run the calibrated setup ({difference}) and calibration {calibration.name!r} "
            "has no compute model to scale to it (made before compute models existed); re-run churnsim calibrate, "
            "or use mode 'setbacks' to take only the convergence setbacks"
        )
    if scenario.pipeline.embedding_placement != "edge_stages":
        raise InputError(
            f"scenario {scenario.name!r}: pipeline.embedding_placement = {scenario.pipeline.embedding_placement!r}; a calibrated "
            "compute model describes runs whose edge stages hold the embedding and head (edge_stages)"
        )
    carried_from = f"{setup_description(calibration.model, calibration.pipeline)} of calibration {calibration.name!r}"
    outside = compute_model.outside_fitted_shapes(scenario.model)
    if outside is not None:  # the speeds of FLOPs, bytes and operations were told apart on other shapes
        carried_from += f", with {outside} of its compute model's fit"
    carried = compute_model.compute_for(scenario.model, scenario.pipeline)
    endless = first_endless_duration(carried.model_dump())
    if endless is not None:  # the user wrote none of these times: name where they came from
        raise InputError(
            f"scenario {scenario.name!r}: the compute model of {carried_from} gives compute.{endless} over {LONGEST_DURATION_S:g} s "
            "(31.7 years) on this setup; check its coefficients"
        )
    return carried.model_copy(update={"carried_from": carried_from})


def _sample_weighted(values: list[tuple[float, int]]) -> float | None:
    if not values:
        return None
    total = sum(count for _, count in values)
    return sum(value * count for value, count in values) / total


def _measured_join_s(table: dict[str, RecoveryTimes]) -> float | None:
    return _sample_weighted([(times.join_s, times.num_samples) for times in table.values() if times.join_s > 0 and times.num_samples > 0])


def recovery_for_failure_mode(
    recovery: RecoverySpec,
    calibration: Calibration,
    failure_mode: Literal["soft", "hard"],
    join_delay_s: float | None = None,
    *,
    model: ModelSpec | None = None,
    pipeline: PipelineSpec | None = None,
    shared_cores: int | None = None,
) -> RecoverySpec:
    """`recovery` with the calibration's measured recovery of `failure_mode` (module docstring).

    Soft failures: the join is the measured reset in place, each measured method's restart its
    `unrecorded_s`. Hard failures, where the calibration measured them (`hard_failure_recovery`):
    the join is `join_delay_s` (the run's configured delay from a kill to its replacement's start)
    plus the measured process start, or the measured join whole where no run said its delay; each measured method's restart is its rendezvous plus its
    `unrecorded_s`. Where the calibration fitted the components under the agent
    (`hard_failure_costs`), a process start no run's join delay told apart is the replacement's start
    from them, and a method without hard-failure measurements gets its soft restart plus the fitted
    rendezvous; otherwise such a method keeps its soft restart, and without any hard measurement the
    soft parts are charged (the validator says so). `join_delay_s` None:
    the delay is not known, and the measured join is charged whole. `pipeline` and `shared_cores`
    (the scenario's) scale the fitted process start to the processes per core that start at once;
    with `model` too, a hard failure's `survivor_restart_s` is the fitted components' on that model
    and pipeline (`HardFailureCosts.survivor_restart_s`), otherwise it stays as `recovery` has it."""
    hard = calibration.hard_failure_recovery if failure_mode == "hard" else {}
    costs = calibration.hard_failure_costs if failure_mode == "hard" else None
    table = {**calibration.recovery, **hard}
    measured_restarts = {method: times.rendezvous_s + times.unrecorded_s for method, times in table.items() if times.num_samples > 0}
    if costs is not None:  # a method measured only under soft failures: its restart plus the fitted rendezvous
        for method, times in calibration.recovery.items():
            if method not in hard and times.num_samples > 0:
                measured_restarts[method] = costs.rendezvous.median_s + times.unrecorded_s
    join_s = _measured_join_s(calibration.recovery)
    if hard or costs is not None:
        starts = [(times.process_start_s, times.num_samples) for times in hard.values() if times.process_start_s > 0 and times.num_samples > 0]
        process_start_s = _sample_weighted(starts)
        if process_start_s is None and costs is not None:  # runs that did not say their join delay: the components
            process_start_s = costs.replacement_start_s(pipeline, shared_cores)
        known = join_delay_s is not None and process_start_s is not None
        join_s = join_delay_s + process_start_s if known else (_measured_join_s(hard) if hard else process_start_s)  # type: ignore[operator]
    survivors = costs is not None and model is not None and pipeline is not None
    return recovery.model_copy(
        update={
            "restart_s_by_method": {**recovery.restart_s_by_method, **measured_restarts},
            **({"join_delay_s": join_s} if join_s is not None else {}),
            **({"survivor_restart_s": costs.survivor_restart_s(model, pipeline, shared_cores)} if survivors else {}),  # type: ignore[union-attr]
        }
    )


def _full(scenario: Scenario, calibration: Calibration) -> dict:
    compute = calibrated_compute(scenario, calibration)
    allreduce_latency_s = scenario.network.allreduce_latency_s
    allreduce_bandwidth_bytes_per_s = scenario.network.allreduce_bandwidth_bytes_per_s
    if scenario.pipeline.data_parallel_degree > 1 and calibration.allreduce is not None:
        allreduce_latency_s = calibration.allreduce.latency_s
        allreduce_bandwidth_bytes_per_s = calibration.allreduce.bandwidth_bytes_per_s
    network = UniformNetwork(
        latency_s=calibration.link.latency_s,
        bandwidth_bytes_per_s=calibration.link.bandwidth_bytes_per_s,
        allreduce_latency_s=allreduce_latency_s,
        allreduce_bandwidth_bytes_per_s=allreduce_bandwidth_bytes_per_s,
    )
    measured_tiers = {tier.name: tier for tier in calibration.storage}
    storage = tuple(
        tier.model_copy(
            update={
                "write_bandwidth_bytes_per_s": measured_tiers[tier.name].write_bandwidth_bytes_per_s,
                "read_bandwidth_bytes_per_s": measured_tiers[tier.name].read_bandwidth_bytes_per_s,
                "fixed_cost_s": calibration.checkpoint_write_latency_s,
            }
        )
        if tier.name in measured_tiers
        else tier.model_copy(update={"fixed_cost_s": calibration.checkpoint_write_latency_s})
        for tier in scenario.storage
    )
    training = scenario.training
    configured_delay_s = training.join_delay_s if training.join_delay_s is not None else scenario.recovery.join_delay_s
    recovery = recovery_for_failure_mode(
        scenario.recovery, calibration, training.failure_mode, configured_delay_s,
        model=scenario.model, pipeline=scenario.pipeline, shared_cores=getattr(compute, "shared_cores", None),
    )  # fmt: skip
    return {
        "compute": compute.model_dump(),
        "network": network.model_dump(),
        "storage": [tier.model_dump() for tier in storage],
        "recovery": recovery.model_dump(),
        "convergence": calibration.convergence.model_dump(),
    }


# Rebuilds a (method, position) needs before its setback is carried to another model: with fewer,
# one noisy loss window decides the headline comparison of a paper-sized preset.
MINIMUM_SETBACK_SAMPLES_TO_TRANSFER = 5


def _setbacks_only(scenario: Scenario, calibration: Calibration) -> dict:
    setbacks = dict(scenario.convergence.setbacks)
    measured = []
    for method, calibrated in calibration.convergence.setbacks.items():
        current = setbacks.get(method)
        specs = {}
        for position in ("interior", "edge"):
            spec = calibrated.for_position(position)  # type: ignore[arg-type]
            # A setback that grows with training progress (the convergence lab's finding on the tiny
            # model) is on the scale of the calibrated model's training length: it is not carried.
            enough = spec.num_samples >= MINIMUM_SETBACK_SAMPLES_TO_TRANSFER and spec.per_progress_iteration == 0.0
            if enough or (current is None and spec.per_progress_iteration == 0.0):
                specs[position] = spec
                if enough:
                    measured.append(f"{method}/{position}")
            else:
                specs[position] = current.for_position(position)  # type: ignore[arg-type]
        setbacks[method] = MethodSetbacks(**specs)
    if not measured:
        raise InputError(
            f"calibration {calibration.name!r} has no setback that carries to another model: none measured from at least "
            f"{MINIMUM_SETBACK_SAMPLES_TO_TRANSFER} rebuilds that stays constant over training (setbacks that grow with "
            "training progress are on the scale of the calibrated model's training length)"
        )
    convergence = scenario.convergence.model_copy(
        update={
            "setbacks": setbacks,
            "setback_scale": 1.0,
            "calibrated": True,
            "setback_source": "measured",
            "source": f"setbacks {', '.join(measured)} from calibration {calibration.name!r}; {SETBACK_TRANSFER_ASSUMPTION}; "
            f"baseline curve and other setbacks ({scenario.convergence.setback_source}) from scenario {scenario.name!r}",
        }
    )
    return {"convergence": convergence.model_dump()}


def apply_calibration(scenario: Scenario, calibration: Calibration, *, mode: ApplyMode) -> Scenario:
    """A copy of `scenario` with the calibration's measurements in place of its assumptions (module docstring)."""
    if mode == "full":
        updates = _full(scenario, calibration)
    elif mode == "setbacks":
        updates = _setbacks_only(scenario, calibration)
    else:
        raise InputError(f"calibration mode {mode!r} is not known; use 'full' or 'setbacks'")
    data = scenario.model_dump()
    data.update(updates)
    data["sources"] = [*scenario.sources, f"calibration {calibration.name!r} ({mode}), created {calibration.provenance.created_utc}"]
    # Validate the result again: e.g. the target loss must lie above a calibrated baseline's floor.
    return validate_model(Scenario, data, f"scenario {scenario.name!r} with calibration {calibration.name!r}")
