"""`--calibration` on simulate, whatif, sweep and recommend (and `calibration=` in the Python API): a
scenario run on a calibrated machine (`presets.configured_scenario`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from churnsim import api
from churnsim.calibration.apply import apply_calibration
from churnsim.calibration.builtin import load_builtin_calibration
from churnsim.calibration.calibration_file import LinkProfile, save_calibration
from churnsim.calibration.convergence import MethodSetbacks, SetbackSpec
from churnsim.calibration.presets import configured_scenario, preset
from churnsim.calibration.scenario_overrides import apply_settings


def builtin():
    calibration, reason = load_builtin_calibration("cpu-tiny")
    assert calibration is not None, reason
    return calibration


def slow_link_machine():
    """The built-in machine with a link 100× slower to start: a scenario on it must take longer."""
    calibration = builtin()
    link = LinkProfile(latency_s=100 * calibration.link.latency_s + 0.01, bandwidth_bytes_per_s=calibration.link.bandwidth_bytes_per_s / 100)
    return calibration.model_copy(update={"name": "slow-link", "link": link})


def run_cli(arguments, cwd):
    return subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_simulate_runs_the_calibrated_preset_on_the_machine_given(tmp_path):
    save_calibration(slow_link_machine(), tmp_path / "slow.json")
    common = ["simulate", "--preset", "cpu-tiny", "--method", "checkpoint", "--replications", "2"]
    assert run_cli([*common, "--out", "builtin"], tmp_path).returncode == 0
    result = run_cli([*common, "--calibration", "slow.json", "--out", "slow"], tmp_path)
    assert result.returncode == 0, result.stderr
    sources = json.loads((tmp_path / "slow" / "manifest.json").read_text())["scenario"]["sources"]
    assert any("calibration 'slow-link' (full)" in source for source in sources)
    assert not any("cpu-tiny" in source for source in sources)  # another machine's: not the built-in one's
    hours = {name: pd.read_csv(tmp_path / name / "summary.csv")["time_to_target_mean_s"].iloc[0] for name in ("builtin", "slow")}
    assert hours["slow"] > 1.2 * hours["builtin"]


def test_a_calibration_is_applied_once_to_a_scenario_with_settings():
    calibration = slow_link_machine()
    base = preset("checkfree-124m-geo-10pct")
    settings = {"pipeline.num_microbatches": 8}
    once = apply_calibration(apply_settings(base, settings), calibration, mode="full")
    assert configured_scenario(base, "checkfree-124m-geo-10pct", settings, calibration=calibration) == once
    # A setting of a section the calibration writes wins over the calibration.
    pinned = configured_scenario(base, None, {"recovery.join_delay_s": 7.0}, calibration=calibration)
    assert pinned.recovery.join_delay_s == 7.0


def test_the_setbacks_mode_takes_only_measured_setbacks_that_carry():
    calibration = builtin()
    setbacks = dict(calibration.convergence.setbacks)
    setbacks["checkfree"] = MethodSetbacks(interior=SetbackSpec(mean_iterations=33.0, num_samples=10), edge=SetbackSpec(mean_iterations=44.0, num_samples=10))
    measured = calibration.model_copy(update={"convergence": calibration.convergence.model_copy(update={"setbacks": setbacks})})
    scenario = api._configured("checkfree-500m-geo-10pct", calibration=measured, calibration_mode="setbacks")
    assert scenario.convergence.setback_source == "measured"
    assert scenario.convergence.setback_iterations("checkfree", "interior") == 33.0
    assert scenario.network == preset("checkfree-500m-geo-10pct").network  # the machine is the scenario's own


def test_the_api_sweeps_a_calibrated_preset_over_stage_counts():
    result = api.sweep("cpu-tiny", {"pipeline.num_stages": [2, 4]}, methods=["checkpoint"], replications=2)
    assert sorted(result.summary["pipeline.num_stages"]) == [2, 4]


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (["whatif", "--calibration", "no-such.json"], "--calibration 'no-such.json': no such file"),
        (["whatif", "--calibration", "cpu-tiny", "--calibration-mode", "half"], "--calibration-mode 'half'"),
        (["recommend", "--preset", "checkfree-500m-geo-10pct", "--calibration", "cpu-tiny", "--calibration-mode", "setbacks"], "no setback that carries"),
    ],
)
def test_a_bad_calibration_option_is_one_line(arguments, fragment, tmp_path):
    result = run_cli([*arguments, "--out", "out"] if arguments[0] == "whatif" else arguments, tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and fragment in result.stderr
    assert not any(tmp_path.iterdir())


def test_a_scenario_saved_from_a_calibrated_preset_takes_another_calibration_s_costs_once(tmp_path):
    from churnsim.calibration.scenario import Scenario

    saved = Scenario.model_validate_json(preset("cpu-tiny").model_dump_json())  # `churnsim presets --show cpu-tiny > mine.json`
    other = slow_link_machine().model_copy(update={"checkpoint_write_latency_s": 0.5})
    again = configured_scenario(saved, None, calibration=other)
    for before, after in zip(saved.storage, again.storage):
        assert after.total_latency_s == pytest.approx(before.latency_s + 0.5)  # the built-in's fixed cost replaced, not added to
