"""What is not known about convergence setbacks, carried into every answer.

A setback with an interval (`SetbackSpec.ci95_low_iterations`, `ci95_high_iterations`: the Student-t
95 % interval of a measured mean, or the range of the paper fit, calibration/paper_setbacks.py) is
uncertain, and the uncertainty is shared by every rebuild of a run: it is about the mean, not
rebuild-to-rebuild noise. So each replication draws one value per (method, position) and uses it for
all its rebuilds; the spread over replications then widens the intervals of time to target and of
speed-ups by what the setbacks leave open.

The draw maps one standard normal z through the interval: mean + z · (mean − low) / 1.96 below the
mean, mean + z · (high − mean) / 1.96 above it (a two-piece normal whose 2.5 % and 97.5 % quantiles
are the interval's ends and whose median is the mean), clipped at 0. A setback without an interval
(the documented defaults, a single measured rebuild) is used as it is.

z comes from `numpy.random.SeedSequence((seed, replication, SETBACK_STREAM, crc32(method), position))`:
its own stream, so drawing setbacks never moves the failure path (`CHURN_STREAM`), every method of a
replication still sees the same failures, and a method's draw does not depend on which other methods
run. The same replication draws the same z at every failure rate and setback scale of a sweep.
`ConvergenceSpec.sample_setbacks = False` turns the draws off (every replication uses the means).
"""

from __future__ import annotations

import zlib

import numpy as np

from .convergence import ConvergenceSpec, MethodSetbacks, SetbackSpec
from .stage_positions import StagePosition
from .statistics import NORMAL_QUANTILE_975

SETBACK_STREAM = 2
"""Source index of the setback draws (calibration/failure_sampling.py: CHURN_STREAM = 1)."""
POSITIONS: tuple[StagePosition, ...] = ("interior", "edge")


def setback_normal_draw(*, seed: int, replication: int, method: str, position: StagePosition) -> float:
    """The standard normal behind replication `replication`'s setback of (`method`, `position`)."""
    entropy = (seed, replication, SETBACK_STREAM, zlib.crc32(method.encode("utf-8")), POSITIONS.index(position))
    return float(np.random.default_rng(np.random.SeedSequence(entropy)).standard_normal())


def has_interval(spec: SetbackSpec) -> bool:
    low, high = spec.ci95_low_iterations, spec.ci95_high_iterations
    return (low is not None and high is not None and high > low) or _has_progress_interval(spec)


def _has_progress_interval(spec: SetbackSpec) -> bool:
    low, high = spec.per_progress_ci95_low, spec.per_progress_ci95_high
    return low is not None and high is not None and high > low


def _two_piece(mean: float, low: float | None, high: float | None, z: float) -> float:
    if low is None or high is None or not high > low:
        return mean
    half_width = (mean - low) if z < 0 else (high - mean)
    return max(0.0, mean + z * max(half_width, 0.0) / NORMAL_QUANTILE_975)


def setback_at(spec: SetbackSpec, z: float) -> float:
    """The setback at standard-normal quantile `z` of `spec`'s two-piece normal (module docstring)."""
    return _two_piece(spec.mean_iterations, spec.ci95_low_iterations, spec.ci95_high_iterations, z)


def spec_at(spec: SetbackSpec, z: float) -> SetbackSpec:
    """`spec` with its mean and its growth with progress both at quantile `z` (one draw moves both): a
    known value now, so without the intervals it was drawn from."""
    return SetbackSpec(
        mean_iterations=setback_at(spec, z),
        num_samples=spec.num_samples,
        per_progress_iteration=_two_piece(spec.per_progress_iteration, spec.per_progress_ci95_low, spec.per_progress_ci95_high, z),
        progress_offset_iterations=spec.progress_offset_iterations,
    )


def is_uncertain(convergence: ConvergenceSpec) -> bool:
    """Whether replications of a scenario with this convergence model draw different setbacks."""
    return convergence.sample_setbacks and any(
        has_interval(setbacks.for_position(position)) for setbacks in convergence.setbacks.values() for position in POSITIONS
    )


def replication_convergence(convergence: ConvergenceSpec, *, seed: int, replication: int) -> ConvergenceSpec:
    """`convergence` with the means replaced by replication `replication`'s draws (unchanged when not sampling)."""
    if not is_uncertain(convergence):
        return convergence
    drawn = {}
    for method, setbacks in convergence.setbacks.items():
        specs = {}
        for position in POSITIONS:
            spec = setbacks.for_position(position)
            z = setback_normal_draw(seed=seed, replication=replication, method=method, position=position)
            specs[position] = spec_at(spec, z)
        drawn[method] = MethodSetbacks(**specs)
    return convergence.model_copy(update={"setbacks": drawn})


def setback_source_note(convergence: ConvergenceSpec) -> str:
    """One line naming where the setbacks come from and whether replications draw them."""
    sampled = is_uncertain(convergence)
    draws = (
        "each replication draws its setbacks from their intervals, so the intervals of time to target include them"
        if sampled
        else "replications use them as they are (no interval, or sample_setbacks off): "
        "`churnsim whatif --setback-sensitivity` shows how the answer moves with them"
    )
    source = convergence.setback_source or ("measured" if convergence.calibrated else "default")
    if source == "measured":
        return f"convergence setbacks are measured ({convergence.source}); {draws}"
    if source == "paper_fitted":
        checkfree = convergence.setbacks.get("checkfree")
        example = ""
        if checkfree is not None:
            spec = checkfree.interior
            example = f"; CheckFree interior: {spec.mean_iterations * convergence.setback_scale:.3g} iterations per rebuild"
            if has_interval(spec):
                low, high = (value * convergence.setback_scale for value in (spec.ci95_low_iterations, spec.ci95_high_iterations))  # type: ignore[operator]
                example += f", range {low:.3g}-{high:.3g}"
        return (
            f"convergence setbacks are uncalibrated on this model: fitted to the CheckFree paper's ablation "
            f"(calibration/paper_setbacks.py{example}), not measured; {draws}"
        )
    return (
        "convergence setbacks are the uncalibrated defaults of calibration/methods.py, not measurements; "
        f"`churnsim calibrate` measures them, and a scenario file can carry measured setbacks (README, Calibration); {draws}"
    )
