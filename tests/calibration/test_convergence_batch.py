"""A loss curve counted in iterations of one global batch, carried to another (calibration/convergence.py,
McCandlish et al.'s empirical model of large-batch training)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from churnsim.calibration.base import validate_model
from churnsim.calibration.convergence import ConvergenceSpec, PowerLawLossCurve, SetbackSpec, MethodSetbacks
from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.scenario_overrides import apply_settings

CURVE = PowerLawLossCurve(floor_loss=2.0, scale=20.0, exponent=0.35, offset_iterations=100.0)


def spec(reference_tokens: float = 1e5, critical_tokens: float = 1e6) -> ConvergenceSpec:
    growing = SetbackSpec(mean_iterations=12.0, ci95_low_iterations=3.0, ci95_high_iterations=24.0, per_progress_iteration=0.4, progress_offset_iterations=200.0)
    return ConvergenceSpec(
        baseline=CURVE,
        setbacks={"checkfree": MethodSetbacks(interior=growing, edge=SetbackSpec(mean_iterations=30.0))},
        baseline_tokens_per_iteration=reference_tokens,
        critical_batch_tokens=critical_tokens,
    )


@given(batch_factor=st.floats(0.1, 50.0), critical_tokens=st.floats(1e3, 1e9), progress=st.floats(0.0, 1e5))
def test_the_carried_curve_reaches_each_loss_after_the_iterations_worth_as_much(batch_factor, critical_tokens, progress):
    original = spec(critical_tokens=critical_tokens)
    carried = original.at_batch(1e5 * batch_factor)
    worth = original.iteration_worth(1e5 * batch_factor)
    assert carried.baseline.loss(progress) == pytest.approx(CURVE.loss(worth * progress), rel=1e-9)
    interior = original.setbacks["checkfree"].interior
    assert carried.setback_iterations("checkfree", "interior", progress) * worth == pytest.approx(interior.at_progress(worth * progress), rel=1e-9)


def test_an_iteration_is_worth_its_batch_well_below_the_critical_batch_and_little_more_far_above_it():
    assert spec(critical_tokens=1e12).iteration_worth(2e5) == pytest.approx(2.0, rel=1e-5)
    assert spec(critical_tokens=1e12).iteration_worth(5e4) == pytest.approx(0.5, rel=1e-5)
    assert spec(critical_tokens=1.0).iteration_worth(2e5) == pytest.approx(1.0, rel=1e-4)
    # B_noise = B_ref: twice the batch is worth (1 + 1) / (1 + 1/2) = 4/3 iterations.
    assert spec(critical_tokens=1e5).iteration_worth(2e5) == pytest.approx(4 / 3)


def test_a_spec_without_a_batch_or_at_its_own_is_left_as_it_is():
    own = spec()
    assert own.at_batch(1e5) is own
    plain = ConvergenceSpec(baseline=CURVE)
    assert plain.at_batch(123.0) is plain and plain.iteration_worth(123.0) == 1.0


def test_the_batch_and_its_critical_size_go_together():
    with pytest.raises(InputError, match="baseline_tokens_per_iteration and convergence.critical_batch_tokens go together"):
        validate_model(ConvergenceSpec, {"baseline": CURVE.model_dump(), "baseline_tokens_per_iteration": 1e5}, "scenario.json")


def test_twice_the_microbatches_need_fewer_iterations_to_the_target_and_the_scenario_reads_back():
    scenario = preset("checkfree-500m-geo-10pct")
    doubled = apply_settings(scenario, {"pipeline.num_microbatches": 8})
    worth = scenario.convergence.iteration_worth(2 * scenario.tokens_per_iteration)
    assert 1.0 < worth < 2.0
    assert doubled.convergence.baseline_tokens_per_iteration == 2 * scenario.tokens_per_iteration
    target = scenario.target.loss
    assert doubled.convergence.baseline.progress_for_loss(target) == pytest.approx(scenario.convergence.baseline.progress_for_loss(target) / worth, rel=1e-9)
    # Carried once: the saved scenario names its own batch and reads back unchanged.
    assert Scenario.model_validate(json.loads(doubled.model_dump_json())) == doubled
    back = apply_settings(doubled, {"pipeline.num_microbatches": 4})
    assert back.convergence.baseline.scale == pytest.approx(scenario.convergence.baseline.scale, rel=1e-12)
    assert back.convergence.baseline.offset_iterations == pytest.approx(scenario.convergence.baseline.offset_iterations, rel=1e-12)


def test_a_curve_that_names_no_batch_counts_iterations_alike():
    scenario = preset("checkfree-124m-geo-10pct")  # TinyStories: no critical batch of web text applies
    assert scenario.convergence.baseline_tokens_per_iteration is None
    assert apply_settings(scenario, {"pipeline.num_microbatches": 8}).convergence.baseline == scenario.convergence.baseline


def test_the_outputs_say_when_the_curve_was_carried_to_another_batch():
    from churnsim.sim.studies.outputs import scenario_notes

    scenario = preset("checkfree-500m-geo-10pct")
    doubled = apply_settings(scenario, {"pipeline.num_microbatches": 8})
    worth = scenario.convergence.iteration_worth(2 * scenario.tokens_per_iteration)
    (note,) = [note for note in scenario_notes(doubled) if "loss curve" in note]
    assert "given for 262,144 tokens per iteration and carried to this scenario's 524,288" in note
    assert f"takes {worth:.2f}× fewer iterations" in note
    assert not any("loss curve" in note for note in scenario_notes(scenario))
    back = apply_settings(doubled, {"pipeline.num_microbatches": 4})
    assert back.convergence.batch_carried_from_tokens_per_iteration is None and back.convergence.batch_note() is None
    halved = apply_settings(scenario, {"pipeline.num_microbatches": 2})
    assert "× more iterations" in halved.convergence.batch_note()


# ------------------------------------------------------------------ model size (Hoffmann et al.'s parameter term)
def test_a_larger_model_moves_every_loss_by_the_parameter_term_and_reads_back():
    from churnsim.calibration.convergence import parameter_loss_term

    scenario = preset("checkfree-500m-geo-10pct")
    assert scenario.convergence.baseline_parameters == scenario.model.num_parameters
    wider = apply_settings(scenario, {"model.hidden_size": 2048})
    change = 406.4 * (wider.model.num_parameters ** -0.34 - scenario.model.num_parameters ** -0.34)
    assert parameter_loss_term(wider.model.num_parameters) - parameter_loss_term(scenario.model.num_parameters) == pytest.approx(change, rel=1e-12)
    assert change < 0
    for progress in (0.0, 1e3, 1e5):
        assert wider.convergence.baseline.loss(progress) == pytest.approx(scenario.convergence.baseline.loss(progress) + change, rel=1e-12)
    target = scenario.target.loss
    assert wider.convergence.baseline.progress_for_loss(target) < scenario.convergence.baseline.progress_for_loss(target)
    # Only the floor moves; the setbacks stay as many iterations; carried once, it reads back unchanged.
    assert wider.convergence.setbacks == scenario.convergence.setbacks
    assert wider.convergence.model_carried_from_parameters == scenario.model.num_parameters
    assert Scenario.model_validate(json.loads(wider.model_dump_json())) == wider
    back = apply_settings(wider, {"model.hidden_size": 1024})
    assert back.convergence.baseline.floor_loss == pytest.approx(scenario.convergence.baseline.floor_loss, rel=1e-12)
    assert back.convergence.model_carried_from_parameters is None and back.convergence.model_size_note(target) is None


def test_the_outputs_say_when_the_curve_was_carried_to_another_model_size():
    from churnsim.sim.studies.outputs import scenario_notes

    scenario = preset("checkfree-500m-geo-10pct")
    deeper = apply_settings(scenario, {"model.num_layers": 48})
    target = scenario.target.loss
    ratio = deeper.convergence.baseline.progress_for_loss(target) / scenario.convergence.baseline.progress_for_loss(target)
    (note,) = [note for note in scenario_notes(deeper) if "model of" in note]
    assert "given for a model of 468M parameters and carried to this scenario's 871M" in note
    assert f"takes {ratio:.2f}× the iterations" in note and ratio < 1 and "extrapolated" not in note
    assert not any("model of" in note for note in scenario_notes(scenario))
    narrow = apply_settings(scenario, {"model.hidden_size": 256})  # 41.6M: below the fit's 70M
    assert "41.6M outside the fit's 70M–16B: extrapolated" in narrow.convergence.model_size_note(target)


def test_a_curve_that_names_no_size_holds_for_every_model():
    scenario = preset("checkfree-124m-geo-10pct")  # TinyStories: outside the web-text fit
    assert scenario.convergence.baseline_parameters is None
    assert apply_settings(scenario, {"model.num_layers": 24}).convergence.baseline == scenario.convergence.baseline


def test_a_model_too_small_for_the_target_is_refused_in_one_line(tmp_path, assert_one_line_error):
    import subprocess
    import sys

    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "simulate", "--preset", "checkfree-500m-geo-10pct", "--set", "model.hidden_size=64", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert_one_line_error(result, "target.loss 2.9 is at or below the loss floor", "never reaches it", "raise target.loss")
    assert not out.exists()
