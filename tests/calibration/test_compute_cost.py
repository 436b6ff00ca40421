"""The compute cost model's hop features and fit (calibration/compute_cost.py), on synthetic hops of
known coefficients: deterministic, no runs."""

from __future__ import annotations

import pytest

from churnsim.calibration.compute_cost import ComputeCostModel, HopCost, fit_hop_cost, stage_features, stage_parameters
from churnsim.calibration.scenario import ModelSpec, PipelineSpec

MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_heads=4, vocab_size=256, sequence_length=64,
                  weight_bytes_per_parameter=4.0, activation_bytes_per_element=4.0)  # fmt: skip
PIPELINE = PipelineSpec(num_stages=4, microbatch_size=8, num_microbatches=4)
TRUE_HOP = HopCost(fixed_s=2e-4, seconds_per_matmul_flop=3e-11, seconds_per_element=4e-10, seconds_per_neighbour=5e-4,
                   seconds_per_shared_core_parameter=2e-9)  # fmt: skip
CORES = 2


def _setup(num_layers: int = 4, **pipeline) -> tuple[ModelSpec, PipelineSpec]:
    return MODEL.model_copy(update={"num_layers": num_layers}), PIPELINE.model_copy(update=pipeline)


# The quick suite on 2 cores: the calibrated setup and its four shapes.
QUICK_SUITE = (
    _setup(),
    _setup(num_stages=2),
    _setup(num_microbatches=8),
    _setup(microbatch_size=16),
    _setup(num_layers=8),
)


def _fit(setups, shared_cores: int | None) -> HopCost:
    features = [feature for model, pipeline in setups for feature in stage_features(model, pipeline, shared_cores)]
    cost, residual = fit_hop_cost(features, [TRUE_HOP.work_s(feature) for feature in features])
    assert residual < 1e-6
    return cost


def test_a_stage_s_parameters_count_as_shared_core_work_only_where_the_processes_outnumber_the_cores():
    model, pipeline = _setup(num_layers=8)
    parameters = stage_parameters(model, pipeline)
    assert [feature[3] for feature in stage_features(model, pipeline, CORES)] == list(map(float, parameters))
    for shared_cores in (None, 4, 8):  # a device each, or a core each
        assert all(feature[3] == 0.0 for feature in stage_features(model, pipeline, shared_cores))
    assert [feature[:3] for feature in stage_features(model, pipeline, None)] == [feature[:3] for feature in stage_features(model, pipeline, CORES)]


def test_the_quick_suite_on_two_cores_recovers_the_shared_core_cost_and_carries_it_to_three_stages_of_two_layers():
    fitted = _fit(QUICK_SUITE, CORES)
    assert fitted.seconds_per_shared_core_parameter == pytest.approx(TRUE_HOP.seconds_per_shared_core_parameter, rel=1e-3)
    assert fitted.seconds_per_matmul_flop == pytest.approx(TRUE_HOP.seconds_per_matmul_flop, rel=1e-3)
    # The benchmark's 3-stage setup, which no suite run measures.
    model, pipeline = _setup(num_layers=6, num_stages=3)
    for feature in stage_features(model, pipeline, CORES):
        assert fitted.work_s(feature) == pytest.approx(TRUE_HOP.work_s(feature), rel=1e-3)


def test_a_carried_setup_s_compute_charges_the_shared_core_cost_only_on_shared_cores():
    common = dict(optimizer_fixed_s=0.0, optimizer_seconds_per_parameter=0.0, iteration_overhead_s=0.0, num_configurations=5, hop_relative_residual=0.0)
    shared = ComputeCostModel(forward=TRUE_HOP, backward=TRUE_HOP, shared_cores=CORES, **common)
    own_devices = ComputeCostModel(forward=TRUE_HOP, backward=TRUE_HOP, shared_cores=None, **common)
    model, pipeline = _setup(num_layers=6, num_stages=3)
    extra = [
        on_shared - alone
        for on_shared, alone in zip(shared.compute_for(model, pipeline).block_forward_s, own_devices.compute_for(model, pipeline).block_forward_s)
    ]
    assert extra == pytest.approx([TRUE_HOP.seconds_per_shared_core_parameter * parameters for parameters in stage_parameters(model, pipeline)])
    # Two stages on the two cores: each process has a core, nothing extra.
    model, pipeline = _setup(num_stages=2)
    assert shared.compute_for(model, pipeline).block_forward_s == own_devices.compute_for(model, pipeline).block_forward_s


def test_a_calibration_file_from_before_the_term_reads_as_no_shared_core_cost():
    old = {"fixed_s": 1e-4, "seconds_per_matmul_flop": 1e-11, "seconds_per_element": 0.0, "seconds_per_neighbour": 1e-4}
    assert HopCost.model_validate(old).seconds_per_shared_core_parameter == 0.0


def test_calibrate_prints_the_shared_core_cost_only_where_it_was_measured(capsys):
    from churnsim.calibration.builtin import load_builtin_calibration
    from churnsim.calibration_report import print_calibration

    calibration, _ = load_builtin_calibration("cpu-tiny")
    assert calibration is not None and calibration.compute_model is not None
    print_calibration(calibration)  # made before the term: nothing to say of it
    assert "shared cores" not in " ".join(capsys.readouterr().out.split()).replace("2 shared cores", "")
    model = calibration.compute_model
    measured = model.model_copy(update={"forward": model.forward.model_copy(update={"seconds_per_shared_core_parameter": 2e-9})})
    print_calibration(calibration.model_copy(update={"compute_model": measured}))
    assert "+ 2.00 ms per million stage parameters on shared cores" in " ".join(capsys.readouterr().out.split())
