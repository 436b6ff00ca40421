"""Convergence setbacks fitted to the CheckFree paper's published ablation (arXiv 2506.15461).

The only published numbers about what a rebuild costs the model are the ablation's perplexities of
the 500M model after 10,000 iterations at 16 %/h (v1 `plot_perplexity.py`, gensyn-ai/CheckFree@0e2711d):
gradient-weighted average 22.60, copy 29.24, random 121.03. This module turns them into setbacks
(iterations of baseline progress lost per rebuilt stage), the quantity the simulator charges.

The model (the simulator's own, sim/model/run_context.py `apply_setback`): effective progress grows by one
per executed iteration; every rebuilt stage subtracts a setback s, not below 0; the loss is the
baseline curve at the effective progress. Rebuilds arrive as a Poisson process in executed
iterations at the rate the `checkfree-500m-geo-16pct` preset produces (`PaperSetting`: 12 stages, each
failing with probability 0.16 per hour, the simulator's 43.7 s iteration, 39 s of recovery downtime
and half a lost iteration per failure, ≈ 0.0263 rebuilds per iteration, ≈ 263 in 10k iterations).
For one s, `ProgressModel` draws 2,000 failure paths (fixed seed, the same for every s), and the fit
finds the s whose mean loss after 10k iterations equals ln(perplexity).

Assumptions (README "Setbacks from the CheckFree paper" repeats them):

1. loss = ln(perplexity). The paper's figure averages per-batch perplexities over 50 validation
   batches, which by Jensen slightly overstates exp(mean loss); ignored.
2. The paper's run and the preset lose the same progress per hour: the paper's v1 layout is 6
   stages of 4 layers at p = 0.004 per iteration (240 rebuilds in 10k iterations), the preset 12 of
   2 layers (≈ 263): about as many rebuilds, each of half as many layers. If a rebuild cost the same
   whatever its size, the preset's per-rebuild setbacks would be about half of these.
3. The anchor, which the paper does not give: the no-failure run's loss at 10k iterations. The fit
   uses the preset's curve (floor 2.2, exponent 0.35; the target 2.9 at ≈ 15k iterations) and
   reports the range from the same curve re-scaled to reach 2.9 at 10k (no-failure perplexity 18.2
   at 10k: large setbacks) and at 20k (22.0: small setbacks), the span of the paper's x-axis. Every
   setback, and every ratio between them, moves with this anchor: neither is identified without it.
4. The range also covers one run's luck: the setbacks for which the paper's loss lies at the 2.5 %
   and the 97.5 % quantile of the simulated runs' losses. It is treated as a 95 % interval when a
   replication draws its setbacks (calibration/setback_uncertainty.py).
5. The weighted run recovers every stage, four of v1's six by copying a neighbour (the swap
   partner in v1's convergence_training.py): its setback is the average over that mix. It is used
   for CheckFree's interior and both CheckFree+ positions; copy's for every copy-based rebuild
   (CheckFree's edge and adjacent fallback); uniform (not in the ablation) takes 1.5 × weighted,
   the defaults' ratio, and copy's for its copy fallback.
6. Random init: ln(121.03) = 4.80 is explained only where progress stalls, a setback of about the
   mean gap between rebuilds (1 / 0.0263 ≈ 38 iterations); beyond it the loss saturates at the
   curve's loss a few dozen iterations in (≈ 5.4–5.9, perplexity ≈ 220–380), so the fit pins random
   near the stall and a larger setback cannot be told apart. The paper's copy and random runs also
   come from reference code with ablation bugs (reference sheet §6, bug 6: parameters without a
   gradient averaged as zeros, so a "random" stage may be a dead one), weaker evidence than the
   weighted run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .churn import stage_hourly_probability_to_rate_per_s
from .convergence import MethodSetbacks, PowerLawLossCurve, SetbackSpec, default_setbacks

PAPER_PERPLEXITY_AFTER_10K: dict[str, float] = {
    "weighted": 22.60155671926645,
    "copy": 29.244000053405763,
    "random": 121.03475341796874,
}
"""The ablation's perplexities (500M, 16 %/h, 10k iterations; CheckFree v1 plot_perplexity.py)."""

PAPER_ABLATION_ITERATIONS = 10_000
PAPER_FAILURE_PROBABILITY_PER_STAGE_HOUR = 0.16
PRESET_500M_NUM_STAGES = 12
PRESET_500M_ITERATION_TIME_S = 43.68
"""The simulator's healthy iteration of `checkfree-500m-geo-*` (tests/calibration/test_paper_setbacks.py checks it)."""
PRESET_500M_RECOVERY_DOWNTIME_S = 39.3
"""The simulator's mean recovery downtime per rebuild there: join 30 s + restart 6.6 s + weight transfer."""
ANCHOR_TARGET_ITERATIONS = (10_000, 20_000)
"""Iterations at which the re-scaled no-failure curves reach the target: the anchor's range (assumption 3)."""
UNIFORM_TO_WEIGHTED_RATIO = 1.5
"""Uniform averaging, not in the ablation: the default setbacks' interior ratio 3 / 2 (assumption 5)."""

PAPER_FIT_SOURCE = (
    "setbacks fitted to the CheckFree paper's ablation (500M, 16 %/h, perplexity after 10k iterations: "
    "weighted 22.60, copy 29.24, random 121.03; calibration/paper_setbacks.py), anchored on the preset's "
    "illustrative no-failure curve; intervals span no-failure curves reaching the target at 10k-20k iterations"
)


@dataclass(frozen=True, kw_only=True)
class PaperSetting:
    """The run the ablation is mapped onto: the `checkfree-500m-geo-16pct` preset (assumption 2)."""

    iterations: int = PAPER_ABLATION_ITERATIONS
    failure_probability_per_stage_hour: float = PAPER_FAILURE_PROBABILITY_PER_STAGE_HOUR
    num_stages: int = PRESET_500M_NUM_STAGES
    iteration_time_s: float = PRESET_500M_ITERATION_TIME_S
    recovery_downtime_s: float = PRESET_500M_RECOVERY_DOWNTIME_S

    @property
    def rebuilds_per_iteration(self) -> float:
        """Stage failures per executed iteration. Failures arrive in wall-clock time, and each one adds
        its recovery downtime and, on average, half a destroyed iteration to the wall-clock."""
        pipeline_rate_per_s = self.num_stages * stage_hourly_probability_to_rate_per_s(self.failure_probability_per_stage_hour)
        busy_fraction = pipeline_rate_per_s * (self.recovery_downtime_s + self.iteration_time_s / 2)
        if busy_fraction >= 1:
            raise ValueError(f"failures every {1 / pipeline_rate_per_s:.3g} s leave no time to train ({self})")
        return pipeline_rate_per_s * self.iteration_time_s / (1 - busy_fraction)


class ProgressModel:
    """Effective progress after `iterations` executed iterations for any setback, over fixed failure paths.

    The same paths (gaps between rebuilds, in iterations) serve every setback, so the final progress
    of each path falls as the setback grows and a fit by root finding is well posed.
    """

    def __init__(self, *, iterations: float, rebuilds_per_iteration: float, num_paths: int = 2000, seed: int = 0) -> None:
        if iterations <= 0 or rebuilds_per_iteration <= 0:
            raise ValueError(f"iterations {iterations} and rebuilds_per_iteration {rebuilds_per_iteration} must be > 0")
        self.iterations = float(iterations)
        expected = rebuilds_per_iteration * iterations
        max_events = int(expected + 8 * math.sqrt(expected) + 20)
        gaps = np.random.default_rng(seed).exponential(1.0 / rebuilds_per_iteration, size=(num_paths, max_events))
        times = np.cumsum(gaps, axis=1)
        if not np.all(times[:, -1] >= iterations):
            raise AssertionError("too few failure events drawn for the horizon")  # internal: 8 sigma above the mean
        self._gaps = gaps
        self._active = times < iterations
        self._last_time = np.where(self._active, times, 0.0).max(axis=1)
        self._num_events = int(self._active.sum(axis=1).max())

    def final_progress(self, setback_iterations: float) -> np.ndarray:
        """Progress of every path after `iterations`, each rebuild subtracting `setback_iterations` (not below 0)."""
        progress = np.zeros(self._gaps.shape[0])
        for event in range(self._num_events):
            active = self._active[:, event]
            progress = np.where(active, np.maximum(progress + self._gaps[:, event] - setback_iterations, 0.0), progress)
        return progress + (self.iterations - self._last_time)

    def final_losses(self, curve: PowerLawLossCurve, setback_iterations: float) -> np.ndarray:
        progress = self.final_progress(setback_iterations)
        return curve.floor_loss + curve.scale * (progress + curve.offset_iterations) ** (-curve.exponent)


def curve_reaching(curve: PowerLawLossCurve, target_loss: float, at_iterations: float) -> PowerLawLossCurve:
    """`curve` with its scale changed so that it reaches `target_loss` after `at_iterations` (floor, exponent, offset kept)."""
    scale = (target_loss - curve.floor_loss) * (at_iterations + curve.offset_iterations) ** curve.exponent
    return curve.model_copy(update={"scale": scale, "r_squared": None})


@dataclass(frozen=True, kw_only=True)
class SetbackSolution:
    """The setback matching one statistic of the simulated losses to the observed loss."""

    setback_iterations: float
    bound: str | None = None
    """None for an exact match; "no_failure_curve" when the observed loss is at or under the no-failure
    loss (setback 0); "saturated" when no setback reaches it (the largest setback tried is returned)."""


def solve_setback(model: ProgressModel, curve: PowerLawLossCurve, observed_loss: float, *, quantile: float | None = None,
                  max_setback_iterations: float = 10_000.0) -> SetbackSolution:
    """The setback whose mean (or `quantile`) of the final losses equals `observed_loss`."""

    def statistic(setback: float) -> float:
        losses = model.final_losses(curve, setback)
        return float(np.mean(losses) if quantile is None else np.quantile(losses, quantile))

    if statistic(0.0) >= observed_loss:
        return SetbackSolution(setback_iterations=0.0, bound="no_failure_curve")
    if statistic(max_setback_iterations) < observed_loss:
        return SetbackSolution(setback_iterations=max_setback_iterations, bound="saturated")
    from scipy import optimize  # lazily: presets import this module, only a fit solves (issue 11)

    root = optimize.brentq(lambda s: statistic(s) - observed_loss, 0.0, max_setback_iterations, xtol=1e-3, rtol=1e-6)
    return SetbackSolution(setback_iterations=float(root))


@dataclass(frozen=True, kw_only=True)
class PaperSetbackFit:
    """The setback per rebuilt stage behind one ablation arm, with its range (module docstring)."""

    ablation: str
    observed_perplexity: float
    setback_iterations: float
    """Mean loss matched, central anchor (the preset's curve)."""
    low_iterations: float
    high_iterations: float
    """Smallest and largest setback over the anchors and the 2.5 %-97.5 % spread of single runs."""
    by_anchor: dict[str, float]
    """Mean-matching setback per anchor ("central", "target at 10000", "target at 20000")."""
    bounds: tuple[str, ...] = ()
    """Anchors or quantiles at which the observed loss was out of reach ("<anchor>: saturated", ...)."""

    @cached_property
    def spec(self) -> SetbackSpec:
        return SetbackSpec(mean_iterations=self.setback_iterations, ci95_low_iterations=self.low_iterations, ci95_high_iterations=self.high_iterations)


def fit_paper_setbacks(
    curve: PowerLawLossCurve,
    target_loss: float,
    *,
    setting: PaperSetting = PaperSetting(),
    anchor_target_iterations: tuple[float, ...] = ANCHOR_TARGET_ITERATIONS,
    observed_perplexity: dict[str, float] | None = None,
    num_paths: int = 2000,
) -> dict[str, PaperSetbackFit]:
    """Setback per rebuilt stage for each ablation arm (about 2 s; the presets use `PAPER_SETBACKS`).

    `curve` is the central anchor; each of `anchor_target_iterations` is the curve re-scaled to reach
    `target_loss` there. `observed_perplexity` defaults to the paper's (`PAPER_PERPLEXITY_AFTER_10K`).
    """
    observed = PAPER_PERPLEXITY_AFTER_10K if observed_perplexity is None else observed_perplexity
    model = ProgressModel(iterations=setting.iterations, rebuilds_per_iteration=setting.rebuilds_per_iteration, num_paths=num_paths)
    anchors = {"central": curve, **{f"target at {at:g}": curve_reaching(curve, target_loss, at) for at in anchor_target_iterations}}
    fits = {}
    for ablation, perplexity in observed.items():
        loss = math.log(perplexity)
        by_anchor, values, bounds = {}, [], []
        for name, anchored in anchors.items():
            for quantile in (None, 0.975, 0.025):
                solution = solve_setback(model, anchored, loss, quantile=quantile)
                values.append(solution.setback_iterations)
                if quantile is None:
                    by_anchor[name] = solution.setback_iterations
                if solution.bound is not None:
                    bounds.append(f"{name}{'' if quantile is None else f' q{quantile:g}'}: {solution.bound}")
        fits[ablation] = PaperSetbackFit(
            ablation=ablation, observed_perplexity=perplexity, setback_iterations=by_anchor["central"],
            low_iterations=min(values), high_iterations=max(values), by_anchor=by_anchor, bounds=tuple(bounds),
        )
    return fits


# `fit_paper_setbacks(checkfree_500m_geo().convergence.baseline, 2.9)`, rounded to 0.1 iteration:
# (central, low, high) iterations of baseline progress per rebuilt stage. Stored so that building a
# preset costs nothing; tests/calibration/test_paper_setbacks.py re-runs the fit and compares.
PAPER_SETBACKS: dict[str, tuple[float, float, float]] = {
    "weighted": (12.0, 2.8, 23.5),
    "copy": (25.3, 18.7, 34.0),
    "random": (39.1, 33.1, 119.1),
}


def _spec(values: tuple[float, float, float], factor: float = 1.0) -> SetbackSpec:
    central, low, high = (value * factor for value in values)
    return SetbackSpec(mean_iterations=central, ci95_low_iterations=low, ci95_high_iterations=high)


def paper_fitted_setbacks(fitted: dict[str, tuple[float, float, float]] | None = None) -> dict[str, MethodSetbacks]:
    """Every setback-using method's setbacks from the paper fit (assumption 5); methods the fit does
    not cover keep their documented defaults."""
    arms = PAPER_SETBACKS if fitted is None else fitted
    weighted, copy, random = _spec(arms["weighted"]), _spec(arms["copy"]), _spec(arms["random"])
    setbacks = default_setbacks()
    paper = {
        "checkfree": MethodSetbacks(interior=weighted, edge=copy),
        "checkfree_plus": MethodSetbacks(interior=weighted, edge=weighted),
        "copy": MethodSetbacks(interior=copy, edge=copy),
        "uniform": MethodSetbacks(interior=_spec(arms["weighted"], UNIFORM_TO_WEIGHTED_RATIO), edge=copy),
        "random": MethodSetbacks(interior=random, edge=random),
    }
    setbacks.update({name: value for name, value in paper.items() if name in setbacks})
    return setbacks
