"""The validator's setup description names every field in which a run's setup differs from the
calibrated one, sequence length included, so that no other setup reads as the calibrated one."""

from __future__ import annotations

import pytest
from real_run_records import CALIBRATION
from real_run_records import real_record

from churnsim.calibration.compute_cost import setup_description, setup_differences
from churnsim.calibration.scenario import ModelSpec, PipelineSpec
from churnsim.sim.checks.validate import validate_record

CALIBRATED = (CALIBRATION.model, CALIBRATION.pipeline)

# A valid other value of each field of the calibrated (4 layers d64, 4 heads, 4 stages) setup.
MODEL_CHANGES = {
    "num_layers": 8, "hidden_size": 128, "num_heads": 8, "vocab_size": 512, "sequence_length": 128, "ffn_hidden_size": 192,
    "weight_bytes_per_parameter": 2.0, "checkpoint_bytes_per_parameter": 8.0, "activation_bytes_per_element": 2.0,
}  # fmt: skip
PIPELINE_CHANGES = {
    "num_stages": 2, "data_parallel_degree": 2, "replicas_fail_together": True, "while_replica_missing": "wait", "schedule": "gpipe",
    "microbatch_size": 4, "num_microbatches": 8, "layers_per_stage": (1, 1, 1, 1), "embedding_placement": "separate_node",
    "checkpoint_sharding": "data_parallel",
}  # fmt: skip
CHANGES = [("model", field, value) for field, value in MODEL_CHANGES.items()] + [("pipeline", field, value) for field, value in PIPELINE_CHANGES.items()]


def _changed(part: str, field: str, value: object) -> tuple[ModelSpec, PipelineSpec]:
    model, pipeline = CALIBRATED
    if part == "model":
        return ModelSpec.model_validate({**model.model_dump(), field: value}), pipeline
    return model, PipelineSpec.model_validate({**pipeline.model_dump(), field: value})


@pytest.mark.parametrize(("part", "field", "value"), CHANGES, ids=[f"{part}.{field}" for part, field, _ in CHANGES])
def test_every_field_that_differs_is_named_and_shown(part, field, value):
    model, pipeline = _changed(part, field, value)
    calibrated_value = getattr(CALIBRATED[part == "pipeline"], field)
    assert setup_differences(model, pipeline, *CALIBRATED) == ((f"{part}.{field}", value, calibrated_value),)
    described = setup_description(model, pipeline, CALIBRATED)
    assert described != setup_description(*CALIBRATED, CALIBRATED)
    shown = {"sequence_length": f"seq {value}", "hidden_size": f"d{value}", "num_layers": f"{value} layers", "num_stages": f"{value} stages",
             "num_microbatches": f"{value} microbatches", "microbatch_size": f"of {value},", "schedule": f", {value},"}  # fmt: skip
    assert shown.get(field, f"{field} {value}") in described, described


def test_the_calibrated_setup_reads_as_itself_and_its_display_name_is_not_a_difference():
    model, pipeline = CALIBRATED
    assert setup_differences(model.model_copy(update={"name": "other"}), pipeline, *CALIBRATED) == ()
    assert setup_description(model, pipeline, CALIBRATED) == "4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 64"


def test_the_validator_names_the_sequence_length_and_every_other_difference_of_a_run():
    model = CALIBRATION.model.model_copy(update={"sequence_length": 128, "num_heads": 8})
    validation = validate_record(real_record("seq-128", hard=False, failures=(), model=model), CALIBRATION)
    assert set(validation.rows["setup"]) == {"4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 128 (num_heads 8)"}
    assert not validation.rows["calibrated_setup"].any()
    assert (
        "runs of 4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 128 (num_heads 8) differ from the calibrated setup in "
        "model.num_heads 8 (calibrated 4), model.sequence_length 128 (calibrated 64)"
    ) in validation.notes
    on_calibrated = validate_record(real_record("calibrated", hard=False, failures=()), CALIBRATION)
    assert set(on_calibrated.rows["setup"]) == {"4 stages × 4 microbatches of 8, 1f1b, 4 layers d64 seq 64"}
    assert not any("differ from the calibrated setup" in note for note in on_calibrated.notes)


def test_a_run_outside_the_compute_model_s_fitted_shapes_is_said_to_be_extrapolated():
    compute_model = CALIBRATION.compute_model.model_copy(update={"fitted_hidden_sizes": (64,), "fitted_sequence_lengths": (64,)})
    calibration = CALIBRATION.model_copy(update={"compute_model": compute_model})
    model = CALIBRATION.model.model_copy(update={"sequence_length": 128})
    notes = validate_record(real_record("seq-128", hard=False, failures=(), model=model), calibration).notes
    assert any(note.endswith("are predicted through its compute model (sequence length 128 outside the measured 64 of its fit: extrapolated)") for note in notes), notes
