"""The setbacks fitted to the CheckFree paper's ablation (calibration/paper_setbacks.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from churnsim.calibration.convergence import PowerLawLossCurve
from churnsim.calibration.paper_setbacks import (
    PAPER_SETBACKS,
    PaperSetting,
    ProgressModel,
    curve_reaching,
    fit_paper_setbacks,
    paper_fitted_setbacks,
    solve_setback,
)
from churnsim.calibration.presets import PRESETS, checkfree_500m_geo, preset

CURVE = PowerLawLossCurve(floor_loss=2.2, scale=20.3, exponent=0.35, offset_iterations=100.0)


def test_progress_model_loses_the_setbacks_exactly_while_progress_stays_above_zero():
    # 0.01 rebuilds per iteration, 2 iterations each: the clip at 0 is (almost) never reached, so the
    # mean progress after 10k iterations is 10k − 2 · (expected rebuilds) = 9,800.
    model = ProgressModel(iterations=10_000, rebuilds_per_iteration=0.01, num_paths=4000)
    progress = model.final_progress(2.0)
    standard_error = 2.0 * math.sqrt(100) / math.sqrt(4000)  # Poisson count of rebuilds
    assert abs(progress.mean() - 9_800.0) < 4 * standard_error
    assert np.all(model.final_progress(0.0) == 10_000.0)


def test_progress_model_stalls_near_the_mean_gap_between_rebuilds_for_huge_setbacks():
    # Every rebuild sends progress to 0: what is left is the time since the last rebuild, Exp(1 / rate).
    model = ProgressModel(iterations=10_000, rebuilds_per_iteration=0.02, num_paths=4000)
    progress = model.final_progress(1e6)
    assert abs(progress.mean() - 50.0) < 4 * 50.0 / math.sqrt(4000)


@pytest.mark.parametrize("true_setback", [3.0, 12.0, 30.0])
def test_fit_recovers_a_known_setback_from_losses_of_independent_failure_paths(true_setback):
    setting = PaperSetting()
    truth = ProgressModel(iterations=setting.iterations, rebuilds_per_iteration=setting.rebuilds_per_iteration, num_paths=4000, seed=12345)
    observed_loss = float(truth.final_losses(CURVE, true_setback).mean())
    fitted = solve_setback(
        ProgressModel(iterations=setting.iterations, rebuilds_per_iteration=setting.rebuilds_per_iteration), CURVE, observed_loss
    )
    assert fitted.bound is None
    assert fitted.setback_iterations == pytest.approx(true_setback, rel=0.03)


def test_a_loss_on_the_no_failure_curve_needs_no_setback_and_one_above_the_stall_is_out_of_reach():
    model = ProgressModel(iterations=10_000, rebuilds_per_iteration=0.0263, num_paths=500)
    assert solve_setback(model, CURVE, CURVE.loss(10_000) - 0.01).bound == "no_failure_curve"
    assert solve_setback(model, CURVE, CURVE.loss(0) + 0.1).bound == "saturated"


def test_curve_reaching_moves_only_the_scale():
    moved = curve_reaching(CURVE, 2.9, 20_000)
    assert moved.loss(20_000) == pytest.approx(2.9)
    assert (moved.floor_loss, moved.exponent, moved.offset_iterations) == (CURVE.floor_loss, CURVE.exponent, CURVE.offset_iterations)


def test_stored_paper_setbacks_are_the_fit_of_the_500m_preset_and_move_with_the_anchor():
    fits = fit_paper_setbacks(checkfree_500m_geo().convergence.baseline, 2.9)
    for arm, (central, low, high) in PAPER_SETBACKS.items():
        fit = fits[arm]
        assert (fit.setback_iterations, fit.low_iterations, fit.high_iterations) == pytest.approx((central, low, high), abs=0.06), arm
        # A no-failure curve that reaches the target sooner (lower loss at 10k) leaves more to explain.
        assert fit.by_anchor["target at 10000"] > fit.by_anchor["central"] > fit.by_anchor["target at 20000"], arm
        assert fit.low_iterations <= fit.setback_iterations <= fit.high_iterations
    weighted, copy, random = (PAPER_SETBACKS[arm][0] for arm in ("weighted", "copy", "random"))
    assert weighted < copy < random  # the paper's order of perplexities
    # Random sits at the stall: about one mean gap between rebuilds (≈ 38 iterations) at 16 %/h.
    assert random == pytest.approx(1.0 / PaperSetting().rebuilds_per_iteration, rel=0.1)


def test_paper_presets_carry_the_paper_fitted_setbacks_and_say_so():
    fitted = paper_fitted_setbacks()
    for name in PRESETS:
        scenario = preset(name)
        if name.startswith("checkfree-"):
            assert scenario.convergence.setback_source == "paper_fitted", name
            assert scenario.convergence.setbacks == fitted, name
            assert not scenario.convergence.calibrated
        elif name != "cpu-tiny":
            assert scenario.convergence.setback_source == "default", name
    checkfree = fitted["checkfree"]
    assert checkfree.interior.mean_iterations == PAPER_SETBACKS["weighted"][0]
    assert checkfree.edge.mean_iterations == PAPER_SETBACKS["copy"][0]  # a copy-based fallback
    assert fitted["random"].interior.ci95_high_iterations == PAPER_SETBACKS["random"][2]
