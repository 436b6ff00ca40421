"""`churnsim recommend`: which method to use on one scenario, with its knobs, and how robust that is.

1. Every real method of the scenario (neither the no-failure reference nor an ablation) runs at its
   knobs; a method with an `edge_fallback` field (CheckFree) runs with `checkpoint` and `copy`.
2. Each method with a checkpoint interval (redundant computation's is its fallback's) gets an
   interval study. For the checkpoint family, δ is its blocked seconds per checkpoint read off the
   first pass's runs (stall / checkpoints taken), M the mean time between failures of the whole
   pipeline (`mean_stage_failure_rate_per_s` × stages), Young's √(2δM) and Daly's optimum in
   iterations, and a small grid of intervals around Daly's (factors `INTERVAL_GRID_FACTORS`, plus
   Young's, Daly's and the scenario's own). Where there is no δ, no failure or no such M (a
   fallback read only after two adjacent losses), the grid is around the scenario's own
   interval. The grid point with the
   lowest mean time to target is the simulated optimum; a fit W(K) = a + b/K + c·K to the grid's
   means gives a smooth estimate beside it. Where the best point is the grid's smallest or largest,
   the grid grows past it (half the smallest, twice the largest interval) and runs again, up to
   `MAX_GRID_EXTENSIONS` times, until the best point has a neighbour on each side, the smallest is
   1 iteration, or the largest exceeds the iterations a run executes (no checkpoint is taken then).
3. The winner is the best variant of each method compared by `sim/verdict.py`'s rule (methods that
   reached the target in every replication first, then the lowest mean time to target).
4. Robustness: each method's best variant (knobs fixed) runs again with every setback scaled (0.5×,
   2×) and the failure rate scaled (×0.5, ×2); each case says whether the winner changes. At a
   scaled failure rate a blocking checkpoint whose kept interval is far from Daly's there also runs
   at Daly's (`sim/untuned_intervals.py`), and the case takes the better of the two.

Common random numbers throughout: every variant and case of replication r sees the same failure
path (for the same churn) and the same setback draws.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.churn import PoissonChurn, StageHourlyChurn
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario

from .analytic import interval_optimum_from_runs
from .replicate import replication_tasks
from .setback_sensitivity import sensitivity_methods
from .sweep import SweepTask, run_sweep
from .untuned_intervals import daly_reruns
from .verdict import Estimate, _json_safe, finite_or_none

INTERVAL_GRID_FACTORS: tuple[float, ...] = (0.5, 1.0, 2.0)
"""Multiples of Daly's interval (Young's where Daly's is missing) in the interval grid."""
MAX_GRID_EXTENSIONS = 4
"""Passes that grow an interval grid past its edge: from the edge, at most 16× smaller or larger."""
EDGE_FALLBACKS: tuple[str, ...] = ("checkpoint", "copy")
SETBACK_SCALES: tuple[float, ...] = (0.5, 2.0)
RATE_FACTORS: tuple[float, ...] = (0.5, 2.0)
VARIANT = "recommend.variant"
CASE = "recommend.case"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One method at one setting of its knobs."""

    method: str
    knobs: dict[str, Any]
    """The knobs this variant sets (empty: the scenario's config as given)."""
    fraction_reached: float | None
    time_to_target_s: Estimate


@dataclass(frozen=True, kw_only=True)
class IntervalStudy:
    method: str
    interval_field: str
    checkpoint_cost_s: float | None
    """δ: blocked seconds per checkpoint, from the runs."""
    mean_time_between_failures_s: float | None
    """M of the whole pipeline; None without failures."""
    iteration_s: float | None
    young_interval_iterations: float | None
    daly_interval_iterations: float | None
    scenario_interval_iterations: int
    best_interval_iterations: int | None
    """The grid point with the lowest mean time to target (the simulated optimum on the grid)."""
    grid_extensions: int
    """Points added past the first grid's edges while the best point lay on one."""
    fitted_optimum_iterations: float | None
    """√(b/c) of a fit a + b/K + c·K to the grid's mean times; None where the fit has no minimum."""
    grid: tuple[Candidate, ...]


@dataclass(frozen=True, kw_only=True)
class RobustnessCase:
    uncertain_input: str
    """`setback_scale` or `failure_rate`."""
    factor: float
    winner: str | None
    winner_time_to_target_s: Estimate | None
    winner_changes: bool | None
    """None where the case could not be run (e.g. a churn model whose rate cannot be scaled)."""
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    scenario: str
    replications: int
    winner: str | None
    winner_knobs: dict[str, Any]
    winner_time_to_target_s: Estimate | None
    cannot_be_told_apart_from: tuple[str, ...]
    best_per_method: tuple[Candidate, ...]
    """Each method's best variant, best first."""
    interval_studies: tuple[IntervalStudy, ...]
    edge_fallbacks: tuple[Candidate, ...]
    robustness: tuple[RobustnessCase, ...]
    caveats: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """Plain data for `json.dumps(..., allow_nan=False)`: every missing number is None."""
        return _json_safe(asdict(self))


def _variant_key(method: str, knobs: dict[str, Any]) -> str:
    return method + "".join(f" {name}={value}" for name, value in sorted(knobs.items()))


def _sort_key(candidate: Candidate) -> tuple[bool, float]:
    mean = candidate.time_to_target_s.mean
    return (candidate.fraction_reached != 1.0, mean if mean is not None else math.inf)


def _tasks(scenario: Scenario, variants: dict[str, MethodConfig], case: str, replications: int) -> list[SweepTask]:
    tasks = []
    for key, method in variants.items():
        point = Scenario.model_validate(scenario.model_copy(update={"methods": (method,), "replications": replications}).model_dump())
        for task in replication_tasks(point):
            tasks.append(SweepTask(task=task, settings={VARIANT: key, CASE: case}, keep_trajectories=False))
    return tasks


def _candidates(runs: pd.DataFrame, knobs: dict[str, dict[str, Any]], case: str) -> dict[str, Candidate]:
    out = {}
    for key, group in runs[runs[CASE] == case].groupby(VARIANT, sort=False):
        out[str(key)] = Candidate(
            method=str(group["method"].iloc[0]),
            knobs=knobs[str(key)],
            fraction_reached=finite_or_none(group["reached_target"].mean()),
            time_to_target_s=Estimate.of_values(group["time_to_target_s"].tolist()),
        )
    return out


def _best_per_method(candidates: Sequence[Candidate]) -> list[Candidate]:
    best: dict[str, Candidate] = {}
    for candidate in sorted(candidates, key=_sort_key):
        best.setdefault(candidate.method, candidate)
    return sorted(best.values(), key=_sort_key)


def scaled_churn(scenario: Scenario, factor: float):
    """The scenario's churn with its failure rate × `factor`; None for churn models without one rate."""
    churn = scenario.churn
    if isinstance(churn, StageHourlyChurn):
        probability = 1.0 - (1.0 - churn.failure_probability_per_stage_hour) ** factor
        return churn.model_copy(update={"failure_probability_per_stage_hour": probability})
    if isinstance(churn, PoissonChurn):
        return churn.model_copy(update={"failures_per_node_hour": churn.failures_per_node_hour * factor})
    return None


def _knob_text(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{name} = {value}" for name, value in knobs.items())


def _fitted_optimum(intervals: Sequence[int], means: Sequence[float]) -> float | None:
    points = [(k, w) for k, w in zip(intervals, means) if w is not None]
    if len(points) < 3:
        return None
    k = np.array([p[0] for p in points], dtype=float)
    design = np.column_stack([np.ones(len(k)), 1.0 / k, k])
    _, inverse, linear = np.linalg.lstsq(design, np.array([p[1] for p in points]), rcond=None)[0]
    return float(math.sqrt(inverse / linear)) if inverse > 0 and linear > 0 else None


def _interval_grid(center: float | None, extra: Sequence[float | None], factors: Sequence[float]) -> list[int]:
    values = [center * factor for factor in factors] if center is not None else []
    values += [value for value in extra if value is not None]
    return sorted({max(1, round(value)) for value in values})


def interval_beyond_edge(grid: Sequence[int], best_interval: int, iterations_executed: float) -> int | None:
    """The next interval past the grid's edge where the best one lies on it: half the smallest (not
    below 1), twice the largest (while a run still takes a checkpoint at it); None where the best
    point has neighbours on both sides or the grid cannot grow that way."""
    if len(grid) < 2:
        return None
    if best_interval == min(grid) and best_interval > 1:
        return max(1, best_interval // 2)
    if best_interval == max(grid) and best_interval < iterations_executed:
        return 2 * best_interval
    return None


def recommend(
    scenario: Scenario,
    *,
    replications: int | None = None,
    interval_grid_factors: Sequence[float] = INTERVAL_GRID_FACTORS,
    setback_scales: Sequence[float] = SETBACK_SCALES,
    rate_factors: Sequence[float] = RATE_FACTORS,
    workers: int | None = None,
    on_pass_done: Callable[[str], None] | None = None,
) -> Recommendation:
    """The best method of `scenario` with its knobs, its time to target, and how robust the choice is."""
    replications = replications or scenario.replications
    if replications < 1:
        raise InputError(f"--replications {replications}: must be >= 1")
    methods = sensitivity_methods(scenario)
    if not methods:
        raise InputError("the scenario has no method to recommend (only the no-failure reference or ablations)")
    caveats: list[str] = []

    # Pass 1: every method as given, and CheckFree's edge fallbacks.
    variants: dict[str, MethodConfig] = {}
    knobs: dict[str, dict[str, Any]] = {}
    for method in methods:
        variants[_variant_key(method.name, {})], knobs[_variant_key(method.name, {})] = method, {}
        if "edge_fallback" in type(method).model_fields:
            for fallback in EDGE_FALLBACKS:
                if fallback != getattr(method, "edge_fallback"):
                    key = _variant_key(method.name, {"edge_fallback": fallback})
                    variants[key], knobs[key] = method.model_copy(update={"edge_fallback": fallback}), {"edge_fallback": fallback}
                    knobs[_variant_key(method.name, {})] = {"edge_fallback": getattr(method, "edge_fallback")}
    runs = run_sweep(_tasks(scenario, variants, "base", replications), workers=workers).runs
    if on_pass_done:
        on_pass_done("methods")

    # Pass 2: the interval grids.
    num_stages = scenario.pipeline.num_stages
    pipeline_rate_per_s = mean_stage_failure_rate_per_s(scenario.churn, num_stages=num_stages) * num_stages
    mtbf_s = 1.0 / pipeline_rate_per_s if pipeline_rate_per_s > 0 else None
    studies_in: list[tuple[MethodConfig, str, float | None, float | None, float | None, float | None, list[int]]] = []
    grid_variants: dict[str, MethodConfig] = {}
    for method in methods:
        interval_field = type(method).checkpoint_interval_field
        if interval_field is None:
            continue
        current = int(getattr(method, interval_field))
        own = runs[(runs[CASE] == "base") & (runs[VARIANT] == _variant_key(method.name, {}))]
        # Young and Daly take M between the failures a checkpoint is read after: every failure for
        # the checkpoint family, only two adjacent losses for redundant computation's fallback.
        optimum = interval_optimum_from_runs(own, current, mtbf_s if type(method).family == "checkpoint" else None)
        delta_s, iteration_s = optimum.checkpoint_cost_s, optimum.iteration_s
        young, daly = optimum.young_interval_iterations, optimum.daly_interval_iterations
        # Without a blocking δ (a non-blocking method) or without failures, the grid is around the scenario's interval.
        center = daly if daly is not None else young if young is not None else float(current)
        grid = _interval_grid(center, [young, daly, current], interval_grid_factors)
        studies_in.append((method, interval_field, delta_s, iteration_s, young, daly, grid))
        for interval in grid:
            if interval != current:
                key = _variant_key(method.name, {interval_field: interval})
                grid_variants[key], knobs[key] = method.model_copy(update={interval_field: interval}), {interval_field: interval}
        knobs[_variant_key(method.name, {})] = {interval_field: current}
    if grid_variants:
        runs = pd.concat([runs, run_sweep(_tasks(scenario, grid_variants, "base", replications), workers=workers).runs], ignore_index=True)
        if on_pass_done:
            on_pass_done("intervals")

    def grid_rows(method: MethodConfig, interval_field: str, grid: Sequence[int]) -> list[Candidate]:
        base = _candidates(runs, knobs, "base")
        return [next(c for c in base.values() if c.method == method.name and c.knobs.get(interval_field) == interval) for interval in grid]

    # The grids grow past an edge the best point lies on, one point a pass, all methods together.
    extensions = {method.name: 0 for method, *_ in studies_in}
    for _ in range(MAX_GRID_EXTENSIONS):
        added: dict[str, MethodConfig] = {}
        for method, interval_field, *_, grid in studies_in:
            best = min(grid_rows(method, interval_field, grid), key=_sort_key)
            if best.time_to_target_s.mean is None:
                continue
            own = runs[(runs[CASE] == "base") & (runs["method"] == method.name)]
            beyond = interval_beyond_edge(grid, int(best.knobs[interval_field]), float(own["iterations_executed"].max()))
            if beyond is None or beyond in grid:
                continue
            grid.append(beyond)
            grid.sort()
            extensions[method.name] += 1
            key = _variant_key(method.name, {interval_field: beyond})
            added[key], knobs[key] = method.model_copy(update={interval_field: beyond}), {interval_field: beyond}
        if not added:
            break
        grid_variants.update(added)
        runs = pd.concat([runs, run_sweep(_tasks(scenario, added, "base", replications), workers=workers).runs], ignore_index=True)
        if on_pass_done:
            on_pass_done("interval grid grown past its edge")
    base = _candidates(runs, knobs, "base")

    studies = []
    for method, interval_field, delta_s, iteration_s, young, daly, grid in studies_in:
        rows = grid_rows(method, interval_field, grid)
        best = min(rows, key=_sort_key)
        studies.append(
            IntervalStudy(
                method=method.name, interval_field=interval_field, checkpoint_cost_s=delta_s,
                mean_time_between_failures_s=mtbf_s, iteration_s=iteration_s,
                young_interval_iterations=young, daly_interval_iterations=daly,
                scenario_interval_iterations=int(getattr(method, interval_field)),
                best_interval_iterations=int(best.knobs[interval_field]) if best.time_to_target_s.mean is not None else None,
                grid_extensions=extensions[method.name],
                fitted_optimum_iterations=_fitted_optimum(grid, [c.time_to_target_s.mean for c in rows]),
                grid=tuple(rows),
            )
        )
    for study in studies:
        grid_intervals = [c.knobs[study.interval_field] for c in study.grid]
        best_interval = study.best_interval_iterations
        if len(grid_intervals) > 1 and best_interval in (min(grid_intervals), max(grid_intervals)) and best_interval != 1:
            grown = f" after {study.grid_extensions} point(s) added past it" if study.grid_extensions else ""
            caveats.append(
                f"{study.method}: the best {study.interval_field} ({best_interval}) is at the edge of the grid "
                f"{grid_intervals}{grown}; the optimum may lie beyond it"
            )
    edge = tuple(sorted((c for c in base.values() if "edge_fallback" in c.knobs), key=_sort_key))
    ranked = _best_per_method(list(base.values()))
    winner = ranked[0] if ranked and ranked[0].time_to_target_s.mean is not None else None
    tied = tuple(c.method for c in ranked[1:] if winner is not None and winner.time_to_target_s.overlaps(c.time_to_target_s))
    if winner is not None and winner.fraction_reached != 1.0:
        caveats.append(f"{winner.method} reached the target in {winner.fraction_reached:.0%} of replications; its mean is optimistic")

    # Pass 3: robustness, each method's best variant with its knobs fixed.
    configs = {**variants, **grid_variants}
    best_configs: dict[str, MethodConfig] = {}
    for candidate in ranked:
        key = next(k for k, config in configs.items() if config.name == candidate.method and knobs[k] == candidate.knobs)
        best_configs[key] = configs[key]
    cases: list[tuple[str, float, Scenario | None, dict[str, MethodConfig]]] = []
    if any(config.uses_setbacks for config in best_configs.values()):
        for scale in setback_scales:
            convergence = scenario.convergence.model_copy(update={"setback_scale": scenario.convergence.setback_scale * scale})
            cases.append(("setback_scale", scale, scenario.model_copy(update={"convergence": convergence}),
                          {k: v for k, v in best_configs.items() if v.uses_setbacks}))
    for factor in rate_factors:
        churn = scaled_churn(scenario, factor)
        cases.append(("failure_rate", factor, scenario.model_copy(update={"churn": churn}) if churn is not None else None, best_configs))
    tasks = []
    for name, factor, case_scenario, case_variants in cases:
        if case_scenario is not None:
            tasks += _tasks(case_scenario, case_variants, f"{name}×{factor:g}", replications)
    if tasks:
        runs = pd.concat([runs, run_sweep(tasks, workers=workers).runs], ignore_index=True)
        if on_pass_done:
            on_pass_done("robustness")
    # At another failure rate a blocking checkpoint's best interval moves: where the kept one is far
    # from Daly's at the new rate, it runs at Daly's too, and the case takes the better of the two.
    retuned: dict[str, list[str]] = {}
    retune_tasks = []
    for name, factor, case_scenario, case_variants in cases:
        case = f"{name}×{factor:g}"
        if name != "failure_rate" or case_scenario is None:
            continue
        point = case_scenario.model_copy(update={"methods": tuple(case_variants.values())})
        for rerun in daly_reruns([point], runs[runs[CASE] == case]):
            key = _variant_key(rerun.method, {rerun.interval_field: rerun.daly_interval_iterations})
            knobs[key] = {rerun.interval_field: rerun.daly_interval_iterations}
            retuned.setdefault(case, []).append(key)
            retune_tasks += _tasks(case_scenario, {key: rerun.point.methods[0]}, case, replications)
    if retune_tasks:
        runs = pd.concat([runs, run_sweep(retune_tasks, workers=workers).runs], ignore_index=True)
        if on_pass_done:
            on_pass_done("checkpoint intervals re-tuned at the scaled failure rates")
    robustness = []
    for name, factor, case_scenario, case_variants in cases:
        if case_scenario is None:
            robustness.append(RobustnessCase(uncertain_input=name, factor=factor, winner=None, winner_time_to_target_s=None,
                                             winner_changes=None, note=f"churn kind {scenario.churn.kind!r} has no single rate to scale"))
            continue
        case = f"{name}×{factor:g}"
        scaled = _candidates(runs, knobs, case)
        # Methods the case does not touch (no setbacks under a setback scale) keep their base result.
        pool = [scaled.get(key, base[key]) for key in best_configs] + [scaled[key] for key in retuned.get(case, []) if key in scaled]
        case_best = _best_per_method(pool)
        case_winner = case_best[0] if case_best and case_best[0].time_to_target_s.mean is not None else None
        moved = [c for c in case_best if any(c is scaled.get(key) for key in retuned.get(case, []))]
        robustness.append(
            RobustnessCase(
                uncertain_input=name, factor=factor,
                winner=case_winner.method if case_winner else None,
                winner_time_to_target_s=case_winner.time_to_target_s if case_winner else None,
                winner_changes=(case_winner.method if case_winner else None) != (winner.method if winner else None),
                note="; ".join(f"{c.method} at {_knob_text(c.knobs)}, Daly's interval at this rate" for c in moved) or None,
            )
        )
    if scenario.convergence.setback_source != "measured" and any(c.uses_setbacks for c in methods):
        caveats.append(f"setbacks are not measured on this model (source: {scenario.convergence.setback_source}); see the setback_scale cases")
    return Recommendation(
        scenario=scenario.name, replications=replications,
        winner=winner.method if winner else None, winner_knobs=dict(winner.knobs) if winner else {},
        winner_time_to_target_s=winner.time_to_target_s if winner else None,
        cannot_be_told_apart_from=tied, best_per_method=tuple(ranked), interval_studies=tuple(studies),
        edge_fallbacks=edge, robustness=tuple(robustness), caveats=tuple(caveats),
    )
