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
3. The winner is the best variant of each method compared by `sim/studies/verdict.py`'s rule (methods that
   reached the target in every replication first, then the lowest mean time to target).
4. Robustness: each method's best variant (knobs fixed) runs again with every setback scaled (0.5×,
   2×) and the failure rate scaled (×0.5, ×2); each case says whether the winner changes. At a
   scaled failure rate each checkpoint interval is also tuned there (Daly's optimum or a search,
   `sim/studies/untuned_intervals.py`), and the case takes the better of the two.

Common random numbers throughout: every variant and case of replication r sees the same failure
path (for the same churn) and the same setback draws.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.churn import churn_with_rate_scaled
from churnsim.calibration.errors import InputError
from churnsim.calibration.failure_sampling import mean_stage_failure_rate_per_s
from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.statistics import intervals_unreliable, small_sample_caveat

from ..model.analytic import IntervalOptimum, interval_optimum_from_runs
from .replicate import replication_tasks, time_to_target_at_least_s
from .setback_sensitivity import sensitivity_methods
from .sweep import SweepTask, run_sweep
from .untuned_intervals import interval_beyond_edge, tune_intervals
from .verdict import Estimate, _json_safe, cannot_be_told_apart, finite_or_none, ranking_time_s

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
    """The mean over the replications that reached the target."""
    time_to_target_at_least_s: float | None = None
    """A lower bound on the mean over all of them, the missed runs counted at the time they were
    stopped (`sim.studies.replicate.time_to_target_at_least_s`); None where unknown."""


@dataclass(frozen=True, kw_only=True)
class IntervalStudy:
    method: str
    interval_field: str
    checkpoint_cost_s: float | None
    """δ: blocked seconds per checkpoint, from the runs."""
    mean_time_between_failures_s: float | None
    """M of the whole pipeline; None without failures, or for a fallback read only after two adjacent losses."""
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
    """None where the case could not be run (a churn model with no rate to scale: none, a fixed schedule)."""
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
    time = ranking_time_s(candidate)
    return (candidate.fraction_reached != 1.0, time if time is not None else math.inf)


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
            time_to_target_at_least_s=finite_or_none(time_to_target_at_least_s(group)),
        )
    return out


def _best_per_method(candidates: Sequence[Candidate]) -> list[Candidate]:
    best: dict[str, Candidate] = {}
    for candidate in sorted(candidates, key=_sort_key):
        best.setdefault(candidate.method, candidate)
    return sorted(best.values(), key=_sort_key)


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


@dataclass
class _Ledger:
    """Every variant run so far, by key ("method knob=value ..."), its config and knobs, and their runs.
    Each pass adds variants and runs them in one sweep."""

    scenario: Scenario
    replications: int
    workers: int | None
    on_pass_done: Callable[[str], None] | None
    runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    configs: dict[str, MethodConfig] = field(default_factory=dict)
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def variant(self, method: MethodConfig, knobs: dict[str, Any], *, key_knobs: dict[str, Any] | None = None) -> str:
        """Register `method` with `knobs` set (the knobs it is shown with); its key names `key_knobs`
        (default: `knobs`). Returns the key."""
        key = _variant_key(method.name, knobs if key_knobs is None else key_knobs)
        self.configs[key], self.knobs[key] = method.model_copy(update=knobs), dict(knobs)
        return key

    def run(self, keys_by_case: Sequence[tuple[str, Scenario, Sequence[str]]], pass_name: str) -> None:
        """Run the variants `keys` of each (case, scenario of the case, keys) in one sweep."""
        tasks = [task for case, scenario, keys in keys_by_case for task in _tasks(
            scenario, {key: self.configs[key] for key in keys}, case, self.replications)]
        if not tasks:
            return
        new = run_sweep(tasks, workers=self.workers).runs
        self.runs = new if self.runs.empty else pd.concat([self.runs, new], ignore_index=True)
        if self.on_pass_done:
            self.on_pass_done(pass_name)

    def candidates(self, case: str) -> dict[str, Candidate]:
        return _candidates(self.runs, self.knobs, case)

    def runs_of(self, case: str, method: str) -> pd.DataFrame:
        return self.runs[(self.runs[CASE] == case) & (self.runs["method"] == method)]


def _run_methods(ledger: _Ledger, methods: Sequence[MethodConfig]) -> None:
    """Pass 1: every method as given, and CheckFree's other edge fallbacks."""
    keys = []
    for method in methods:
        given = {"edge_fallback": getattr(method, "edge_fallback")} if "edge_fallback" in type(method).model_fields else {}
        keys.append(ledger.variant(method, given, key_knobs={}))
        for fallback in EDGE_FALLBACKS if given else ():
            if fallback != given["edge_fallback"]:
                keys.append(ledger.variant(method, {"edge_fallback": fallback}))
    ledger.run([("base", ledger.scenario, keys)], "methods")


def _interval_studies(ledger: _Ledger, methods: Sequence[MethodConfig], grid_factors: Sequence[float]) -> list[IntervalStudy]:
    """Pass 2: each method's checkpoint interval on a grid, grown past an edge its best point lies on."""
    scenario = ledger.scenario
    num_stages = scenario.pipeline.num_stages
    pipeline_rate_per_s = mean_stage_failure_rate_per_s(scenario.churn, num_stages=num_stages) * num_stages
    mtbf_s = 1.0 / pipeline_rate_per_s if pipeline_rate_per_s > 0 else None
    plans: list[tuple[MethodConfig, str, IntervalOptimum, list[int]]] = []
    new_keys = []
    for method in methods:
        interval_field = type(method).checkpoint_interval_field
        if interval_field is None:
            continue
        current = int(getattr(method, interval_field))
        ledger.knobs[_variant_key(method.name, {})] = {interval_field: current}
        # Young and Daly take M between the failures a checkpoint is read after: every failure for
        # the checkpoint family, only two adjacent losses for redundant computation's fallback.
        optimum = interval_optimum_from_runs(
            ledger.runs_of("base", method.name), current, mtbf_s if type(method).family == "checkpoint" else None
        )
        young, daly = optimum.young_interval_iterations, optimum.daly_interval_iterations
        # Without a blocking δ (a non-blocking method) or without failures, the grid is around the scenario's interval.
        center = daly if daly is not None else young if young is not None else float(current)
        grid = _interval_grid(center, [young, daly, current], grid_factors)
        plans.append((method, interval_field, optimum, grid))
        new_keys += [ledger.variant(method, {interval_field: interval}) for interval in grid if interval != current]
    ledger.run([("base", scenario, new_keys)], "intervals")

    def grid_rows(base: dict[str, Candidate], method: MethodConfig, interval_field: str, grid: Sequence[int]) -> list[Candidate]:
        return [next(c for c in base.values() if c.method == method.name and c.knobs.get(interval_field) == interval) for interval in grid]

    # The grids grow past an edge the best point lies on, one point a pass, all methods together.
    extensions = {method.name: 0 for method, *_ in plans}
    for _ in range(MAX_GRID_EXTENSIONS):
        added = []
        base = ledger.candidates("base")
        for method, interval_field, _optimum, grid in plans:
            best = min(grid_rows(base, method, interval_field, grid), key=_sort_key)
            if best.time_to_target_s.mean is None:
                continue
            executed = float(ledger.runs_of("base", method.name)["iterations_executed"].max())
            beyond = interval_beyond_edge(grid, int(best.knobs[interval_field]), executed)
            if beyond is None or beyond in grid:
                continue
            grid.append(beyond)
            grid.sort()
            extensions[method.name] += 1
            added.append(ledger.variant(method, {interval_field: beyond}))
        if not added:
            break
        ledger.run([("base", scenario, added)], "interval grid grown past its edge")

    studies = []
    base = ledger.candidates("base")
    for method, interval_field, optimum, grid in plans:
        rows = grid_rows(base, method, interval_field, grid)
        own_mtbf_s = mtbf_s if type(method).family == "checkpoint" else None  # the M Young and Daly would take
        best = min(rows, key=_sort_key)
        studies.append(
            IntervalStudy(
                method=method.name, interval_field=interval_field, checkpoint_cost_s=optimum.checkpoint_cost_s,
                mean_time_between_failures_s=own_mtbf_s, iteration_s=optimum.iteration_s,
                young_interval_iterations=optimum.young_interval_iterations, daly_interval_iterations=optimum.daly_interval_iterations,
                scenario_interval_iterations=int(getattr(method, interval_field)),
                best_interval_iterations=int(best.knobs[interval_field]) if best.time_to_target_s.mean is not None else None,
                grid_extensions=extensions[method.name],
                fitted_optimum_iterations=_fitted_optimum(grid, [c.time_to_target_s.mean for c in rows]),
                grid=tuple(rows),
            )
        )
    return studies


def _grid_edge_caveats(studies: Sequence[IntervalStudy]) -> list[str]:
    caveats = []
    for study in studies:
        grid_intervals = [c.knobs[study.interval_field] for c in study.grid]
        best_interval = study.best_interval_iterations
        if len(grid_intervals) > 1 and best_interval in (min(grid_intervals), max(grid_intervals)) and best_interval != 1:
            grown = f" after {study.grid_extensions} point(s) added past it" if study.grid_extensions else ""
            caveats.append(
                f"{study.method}: the best {study.interval_field} ({best_interval}) is at the edge of the grid "
                f"{grid_intervals}{grown}; the optimum may lie beyond it"
            )
    return caveats


def _robustness(
    ledger: _Ledger, ranked: Sequence[Candidate], winner: Candidate | None, setback_scales: Sequence[float], rate_factors: Sequence[float]
) -> list[RobustnessCase]:
    """Pass 3: each method's best variant (knobs fixed) with every setback scaled and with the
    failure rate scaled; at a scaled rate each checkpoint interval is also tuned there, and the case
    takes the better of the two."""
    scenario = ledger.scenario
    best_keys = [next(k for k, config in ledger.configs.items() if config.name == c.method and ledger.knobs[k] == c.knobs) for c in ranked]
    cases: list[tuple[str, float, Scenario | None, list[str]]] = []
    if any(ledger.configs[key].uses_setbacks for key in best_keys):
        for scale in setback_scales:
            convergence = scenario.convergence.model_copy(update={"setback_scale": scenario.convergence.setback_scale * scale})
            cases.append(("setback_scale", scale, scenario.model_copy(update={"convergence": convergence}),
                          [key for key in best_keys if ledger.configs[key].uses_setbacks]))
    for factor in rate_factors:
        churn = churn_with_rate_scaled(scenario.churn, factor)
        cases.append(("failure_rate", factor, scenario.model_copy(update={"churn": churn}) if churn is not None else None, best_keys))
    ledger.run([(f"{name}×{factor:g}", case_scenario, keys) for name, factor, case_scenario, keys in cases if case_scenario is not None],
               "robustness")

    # At another failure rate a checkpoint interval's best moves: tuned there (Daly's optimum or a
    # search, sim/studies/untuned_intervals.py), a method enters the case with the better of the two.
    retuned: dict[str, list[Candidate]] = {}
    for name, factor, case_scenario, keys in cases:
        case = f"{name}×{factor:g}"
        if name != "failure_rate" or case_scenario is None:
            continue
        point = case_scenario.model_copy(update={"methods": tuple(ledger.configs[key] for key in keys)})
        for tuned in tune_intervals([point], ledger.runs[ledger.runs[CASE] == case], workers=ledger.workers):
            result = tuned.result
            retuned.setdefault(case, []).append(Candidate(
                method=result.method, knobs={result.interval_field: result.tuned_interval_iterations},
                fraction_reached=result.fraction_reached, time_to_target_s=result.time_to_target_s,
            ))
    if retuned and ledger.on_pass_done:
        ledger.on_pass_done("checkpoint intervals tuned at the scaled failure rates")

    base = ledger.candidates("base")
    robustness = []
    for name, factor, case_scenario, keys in cases:
        if case_scenario is None:
            robustness.append(RobustnessCase(uncertain_input=name, factor=factor, winner=None, winner_time_to_target_s=None,
                                             winner_changes=None, note=f"churn kind {scenario.churn.kind!r} has no failure rate to scale"))
            continue
        case = f"{name}×{factor:g}"
        scaled = ledger.candidates(case)
        # Methods the case does not touch (no setbacks under a setback scale) keep their base result.
        pool = [scaled.get(key, base[key]) for key in best_keys] + retuned.get(case, [])
        case_best = _best_per_method(pool)
        case_winner = case_best[0] if case_best and case_best[0].time_to_target_s.mean is not None else None
        moved = [c for c in case_best if any(c is tuned for tuned in retuned.get(case, []))]
        robustness.append(
            RobustnessCase(
                uncertain_input=name, factor=factor,
                winner=case_winner.method if case_winner else None,
                winner_time_to_target_s=case_winner.time_to_target_s if case_winner else None,
                winner_changes=(case_winner.method if case_winner else None) != (winner.method if winner else None),
                note="; ".join(f"{c.method} at {_knob_text(c.knobs)}, tuned at this rate" for c in moved) or None,
            )
        )
    return robustness


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
    ledger = _Ledger(scenario=scenario, replications=replications, workers=workers, on_pass_done=on_pass_done)
    _run_methods(ledger, methods)
    studies = _interval_studies(ledger, methods, interval_grid_factors)
    caveats = _grid_edge_caveats(studies)
    base = ledger.candidates("base")
    edge = tuple(sorted((c for c in base.values() if "edge_fallback" in c.knobs), key=_sort_key))
    ranked = _best_per_method(list(base.values()))
    winner = ranked[0] if ranked and ranked[0].time_to_target_s.mean is not None else None
    tied = tuple(c.method for c in ranked[1:] if winner is not None and cannot_be_told_apart(winner, c))
    if winner is not None and winner.fraction_reached != 1.0:
        caveats.append(f"{winner.method} reached the target in {winner.fraction_reached:.0%} of replications; its mean is optimistic")
    if intervals_unreliable(replications):
        caveats.append(small_sample_caveat(replications))
    robustness = _robustness(ledger, ranked, winner, setback_scales, rate_factors)
    if scenario.convergence.setback_source != "measured" and any(c.uses_setbacks for c in methods):
        caveats.append(f"setbacks are not measured on this model (source: {scenario.convergence.setback_source}); see the setback_scale cases")
    return Recommendation(
        scenario=scenario.name, replications=replications,
        winner=winner.method if winner else None, winner_knobs=dict(winner.knobs) if winner else {},
        winner_time_to_target_s=winner.time_to_target_s if winner else None,
        cannot_be_told_apart_from=tied, best_per_method=tuple(ranked), interval_studies=tuple(studies),
        edge_fallbacks=edge, robustness=tuple(robustness), caveats=tuple(caveats),
    )
