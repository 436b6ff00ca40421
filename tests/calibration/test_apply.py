"""apply_calibration: which scenario fields a calibration replaces, in each mode."""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.apply import apply_calibration
from churnsim.calibration.calibration_file import (
    Calibration,
    LinkProfile,
    MeasuredDuration,
    Provenance,
    RecoveryTimes,
    StageTimings,
    TierBandwidth,
)
from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.convergence import ConvergenceSpec, MethodSetbacks, PowerLawLossCurve, SetbackSpec, default_setbacks
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import default_methods, preset
from churnsim.calibration.scenario import (
    ExplicitCompute,
    FlopsCompute,
    ModelSpec,
    PipelineSpec,
    RecoverySpec,
    Scenario,
    SiteNetwork,
    StorageTier,
    TargetSpec,
    UniformNetwork,
)

TINY_MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, sequence_length=16)
TINY_PIPELINE = PipelineSpec(num_stages=4, microbatch_size=2, num_microbatches=4)
MEASURED_INTERIOR = SetbackSpec(mean_iterations=12.0, ci95_low_iterations=8.0, ci95_high_iterations=16.0, num_samples=6)
CALIBRATED_CURVE = PowerLawLossCurve(floor_loss=1.2, scale=3.0, exponent=0.4, offset_iterations=5.0, r_squared=0.98)


def _duration(median_s: float) -> MeasuredDuration:
    return MeasuredDuration(median_s=median_s, interquartile_range_s=0.1 * median_s, num_samples=100)


def _calibration(*, measured: bool = True) -> Calibration:
    setbacks = default_setbacks()
    if measured:
        setbacks["checkfree"] = MethodSetbacks(interior=MEASURED_INTERIOR, edge=default_setbacks()["checkfree"].edge)
    return Calibration(
        name="tiny-cpu",
        provenance=Provenance(hardware={"machine": "x"}, package_versions={"python": "3"}, created_utc="2026-01-01T00:00:00+00:00"),
        model=TINY_MODEL,
        pipeline=TINY_PIPELINE,
        stage_timings=tuple(
            StageTimings(stage=s, block_forward=_duration(0.01 * (s + 1)), block_backward=_duration(0.02 * (s + 1))) for s in range(4)
        ),
        optimizer_step=_duration(0.004),
        iteration_overhead_s=0.05,
        activation_bytes=2048.0,
        link=LinkProfile(latency_s=2e-4, bandwidth_bytes_per_s=3e9, r_squared=0.99, num_points=30),
        storage=(
            TierBandwidth(name="local_disk", write_bandwidth_bytes_per_s=1.5e9, read_bandwidth_bytes_per_s=2.5e9),
            TierBandwidth(name="nvme_scratch", write_bandwidth_bytes_per_s=5e9, read_bandwidth_bytes_per_s=6e9),
        ),
        recovery={
            "checkfree": RecoveryTimes(join_s=2.0, transfer_s=0.3, rebuild_s=0.05, unrecorded_s=0.008, num_samples=3),
            "checkpoint": RecoveryTimes(join_s=4.0, load_s=0.5, unrecorded_s=0.04, num_samples=1),
            "copy": RecoveryTimes(transfer_s=0.2, num_samples=2),
        },
        convergence=ConvergenceSpec(baseline=CALIBRATED_CURVE, setbacks=setbacks, calibrated=True, source="calibration 'tiny-cpu'"),
    )


def _tiny_scenario() -> Scenario:
    return Scenario(
        name="tiny-cpu",
        model=TINY_MODEL,
        pipeline=TINY_PIPELINE,
        compute=FlopsCompute(peak_flops_per_s=1e11, optimizer_step_s=0.01),
        network=UniformNetwork(latency_s=1e-3, bandwidth_bytes_per_s=1e8, allreduce_latency_s=1e-3, allreduce_bandwidth_bytes_per_s=2e8),
        storage=(
            StorageTier(name="local_disk", write_bandwidth_bytes_per_s=1e9, read_bandwidth_bytes_per_s=1e9, latency_s=0.01, survives_node_loss=False),
            StorageTier(name="remote", write_bandwidth_bytes_per_s=1e8, read_bandwidth_bytes_per_s=1e8, survives_node_loss=True, shared=True),
        ),
        churn=StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.1),
        recovery=RecoverySpec(join_delay_s=30.0, restart_s=6.6),
        methods=default_methods(),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=1.0, scale=4.0, exponent=0.5, offset_iterations=10.0)),
        target=TargetSpec(loss=1.5),
    )


def test_full_mode_replaces_compute_network_storage_recovery_and_convergence():
    scenario, calibration = _tiny_scenario(), _calibration()
    applied = apply_calibration(scenario, calibration, mode="full")
    assert applied.compute == ExplicitCompute(
        block_forward_s=(0.01, 0.02, 0.03, 0.04),
        block_backward_s=(0.02, 0.04, 0.06, 0.08),
        optimizer_step_s=0.004 + 0.05,  # the iteration overhead rides on the optimizer step
    )
    assert applied.network == UniformNetwork(
        latency_s=2e-4, bandwidth_bytes_per_s=3e9, allreduce_latency_s=1e-3, allreduce_bandwidth_bytes_per_s=2e8
    )
    local_disk, remote = applied.storage
    assert (local_disk.write_bandwidth_bytes_per_s, local_disk.read_bandwidth_bytes_per_s) == (1.5e9, 2.5e9)
    assert (local_disk.latency_s, local_disk.survives_node_loss) == (0.01, False)
    assert remote == scenario.storage[1]  # not measured: unchanged; nvme_scratch is not added
    # join delay: sample-weighted mean of measured recovery.join (3 × 2 s, 1 × 4 s); each measured
    # method restarts in the time its recovery steps took beyond their spans, the others as before.
    assert applied.recovery == RecoverySpec(
        join_delay_s=2.5, restart_s=6.6, restart_s_by_method={"checkfree": 0.008, "checkpoint": 0.04, "copy": 0.0}
    )
    assert applied.recovery.restart_s_for("checkpoint") == 0.04 and applied.recovery.restart_s_for("redundant") == 6.6
    assert applied.convergence == calibration.convergence
    assert applied.convergence.calibrated is True
    assert applied.sources[-1].startswith("calibration 'tiny-cpu' (full)")
    # Everything else is the scenario's.
    for field in ("model", "pipeline", "churn", "methods", "target", "seed", "replications", "name"):
        assert getattr(applied, field) == getattr(scenario, field)


def test_full_mode_keeps_join_delay_when_no_join_was_measured():
    calibration = _calibration().model_copy(update={"recovery": {"copy": RecoveryTimes(transfer_s=0.2, num_samples=2)}})
    assert apply_calibration(_tiny_scenario(), calibration, mode="full").recovery == RecoverySpec(
        join_delay_s=30.0, restart_s=6.6, restart_s_by_method={"copy": 0.0}
    )


def test_full_mode_on_another_model_raises_and_points_to_setbacks_mode():
    with pytest.raises(InputError, match=r"does not run the calibrated setup \(model.hidden_size = 512 .*no compute model to scale.*use mode 'setbacks'"):
        apply_calibration(preset("checkfree-124m-geo-10pct"), _calibration(), mode="full")
    other_pipeline = _tiny_scenario().model_copy(update={"pipeline": TINY_PIPELINE.model_copy(update={"num_microbatches": 8})})
    with pytest.raises(InputError, match="pipeline.num_microbatches = 8 in the scenario, 4 in the calibration"):
        apply_calibration(other_pipeline, _calibration(), mode="full")


def test_full_mode_with_a_target_below_the_calibrated_floor_raises():
    scenario = _tiny_scenario().model_copy(update={"target": TargetSpec(loss=1.1)})
    with pytest.raises(InputError, match="with calibration 'tiny-cpu'.*floor"):
        apply_calibration(scenario, _calibration(), mode="full")


def test_setbacks_mode_takes_only_measured_setbacks_unscaled():
    scenario, calibration = preset("checkfree-500m-geo-10pct"), _calibration()
    applied = apply_calibration(scenario, calibration, mode="setbacks")
    convergence = applied.convergence
    assert convergence.setbacks["checkfree"].interior == MEASURED_INTERIOR
    # Unmeasured positions and methods keep the scenario's setbacks.
    assert convergence.setbacks["checkfree"].edge == scenario.convergence.setbacks["checkfree"].edge
    assert convergence.setbacks["copy"] == scenario.convergence.setbacks["copy"]
    assert convergence.baseline == scenario.convergence.baseline
    assert convergence.setback_scale == 1.0
    assert convergence.calibrated is True
    assert "calibration 'tiny-cpu'" in convergence.source and "checkfree/interior" in convergence.source
    assert "setback_scale" in convergence.source  # the transfer assumption is stated
    for field in ("model", "pipeline", "compute", "network", "storage", "churn", "recovery", "methods", "target"):
        assert getattr(applied, field) == getattr(scenario, field)
    assert math.isclose(applied.convergence.setback_iterations("checkfree", "interior"), 12.0)


def test_setbacks_mode_without_measured_setbacks_raises():
    with pytest.raises(InputError, match="none measured from at least"):
        apply_calibration(preset("checkfree-500m-geo-10pct"), _calibration(measured=False), mode="setbacks")


def test_setbacks_that_grow_with_training_progress_are_not_carried_to_another_model():
    calibration = _calibration(measured=True)
    growing = {
        method: setbacks.model_copy(update={"interior": setbacks.interior.model_copy(update={"per_progress_iteration": 0.4})})
        for method, setbacks in calibration.convergence.setbacks.items()
    }
    calibration = calibration.model_copy(update={"convergence": calibration.convergence.model_copy(update={"setbacks": growing})})
    with pytest.raises(InputError, match="grow with training progress"):
        apply_calibration(preset("checkfree-500m-geo-10pct"), calibration, mode="setbacks")


def test_unknown_mode_raises():
    with pytest.raises(InputError, match="mode 'partial' is not known"):
        apply_calibration(_tiny_scenario(), _calibration(), mode="partial")  # type: ignore[arg-type]


def test_full_mode_replaces_a_site_network_by_the_measured_uniform_link():
    scenario = _tiny_scenario().model_copy(update={"network": SiteNetwork(sites=("a", "b"), allreduce_latency_s=0.5)})
    network = apply_calibration(scenario, _calibration(), mode="full").network
    assert isinstance(network, UniformNetwork)
    assert (network.latency_s, network.allreduce_latency_s) == (2e-4, 0.5)
