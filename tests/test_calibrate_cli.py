"""`churnsim calibrate --runs` and `churnsim validate` on small synthetic real-run records (no torch)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.calibration_file import load_calibration
from churnsim.calibration.convergence import PowerLawLossCurve
from churnsim.calibration.failures import ScheduledFailure
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.run_record import RealRunSettings, RunManifest, make_run_record, write_run_record
from churnsim.calibration.scenario import ModelSpec, PipelineSpec
from churnsim.calibration.tables import VALIDATION_COLUMNS
from churnsim.cli import main

NUM_STAGES = 4
NUM_MICROBATCHES = 2
NUM_ITERATIONS = 80
FORWARD_S = 0.002
BACKWARD_S = 0.004
OPTIMIZER_S = 0.001
OVERHEAD_S = 0.01
EVAL_EVERY = 40
EVAL_S = 0.05
CURVE = PowerLawLossCurve(floor_loss=2.0, scale=4.0, exponent=0.6, offset_iterations=5.0)
FAILURES = ((30, 1), (55, 0))
SETBACK = {0: 8.0, 1: 4.0, 2: 4.0, 3: 8.0}  # by stage: edge stages lose more


def _record(directory: Path, *, method: str, seed: int, failures=()) -> Path:
    """A real-run record whose steps take the closed-form GPipe/1F1B time plus a fixed overhead."""
    rng = np.random.default_rng(seed)
    iteration_s = (NUM_MICROBATCHES + NUM_STAGES - 1) * (FORWARD_S + BACKWARD_S) + OPTIMIZER_S + OVERHEAD_S
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
            lost += SETBACK[stage]
        for stage in range(NUM_STAGES):
            for microbatch in range(NUM_MICROBATCHES):
                for kind, seconds in (("forward", FORWARD_S), ("backward", BACKWARD_S)):
                    spans.append(dict(rank=stage, stage=stage, iteration=step, kind=kind, microbatch=microbatch, start_s=start, end_s=start + seconds))
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="optimizer", microbatch=None, start_s=start, end_s=start + OPTIMIZER_S))
        wall_s = start + iteration_s * (1 + 0.01 * rng.standard_normal())
        evaluated = (step + 1) % EVAL_EVERY == 0
        if evaluated:
            spans.append(dict(rank=NUM_STAGES - 1, stage=NUM_STAGES - 1, iteration=step, kind="eval", microbatch=None, start_s=wall_s, end_s=wall_s + EVAL_S))
            wall_s += EVAL_S
        loss = CURVE.loss(step - lost) * (1 + 0.002 * rng.standard_normal())
        metrics.append(dict(step=step, iteration=step, wall_time_s=wall_s, train_loss=loss, eval_loss=loss if evaluated else math.nan))
    settings = RealRunSettings(
        model=ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, sequence_length=64,
                        weight_bytes_per_parameter=4.0, activation_bytes_per_element=4.0),
        pipeline=PipelineSpec(num_stages=NUM_STAGES, microbatch_size=2, num_microbatches=NUM_MICROBATCHES),
        method=method_from_name(method),
        num_iterations=NUM_ITERATIONS,
        learning_rate=1e-3,
        eval_every_iterations=EVAL_EVERY,
    )
    run_id = f"{method}-s{seed}"
    manifest = RunManifest(run_id=run_id, source="real", method=method, seed=seed, real_settings=settings)
    return write_run_record(make_run_record(manifest, metrics, spans, failure_rows), directory / run_id)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    fit = root / "fit"
    for seed in (0, 1):
        _record(fit, method="none", seed=seed)
    _record(fit, method="checkfree", seed=0, failures=FAILURES)
    sizes = np.array([1024.0, 65536.0, 1048576.0, 16777216.0])
    pd.DataFrame({"bytes": sizes, "seconds": 1e-4 + sizes / 2e9}).to_csv(fit / "link_profile.csv", index=False)
    pd.DataFrame([dict(name="local_disk", num_bytes=2**25, write_s=0.2, read_s=0.05)]).to_csv(fit / "storage.csv", index=False)
    out = root / "tiny.json"
    main(["calibrate", "--runs", str(fit), "--out", str(out)])
    return root, out


def test_calibrate_from_existing_records_writes_a_loadable_calibration(calibrated):
    _, out = calibrated
    calibration = load_calibration(str(out))
    assert set(calibration.provenance.fit_run_ids) == {"none-s0", "none-s1", "checkfree-s0"}
    assert [timing.stage for timing in calibration.stage_timings] == list(range(NUM_STAGES))
    assert calibration.stage_timings[1].block_forward.median_s == pytest.approx(FORWARD_S)
    assert calibration.link.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert calibration.storage[0].write_bandwidth_bytes_per_s == pytest.approx(2**25 / 0.2)
    assert calibration.evaluation is not None and calibration.evaluation.median_s == pytest.approx(EVAL_S)
    assert calibration.convergence.calibrated
    assert calibration.convergence.setbacks["checkfree"].interior.num_samples == 1
    assert "checkfree" in calibration.recovery


def test_validate_replays_held_out_real_records_close_to_measured(calibrated):
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
