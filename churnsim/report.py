"""How the commands show a verdict (`churnsim.sim.studies.verdict`): a table per failure rate, one answer line
each, the caveats; or the same as strict JSON on stdout for scripts (`--json`).

Formatting only: which method wins, by how much and against whom is decided in sim/studies/verdict.py.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from churnsim.calibration.base import strict_json_dumps
from churnsim.calibration.churn import RATE_FIELD_OF_KIND, rate_field_of_setting
from churnsim.calibration.statistics import intervals_unreliable, small_sample_caveat


from churnsim.sim.studies.verdict import duration_unit as _unit


def _duration(estimate, unit: tuple[str, float], *, suffix: str = "") -> str:
    """`12.3 [12.1, 12.5]`, the unit (when given as `suffix`) after the mean."""
    name, seconds = unit
    if estimate is None or estimate.mean is None:
        return "—"
    text = f"{estimate.mean / seconds:.1f}{suffix}"
    if estimate.ci95_low is not None and estimate.ci95_high is not None and estimate.ci95_low != estimate.ci95_high:
        text += f" [{estimate.ci95_low / seconds:.1f}, {estimate.ci95_high / seconds:.1f}]"
    return text


def _ratio(estimate, *, suffix: str = "") -> str:
    """`1.23 [1.20, 1.26]`, or the mean alone without an interval."""
    if estimate is None or estimate.mean is None:
        return "—"
    if estimate.ci95_low is None or estimate.ci95_high is None or estimate.ci95_low == estimate.ci95_high:
        return f"{estimate.mean:.2f}{suffix}"
    return f"{estimate.mean:.2f}{suffix} [{estimate.ci95_low:.2f}, {estimate.ci95_high:.2f}]"


def point_title(point) -> str:
    """What a table or an answer line is about: the scenario, the grid point, the failure rate."""
    where = ", ".join(_grid_words(path, value) for path, value in point.grid.items())
    base = point.scenario.split("[", 1)[0] if point.grid else point.scenario
    hourly = point.failure_probability_per_stage_hour
    stage_hourly = RATE_FIELD_OF_KIND["stage_hourly"]
    # A grid over the stage-hourly rate has already named it among the grid's words.
    rate = "" if hourly is None or stage_hourly.setting in point.grid else f"at {stage_hourly.words(hourly)}"
    return ", ".join(part for part in (base, where, rate) if part)


def _grid_words(path: str, value) -> str:
    """`pipeline.num_microbatches = 8`, or a churn's failure rate in words (`at 240 failures per node-hour`)."""
    rate = rate_field_of_setting(path)
    if rate is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"at {rate.words(float(value))}"
    return f"{path} = {value}"


def _named(method: str, label: str) -> str:
    """The display label, with the method's name when the label does not already start with it."""
    return label if label.lower().startswith(method.replace("_", " ")) else f"{label} ({method})"


def answer_line(point) -> str:
    """The one-line answer at one failure rate: winner, speed-ups with 95 % intervals, ties."""
    return point_title(point) + ": " + answer_text(point)


def tuned_answer_line(point) -> str | None:
    """The answer again with the checkpoint intervals tuned at this point (sim/studies/untuned_intervals.py), or None."""
    tuned = point.with_tuned_intervals
    return None if tuned is None else "  with checkpoint intervals tuned here (see the caveats): " + answer_text(tuned)


def answer_text(point) -> str:
    """`answer_line` without the point's title.

    Where every real method missed the target in some replications, the winner comes first by its
    lower bound, and its speed-ups are upper bounds: none of their means covers every replication.
    """
    if point.winner is None:
        return "no method reached the target in any replication; raise target.max_wall_clock_s or lower the failure rate."
    labels = {standing.method: standing.label for standing in point.standings}
    winner = next((s for s in point.standings if s.method == point.winner), None)
    named = _named(point.winner, point.winner_label)
    if winner is not None and _missed_some(winner) and winner.time_to_target_at_least_s is not None:
        name, seconds = _unit(winner.time_to_target_at_least_s)
        text = (
            f"no method reached the target in every replication; {named} comes first by its lower bound, "
            f"at least {winner.time_to_target_at_least_s / seconds:.1f} {name} (it reached the target in "
            f"{winner.fraction_reached:.0%} of replications; the others counted at the time they were stopped)"
        )
        bounds = {baseline: winner.speedup_at_most.get(baseline) for baseline in point.winner_speedup}
        speedups = {baseline: None if bound is None else f"speed-up at most {bound:.2f}×" for baseline, bound in bounds.items()}
        baseline_missed = "no bound on its speed-up over {label}, which missed the target too"
    else:
        unit = _unit(point.winner_time_to_target_s.ci95_high or point.winner_time_to_target_s.mean)
        text = f"{named} reaches the target first, in {_duration(point.winner_time_to_target_s, unit, suffix=' ' + unit[0])}"
        speedups = {
            baseline: None if estimate is None else f"speed-up {_ratio(estimate, suffix='×')}" for baseline, estimate in point.winner_speedup.items()
        }
        baseline_missed = "{label} never reached the target"
    comparisons = []
    for baseline, speedup in speedups.items():
        label = labels.get(baseline, baseline)
        if baseline == point.winner:
            comparisons.append(f"it is the {label} baseline")
        elif speedup is not None:
            comparisons.append(f"{speedup} over {label}")
        else:
            comparisons.append(baseline_missed.format(label=label) if baseline in labels else f"{label} not run")
    if comparisons:
        text += "; " + ", ".join(comparisons)
    if point.cannot_be_told_apart_from:
        tied = ", ".join(labels.get(method, method) for method in point.cannot_be_told_apart_from)
        text += f"; cannot be told apart from {tied} (95 % intervals overlap{_unreliable_at(point.num_replications)})"
    return text + "."


def _unreliable_at(num_replications: int | None) -> str:
    """`, unreliable at 3 replications` where that is too few for the intervals to mean much."""
    return f", unreliable at {num_replications} replications" if intervals_unreliable(num_replications) else ""


def warn_if_intervals_unreliable(num_replications: int | None) -> None:
    """One warning line on stderr where the intervals rest on too few replications."""
    if intervals_unreliable(num_replications):
        print(f"warning: {small_sample_caveat(num_replications)}", file=sys.stderr)  # type: ignore[arg-type]


def _missed_some(standing) -> bool:
    """A method that missed the target in some replications: its mean covers only those that did."""
    return standing.fraction_reached is not None and standing.fraction_reached < 1.0


def _bound(value: float | None, relation: str, text) -> str:
    return "—" if value is None else f"{relation} {text(value)}"


def print_point_table(point, console: Console) -> None:
    """Real methods (fastest first), the no-failure reference, then the ablations in a section of their own.

    A method that missed the target in some replications shows bounds instead of means: its time at
    least, its speed-ups at most, with its missed runs counted at the time they were stopped.
    """
    baselines = list(point.winner_speedup) or sorted({b for s in point.standings for b in s.speedup})
    highs = [s.time_to_target_s.ci95_high or s.time_to_target_s.mean for s in point.standings]
    highs += [s.time_to_target_at_least_s for s in point.standings if _missed_some(s)]
    unit = _unit(max((value for value in highs if value is not None), default=0.0))
    bounded = any(_missed_some(s) for s in point.standings)
    table = Table(
        "method", "reached", f"time to target {unit[0]} [95 % CI]", *(f"× vs {baseline} [CI]" for baseline in baselines),
        title=escape(point_title(point)),
        caption="≥, ≤: bounds where a method missed the target, its missed runs counted at the time they were stopped" if bounded else None,
    )
    previous_role = None
    for standing in point.standings:
        if standing.role == "ablation" and previous_role != "ablation":
            table.add_section()
        previous_role = standing.role
        name = standing.method + {"reference": " (reference)", "ablation": " (ablation)"}.get(standing.role, "")
        reached = "—" if standing.fraction_reached is None else f"{standing.fraction_reached:.0%}"
        style = "bold" if standing.method == point.winner else None
        if _missed_some(standing):
            cells = [
                _bound(standing.time_to_target_at_least_s, "≥", lambda seconds: f"{seconds / unit[1]:.1f}"),
                *(_bound(standing.speedup_at_most.get(baseline), "≤", lambda ratio: f"{ratio:.2f}") for baseline in baselines),
            ]
        else:
            cells = [_duration(standing.time_to_target_s, unit), *(_ratio(standing.speedup.get(baseline)) for baseline in baselines)]
        table.add_row(escape(name), reached, *cells, style=style)
    console.print(table)


def show_verdict(verdict, *, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    """Tables and answer lines (answers on stdout), or with `as_json` only strict JSON on stdout.

    Tables go to stderr under `--json`, so stdout stays parseable while a person still sees them.
    """
    warn_if_intervals_unreliable(min((p.num_replications for p in verdict.points if p.num_replications is not None), default=None))
    tables = Console(stderr=as_json, width=max(Console().width, 110))
    for point in verdict.points:
        print_point_table(point, tables)
    if as_json:
        data = verdict.to_json()
        for point, row in zip(verdict.points, data["points"]):
            row["answer"] = answer_line(point)
            tuned = point.with_tuned_intervals
            row["answer_with_tuned_intervals"] = answer_text(tuned) if tuned is not None else None
        sys.stdout.write(strict_json_dumps({**(extra or {}), **data}) + "\n")
        return
    out = Console(width=max(Console().width, 110), highlight=False)
    out.print("[bold]Answer[/bold]")
    for point in verdict.points:
        out.print(escape(answer_line(point)), soft_wrap=True)
        tuned = tuned_answer_line(point)
        if tuned:
            out.print(escape(tuned), soft_wrap=True)
    caveats = all_caveats(verdict)
    if caveats:
        out.print("[bold]Caveats[/bold]")
    for caveat in caveats:
        out.print(escape(f"- {caveat}"), soft_wrap=True)


def all_caveats(verdict) -> list[str]:
    """The caveats of the whole answer, then each failure rate's own, named by its title."""
    return list(verdict.caveats) + [f"{point_title(point)}: {caveat}" for point in verdict.points for caveat in point.caveats]


__all__ = ["all_caveats", "answer_line", "answer_text", "point_title", "print_point_table", "show_verdict", "tuned_answer_line"]
