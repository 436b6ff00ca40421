"""The calibrate-and-validate benchmark's carry figure (benchmarks/calibrate_and_validate.py,
`carry_by_setup`): a setup's steady step over its prediction, over the calibrated setup's in the
same round, so that the machine's speed in each round cancels and the compute model's miss stays."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate_and_validate.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("calibrate_and_validate", _BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _round(index: int, machine_speed: float, setup_miss: dict[str, float]) -> pd.DataFrame:
    """One round's validation rows: every run's steady step predicted at 0.1 s and measured slower by
    the round's machine speed, and a setup's runs by its miss as well."""
    rows = []
    for method in ("checkpoint", "checkfree", "redundant"):
        rows.append((f"r{index}-calibrated-{method}-120-per-hour-s1", 0.1 * machine_speed))
        for setup, miss in setup_miss.items():
            rows.append((f"r{index}-{setup}-{method}-s1", 0.1 * machine_speed * miss))
    rows.append((f"r{index}-calibrated-none-twin-s1", 0.1 * machine_speed))
    return pd.DataFrame(
        [{"run_id": run_id, "quantity": "steady_iteration_s", "measured": measured, "predicted": 0.1} for run_id, measured in rows]
        + [{"run_id": run_id, "quantity": "total_wall_clock_s", "measured": 9.0, "predicted": 8.0} for run_id, _ in rows]
    )


def test_the_carry_takes_out_the_machine_s_speed_and_keeps_the_setup_s_miss():
    benchmark = _benchmark()
    # The machine ran 0.8× to 1.3× the calibration's speed; 3 stages ran 12 % over the carry, GPipe 5 %.
    tables = [_round(index, speed, {"3-stages": 1.12, "gpipe": 1.05, "6-stages": 1.0}) for index, speed in enumerate((0.8, 1.0, 1.3, 1.1))]
    carry = benchmark.carry_by_setup(tables)
    assert set(carry) == {"3-stages", "gpipe", "6-stages"}
    assert carry["3-stages"]["steady_step_over_prediction"] == pytest.approx(1.12)
    assert carry["gpipe"]["steady_step_over_prediction"] == pytest.approx(1.05)
    assert carry["6-stages"]["steady_step_over_prediction"] == pytest.approx(1.0)
    assert carry["3-stages"]["rounds"] == 4 and carry["3-stages"]["ci95"] == pytest.approx([1.12, 1.12])


def test_the_carry_interval_spans_the_rounds_that_disagree():
    benchmark = _benchmark()
    tables = [_round(index, 1.0, {"3-stages": miss}) for index, miss in enumerate((1.05, 1.10, 1.15, 1.20, 1.10))]
    carry = benchmark.carry_by_setup(tables)["3-stages"]
    assert carry["steady_step_over_prediction"] == pytest.approx(1.10)
    low, high = carry["ci95"]
    assert 1.05 <= low < 1.10 < high <= 1.20


def test_a_pool_of_some_runs_goes_to_its_own_file_and_leaves_the_committed_ones_alone(tmp_path):
    """`--resummarize --pool DIR --pooled-out FILE` pools the committed run with DIR's into FILE only."""
    results = _BENCHMARK.parent / "results"
    earlier_run = results / "calibrate-and-validate-runs" / "2026-11-29-8fa3aeb"
    committed = {path: path.read_bytes() for path in (results / "calibrate-and-validate.json", results / "calibrate-and-validate-pooled.json")}
    rounds = [len(json.loads(path.read_text())["rounds"]) for path in (results / "calibrate-and-validate.json", earlier_run / "calibrate-and-validate.json")]
    out = tmp_path / "pooled.json"
    command = [sys.executable, str(_BENCHMARK), "--resummarize", "--pool", str(earlier_run), "--pooled-out", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    pooled = json.loads(out.read_text())
    assert pooled["rounds"] == sum(rounds)
    assert pooled["pooled_over"][1] == str(earlier_run)
    assert {"calibrated setup", "other setups", "time to target"} <= set(pooled["target_verdicts"])
    assert all(path.read_bytes() == content for path, content in committed.items())


def test_pooled_out_without_a_pool_is_refused_in_one_line(tmp_path):
    finished = subprocess.run([sys.executable, str(_BENCHMARK), "--resummarize", "--pooled-out", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines()[-1].endswith("--pooled-out goes with --pool: without it there is nothing pooled to write")
    assert not (tmp_path / "x.json").exists()
