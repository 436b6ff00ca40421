"""The built-in calibration cpu-tiny: shipped with provenance, used by the presets, never fatal when missing."""

from __future__ import annotations

import json
import math
import re

import pytest

from churnsim.calibration import builtin
from churnsim.calibration.apply import MINIMUM_SETBACK_SAMPLES_TO_TRANSFER
from churnsim.calibration.builtin import load_builtin_calibration, resolve_calibration
from churnsim.calibration.calibration_file import Calibration, load_calibration
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import PRESETS, checkfree_124m_geo, preset


@pytest.fixture
def no_builtin_calibrations(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin, "CALIBRATION_DIRECTORY", tmp_path)
    load_builtin_calibration.cache_clear()
    yield tmp_path
    load_builtin_calibration.cache_clear()


def test_cpu_tiny_is_shipped_with_provenance():
    calibration, reason = load_builtin_calibration("cpu-tiny")
    assert calibration is not None, reason
    provenance = calibration.provenance
    assert provenance.fit_run_ids and provenance.created_utc and provenance.hardware and provenance.package_versions
    assert provenance.command.startswith("churnsim calibrate")
    assert calibration.pipeline.num_stages == 4 and calibration.model.num_layers == 4
    assert calibration.convergence.calibrated


def test_cpu_tiny_preset_runs_the_calibrated_model_in_full_mode():
    calibration, _ = load_builtin_calibration("cpu-tiny")
    scenario = preset("cpu-tiny")
    assert scenario.model.model_dump(exclude={"name"}) == calibration.model.model_dump(exclude={"name"})
    assert scenario.compute.block_forward_s == tuple(t.block_forward.median_s for t in calibration.stage_timings)
    assert scenario.convergence == calibration.convergence
    assert scenario.target.loss > calibration.convergence.baseline.floor_loss


def test_paper_presets_take_only_constant_setbacks_measured_on_enough_rebuilds():
    calibration, _ = load_builtin_calibration("cpu-tiny")
    uncalibrated = checkfree_124m_geo(0.10)
    scenario = preset("checkfree-124m-geo-10pct")
    assert scenario.convergence.baseline == uncalibrated.convergence.baseline
    assert scenario.compute == uncalibrated.compute
    transferred = 0
    for method, measured in calibration.convergence.setbacks.items():
        for position in ("interior", "edge"):
            spec = measured.for_position(position)
            carried = spec.num_samples >= MINIMUM_SETBACK_SAMPLES_TO_TRANSFER and spec.per_progress_iteration == 0.0
            expected = spec if carried else uncalibrated.convergence.setbacks[method].for_position(position)
            assert scenario.convergence.setbacks[method].for_position(position) == expected, (method, position)
            transferred += carried
    assert scenario.convergence.calibrated == (transferred > 0)
    assert scenario.convergence.setback_source == ("measured" if transferred else "paper_fitted")
    if not transferred:
        assert "uncalibrated" in scenario.description.lower() and "CheckFree paper's ablation" in scenario.description


def test_presets_fall_back_to_defaults_and_say_so_without_the_file(no_builtin_calibrations):
    for name, factory in PRESETS.items():
        scenario = factory()
        assert "uncalibrated" in scenario.description.lower() or "UNCALIBRATED" in scenario.description, name
        assert not scenario.convergence.calibrated, name


def test_presets_fall_back_when_the_file_is_invalid(no_builtin_calibrations):
    (no_builtin_calibrations / "cpu-tiny.json").write_text('{"name": "cpu-tiny"}')
    scenario = preset("checkfree-500m-geo-10pct")
    assert "invalid" in scenario.description and not scenario.convergence.calibrated
    with pytest.raises(InputError, match="invalid"):
        resolve_calibration("cpu-tiny")


def test_cpu_tiny_with_another_setup_takes_the_calibrated_compute_model():
    """`--set` on the calibrated preset: a changed pipeline gets the calibration's compute model for it
    (its per-stage times would not fit six stages); an explicit compute value still wins."""
    from churnsim.calibration.apply import calibrated_compute
    from churnsim.calibration.compute_cost import compute_carry_note
    from churnsim.sim.studies.outputs import scenario_notes

    calibration, _ = load_builtin_calibration("cpu-tiny")
    assert calibration is not None and calibration.compute_model is not None
    six = preset("cpu-tiny", {"pipeline.num_stages": 6, "model.num_layers": 6}, methods=("checkfree",))
    assert six.pipeline.num_stages == 6 and [method.name for method in six.methods] == ["checkfree"]
    assert six.compute == calibrated_compute(six, calibration)
    assert len(six.compute.block_forward_s) == 6
    assert six.name == "cpu-tiny[pipeline.num_stages=6,model.num_layers=6]"
    # Every output of the carried setup says where its compute comes from; given times are not carried.
    assert six.compute.carried_from == "4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 64 of calibration 'cpu-tiny'"
    carried = compute_carry_note(six)
    assert carried is not None and carried in scenario_notes(six)
    assert carried.startswith("compute of 6 stages × 4 microbatches of 8, 1f1b, 6 layers d64 seq 64 is carried by the compute model from 4 stages")
    assert preset("cpu-tiny").compute.carried_from == "" and compute_carry_note(preset("cpu-tiny")) is None
    explicit = preset("cpu-tiny", {"pipeline.num_stages": 6, "model.num_layers": 6, "compute.optimizer_step_s": 0.5})
    assert explicit.compute.optimizer_step_s == 0.5
    assert explicit.compute.block_forward_s == six.compute.block_forward_s
    assert explicit.compute.carried_from == six.compute.carried_from  # its hops are still the model's
    given = preset("cpu-tiny", {"pipeline.num_stages": 2, "compute.block_forward_s": 0.01, "compute.block_backward_s": 0.02}, methods=("checkfree",))
    assert given.compute.carried_from == "" and compute_carry_note(given) is None
    # Settings that leave the setup alone give the preset with them applied, as before.
    assert preset("cpu-tiny", {"seed": 3}).model_dump(exclude={"name", "seed"}) == preset("cpu-tiny").model_dump(exclude={"name", "seed"})


def test_an_impossible_carried_time_names_the_compute_model_it_came_from():
    """A compute model whose coefficient gives a hop of 1e300 s: the user wrote no such time, so the
    one line names the calibration's compute model that carried it."""
    from churnsim.calibration.apply import calibrated_compute

    calibration, _ = load_builtin_calibration("cpu-tiny")
    assert calibration is not None and calibration.compute_model is not None
    forward = calibration.compute_model.forward.model_copy(update={"fixed_s": 1e300})
    broken = calibration.model_copy(update={"compute_model": calibration.compute_model.model_copy(update={"forward": forward})})
    two = preset("cpu-tiny", {"pipeline.num_stages": 2}, methods=("checkfree",))
    with pytest.raises(InputError, match=r"the compute model of 4 stages × 4 microbatches .* of calibration 'cpu-tiny' gives compute.block_forward_s.* over 1e\+09 s"):
        calibrated_compute(two, broken)
    assert calibrated_compute(two, calibration).carried_from  # the unbroken model carries as before


def _builtin_calibration_with(tmp_path, path: tuple[str, ...], value) -> str:
    """The built-in cpu-tiny calibration with one value replaced, written to a file; its path."""
    data = json.loads(builtin.builtin_calibration_path("cpu-tiny").read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (tmp_path / "calibration.json").write_text(json.dumps(data))
    return str(tmp_path / "calibration.json")


@pytest.mark.parametrize(("path", "value"), [
    (("recovery", "checkfree", "rebuild_s"), "Infinity"),
    (("convergence", "baseline", "floor_loss"), "1e999"),  # parsed as infinity
    (("optimizer_step", "median_s"), "NaN"),
])
def test_a_calibration_with_a_number_that_is_not_finite_is_refused_naming_it(tmp_path, path, value):
    with pytest.raises(InputError, match=re.escape(".".join(path[1:] if path[0] == "convergence" else path))):
        load_calibration(_builtin_calibration_with(tmp_path, path, value))


@pytest.mark.parametrize(("path", "value"), [
    (("warmup_extra_s",), 1e300),  # got past the finite check; validate's figure then overflowed
    (("evaluation", "median_s"), 1e300),
    (("method_iteration_extra_s", "redundant"), -2e9),  # a mapping of seconds, and either way
])
def test_a_calibration_with_a_duration_no_run_measures_is_refused_naming_it(tmp_path, path, value):
    with pytest.raises(InputError, match=re.escape(".".join(path)) + r" is more than 1e\+09 s \(31.7 years\) either way"):
        load_calibration(_builtin_calibration_with(tmp_path, path, value))
    assert Calibration.model_validate(json.loads(builtin.builtin_calibration_path("cpu-tiny").read_text()))  # its bandwidths (2.7e9 B/s) are no durations


def test_a_calibrations_bandwidth_may_be_infinite():
    data = json.loads(builtin.builtin_calibration_path("cpu-tiny").read_text())
    data["link"]["bandwidth_bytes_per_s"] = "Infinity"
    assert math.isinf(Calibration.model_validate(data).link.bandwidth_bytes_per_s)
