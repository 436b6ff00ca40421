"""How `churnsim recommend` shows a `sim.studies.recommend.Recommendation`: a few lines, or strict JSON.

Formatting only: what is recommended and why is decided in sim/studies/recommend.py.
"""

from __future__ import annotations

import sys
from typing import Any

from churnsim.calibration.base import strict_json_dumps

from .report import _duration, _unit, _unreliable_at, warn_if_intervals_unreliable


def _knobs(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{name} = {value}" for name, value in knobs.items())


def _iterations(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _candidate_time(candidate, unit: tuple[str, float]) -> str:
    """Its time to target; where it missed the target in some replications, the lower bound first,
    then the optimistic mean of those that reached it."""
    reached = candidate.fraction_reached
    if reached is None or reached >= 1.0 or candidate.time_to_target_s.mean is None:
        return _duration(candidate.time_to_target_s, unit) if candidate.time_to_target_s.mean is not None else "never reached the target"
    over_those = f"reached in {reached:.0%}: {_duration(candidate.time_to_target_s, unit)} over those"
    at_least = candidate.time_to_target_at_least_s
    return f"≥ {at_least / unit[1]:.1f} ({over_those})" if at_least is not None else f"{over_those}, optimistic"


def recommendation_lines(recommendation) -> list[str]:
    times = [c.time_to_target_s.mean for c in recommendation.best_per_method if c.time_to_target_s.mean is not None]
    unit = _unit(max(times, default=0.0))
    lines = [f"scenario {recommendation.scenario}, {recommendation.replications} replication(s); time to target {unit[0]} [95 % CI]"]
    if recommendation.winner is None:
        lines.append("Recommendation: none — no method reached the target")
    else:
        knobs = f" ({_knobs(recommendation.winner_knobs)})" if recommendation.winner_knobs else ""
        lines.append(f"Recommendation: {recommendation.winner}{knobs}: {_duration(recommendation.winner_time_to_target_s, unit)}")
        if recommendation.cannot_be_told_apart_from:
            unreliable = _unreliable_at(recommendation.replications)
            lines.append(f"  cannot be told apart from: {', '.join(recommendation.cannot_be_told_apart_from)}" + (f" ({unreliable[2:]}, see the notes)" if unreliable else ""))
    lines.append("Each method at its best knobs:")
    for candidate in recommendation.best_per_method:
        knobs = f" ({_knobs(candidate.knobs)})" if candidate.knobs else ""
        lines.append(f"  {candidate.method}{knobs}: {_candidate_time(candidate, unit)}")
    for study in recommendation.interval_studies:
        delta = "—" if study.checkpoint_cost_s is None else f"{study.checkpoint_cost_s:.3g} s"
        mtbf = "—" if study.mean_time_between_failures_s is None else f"{study.mean_time_between_failures_s:.4g} s"
        grid = ", ".join(f"{c.knobs[study.interval_field]}: {_candidate_time(c, unit)}" for c in study.grid)
        lines.append(
            f"{study.method} {study.interval_field}: simulated best {_iterations(study.best_interval_iterations)} "
            f"(fit {_iterations(study.fitted_optimum_iterations)}), Young {_iterations(study.young_interval_iterations)}, "
            f"Daly {_iterations(study.daly_interval_iterations)}, scenario {study.scenario_interval_iterations} (δ = {delta}, M = {mtbf})"
        )
        lines.append(f"  grid: {grid}")
    if recommendation.edge_fallbacks:
        lines.append("edge_fallback: " + ", ".join(
            f"{c.knobs['edge_fallback']} {_candidate_time(c, unit)}" for c in recommendation.edge_fallbacks))
    for case in recommendation.robustness:
        name = "setbacks ×" if case.uncertain_input == "setback_scale" else "failure rate ×"
        if case.winner_changes is None:
            lines.append(f"robustness, {name}{case.factor:g}: not run ({case.note})")
        else:
            verdict = f"winner changes to {case.winner}" if case.winner_changes else "winner unchanged"
            retuned = f"; {case.note}" if case.note else ""
            lines.append(
                f"robustness, {name}{case.factor:g}: {verdict} ({case.winner} {_duration(case.winner_time_to_target_s, unit)}{retuned})"
            )
    lines += [f"note: {caveat}" for caveat in recommendation.caveats]
    return lines


def show_recommendation(recommendation, *, as_json: bool) -> None:
    warn_if_intervals_unreliable(recommendation.replications)
    if as_json:
        sys.stdout.write(strict_json_dumps({"command": "recommend", **recommendation.to_json()}) + "\n")
        return
    for line in recommendation_lines(recommendation):
        print(line)
