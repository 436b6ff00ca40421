"""The validator: a simulated record replayed with the calibration it implies is predicted exactly;
bad records and fitted runs are refused with one clear message."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.calibration_file import (
    Calibration,
    LinkProfile,
    MeasuredDuration,
    Provenance,
    StageTimings,
    TierBandwidth,
)
from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve
from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import method_from_name
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
from churnsim.calibration.tables import VALIDATION_COLUMNS
from churnsim.sim.studies.outputs import write_simulated_run_records
from churnsim.calibration.failure_sampling import FailureEvent
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
from churnsim.sim.model.calibrated import STEP_PLACEMENT_DELAY_S, executed_step_time_s, replay_failures_at_steps
from churnsim.sim.model.run import simulate_run
from churnsim.sim.checks.validate import QUANTITIES, SMOOTHING_ITERATIONS, progress_for_smoothed_loss, validate_runs

FORWARD_S = (0.010, 0.012, 0.011, 0.014)
BACKWARD_S = (0.020, 0.024, 0.022, 0.028)
OPTIMIZER_S = 0.003


def _scenario() -> Scenario:
    return Scenario(
        name="validate-me",
        model=ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, sequence_length=64),
        pipeline=PipelineSpec(num_stages=4, microbatch_size=8, num_microbatches=4),
        compute=ExplicitCompute(block_forward_s=FORWARD_S, block_backward_s=BACKWARD_S, optimizer_step_s=OPTIMIZER_S),
        network=UniformNetwork(latency_s=1e-4, bandwidth_bytes_per_s=1e9),
        storage=(
            StorageTier(name="local_disk", write_bandwidth_bytes_per_s=2e8, read_bandwidth_bytes_per_s=1e9, survives_node_loss=False),
            StorageTier(name="remote", write_bandwidth_bytes_per_s=5e7, read_bandwidth_bytes_per_s=1e8, survives_node_loss=True),
        ),
        churn=StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=0.1),
        recovery=RecoverySpec(join_delay_s=0.5, restart_s=0.2),
        methods=(method_from_name("checkfree"), method_from_name("checkpoint", interval_iterations=20), method_from_name("none")),
        convergence=ConvergenceSpec(baseline=PowerLawLossCurve(floor_loss=2.0, scale=10.0, exponent=0.5, offset_iterations=10.0)),
        target=TargetSpec(loss=2.8),
        seed=3,
    )


def calibration_implied_by(scenario: Scenario, *, fit_run_ids: tuple[str, ...] = ()) -> Calibration:
    """The calibration whose measurements are exactly the scenario's assumptions."""
    compute, network = scenario.compute, scenario.network
    assert isinstance(compute, ExplicitCompute) and isinstance(network, UniformNetwork)

    def duration(value: float) -> MeasuredDuration:
        return MeasuredDuration(median_s=value, num_samples=1)

    return Calibration(
        name="implied",
        provenance=Provenance(hardware={}, package_versions={}, created_utc="2026-01-01T00:00:00+00:00", fit_run_ids=fit_run_ids),
        model=scenario.model,
        pipeline=scenario.pipeline,
        stage_timings=tuple(
            StageTimings(stage=stage, block_forward=duration(forward), block_backward=duration(backward))
            for stage, (forward, backward) in enumerate(zip(compute.block_forward_s, compute.block_backward_s))  # type: ignore[arg-type]
        ),
        optimizer_step=duration(compute.optimizer_step_s),
        activation_bytes=scenario.activation_bytes,
        link=LinkProfile(latency_s=network.latency_s, bandwidth_bytes_per_s=network.bandwidth_bytes_per_s),
        storage=tuple(
            TierBandwidth(name=tier.name, write_bandwidth_bytes_per_s=tier.write_bandwidth_bytes_per_s, read_bandwidth_bytes_per_s=tier.read_bandwidth_bytes_per_s)
            for tier in scenario.storage
        ),
        convergence=scenario.convergence,
    )


@pytest.fixture(scope="module")
def simulated_records(tmp_path_factory):
    scenario = _scenario()
    # Interior, edge, a failure of a stage that is still down, and one during a recovery.
    failures = (
        FailureEvent(time_s=5.0, stage=1, kind="stage_hourly"),
        FailureEvent(time_s=12.0, stage=0, kind="stage_hourly"),
        FailureEvent(time_s=12.1, stage=0, kind="stage_hourly"),
        FailureEvent(time_s=12.3, stage=2, kind="stage_hourly"),
        FailureEvent(time_s=20.0, stage=3, kind="stage_hourly"),
    )
    results = [simulate_run(scenario, method, failures, seed=scenario.seed) for method in scenario.methods]
    assert all(len(result.failures) >= 3 for result in results)  # the replay has failures to replay
    directory = tmp_path_factory.mktemp("records")
    return scenario, write_simulated_run_records(directory, scenario, results, {})


def test_simulated_record_replayed_with_its_own_calibration_has_zero_error(simulated_records):
    scenario, paths = simulated_records
    report = validate_runs(paths, calibration_implied_by(scenario))
    table = report.table
    assert list(table.columns) == list(VALIDATION_COLUMNS)
    assert len(table) == len(paths) * len(QUANTITIES)
    assert set(table["quantity"]) == set(QUANTITIES)
    assert (table["measured"].to_numpy() == table["predicted"].to_numpy()).all()
    assert (table["relative_error"] == 0.0).all()
    checkpoint = table[(table["method"] == "checkpoint") & (table["quantity"] == "checkpoint_stall_s")]
    assert checkpoint["measured"].iloc[0] > 0  # a non-trivial quantity was compared, not only zeros


def test_simulated_record_validates_without_a_calibration(simulated_records):
    _, paths = simulated_records
    table = validate_runs(paths[:1], None).table
    assert (table["relative_error"] == 0.0).all()


def test_validating_a_run_the_calibration_was_fitted_on_is_refused(simulated_records):
    scenario, paths = simulated_records
    fitted = json.loads((paths[0] / "manifest.json").read_text())["run_id"]
    with pytest.raises(InputError, match="was used to fit calibration 'implied'.*held-out"):
        validate_runs(paths, calibration_implied_by(scenario, fit_run_ids=(fitted,)))


def _with_manifest_changed(record, directory, change) -> None:
    """A copy of `record` in `directory` whose manifest `change` (a function of its JSON data) edits."""
    directory.mkdir()
    for name in ("metrics.csv", "spans.csv", "failures.csv"):
        (directory / name).write_bytes((record / name).read_bytes())
    manifest = json.loads((record / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_malformed_manifest_error_names_the_file_and_the_field(simulated_records, tmp_path):
    _, paths = simulated_records
    broken = tmp_path / "broken"
    _with_manifest_changed(paths[0], broken, lambda manifest: manifest.update(seed="not-a-seed"))
    with pytest.raises(InputError) as error:
        validate_runs([broken], None)
    message = str(error.value)
    assert "manifest.json" in message and "'seed'" in message


def test_malformed_metrics_error_names_the_file_and_the_column(simulated_records, tmp_path):
    _, paths = simulated_records
    broken = tmp_path / "broken-metrics"
    broken.mkdir()
    for name in ("manifest.json", "spans.csv", "failures.csv"):
        (broken / name).write_bytes((paths[0] / name).read_bytes())
    metrics = pd.read_csv(paths[0] / "metrics.csv").astype({"wall_time_s": object})
    metrics.loc[2, "wall_time_s"] = "soon"
    metrics.to_csv(broken / "metrics.csv", index=False)
    with pytest.raises(InputError) as error:
        validate_runs([broken], None)
    message = str(error.value)
    assert "metrics.csv" in message and "'wall_time_s'" in message and "row 2" in message


@pytest.mark.parametrize(("field", "value", "said"), [
    ("healthy_iteration_time_s", "fast", "healthy_iteration_time_s (not a number)"),
    ("wall_clock_s", None, "wall_clock_s (not a number)"),
    ("reached_target", "yes", "reached_target (not true or false)"),
])
def test_a_simulated_records_summary_of_the_wrong_type_is_refused(simulated_records, tmp_path, field, value, said):
    _, paths = simulated_records
    broken = tmp_path / "broken-summary"
    _with_manifest_changed(paths[0], broken, lambda manifest: manifest["summary"].update({field: value}))
    with pytest.raises(InputError, match=re.escape(f"manifest.json field 'summary' has {said}; re-write the record")):
        validate_runs([broken], None)


def test_a_directory_without_records_is_refused(tmp_path):
    with pytest.raises(InputError, match="neither a run record"):
        validate_runs([tmp_path], None)


def _failure_record(*step_and_stages: tuple[int, int]):
    """The part of a real run's record that step placement reads: failures with their step (and a time
    that would land elsewhere on another machine)."""
    failures = tuple(ScheduledFailure(time_s=0.5 * step, iteration=step, stage=stage) for step, stage in step_and_stages)
    return SimpleNamespace(failures=FailureSchedule(failures=failures))


@pytest.mark.parametrize("speed_factor", [0.5, 1.0, 1.7])
def test_failures_replayed_at_their_steps_keep_the_run_s_rollbacks_at_any_speed(speed_factor):
    """Checkpoints every 10 iterations: a failure before step 20 finds the checkpoint of iteration 20
    written (nothing rolled back), one before step 35 rolls back 5 (to 30), two together before step
    62 (progress 57) roll back 7 more, however fast the machine is."""
    scenario = _scenario()
    compute = scenario.compute
    scaled = compute.model_copy(update={
        "block_forward_s": tuple(value * speed_factor for value in compute.block_forward_s),
        "block_backward_s": tuple(value * speed_factor for value in compute.block_backward_s),
    })
    scenario = scenario.model_copy(update={"compute": scaled, "target": TargetSpec(iterations=100)})
    method = method_from_name("checkpoint", interval_iterations=10)

    def simulate(events):
        return simulate_run(scenario, method, events)

    placed = replay_failures_at_steps(_failure_record((20, 3), (35, 1), (62, 0), (62, 2), (400, 3)), simulate)
    assert [event.stage for event in placed] == [3, 1, 0, 2]  # the failure after the run's end is dropped
    assert placed[2].time_s == placed[3].time_s
    result = simulate(placed)
    assert result.iterations_executed == 100 + 0 + 5 + 7
    for event, step in zip(placed, (20, 35, 62, 62)):
        earlier = simulate(tuple(other for other in placed if other.time_s < event.time_s))
        assert executed_step_time_s(earlier, step) == pytest.approx(event.time_s - STEP_PLACEMENT_DELAY_S, abs=1e-12)


def test_a_step_begins_after_the_work_at_its_boundary():
    scenario = _scenario().model_copy(update={"target": TargetSpec(iterations=50)})
    method = method_from_name("checkpoint", interval_iterations=10)
    healthy = simulate_run(scenario, method, ())
    step_s = healthy.healthy_iteration_time_s
    begins = [executed_step_time_s(healthy, step) for step in range(50)]
    assert begins[0] == 0.0
    assert begins[9] - begins[8] == pytest.approx(step_s)
    assert begins[10] - begins[9] > step_s * 1.01  # the checkpoint write of iteration 10 comes first
    assert begins[49] == pytest.approx(healthy.wall_clock_s - step_s)
    assert executed_step_time_s(healthy, 50) is None
    failed = simulate_run(scenario, method, (FailureEvent(time_s=25.5 * step_s, stage=2, kind="poisson"),))
    assert failed.iterations_executed > 50
    assert executed_step_time_s(failed, failed.iterations_executed - 1) == pytest.approx(failed.wall_clock_s - step_s)
    assert executed_step_time_s(failed, failed.iterations_executed) is None


def _validation_rows(run_id: str, method: str, *, steady_measured_s: float, steady_predicted_s: float, wall_error: float, normalised_error: float | None):
    """The rows of one run that `machine_speed` and `median_absolute_error` read (other columns NaN)."""
    wall_rows = {"run_id": run_id, "method": method, "quantity": "total_wall_clock_s", "measured": 100.0, "predicted": 100.0 * (1 + wall_error),
                 "relative_error": wall_error, "load_normalised_relative_error": float("nan") if normalised_error is None else normalised_error}
    steady_rows = {"run_id": run_id, "method": method, "quantity": "steady_iteration_s", "measured": steady_measured_s,
                   "predicted": steady_predicted_s, "relative_error": steady_predicted_s / steady_measured_s - 1,
                   "load_normalised_relative_error": float("nan")}
    return [wall_rows, steady_rows]


def test_machine_speed_is_each_real_run_s_steady_step_over_the_prediction():
    from churnsim.sim.checks.validate import machine_speed, median_absolute_error

    rows = (
        _validation_rows("a", "checkfree", steady_measured_s=0.9, steady_predicted_s=1.0, wall_error=-0.10, normalised_error=0.01)
        + _validation_rows("b", "checkfree", steady_measured_s=1.0, steady_predicted_s=1.0, wall_error=0.02, normalised_error=-0.03)
        + _validation_rows("c", "redundant", steady_measured_s=2.4, steady_predicted_s=2.0, wall_error=0.20, normalised_error=0.05)
        # A simulated record has no load-normalised prediction: not a measurement of the machine.
        + _validation_rows("d", "redundant", steady_measured_s=5.0, steady_predicted_s=1.0, wall_error=0.0, normalised_error=None)
    )
    table = pd.DataFrame(rows)
    speed = machine_speed(table)
    assert speed is not None and speed.num_runs == 3
    assert speed.median_factor == pytest.approx(1.0)
    assert (speed.lowest_factor, speed.highest_factor) == (pytest.approx(0.9), pytest.approx(1.2))
    assert speed.scatter == pytest.approx(0.1)  # median of |0.9 − 1|, 0, |1.2 − 1|
    assert speed.log_standard_deviation == pytest.approx(np.std(np.log([0.9, 1.0, 1.2]), ddof=1))
    errors = median_absolute_error(table).set_index("method")
    assert errors.loc["checkfree", "num_runs"] == 2
    assert errors.loc["checkfree", "median_absolute_relative_error"] == pytest.approx(0.06)
    # Two runs, 2 % and 10 % off: the median's interval spans them (a bootstrap of two values).
    assert (errors.loc["checkfree", "median_absolute_relative_error_ci95_low"], errors.loc["checkfree", "median_absolute_relative_error_ci95_high"]) == (
        pytest.approx(0.02), pytest.approx(0.10))
    assert errors.loc["checkfree", "median_load_normalised_absolute_relative_error"] == pytest.approx(0.02)
    assert errors.loc["redundant", "median_load_normalised_absolute_relative_error"] == pytest.approx(0.05)
    assert machine_speed(table[table["run_id"] == "d"]) is None


@pytest.mark.parametrize("target_loss", [2.5, 2.9, 3.4])
def test_the_goal_s_progress_is_where_the_curve_s_trailing_mean_first_reaches_it(target_loss):
    curve = PowerLawLossCurve(floor_loss=2.0, scale=4.0, exponent=0.6, offset_iterations=5.0)
    progress = progress_for_smoothed_loss(curve, target_loss)
    smoothed = pd.Series([curve.loss(float(iteration)) for iteration in range(progress + 1)]).rolling(SMOOTHING_ITERATIONS, min_periods=1).mean()
    # `progress` iterations executed: the last one, progress − 1, is the first whose trailing mean is at the goal.
    assert smoothed.iloc[progress - 1] <= target_loss < smoothed.iloc[progress - 2]
    assert progress > curve.progress_for_loss(target_loss) + 1  # later than the curve itself
