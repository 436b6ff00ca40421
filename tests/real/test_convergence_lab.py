"""The convergence lab forks rebuilds from the no-failure run and measures their setbacks."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from churnsim.calibration.methods import method_from_name
from churnsim.real.convergence_lab import LabPipeline, LabSettings, add_setbacks, lab_data, measure_setbacks, run_seed
from churnsim.real.model import ModelConfig

MODEL = ModelConfig(vocab_size=256, dim=16, num_heads=2, num_layers=4, seq_len=16)


def _settings(**overrides) -> LabSettings:
    base = dict(
        model=MODEL, num_stages=4, num_microbatches=2, microbatch_size=2, num_iterations=16, failure_iterations=(4, 8),
        window_iterations=6, early_windows=(2,), num_eval_batches=1, eval_every_iterations=1, corpus_max_bytes=200_000,
        methods=(method_from_name("checkfree", edge_fallback="copy"), method_from_name("random"), method_from_name("checkfree_plus", replica_refresh_iterations=3)),
    )  # fmt: skip
    base.update(overrides)
    return LabSettings(**base)


def test_every_fork_is_paired_with_the_baseline_at_the_same_iteration():
    rows, curve = run_seed(_settings(), seed=3)
    # 2 failure points × (interior, edge) × 3 methods × 2 windows
    assert len(rows) == 24
    assert set(rows["window_iterations"]) == {2, 6}
    assert set(rows["position"]) == {"interior", "edge"}
    checkfree = rows[(rows["method"] == "checkfree") & (rows["position"] == "interior")]
    assert all(source.startswith("weighted_average(") for source in checkfree["rebuilt_from"])
    plus_edges = rows[(rows["method"] == "checkfree_plus") & (rows["position"] == "edge")]
    assert all(source.startswith("copy(") for source in plus_edges["rebuilt_from"])
    # The baseline loss of a fork is the no-failure run's own held-out loss at that iteration.
    plain = curve[~curve["swapped"]].set_index("iteration")["held_out_loss"]
    for row in rows[(rows["method"] == "random")].itertuples():
        iteration = row.failure_iteration + row.window_iterations
        if iteration in plain.index:
            assert math.isclose(row.baseline_loss, plain[iteration])
    rows, _ = add_setbacks(rows, curve)
    assert rows["setback_iterations"].notna().all()


def test_a_lost_stage_gets_exactly_the_gradient_weighted_average_of_its_neighbours():
    pipeline = LabPipeline(_settings(), seed=1, swap_odd_microbatches=False)
    pipeline.gradient_norms = [1.0, 2.0, 3.0, 1.0]
    before = [torch.cat([p.detach().flatten() for p in stage.part_parameters("blocks").values()]).clone() for stage in pipeline.stages]
    pipeline.lose_and_rebuild(method_from_name("checkfree", edge_fallback="copy"), 2, failure_iteration=5)
    after = torch.cat([p.detach().flatten() for p in pipeline.stages[2].part_parameters("blocks").values()])
    weights = (2.0**2, 1.0**2)  # ω = squared gradient norms of stages 1 and 3
    expected = (weights[0] * before[1] + weights[1] * before[3]) / sum(weights)
    torch.testing.assert_close(after, expected)
    assert pipeline.lr_scales[2] == 1.1


def test_each_seed_s_raw_tables_are_handed_over_as_it_finishes_and_the_result_is_in_seed_order():
    settings = _settings(num_iterations=12, failure_iterations=(6,), methods=(method_from_name("random"),))
    seen: list[tuple[int, int, set[int]]] = []
    rows, curve, _ = measure_setbacks(
        settings, (5, 2), workers=1, on_seed_done=lambda seed, rows, curve: seen.append((seed, len(rows), set(curve["seed"])))
    )
    assert seen == [(5, 4, {5}), (2, 4, {2})]  # 1 failure point × (interior, edge) × 2 windows, per seed
    assert list(rows["seed"].drop_duplicates()) == [5, 2]
    assert rows["setback_iterations"].notna().all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CI has none; ran on an H100 on 2026-11-26)")
def test_the_lab_trains_on_the_gpu_when_its_settings_name_cuda():
    settings = _settings(device="cuda")
    pipeline = LabPipeline(settings, seed=0, swap_odd_microbatches=True)
    assert {parameter.device.type for stage in pipeline.stages for parameter in stage.parameters()} == {"cuda"}
    data, held_out = lab_data(settings)
    assert {tokens.device.type for tokens, _ in held_out} == {"cuda"}
    assert math.isfinite(pipeline.train_step(data, 0))


def test_on_cuda_the_seeds_take_the_host_s_gpus_in_turn(monkeypatch):
    from churnsim.real import convergence_lab

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    devices = [convergence_lab.settings_for_worker(_settings(device="cuda"), index).device for index in range(3)]
    assert devices == ["cuda:0", "cuda:1", "cuda:0"]
    assert convergence_lab.settings_for_worker(_settings(device="cpu"), 1).device == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert convergence_lab.settings_for_worker(_settings(device="cuda"), 1).device == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_the_lab_on_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, assert_one_line_error):
    result = subprocess.run([sys.executable, "-m", "churnsim", "calibrate", "--convergence", "--device", "cuda", "--out", "x/lab.json"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)  # fmt: skip
    assert_one_line_error(result, "--device cuda: CUDA is not available")
    assert not (tmp_path / "x").exists()
