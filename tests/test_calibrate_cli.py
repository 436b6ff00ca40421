"""`churnsim calibrate --runs` and `churnsim validate` on small synthetic real-run records (no torch)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.calibration_file import LinkProfile, load_calibration
from churnsim.calibration.compute_cost import ComputeCostModel, PhysicalHopCost, setup_description, setup_fingerprint
from churnsim.calibration.convergence import PowerLawLossCurve
from churnsim.calibration.failures import ScheduledFailure
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.run_record import RealRunSettings, RunManifest, make_run_record, write_run_record
from churnsim.calibration.scenario import ModelSpec, PipelineSpec
from churnsim.calibration.speed_uncertainty import run_speed_log_sd
from churnsim.calibration.tables import VALIDATION_COLUMNS
from churnsim.cli import main
from churnsim.sim.checks.validate import OWN_SETUP_CALIBRATION_ADVICE
from churnsim.sim.model.calibrated import iteration_predictor

NUM_STAGES = 4
NUM_MICROBATCHES = 2
NUM_ITERATIONS = 80
OPTIMIZER_S = 0.001
OVERHEAD_S = 0.01
EVAL_EVERY = 40
EVAL_S = 0.05
CURVE = PowerLawLossCurve(floor_loss=2.0, scale=4.0, exponent=0.6, offset_iterations=5.0)
FAILURES = ((30, 1), (55, 0))
EDGE_SETBACK, INTERIOR_SETBACK = 8.0, 4.0
LINK = LinkProfile(latency_s=1e-4, bandwidth_bytes_per_s=2e9)
# Hop work of the synthetic machine (calibration.compute_cost): what a calibration must recover.
TRUE_FORWARD = PhysicalHopCost(fixed_s=5e-4, seconds_per_operation=5e-6, seconds_per_matmul_flop=5e-11, seconds_per_byte=2e-10, seconds_per_message=3e-4)
TRUE_BACKWARD = PhysicalHopCost(fixed_s=1e-3, seconds_per_operation=5e-6, seconds_per_matmul_flop=5e-11, seconds_per_byte=2e-10, seconds_per_message=5e-4)
TRUE_COSTS = ComputeCostModel(
    forward=TRUE_FORWARD, backward=TRUE_BACKWARD, optimizer_fixed_s=OPTIMIZER_S, optimizer_seconds_per_parameter=0.0,
    iteration_overhead_s=0.0, num_configurations=1, hop_relative_residual=0.0,
)
MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, sequence_length=64,
                  weight_bytes_per_parameter=4.0, activation_bytes_per_element=4.0)
CALIBRATED_PIPELINE = PipelineSpec(num_stages=NUM_STAGES, microbatch_size=2, num_microbatches=NUM_MICROBATCHES)
# No-failure runs of other setups: they tell the compute model how work grows.
SHAPES = (
    CALIBRATED_PIPELINE.model_copy(update={"num_stages": 2}),
    CALIBRATED_PIPELINE.model_copy(update={"num_microbatches": 4}),
    CALIBRATED_PIPELINE.model_copy(update={"microbatch_size": 4}),
)


def _record(
    directory: Path, *, method: str, seed: int, failures=(), pipeline: PipelineSpec = CALIBRATED_PIPELINE, run_id: str | None = None, speed: float = 1.0,
    overhead_per_stage_microbatch_s: float = 0.0, device: str = "cpu",
) -> Path:
    """A real-run record on a machine whose hops cost TRUE_COSTS: each step takes the simulator's
    iteration of that compute plus a fixed overhead and `overhead_per_stage_microbatch_s` per
    (stage, microbatch) (±1 % noise); `speed` 1.1: this run's machine computes 10 % slower."""
    rng = np.random.default_rng(seed)
    true_compute = TRUE_COSTS.compute_for(MODEL, pipeline)
    compute = true_compute.model_copy(
        update={name: tuple(speed * value for value in getattr(true_compute, name)) for name in ("block_forward_s", "block_backward_s")}
    )
    iteration_s = (
        iteration_predictor(link=LINK)(MODEL, pipeline, compute)
        + OVERHEAD_S
        + overhead_per_stage_microbatch_s * pipeline.num_stages * pipeline.num_microbatches
    )
    num_stages = pipeline.num_stages
    failed = dict(failures)
    spans, metrics, failure_rows, wall_s, lost = [], [], [], 0.0, 0.0
    for step in range(NUM_ITERATIONS):
        start = wall_s
        if step in failed:
            stage = failed[step]
            failure_rows.append(ScheduledFailure(time_s=wall_s, iteration=step, stage=stage, kind="stage_failure"))
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="recovery.join", microbatch=None, start_s=start, end_s=start + 0.001))
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="recovery.transfer", microbatch=None, start_s=start, end_s=start + 0.002))
            start += 0.003
            lost += EDGE_SETBACK if stage in (0, num_stages - 1) else INTERIOR_SETBACK
        for stage in range(num_stages):
            for microbatch in range(pipeline.num_microbatches):
                for kind, seconds in (("forward", compute.block_forward_s[stage]), ("backward", compute.block_backward_s[stage])):
                    spans.append(dict(rank=stage, stage=stage, iteration=step, kind=kind, microbatch=microbatch, start_s=start, end_s=start + seconds))
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="optimizer", microbatch=None, start_s=start, end_s=start + OPTIMIZER_S))
        wall_s = start + iteration_s * (1 + 0.01 * rng.standard_normal())
        evaluated = (step + 1) % EVAL_EVERY == 0
        if evaluated:
            spans.append(dict(rank=num_stages - 1, stage=num_stages - 1, iteration=step, kind="eval", microbatch=None, start_s=wall_s, end_s=wall_s + EVAL_S))
            wall_s += EVAL_S
        loss = CURVE.loss(step - lost) * (1 + 0.002 * rng.standard_normal())
        metrics.append(dict(step=step, iteration=step, wall_time_s=wall_s, train_loss=loss, eval_loss=loss if evaluated else math.nan))
    settings = RealRunSettings(
        model=MODEL,
        pipeline=pipeline,
        method=method_from_name(method),
        num_iterations=NUM_ITERATIONS,
        learning_rate=1e-3,
        eval_every_iterations=EVAL_EVERY,
        device=device,
    )
    run_id = run_id or f"{method}-s{seed}"
    manifest = RunManifest(run_id=run_id, source="real", method=method, seed=seed, real_settings=settings)
    return write_run_record(make_run_record(manifest, metrics, spans, failure_rows), directory / run_id)


def _calibrate(
    root: Path, *, speeds: tuple[float, float, float] = (1.0, 1.0, 1.0), overhead_per_stage_microbatch_s: float = 0.0, device: str = "cpu",
) -> Path:
    """`churnsim calibrate --runs` on the calibrated setup's three runs, at `speeds`, and the shapes."""
    fit = root / "fit"
    overhead = {"overhead_per_stage_microbatch_s": overhead_per_stage_microbatch_s, "device": device}
    for seed in (0, 1):
        _record(fit, method="none", seed=seed, speed=speeds[seed], **overhead)
    _record(fit, method="checkfree", seed=0, failures=FAILURES, speed=speeds[2], **overhead)
    for index, pipeline in enumerate(SHAPES):
        _record(fit, method="none", seed=0, pipeline=pipeline, run_id=f"shape-{index}", **overhead)
    sizes = np.array([1024.0, 65536.0, 1048576.0, 16777216.0])
    pd.DataFrame({"bytes": sizes, "seconds": LINK.latency_s + sizes / LINK.bandwidth_bytes_per_s}).to_csv(fit / "link_profile.csv", index=False)
    pd.DataFrame([dict(name="local_disk", num_bytes=2**25, write_s=0.2, read_s=0.05)]).to_csv(fit / "storage.csv", index=False)
    out = root / "tiny.json"
    main(["calibrate", "--runs", str(fit), "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    return root, _calibrate(root)


def test_calibrate_from_existing_records_writes_a_loadable_calibration(calibrated):
    _, out = calibrated
    calibration = load_calibration(str(out))
    assert set(calibration.provenance.fit_run_ids) == {"none-s0", "none-s1", "checkfree-s0", "shape-0", "shape-1", "shape-2"}
    assert [timing.stage for timing in calibration.stage_timings] == list(range(NUM_STAGES))
    true_compute = TRUE_COSTS.compute_for(MODEL, CALIBRATED_PIPELINE)
    assert calibration.stage_timings[1].block_forward.median_s == pytest.approx(true_compute.block_forward_s[1])
    assert calibration.iteration_overhead_s == pytest.approx(OVERHEAD_S, rel=0.05)
    assert calibration.link.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert calibration.storage[0].write_bandwidth_bytes_per_s == pytest.approx(2**25 / 0.2)
    assert calibration.evaluation is not None and calibration.evaluation.median_s == pytest.approx(EVAL_S)
    assert calibration.convergence.calibrated
    assert calibration.convergence.setbacks["checkfree"].interior.num_samples == 1
    assert "checkfree" in calibration.recovery


def test_calibrate_from_records_takes_their_device_unless_told(tmp_path, assert_one_line_error):
    out = _calibrate(tmp_path / "gpu", device="cuda")  # link and storage files beside them: nothing measured here
    assert load_calibration(str(out)).device == "cuda"
    overridden = tmp_path / "as-cpu.json"
    main(["calibrate", "--runs", str(tmp_path / "gpu" / "fit"), "--device", "cpu", "--out", str(overridden)])
    assert load_calibration(str(overridden)).device == "cpu"
    _record(tmp_path / "gpu" / "fit", method="none", seed=5, run_id="a-cpu-run", device="cpu")
    mixed = tmp_path / "mixed.json"
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "calibrate", "--runs", str(tmp_path / "gpu" / "fit"), "--out", str(mixed)],
        capture_output=True, text=True, timeout=120,
    )
    assert_one_line_error(result, "the records ran on cpu and cuda", "--device")
    assert not mixed.exists()


def test_validate_replays_held_out_real_records_close_to_measured(calibrated, capsys):
    root, calibration = calibrated
    held_out = root / "held-out"
    _record(held_out, method="none", seed=7)
    _record(held_out, method="checkfree", seed=8, failures=((20, 2), (50, 3)))
    out = root / "validation"
    main(["validate", "--calibration", str(calibration), str(held_out), "--out", str(out), "--no-figures"])
    table = pd.read_csv(out / "validation.csv")
    assert list(table.columns) == list(VALIDATION_COLUMNS)
    assert set(table["run_id"]) == {"none-s7", "checkfree-s8"}
    wall_clock = table[table["quantity"] == "total_wall_clock_s"]
    # The records follow the simulator's own closed form (+1 % noise): the replay must be close.
    assert (wall_clock["relative_error"].abs() < 0.03).all(), wall_clock
    printed = " ".join(capsys.readouterr().out.split())
    assert "load-normalised" in printed and "machine speed: the 2 real runs' steady steps were" in printed
    assert not any("compute model" in note for note in json.loads((out / "manifest.json").read_text())["notes"])  # its own setup


def test_validate_refuses_a_fit_run_with_one_line(calibrated):
    root, calibration = calibrated
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "validate", "--calibration", str(calibration), str(root / "fit" / "none-s0"), "--no-figures",
         "--out", str(root / "refused")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("churnsim: error: ") and "was used to fit calibration" in result.stderr
    assert "Traceback" not in result.stderr


def test_calibration_fits_the_machine_s_compute_model_on_four_setups(calibrated):
    _, out = calibrated
    compute_model = load_calibration(str(out)).compute_model
    assert compute_model is not None and compute_model.num_configurations == 4 and compute_model.shared_cores is None
    assert set(compute_model.fitted_setups) == {setup_fingerprint(MODEL, pipeline) for pipeline in (CALIBRATED_PIPELINE, *SHAPES)}
    assert compute_model.physical and compute_model.slowdown_per_extra_process_per_core == 0.0  # a device per stage
    assert compute_model.fitted_hidden_sizes == (64,) and compute_model.fitted_sequence_lengths == (64,)
    # These four setups vary stages and tokens, not width or sequence: FLOPs, bytes and operations
    # grow together in them, so the fit cannot tell the speeds apart (tests/calibration/
    # test_compute_cost.py recovers them from a suite that varies width); it must still give every
    # setup's hops, and those of a pipeline between them, as the machine did.
    between = CALIBRATED_PIPELINE.model_copy(update={"num_microbatches": 3, "microbatch_size": 3})
    for pipeline in (CALIBRATED_PIPELINE, *SHAPES, between):
        for fitted, true in zip(compute_model.hop_work_s(MODEL, pipeline), TRUE_COSTS.hop_work_s(MODEL, pipeline)):
            assert np.asarray(fitted) == pytest.approx(np.asarray(true), rel=0.02)
    assert compute_model.hop_relative_residual < 0.01
    assert compute_model.iteration_overhead_s == pytest.approx(OVERHEAD_S, rel=0.05)


def test_validate_predicts_setups_the_calibration_did_not_run_from_its_compute_model(calibrated):
    root, calibration = calibrated
    two_stages = CALIBRATED_PIPELINE.model_copy(update={"num_stages": 2, "num_microbatches": 3, "schedule": "gpipe"})
    other = CALIBRATED_PIPELINE.model_copy(update={"num_microbatches": 3, "microbatch_size": 3, "schedule": "gpipe"})
    held_out = root / "held-out-other-setups"
    _record(held_out, method="none", seed=9, pipeline=two_stages, run_id="two-stages-none-s9")
    _record(held_out, method="none", seed=9, pipeline=other)
    # Interior failures only: the synthetic runs resume in place, as CheckFree does for an interior stage.
    _record(held_out, method="checkfree", seed=9, failures=((20, 1), (50, 2)), pipeline=other)
    # A held-out run of a setup the calibration ran only as a shape of its compute model's fit.
    _record(held_out, method="none", seed=9, pipeline=SHAPES[0], run_id="shape-setup-none-s9")
    out = root / "validation-other-setups"
    main(["validate", "--calibration", str(calibration), str(held_out), "--out", str(out), "--no-figures"])
    table = pd.read_csv(out / "validation.csv")
    assert not table["calibrated_setup"].any()
    shape_setup = setup_description(MODEL, SHAPES[0])
    assert set(table["setup"]) == {"2 stages × 3 microbatches of 2, gpipe, 4 layers d64 seq 64", "4 stages × 3 microbatches of 3, gpipe, 4 layers d64 seq 64", shape_setup}
    wall_clock = table[table["quantity"] == "total_wall_clock_s"]
    assert set(wall_clock["run_id"]) == {"two-stages-none-s9", "none-s9", "checkfree-s9", "shape-setup-none-s9"}
    assert (wall_clock["relative_error"].abs() < 0.03).all(), wall_clock
    assert (wall_clock["load_normalised_relative_error"].abs() < 0.03).all(), wall_clock
    # The failure run's goal is its no-failure twin's loss, reached through the calibrated setbacks.
    target = table[(table["quantity"] == "time_to_target_s") & (table["run_id"] == "checkfree-s9")]
    assert abs(float(target["relative_error"].iloc[0])) < 0.10, target
    # The output says once per setup that it was predicted through the compute model (and whether the
    # fit measured that setup), then once how to do better.
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    through_the_model = [note for note in notes if "predicted through its compute model" in note]
    assert len(through_the_model) == 3
    assert [note for note in through_the_model if "ran among its compute model's shapes" in note] == [
        f"runs of {shape_setup}, a setup calibration {load_calibration(str(calibration)).name!r} ran among its compute model's shapes "
        "but not as its calibrated setup, are predicted through its compute model"
    ]
    advice = [note for note in notes if "churnsim calibrate --quick --set" in note]
    assert advice == [OWN_SETUP_CALIBRATION_ADVICE] and notes[-1] == OWN_SETUP_CALIBRATION_ADVICE


def test_validate_states_the_carry_to_each_setup_with_the_machine_s_speed_cancelled(calibrated, capsys):
    # Every held-out run on a machine 20 % slower than at calibration; the 2-stage runs 30 % slower
    # still, as a carry that misses would make them.
    root, calibration = calibrated
    two_stages = CALIBRATED_PIPELINE.model_copy(update={"num_stages": 2})
    gpipe = CALIBRATED_PIPELINE.model_copy(update={"schedule": "gpipe"})
    held_out = root / "held-out-carry"
    _record(held_out, method="none", seed=11, speed=1.2, run_id="calibrated-none-s11")
    _record(held_out, method="none", seed=11, pipeline=gpipe, speed=1.2, run_id="gpipe-none-s11")
    _record(held_out, method="none", seed=11, pipeline=two_stages, speed=1.2 * 1.3, run_id="two-stages-none-s11")
    capsys.readouterr()
    main(["validate", "--calibration", str(calibration), str(held_out), "--out", str(root / "validation-carry"), "--no-figures"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "the compute model's carry, with the machine's speed cancelled" in printed
    carry = {setup: float(ratio) for setup, ratio in re.findall(r"(\d+ stages × [^:;]+): (\d+\.\d+)×", printed)}
    assert set(carry) == {setup_description(MODEL, gpipe), setup_description(MODEL, two_stages)}
    assert carry[setup_description(MODEL, gpipe)] == pytest.approx(1.0, abs=0.02)
    assert 1.15 < carry[setup_description(MODEL, two_stages)] < 1.3


def test_an_overhead_that_grows_with_stages_and_microbatches_carries_to_other_pipelines(tmp_path):
    # Each (stage, microbatch) adds 2 ms to a step: 2 stages × 5 microbatches pay 20 ms, a setup the calibration did not run.
    per_stage_microbatch_s = 0.002
    calibration_file = _calibrate(tmp_path, overhead_per_stage_microbatch_s=per_stage_microbatch_s)
    compute_model = load_calibration(str(calibration_file)).compute_model
    assert compute_model is not None
    assert compute_model.overhead_per_stage_microbatch_s == pytest.approx(per_stage_microbatch_s, rel=0.05)
    assert compute_model.iteration_overhead_s == pytest.approx(OVERHEAD_S, rel=0.1)
    held_out = tmp_path / "held-out"
    other = CALIBRATED_PIPELINE.model_copy(update={"num_stages": 2, "num_microbatches": 5})
    _record(held_out, method="none", seed=9, pipeline=other, run_id="two-stages-none-s9", overhead_per_stage_microbatch_s=per_stage_microbatch_s)
    out = tmp_path / "validation"
    main(["validate", "--calibration", str(calibration_file), str(held_out), "--out", str(out), "--no-figures"])
    table = pd.read_csv(out / "validation.csv")
    wall_clock = table[table["quantity"] == "total_wall_clock_s"]
    assert (wall_clock["relative_error"].abs() < 0.03).all(), wall_clock


def test_validate_predicts_each_run_within_the_machine_s_measured_speed_spread(tmp_path, capsys):
    # Calibration runs 5 % apart in speed: the predictions carry a 95 % interval of about ±10 %.
    calibration_file = _calibrate(tmp_path, speeds=(0.95, 1.0, 1.05))
    factors = sorted(load_calibration(str(calibration_file)).run_speed_factors.values())
    assert factors == pytest.approx([0.95, 1.0, 1.05], rel=0.01)
    held_out = tmp_path / "held-out"
    _record(held_out, method="none", seed=7)
    _record(held_out, method="checkfree", seed=8, failures=((20, 2), (50, 3)), speed=1.3, run_id="checkfree-slow-s8")
    out = tmp_path / "validation"
    main(["validate", "--calibration", str(calibration_file), str(held_out), "--out", str(out), "--no-figures"])
    wall_clock = pd.read_csv(out / "validation.csv").set_index(["run_id", "quantity"]).xs("total_wall_clock_s", level="quantity")
    low, high = wall_clock["predicted_ci95_low"], wall_clock["predicted_ci95_high"]
    assert ((low < wall_clock["predicted"]) & (wall_clock["predicted"] < high)).all(), wall_clock
    assert (high / low).between(1.15, 1.3).all(), high / low
    assert low["none-s7"] <= wall_clock.at["none-s7", "measured"] <= high["none-s7"]
    assert wall_clock.at["checkfree-slow-s8", "measured"] > high["checkfree-slow-s8"]
    printed = " ".join(capsys.readouterr().out.split())
    assert "1 of 2 real runs' total wall-clock fell inside the prediction's 95 % interval" in printed and "(1 slower, 0 faster)" in printed
    # The held-out runs' own spread, ready to carry into a scenario: of their measured steady steps
    # over the predicted ones (the slow run's compute took 1.3×, its fixed overhead did not).
    steady = pd.read_csv(out / "validation.csv").query("quantity == 'steady_iteration_s'")
    spread = np.std(np.log(steady["measured"] / steady["predicted"]), ddof=1)
    assert 0.1 < spread < np.log(1.3)
    assert f"--set compute.run_speed_log_sd={spread:.3f}" in printed


def test_a_calibration_without_a_speed_spread_gives_no_interval(calibrated):
    root, calibration = calibrated
    # Every calibration run computed at the same speed: no spread to carry.
    assert run_speed_log_sd(load_calibration(str(calibration)).run_speed_factors.values()) == 0.0
    held_out = root / "held-out-no-spread"
    _record(held_out, method="none", seed=7)
    main(["validate", "--calibration", str(calibration), str(held_out), "--out", str(root / "validation-no-spread"), "--no-figures"])
    table = pd.read_csv(root / "validation-no-spread" / "validation.csv")
    assert table["predicted_ci95_low"].isna().all() and table["predicted_ci95_high"].isna().all()


def test_a_no_failure_run_s_time_to_target_waits_for_its_smoothed_loss(calibrated):
    # Without a twin the goal (the run's smoothed loss at 75 % of its steps) is reached through the
    # calibrated curve, smoothed the same way: the raw curve reaches it about half a smoothing
    # window earlier, 8 % of this run's time to target.
    root, calibration = calibrated
    held_out = root / "held-out-no-failures"
    _record(held_out, method="none", seed=11)
    out = root / "validation-no-failures"
    main(["validate", "--calibration", str(calibration), str(held_out), "--out", str(out), "--no-figures"])
    table = pd.read_csv(out / "validation.csv")
    target = table[table["quantity"] == "time_to_target_s"]
    assert abs(float(target["relative_error"].iloc[0])) < 0.03, target


# -- the machine's speed probe: absolute, load-normalised and the machine's drift apart -----------


def _with_reference(calibration_path: Path, copy: Path, **reference) -> Path:
    """A copy of the calibration with a speed reference of the current probe's workload (`reference` overrides)."""
    from churnsim.calibration.calibration_file import SpeedReference, save_calibration
    from churnsim.real.speed_probe import PROBE_WORKLOAD

    fields = dict(workload=PROBE_WORKLOAD, probe_s=0.05, num_repeats=3, measured_utc="2026-01-01T00:00:00+00:00") | reference
    calibration = load_calibration(str(calibration_path))
    save_calibration(calibration.model_copy(update={"speed_reference": SpeedReference(**fields)}), str(copy))
    return copy


def test_the_speed_reference_round_trips_in_the_calibration_file(tmp_path, capsys):
    from churnsim.calibration.builtin import resolve_calibration
    from churnsim.calibration.calibration_file import save_calibration
    from churnsim.calibration_report import print_calibration
    from churnsim.real.speed_probe import PROBE_WORKLOAD, measure_speed_reference

    reference = measure_speed_reference(num_repeats=3)
    assert reference.workload == PROBE_WORKLOAD and reference.probe_s > 0 and reference.num_repeats == 3
    path = tmp_path / "with-reference.json"
    save_calibration(resolve_calibration("cpu-tiny").model_copy(update={"speed_reference": reference}), str(path))
    assert load_calibration(str(path)).speed_reference == reference
    print_calibration(load_calibration(str(path)))
    assert "speed reference: the probe took" in " ".join(capsys.readouterr().out.split())


def test_validate_reports_absolute_and_load_normalised_error_and_the_probe_s_slowdown(calibrated, tmp_path):
    root, calibration = calibrated
    # A reference 1000× slower than any probe here: the machine reads as much faster now, whatever its load.
    with_reference = _with_reference(calibration, tmp_path / "probed.json", probe_s=1000.0)
    held_out = tmp_path / "held-out"
    _record(held_out, method="none", seed=17)
    out = tmp_path / "validation"
    main(["validate", "--calibration", str(with_reference), str(held_out), "--out", str(out), "--no-figures"])
    table = pd.read_csv(out / "validation.csv")
    wall_clock = table[table["quantity"] == "total_wall_clock_s"].iloc[0]
    assert math.isfinite(wall_clock["relative_error"]) and math.isfinite(wall_clock["load_normalised_relative_error"])
    assert (table["machine_slowdown_at_validation"] < 0.01).all() and (table["machine_slowdown_at_validation"] > 0).all()
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    assert any(note.startswith("machine speed against calibration time: the speed probe ran") and "faster" in note for note in notes)


@pytest.mark.parametrize(
    "reference, arguments, reason",
    [
        (None, [], "holds no speed reference"),
        ({}, ["--no-speed-probe"], "--no-speed-probe was given"),
        ({"workload": "an-older-probe-v0"}, [], "the reference times workload 'an-older-probe-v0'"),
    ],
)
def test_a_validation_whose_probe_was_not_run_says_so_and_why(calibrated, tmp_path, reference, arguments, reason):
    root, calibration = calibrated
    # The fixture's records say nothing of their hardware, so its calibration has no reference: an old file's case.
    assert load_calibration(str(calibration)).speed_reference is None
    chosen = calibration if reference is None else _with_reference(calibration, tmp_path / "probed.json", **reference)
    held_out = tmp_path / "held-out"
    _record(held_out, method="none", seed=18)
    out = tmp_path / "validation"
    main(["validate", "--calibration", str(chosen), str(held_out), "--out", str(out), "--no-figures", *arguments])
    table = pd.read_csv(out / "validation.csv")
    assert table["machine_slowdown_at_validation"].isna().all() and table["relative_error"].notna().any()
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    assert any(note.startswith("machine speed against calibration time: not measured") and reason in note for note in notes), notes


def test_a_calibration_of_another_machine_is_not_probed(calibrated, tmp_path):
    from churnsim.calibration.calibration_file import save_calibration

    root, calibration = calibrated
    probed = load_calibration(str(_with_reference(calibration, tmp_path / "probed.json")))
    hardware = probed.provenance.hardware | {"processor": "another-processor"}
    elsewhere = tmp_path / "elsewhere.json"
    save_calibration(probed.model_copy(update={"provenance": probed.provenance.model_copy(update={"hardware": hardware})}), str(elsewhere))
    held_out = tmp_path / "held-out"
    _record(held_out, method="none", seed=19)
    out = tmp_path / "validation"
    main(["validate", "--calibration", str(elsewhere), str(held_out), "--out", str(out), "--no-figures"])
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    assert any("not measured (this is not the machine" in note and "another-processor there" in note for note in notes), notes


def test_refreshing_the_speed_reference_changes_nothing_else(calibrated, tmp_path):
    root, calibration = calibrated
    path = _with_reference(calibration, tmp_path / "probed.json", probe_s=1000.0)
    before = load_calibration(str(path))
    main(["calibrate", "--refresh-speed-reference", "--out", str(path)])
    after = load_calibration(str(path))
    assert after.speed_reference is not None and after.speed_reference.probe_s < 1000.0
    assert after.model_dump(exclude={"speed_reference"}) == before.model_dump(exclude={"speed_reference"})


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (["--out", "missing.json"], "--out missing.json: no calibration file there"),
        (["--out", "c.json", "--quick"], "--refresh-speed-reference changes only the speed reference of the --out file: drop --quick"),
    ],
)
def test_refreshing_refuses_in_one_line(tmp_path, assert_one_line_error, arguments, fragment):
    (tmp_path / "c.json").write_text("{}")
    result = subprocess.run([sys.executable, "-m", "churnsim", "calibrate", "--refresh-speed-reference", *arguments],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert_one_line_error(result, fragment)
    assert (tmp_path / "c.json").read_text() == "{}"


def test_refreshing_a_calibration_of_another_machine_is_refused_and_leaves_it_as_it_was(calibrated, tmp_path, assert_one_line_error):
    from churnsim.calibration.calibration_file import save_calibration

    root, calibration = calibrated
    probed = load_calibration(str(_with_reference(calibration, tmp_path / "probed.json")))
    hardware = probed.provenance.hardware | {"processor": "another-processor"}
    elsewhere = tmp_path / "elsewhere.json"
    save_calibration(probed.model_copy(update={"provenance": probed.provenance.model_copy(update={"hardware": hardware})}), str(elsewhere))
    before = elsewhere.read_bytes()
    result = subprocess.run([sys.executable, "-m", "churnsim", "calibrate", "--refresh-speed-reference", "--out", str(elsewhere)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert_one_line_error(result, "was made on another machine", "another-processor there", "refresh it there")
    assert elsewhere.read_bytes() == before
