"""Hard-failure costs fitted per component from recoveries.csv (calibration/hard_failure_costs.py):
a synthetic table with known components is recovered, few points are said to be few, the fitted
survivors' restart scales with another scenario's stage, and a calibration made before the fit
existed still loads and charges what it charged."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from churnsim.calibration.apply import apply_calibration
from churnsim.calibration.builtin import load_builtin_calibration
from churnsim.calibration.calibration_file import Calibration, load_calibration, save_calibration
from churnsim.calibration.errors import InputError
from churnsim.calibration.hard_failure_costs import agent_recovery_points, fit_hard_failure_costs
from churnsim.calibration.presets import cpu_tiny
from churnsim.calibration.run_record import read_recoveries
from churnsim.calibration.scenario import ModelSpec, PipelineSpec, TrainingSpec, stage_parameter_counts

DETECTION_S = 0.08
AGENT_RESTART_S = 0.3
PROCESS_START_S = 2.5  # without the reload
RELOAD_LATENCY_S = 0.004
RELOAD_BANDWIDTH = 2e8
BYTES_PER_PARAMETER = 12.0
RENDEZVOUS_S = 0.003
PIPELINE = PipelineSpec(num_stages=4, microbatch_size=1, num_microbatches=4)


def _model(hidden_size: int) -> ModelSpec:
    return ModelSpec(num_layers=4, hidden_size=hidden_size, num_heads=4, vocab_size=256, sequence_length=32)


def _recoveries(model: ModelSpec, failed_stages: list[int], *, noise_s: float = 0.0) -> pd.DataFrame:
    """recoveries.csv rows of one run under the agent, its parts the constants above."""
    parameters = stage_parameter_counts(model, PIPELINE)
    rows = []
    for index, failed in enumerate(failed_stages):
        survivors = [count for stage, count in enumerate(parameters) if stage != failed]
        transfer_bytes = 4096.0 * (index + 1) * model.hidden_size / 32
        reload_s = RELOAD_LATENCY_S + max(survivors) * BYTES_PER_PARAMETER / RELOAD_BANDWIDTH + (noise_s if index % 2 else -noise_s)
        rows.append(
            {
                "step": 3 + index, "failure_mode": "hard", "failed_stages": json.dumps([failed]), "degraded": False,
                "join_s": PROCESS_START_S + reload_s + 0.2, "rendezvous_s": RENDEZVOUS_S, "transfer_s": 0.001 + transfer_bytes / 1e9,
                "network_bytes": transfer_bytes, "detection_s": DETECTION_S, "agent_restart_s": AGENT_RESTART_S,
                "process_start_s": PROCESS_START_S + reload_s, "survivor_reload_s": reload_s,
                "survivor_reload_bytes": sum(survivors) * BYTES_PER_PARAMETER, "survivor_restart_s": AGENT_RESTART_S + PROCESS_START_S + reload_s,
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


def _points(hidden_sizes=(32, 64, 128), failed=(1, 2)):
    return [agent_recovery_points(_recoveries(_model(hidden), list(failed)), _model(hidden), PIPELINE) for hidden in hidden_sizes]


def test_a_synthetic_table_with_known_components_is_recovered():
    costs = fit_hard_failure_costs(_points())
    assert costs is not None and costs.num_recoveries == 6
    assert costs.detection.median_s == pytest.approx(DETECTION_S) and costs.detection.num_points == 6
    assert costs.agent_restart.median_s == pytest.approx(AGENT_RESTART_S)
    assert costs.process_start.median_s == pytest.approx(PROCESS_START_S)
    assert costs.rendezvous.median_s == pytest.approx(RENDEZVOUS_S)
    assert costs.snapshot_bytes_per_parameter == pytest.approx(BYTES_PER_PARAMETER)
    reload = costs.survivor_reload
    assert reload.latency_s == pytest.approx(RELOAD_LATENCY_S, rel=1e-6)
    assert reload.bandwidth_bytes_per_s == pytest.approx(RELOAD_BANDWIDTH, rel=1e-6)
    assert reload.r_squared == pytest.approx(1.0) and reload.num_points == 6 and not reload.note
    # The composed survivors' restart reproduces every measured one, from the kill.
    assert costs.survivor_restart_check.num_points == 6 and costs.survivor_restart_check.median_relative_error == pytest.approx(0.0, abs=1e-9)
    assert costs.survivor_restart_check.r_squared == pytest.approx(1.0)
    assert costs.state_transfer is not None and costs.state_transfer.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    assert costs.state_transfer.latency_s == pytest.approx(0.001, rel=1e-6)


def test_the_survivors_restart_scales_with_another_scenario_s_largest_stage():
    costs = fit_hard_failure_costs(_points())
    wide = _model(512)
    largest = max(stage_parameter_counts(wide, PIPELINE))
    expected = DETECTION_S + AGENT_RESTART_S + PROCESS_START_S + RELOAD_LATENCY_S + largest * BYTES_PER_PARAMETER / RELOAD_BANDWIDTH
    assert costs.survivor_restart_s(wide, PIPELINE) == pytest.approx(expected, rel=1e-6)
    assert costs.survivor_restart_s(wide, PIPELINE) > costs.survivor_restart_s(_model(32), PIPELINE)


def test_process_start_is_fitted_in_core_seconds_and_charged_at_the_predicted_setup_s_processes_per_core():
    # Runs of 4 stages on 2 shared cores start 2 processes per core at once: each start took twice its
    # core-seconds. The fit takes that out; a prediction puts back the processes per core it predicts.
    shared = fit_hard_failure_costs(
        [agent_recovery_points(_recoveries(_model(hidden), [1, 2]), _model(hidden), PIPELINE, shared_cores=2) for hidden in (32, 64, 128)]
    )
    assert shared.process_start.median_s == pytest.approx(PROCESS_START_S / 2)
    assert shared.survivor_restart_check.median_relative_error == pytest.approx(0.0, abs=1e-9)
    two_stages = PipelineSpec(num_stages=2, microbatch_size=1, num_microbatches=4)
    eight_processes = PipelineSpec(num_stages=4, microbatch_size=1, num_microbatches=4, data_parallel_degree=2)
    assert shared.process_start_s(PIPELINE, 2) == pytest.approx(PROCESS_START_S)
    assert shared.process_start_s(two_stages, 2) == pytest.approx(PROCESS_START_S / 2)  # a core each
    assert shared.process_start_s(eight_processes, 2) == pytest.approx(2 * PROCESS_START_S)
    assert shared.process_start_s(eight_processes, None) == pytest.approx(PROCESS_START_S / 2)  # a device each
    assert shared.replacement_start_s(eight_processes, 2) == pytest.approx(DETECTION_S + AGENT_RESTART_S + 2 * PROCESS_START_S)


def test_few_points_are_said_to_be_few_and_get_no_r_squared():
    costs = fit_hard_failure_costs(_points(hidden_sizes=(64,), failed=(1,)))
    assert costs is not None and costs.num_recoveries == 1
    assert any("only 1 hard-failure recovery" in note for note in costs.notes)
    assert costs.survivor_reload.r_squared is None and "latency not separated" in costs.survivor_reload.note
    assert costs.survivor_restart_check.r_squared is None
    # Total bytes over total seconds: the one point is reproduced, and larger stages still reload longer.
    point = _points(hidden_sizes=(64,), failed=(1,))[0].iloc[0]
    assert costs.survivor_reload.seconds_for(point["largest_survivor_bytes"]) == pytest.approx(point["survivor_reload_s"])


def test_runs_without_the_agent_give_no_costs():
    soft = _recoveries(_model(64), [1]).assign(failure_mode="soft")
    assert fit_hard_failure_costs([agent_recovery_points(soft, _model(64), PIPELINE)]) is None
    older = _recoveries(_model(64), [1]).drop(columns=["survivor_restart_s"])  # a record from before the agent
    assert fit_hard_failure_costs([agent_recovery_points(older, _model(64), PIPELINE)]) is None


def test_the_calibration_sets_a_hard_failure_scenario_s_survivor_restart_and_nothing_else_s():
    calibration = load_builtin_calibration("cpu-tiny")[0]
    costs = fit_hard_failure_costs(_points())
    fitted = calibration.model_copy(update={"hard_failure_costs": costs})
    hard = cpu_tiny().model_copy(update={"training": TrainingSpec(failure_mode="hard")})
    applied = apply_calibration(hard, fitted, mode="full")
    assert applied.recovery.survivor_restart_s == pytest.approx(costs.survivor_restart_s(hard.model, hard.pipeline, applied.compute.shared_cores))
    assert applied.survivor_restart_charged_s > PROCESS_START_S
    soft = apply_calibration(cpu_tiny(), fitted, mode="full")
    assert soft.survivor_restart_charged_s == 0.0


def test_an_old_calibration_file_loads_and_charges_no_survivor_restart(tmp_path):
    calibration = load_builtin_calibration("cpu-tiny")[0]
    data = json.loads(calibration.model_dump_json())
    data.pop("hard_failure_costs", None)  # as written before the field existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_calibration(str(path))
    assert old.hard_failure_costs is None
    hard = cpu_tiny().model_copy(update={"training": TrainingSpec(failure_mode="hard")})
    applied = apply_calibration(hard, old, mode="full")
    assert applied.recovery.survivor_restart_s == 0.0 and applied.survivor_restart_charged_s == 0.0
    # The rest of the old charge is unchanged by the new field.
    assert applied.recovery.model_dump(exclude={"survivor_restart_s"}) == apply_calibration(hard, calibration, mode="full").recovery.model_dump(
        exclude={"survivor_restart_s"}
    )
    # And a calibration with fitted costs round-trips through its file.
    fitted = calibration.model_copy(update={"hard_failure_costs": fit_hard_failure_costs(_points())})
    save_calibration(fitted, str(tmp_path / "new.json"))
    assert load_calibration(str(tmp_path / "new.json")).hard_failure_costs == fitted.hard_failure_costs
    assert isinstance(fitted, Calibration)


def test_a_bad_recoveries_table_is_refused_with_its_line(tmp_path):
    table = _recoveries(_model(64), [1, 2])
    table.to_csv(tmp_path / "recoveries.csv", index=False)
    assert read_recoveries(tmp_path)["survivor_restart_s"].notna().all()
    table = table.astype({"survivor_restart_s": object})
    table.loc[1, "survivor_restart_s"] = "soon"
    table.to_csv(tmp_path / "recoveries.csv", index=False)
    with pytest.raises(InputError, match=r"recoveries.csv: line 3: column survivor_restart_s holds 'soon'"):
        read_recoveries(tmp_path)
    assert read_recoveries(tmp_path / "nowhere") is None
    # An older run's table without the columns of the agent path still loads, and gives no costs.
    pd.DataFrame({"step": [3], "join_s": [0.5]}).to_csv(tmp_path / "recoveries.csv", index=False)
    older = read_recoveries(tmp_path)
    assert older["join_s"].tolist() == [0.5] and agent_recovery_points(older, _model(64), PIPELINE).empty


def test_calibrate_s_report_shows_each_part_with_its_points_and_r_squared(capsys):
    from churnsim.calibration_report import print_calibration

    calibration = load_builtin_calibration("cpu-tiny")[0]
    print_calibration(calibration.model_copy(update={"hard_failure_costs": fit_hard_failure_costs(_points(hidden_sizes=(64,), failed=(1,)))}))
    shown = capsys.readouterr().out
    assert "a hard failure's restart under torchrun's agent (1" in shown and "survivors' reload" in shown
    assert "note: only 1 hard-failure recovery" in shown
    print_calibration(calibration)
    assert "torchrun's agent" not in capsys.readouterr().out


def test_a_quick_calibration_s_components_give_the_replacement_start_and_a_rendezvous_to_every_method():
    """The suite's hard-failure run does not say its join delay and runs one method: the components
    give the replacement's start after a scenario's configured delay, and every soft-measured method
    its soft restart plus the fitted rendezvous."""
    from churnsim.calibration.apply import recovery_for_failure_mode
    from churnsim.calibration.calibration_file import RecoveryTimes
    from churnsim.calibration.scenario import RecoverySpec

    calibration = load_builtin_calibration("cpu-tiny")[0]
    costs = fit_hard_failure_costs(_points())
    measured_once = {"checkfree": RecoveryTimes(join_s=2.9, rendezvous_s=0.004, unrecorded_s=0.02, num_samples=2)}  # process start not told apart
    fitted = calibration.model_copy(update={"hard_failure_costs": costs, "hard_failure_recovery": measured_once})
    hard = recovery_for_failure_mode(RecoverySpec(), fitted, "hard", 2.0)
    assert hard.join_delay_s == pytest.approx(2.0 + DETECTION_S + AGENT_RESTART_S + PROCESS_START_S)
    assert hard.restart_s_for("checkfree") == pytest.approx(0.024)
    soft_checkpoint = calibration.recovery["checkpoint"]
    assert hard.restart_s_for("checkpoint") == pytest.approx(RENDEZVOUS_S + soft_checkpoint.unrecorded_s)
    # Without the components the old charge stays: the measured join whole, the soft restart.
    old = recovery_for_failure_mode(RecoverySpec(), calibration.model_copy(update={"hard_failure_recovery": measured_once}), "hard", 2.0)
    assert old.join_delay_s == pytest.approx(2.9) and old.restart_s_for("checkpoint") == pytest.approx(soft_checkpoint.unrecorded_s)
