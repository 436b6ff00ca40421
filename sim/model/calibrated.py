"""The bridge from measurements to the simulator: calibration fits need the simulator's iteration model.

`calibration/fit.py` may not import sim/, so `build_calibration` takes the iteration model as a
function; `iteration_predictor` is that function. It also builds the scenario and the failures a
run record is replayed with (`replay_scenario`, `replay_failures`, `replay_failures_at_steps`; the
rules are in sim/checks/validate.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from churnsim.calibration.apply import apply_calibration
from churnsim.calibration.calibration_file import Calibration, LinkProfile, TierBandwidth
from churnsim.calibration.churn import NoChurn
from churnsim.calibration.convergence import ConvergenceSpec, MethodSetbacks, PowerLawLossCurve, SetbackSpec
from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import MethodConfig, NoneConfig
from churnsim.calibration.run_record import RunRecord
from churnsim.calibration.scenario import (
    ExplicitCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    StorageTier,
    TargetSpec,
    UniformNetwork,
)

from churnsim.calibration.failure_sampling import FailureEvent, sorted_events
from .iteration import simulate_iteration
from .method_extras import structural_extra_s, with_measured_method_extra
from .pipeline_state import build_pipeline_state
from .results import RunResult

# Tiers that die with their node (DESIGN.md section 2); any other tier name is taken to survive.
NODE_LOCAL_TIERS = frozenset({"host_memory", "local_disk"})
_PLACEHOLDER_CURVE = PowerLawLossCurve(floor_loss=0.0, scale=1.0, exponent=0.5)
_ZERO_SETBACKS = MethodSetbacks(interior=SetbackSpec(mean_iterations=0.0), edge=SetbackSpec(mean_iterations=0.0))


def timing_scenario(*, model: ModelSpec, pipeline: PipelineSpec, compute: ExplicitCompute, link: LinkProfile) -> Scenario:
    """A scenario that holds only the timing half of a calibration (no churn, one `none` method)."""
    return Scenario(
        name="calibration-timing",
        model=model,
        pipeline=pipeline,
        compute=compute,
        network=UniformNetwork(latency_s=link.latency_s, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s),
        churn=NoChurn(kind="none"),
        methods=(NoneConfig(),),
        convergence=ConvergenceSpec(baseline=_PLACEHOLDER_CURVE),
        target=TargetSpec(iterations=1),
    )


def iteration_predictor(*, link: LinkProfile) -> Callable[[ModelSpec, PipelineSpec, ExplicitCompute], float]:
    """`predict(model, pipeline, compute)`: the healthy in-order iteration time the simulator
    computes over `link`."""

    def predict(model: ModelSpec, pipeline: PipelineSpec, compute: ExplicitCompute) -> float:
        scenario = timing_scenario(model=model, pipeline=pipeline, compute=compute, link=link)
        return simulate_iteration(build_pipeline_state(scenario)).time_s

    return predict


def replay_storage(measured: Sequence[TierBandwidth], needed: Sequence[str]) -> tuple[StorageTier, ...]:
    """Storage tiers for replaying a local real run: every measured tier, plus every tier a method names.

    A named tier that was not measured takes the bandwidth of `local_disk` (or of the first measured
    tier): in a local run every "tier" is a directory on this machine's disks (approximation).
    Survival follows the name (`NODE_LOCAL_TIERS` die with the node).
    """
    by_name = {tier.name: tier for tier in measured}
    fallback = by_name.get("local_disk") or (measured[0] if measured else None)
    tiers = []
    for name in [*by_name, *(name for name in needed if name not in by_name)]:
        source = by_name.get(name) or fallback
        if source is None:
            write_bandwidth = read_bandwidth = 1e9  # nothing measured: an assumption, only used if a method writes
        else:
            write_bandwidth, read_bandwidth = source.write_bandwidth_bytes_per_s, source.read_bandwidth_bytes_per_s
        tiers.append(
            StorageTier(
                name=name,
                write_bandwidth_bytes_per_s=write_bandwidth,
                read_bandwidth_bytes_per_s=read_bandwidth,
                survives_node_loss=name not in NODE_LOCAL_TIERS,
            )
        )
    return tuple(tiers)


# -- replaying a run record (sim/checks/validate.py) ---------------------------------------------------


def replay_scenario(record: RunRecord, calibration: Calibration | None) -> Scenario:
    """The scenario a record is replayed in, under the record's stopping rule (module docstring)."""
    manifest = record.manifest
    if manifest.real_settings is None:
        assert manifest.scenario is not None
        scenario = manifest.scenario
        if calibration is not None:
            scenario = apply_calibration(scenario, calibration, mode="full")
        return scenario.model_copy(update={"churn": NoChurn(kind="none"), "replications": 1})
    if calibration is None:
        raise InputError(f"run record {manifest.run_id!r} is a real run: replaying it needs a calibration (--calibration FILE)")
    settings = manifest.real_settings
    base = Scenario(
        name=f"replay-{manifest.run_id}",
        description=f"replay of real run {manifest.run_id!r}",
        model=settings.model,
        pipeline=settings.pipeline,
        # Placeholders: the calibration replaces compute and network.
        compute=ExplicitCompute(block_forward_s=0.0, block_backward_s=0.0),
        network=UniformNetwork(latency_s=0.0, bandwidth_bytes_per_s=1.0),
        storage=replay_storage(calibration.storage, settings.method.tiers_used),
        churn=NoChurn(kind="none"),
        recovery=RecoverySpec(join_delay_s=0.0, restart_s=0.0),
        methods=(settings.method,),
        convergence=calibration.convergence,
        target=TargetSpec(iterations=settings.num_iterations),
        seed=manifest.seed,
    )
    # Charged here, at the calibrated speed, not in each run: the validator then scales the charged
    # replay by the run's own load (`_predict_real`), as it scales the rest of its compute.
    return with_measured_method_extra(apply_calibration(base, calibration, mode="full"), settings.method)


def method_extra_predictor(
    *, link: LinkProfile, storage: Sequence[TierBandwidth] = ()
) -> Callable[[ModelSpec, PipelineSpec, ExplicitCompute, MethodConfig], float]:
    """`predict(model, pipeline, compute, method)`: `structural_extra_s` over `link`, with the
    storage tiers the method names (`replay_storage`), for `Calibration.method_model_extra_s`."""

    def predict(model: ModelSpec, pipeline: PipelineSpec, compute: ExplicitCompute, method: MethodConfig) -> float:
        scenario = timing_scenario(model=model, pipeline=pipeline, compute=compute, link=link)
        scenario = scenario.model_copy(update={"storage": replay_storage(storage, method.tiers_used)})
        return structural_extra_s(scenario, method)

    return predict


def without_setbacks(scenario: Scenario) -> Scenario:
    """The scenario with no convergence cost of a rebuild, a stale reload or a restart from scratch: a
    real run executes its iterations whatever its loss does, so its wall-clock is predicted without them."""
    setbacks = {method: _ZERO_SETBACKS for method in scenario.convergence.setbacks}
    convergence = scenario.convergence.model_copy(
        update={"setbacks": setbacks, "stale_reload_costs_progress": False, "restart_from_scratch_costs_progress": False}
    )
    return scenario.model_copy(update={"convergence": convergence})


def replay_failures(record: RunRecord) -> tuple[FailureEvent, ...]:
    """The record's failures as simulator events at their measured times (module docstring)."""
    metrics = record.metrics.sort_values("step")
    events = []
    for failure in record.failures.failures:
        time_s = failure.time_s
        if time_s is None:
            before = metrics.loc[metrics["step"] < int(failure.iteration or 0), "wall_time_s"]  # type: ignore[arg-type]
            time_s = float(before.iloc[-1]) if not before.empty else 0.0
        events.append(FailureEvent(time_s=float(time_s), stage=failure.stage, replica=failure.replica, kind=failure.kind))  # type: ignore[arg-type]
    return sorted_events(events)


STEP_PLACEMENT_DELAY_S = 1e-6
"""A failure placed at a step boundary strikes this long after the next step began: the real trainer
checks for failures between steps, and the step that just began loses nothing measurable."""


def executed_step_time_s(result: RunResult, executed_steps: int) -> float | None:
    """When the simulated run began its step number `executed_steps` (counting from 0; rolled-back
    iterations count again), or None if it ended first.

    From the trajectory: a point closes each stretch of training, and progress only rises by
    training, so the executed count is the sum of the rises. A stretch's training comes last in it
    (a wait such as a checkpoint write follows the point before), so a step inside a stretch begins
    whole healthy iterations back from its end, and a step that begins a stretch begins after the
    boundary's work (as a real trainer finishes a checkpoint before it looks for failures).
    Approximation: inside a degraded stretch (redundant computation) the healthy iteration time is
    used.
    """
    executed = 0.0
    previous_progress = 0.0
    for time_s, progress in result.trajectory:
        rise = progress - previous_progress
        previous_progress = progress
        if rise <= 0:
            continue
        if executed + rise > executed_steps + 1e-9:
            return time_s - (executed + rise - executed_steps) * result.healthy_iteration_time_s
        executed += rise
    return None


def replay_failures_at_steps(record: RunRecord, simulate: Callable[[tuple[FailureEvent, ...]], RunResult]) -> tuple[FailureEvent, ...]:
    """The record's failures as simulator events at the simulated instants of the steps they struck.

    A real run's failure takes effect before one of its steps (the schedule's `iteration` counts the
    steps executed before it). Each failure, in step order, is placed where the simulated run, with
    the earlier failures placed, begins that step; failures of one step strike together. A failure
    after the simulated run's end is dropped. So a prediction keeps the run's failure pattern (which
    checkpoint a rollback returns to, which failures overlap) even where its speed differs from the
    run's, which replay at measured times does not (sim/checks/validate.py). Records whose failures lack a
    step are replayed at their measured times.

    A failure of the same step recorded later than a step's length after the first (`failure_rounds`)
    fell due while the earlier one's recovery ran (a hard failure's restart under torchrun's agent
    takes seconds, and the run makes no step meanwhile): it is placed where the simulated run, with the
    earlier one placed, begins that step again, so it costs its own recovery as it did in the run.
    """
    failures = record.failures.failures
    if not failures or any(failure.iteration is None for failure in failures):
        return replay_failures(record)
    placed: list[FailureEvent] = []
    gap_s = _median_step_s(record)
    ordered = sorted(failures, key=lambda failure: (failure.iteration, failure.time_s if failure.time_s is not None else 0.0, failure.stage, failure.replica))
    for step, same_step in itertools.groupby(ordered, key=lambda failure: int(failure.iteration)):  # type: ignore[arg-type]
        for same_round in failure_rounds(list(same_step), gap_s):
            time_s = executed_step_time_s(simulate(tuple(placed)), step)
            if time_s is None:
                return tuple(placed)
            placed += [
                FailureEvent(time_s=time_s + STEP_PLACEMENT_DELAY_S, stage=failure.stage, replica=failure.replica, kind=failure.kind)  # type: ignore[arg-type]
                for failure in same_round
            ]
    return tuple(placed)


def _median_step_s(record: RunRecord) -> float:
    """The run's median step after its first (`step_durations_s`); inf without two steps."""
    from churnsim.calibration.fit_timing import step_durations_s

    if getattr(record, "metrics", None) is None:  # a bare schedule (tests) has none: one round per step
        return float("inf")
    durations = step_durations_s(record).iloc[1:]  # the first step includes the run's start-up
    return float(durations.median()) if len(durations) else float("inf")


def failure_rounds(same_step: list, gap_s: float) -> list[list]:
    """The failures of one step (in time order) as rounds that struck together: a failure recorded
    more than `gap_s` after its round's first starts a new round; failures without a time join the first."""
    rounds: list[list] = []
    for failure in same_step:
        if rounds and (failure.time_s is None or rounds[-1][0].time_s is None or failure.time_s - rounds[-1][0].time_s <= gap_s):
            rounds[-1].append(failure)
        else:
            rounds.append([failure])
    return rounds
