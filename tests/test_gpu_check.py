"""benchmarks/gpu_check.py's CPU dry run: the parts the GPU check runs (ring of point-to-point
messages, calibration, held-out runs with stage processes killed, validation) on gloo with tiny
sizes. The GPU paths themselves (NCCL, CUDA events, `calibrate --device cuda`) run only on a GPU
machine; this checks the script around them, so that it works when one is at hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
SCRIPT = REPOSITORY / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_the_dry_run_kills_checkfree_plus_stages_calibrates_and_validates(tmp_path):
    environment = dict(os.environ, PYTHONPATH=str(REPOSITORY))
    work, out = tmp_path / "work", tmp_path / "gpu-check.json"
    finished = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--methods", "checkfree_plus", "--work-dir", str(work),
         "--out", str(out), "--no-report", "--budget-s", "400"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=environment,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"environment", "point_to_point", "calibrate", "held_out", "kill_schedule", "validate"}
    ring = result["point_to_point"]
    assert ring["all_received"] and ring["backend"] == ["gloo"] and ring["exit_codes"] == [0, 0]
    assert ring["span_timing"] == ["host clock"] and ring["spans_ordered"] and min(ring["forward_span_s"]) > 0
    assert result["calibrate"]["exit_code"] == 0 and (work / "calibration.json").is_file()
    twin, killed = result["held_out"]["none"], result["held_out"]["checkfree_plus"]
    assert (twin["exit_code"], twin["hard_recoveries"]) == (0, 0)
    assert (killed["failure_mode"], killed["exit_code"]) == ("hard", 0)
    assert killed["hard_recoveries"] >= 1 and killed["final_loss_finite"]
    assert [kill["stage"] for kill in result["kill_schedule"]["kills"]] == [1, 3]
    validated = result["validate"]
    assert validated["exit_code"] == 0 and validated["num_rows"] > 0
    assert "total_wall_clock_s" in validated["relative_error"]["checkfree_plus"]

def test_without_cuda_the_gpu_check_refuses_with_one_line():
    finished = subprocess.run([sys.executable, str(SCRIPT), "--no-report"], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPOSITORY), CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert finished.returncode == 2
    assert finished.stderr.strip().startswith("gpu_check: no CUDA device here")
    assert "Traceback" not in finished.stderr
