"""The calibration suite's plan: the tiny model by default, or a scenario's model and pipeline
(`churnsim calibrate --preset/--scenario/--set`). Plans only: no run is started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.presets import configured_scenario, preset
from churnsim.real.calibration_suite import full_settings, quick_settings, scenario_suite_settings, suite_plan
from churnsim.real.model import model_preset


def test_the_default_suite_is_the_tiny_model_in_four_stages_with_its_six_shapes_on_two_cores():
    plan = suite_plan(quick_settings(), shared_cores=2)
    assert [run.run_id for run in plan] == [
        "fit-none-s0", "fit-none-s1", "fit-shape-2-stages", "fit-shape-8-microbatches", "fit-shape-microbatch-16", "fit-shape-8-layers",
        "fit-shape-width-32", "fit-shape-seq-128", "fit-data-parallel-2x2", "fit-checkpoint-s0", "fit-async_checkpoint-s1", "fit-redundant-s0", "fit-checkfree-s1", "fit-checkfree_plus-s0",
        "fit-copy-s1", "fit-uniform-s0", "fit-random-s1", "fit-checkfree-hard",
    ]  # fmt: skip
    by_id = {run.run_id: run.config for run in plan}
    reshaped = {"fit-shape-8-layers", "fit-shape-width-32", "fit-shape-seq-128"}
    assert all(config.model == model_preset("tiny") for run_id, config in by_id.items() if run_id not in reshaped)
    assert (by_id["fit-shape-2-stages"].num_stages, by_id["fit-shape-8-microbatches"].num_microbatches, by_id["fit-shape-microbatch-16"].microbatch_size) == (2, 8, 16)
    assert by_id["fit-checkfree-s1"].failures == ((25, 1), (50, 3), (75, 2))  # interior, edge, interior
    # The data-parallel run: 2 stages × 2 replicas, one replica of each stage lost (healed, never a stage loss).
    data_parallel = by_id["fit-data-parallel-2x2"]
    assert (data_parallel.num_stages, data_parallel.data_parallel_degree) == (2, 2)
    assert data_parallel.failures == ((12, 0, 1), (26, 1, 0))
    deeper = by_id["fit-shape-8-layers"]
    assert (deeper.model.num_layers, deeper.num_stages, deeper.model.dim) == (8, 4, model_preset("tiny").dim)
    narrower, longer = by_id["fit-shape-width-32"].model, by_id["fit-shape-seq-128"].model
    assert (narrower.dim, narrower.seq_len, longer.dim, longer.seq_len) == (32, 64, 64, 128)


@pytest.mark.parametrize("shared_cores", [None, 2])
@pytest.mark.parametrize("hidden_size, num_heads, other_width", [(64, 4, 32), (3072, 8, 1536), (24, 4, 48)])
def test_the_suite_runs_more_than_one_width_and_one_sequence_length(shared_cores, hidden_size, num_heads, other_width):
    # With one width and one sequence the compute model cannot tell work per FLOP from work per byte.
    settings = scenario_suite_settings(_scenario(**{"model.hidden_size": hidden_size, "model.num_heads": num_heads}), quick_settings())
    models = [run.config.model for run in suite_plan(settings, shared_cores=shared_cores) if run.purpose in ("baseline", "shape")]
    widths = {model.dim for model in models}
    assert widths == {hidden_size, other_width} and len({model.seq_len for model in models}) > 1
    # 24 wide in 4 heads: half the width would make heads of 3, which RoPE cannot rotate in pairs, so twice it.


@pytest.mark.parametrize("shared_cores", [None, 4, 16])
def test_the_double_depth_shape_runs_only_where_the_stage_processes_outnumber_the_cores(shared_cores):
    # With a device or a core each, the shape would measure nothing the 2-stage shape does not.
    shapes = [run.run_id for run in suite_plan(quick_settings(), shared_cores=shared_cores) if run.purpose == "shape"]
    assert "fit-shape-8-layers" not in shapes and "fit-shape-2-stages" in shapes


def _scenario(**settings):
    return configured_scenario(preset("cpu-tiny"), "cpu-tiny", settings, methods=("none",))


def test_a_scenario_s_model_and_pipeline_are_what_the_suite_runs():
    settings = scenario_suite_settings(_scenario(**{"model.num_layers": 8, "model.hidden_size": 32, "pipeline.schedule": "gpipe"}), quick_settings())
    plan = suite_plan(settings, shared_cores=None)
    baseline = plan[0].config
    assert (baseline.model.num_layers, baseline.model.dim, baseline.num_stages, baseline.schedule) == (8, 32, 4, "gpipe")
    shapes = {run.run_id: run.config for run in plan if run.purpose == "shape"}
    assert shapes["fit-shape-2-stages"].model.num_layers == 8 and shapes["fit-shape-2-stages"].num_stages == 2


def test_three_stages_leave_out_the_stage_shape_and_checkfree_plus_and_fail_every_stage():
    plan = suite_plan(scenario_suite_settings(_scenario(**{"model.num_layers": 6, "pipeline.num_stages": 3}), quick_settings()), shared_cores=None)
    assert [run.run_id for run in plan if run.purpose == "shape"] == [
        "fit-shape-8-microbatches", "fit-shape-microbatch-16", "fit-shape-width-32", "fit-shape-seq-128"
    ]  # fmt: skip
    failure_runs = [run for run in plan if run.purpose == "failures"]
    assert "checkfree_plus" not in {run.config.method.name for run in failure_runs}
    assert {stage for run in failure_runs for _, stage in run.config.failures} <= {0, 1, 2}
    assert 1 in {stage for run in failure_runs for _, stage in run.config.failures}  # the interior stage


def test_a_pipeline_real_runs_cannot_take_is_refused():
    with pytest.raises(InputError, match="data_parallel_degree = 2"):
        scenario_suite_settings(_scenario(**{"pipeline.data_parallel_degree": 2}), quick_settings())


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (["--runs", "records", "--preset", "cpu-tiny"], "--runs fits existing records"),
        (["--convergence", "--set", "model.num_layers=8"], "--convergence runs the convergence lab"),
        (["--quick", "--set", "pipeline.data_parallel_degree=2"], "data_parallel_degree = 2"),
        (["--quick", "--set", "model.hidden_size=100000"], "GiB"),
        # Found by scanning the lab's flags: a traceback in every lab process, a lab of days, 10^8
        # failure points built before any check, and an empty seed dropped without a word.
        (["--convergence", "--seeds", "99999999999999999999999"], "give distinct seeds from 0 to 9223372036854775807"),
        (["--convergence", "--lab-iterations", "1000000000"], "more than the limit of 100,000"),
        (["--convergence", "--failure-points", "100000000"], "more than the 871 iterations failures may strike"),
        (["--convergence", "--seeds", "1,,2"], "value 2 is empty"),
        # Lab flags without --convergence used to be ignored without a word.
        (["--quick", "--seeds", "1"], "--seeds configures the convergence lab: add --convergence"),
        (["--runs", "records", "--lab-iterations", "100", "--failure-points", "3"], "--lab-iterations, --failure-points configure"),
    ],
)
def test_calibrate_refuses_a_suite_it_cannot_run_in_one_line(arguments, fragment, tmp_path):
    result = subprocess.run([sys.executable, "-m", "churnsim", "calibrate", *arguments, "--out", "c.json"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and fragment in result.stderr
    assert not any(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize("cpu_count, refused", [("2", True), ("16", False)])
def test_a_shape_run_too_big_for_the_machine_is_refused_before_any_run_naming_the_shape(monkeypatch, cpu_count, refused):
    # 3072 wide: the suite's own 4-layer runs need about 20.6 GiB, its double-depth shape about 24.1.
    import churnsim.calibration.run_record as run_record
    import churnsim.real.scenario_run as scenario_run
    from churnsim.calibrating import _scenario_suite_settings

    monkeypatch.setattr(scenario_run, "available_memory_bytes", lambda: 22.8 * 2**30)
    monkeypatch.setattr(run_record, "hardware_description", lambda: {"cpu_count": cpu_count})
    check = lambda: _scenario_suite_settings(None, None, ["model.hidden_size=3072"], quick_settings(), device="cpu")  # noqa: E731
    if refused:
        with pytest.raises(InputError, match=r"the suite's shape run '8-layers' \(model.num_layers=8, 40 iterations\) cannot run here: .* GiB"):
            check()
    else:
        assert check()[0].model.dim == 3072


def test_the_quick_suite_ends_with_a_short_hard_failure_run_of_a_rebuild_method():
    (hard,) = [run for run in suite_plan(quick_settings(), shared_cores=2) if run.purpose == "hard_failures"]
    config = hard.config
    assert hard.run_id == "fit-checkfree-hard" and config.method.name == "checkfree"
    assert (config.failure_mode, config.join_delay_s, config.num_iterations) == ("hard", 0.0, 40)
    # Two kills, an interior then an edge stage: the survivors that reload differ between them.
    assert config.failures == ((13, 1), (26, 3))
    assert config.model == model_preset("tiny") and config.num_stages == 4
    # The full suite kills more often; a suite of methods without checkfree takes its first failing method.
    (full,) = [run for run in suite_plan(full_settings(), shared_cores=2) if run.purpose == "hard_failures"]
    assert len(full.config.failures) == 4
    (other,) = [run for run in suite_plan(quick_settings(), shared_cores=2, methods=("none", "checkpoint")) if run.purpose == "hard_failures"]
    assert other.config.method.name == "checkpoint"
    assert not [run for run in suite_plan(quick_settings(), shared_cores=2, methods=("none",)) if run.purpose == "hard_failures"]
