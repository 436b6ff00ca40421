"""Per-replication setback draws and the setback source (calibration/setback_uncertainty.py, convergence.py)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from churnsim.calibration.convergence import ConvergenceSpec, MethodSetbacks, PowerLawLossCurve, SetbackSpec
from churnsim.calibration.setback_uncertainty import (
    is_uncertain,
    replication_convergence,
    setback_at,
    setback_normal_draw,
    setback_source_note,
)

CURVE = PowerLawLossCurve(floor_loss=1.0, scale=10.0, exponent=0.5)
ASYMMETRIC = SetbackSpec(mean_iterations=12.0, ci95_low_iterations=3.0, ci95_high_iterations=24.0)


def uncertain_convergence(**fields) -> ConvergenceSpec:
    return ConvergenceSpec(
        baseline=CURVE,
        setbacks={"checkfree": MethodSetbacks(interior=ASYMMETRIC, edge=SetbackSpec(mean_iterations=6.0)), "copy": MethodSetbacks(interior=ASYMMETRIC, edge=ASYMMETRIC)},
        setback_source="paper_fitted",
        **fields,
    )


def test_draws_put_the_interval_ends_at_the_2_5_and_97_5_percent_quantiles_and_the_mean_at_the_median():
    values = np.array([setback_at(ASYMMETRIC, z) for z in np.random.default_rng(0).standard_normal(40_000)])
    low, median, high = np.quantile(values, [0.025, 0.5, 0.975])
    assert low == pytest.approx(3.0, abs=0.3) and median == pytest.approx(12.0, abs=0.2) and high == pytest.approx(24.0, abs=0.5)
    assert values.min() >= 0.0


def test_a_setback_without_an_interval_is_used_as_it_is():
    assert setback_at(SetbackSpec(mean_iterations=6.0), 2.5) == 6.0
    defaults = ConvergenceSpec(baseline=CURVE)
    assert not is_uncertain(defaults)
    assert replication_convergence(defaults, seed=0, replication=3) is defaults


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"mean_iterations": 12.0, "ci95_low_iterations": 30.0, "ci95_high_iterations": 40.0}, "mean_iterations 12 lies outside"),
        ({"mean_iterations": 12.0, "ci95_low_iterations": 20.0, "ci95_high_iterations": 3.0}, "mean_iterations 12 lies outside"),
        ({"mean_iterations": 12.0, "ci95_low_iterations": 3.0}, "give both ci95_low_iterations and ci95_high_iterations"),
        ({"mean_iterations": 0.0, "per_progress_iteration": 0.4, "per_progress_ci95_low": 0.5, "per_progress_ci95_high": 0.6}, "per_progress_iteration 0.4 lies outside"),
    ],
)
def test_an_interval_that_does_not_hold_its_value_is_refused(fields, words):
    """The draws use an interval only when it brackets the value; any other would be dropped silently."""
    with pytest.raises(ValidationError, match=words):
        SetbackSpec(**fields)
    assert setback_at(SetbackSpec(mean_iterations=12.0, ci95_low_iterations=12.0, ci95_high_iterations=12.0), 1.0) == 12.0


def test_each_replication_draws_its_own_setbacks_reproducibly_from_its_own_stream():
    convergence = uncertain_convergence()
    draws = [replication_convergence(convergence, seed=7, replication=r).setback_iterations("checkfree", "interior") for r in range(6)]
    again = [replication_convergence(convergence, seed=7, replication=r).setback_iterations("checkfree", "interior") for r in range(6)]
    assert draws == again
    assert len(set(draws)) == 6
    other_seed = [replication_convergence(convergence, seed=8, replication=r).setback_iterations("checkfree", "interior") for r in range(6)]
    assert other_seed != draws
    # Without an interval (checkfree's edge here) nothing is drawn.
    assert {replication_convergence(convergence, seed=7, replication=r).setback_iterations("checkfree", "edge") for r in range(6)} == {6.0}
    # A method's draw does not depend on which other methods have setbacks.
    alone = convergence.model_copy(update={"setbacks": {"checkfree": convergence.setbacks["checkfree"]}})
    assert replication_convergence(alone, seed=7, replication=2).setback_iterations("checkfree", "interior") == draws[2]
    # setback_scale multiplies the draw.
    scaled = convergence.model_copy(update={"setback_scale": 2.0})
    assert replication_convergence(scaled, seed=7, replication=2).setback_iterations("checkfree", "interior") == pytest.approx(2 * draws[2])
    z = setback_normal_draw(seed=7, replication=2, method="checkfree", position="interior")
    assert draws[2] == pytest.approx(setback_at(ASYMMETRIC, z))


def test_sample_setbacks_false_uses_the_means():
    convergence = uncertain_convergence(sample_setbacks=False)
    assert replication_convergence(convergence, seed=7, replication=2) is convergence


def test_setback_source_follows_calibrated_and_contradictions_are_refused():
    assert ConvergenceSpec(baseline=CURVE).setback_source == "default"
    assert ConvergenceSpec(baseline=CURVE, calibrated=True).setback_source == "measured"
    assert ConvergenceSpec(baseline=CURVE, setback_source="measured").calibrated is True
    assert ConvergenceSpec(baseline=CURVE, setback_source="paper_fitted").calibrated is False
    round_trip = ConvergenceSpec.model_validate(uncertain_convergence().model_dump())
    assert round_trip.setback_source == "paper_fitted" and round_trip.sample_setbacks
    with pytest.raises(ValidationError, match="contradicts setback_source"):
        ConvergenceSpec(baseline=CURVE, calibrated=True, setback_source="paper_fitted")


@pytest.mark.parametrize(
    ("source", "words"),
    [("default", "uncalibrated defaults"), ("paper_fitted", "CheckFree paper's ablation"), ("measured", "are measured")],
)
def test_the_note_names_the_setback_source_and_whether_replications_draw_them(source, words):
    convergence = uncertain_convergence().model_copy(update={"setback_source": source})
    note = setback_source_note(convergence)
    assert words in note and "each replication draws" in note
    assert "no interval, or sample_setbacks off" in setback_source_note(convergence.model_copy(update={"sample_setbacks": False}))
