"""The answer to "which method reaches the target first, and by how much", as data.

From a summary table (`sim.studies.replicate.summary_table`, one row per scenario × failure rate × method)
`verdict_from_summary` picks, at each failure rate (and each grid point of a sweep):

- the *winner*: the real method (neither the no-failure reference, trait `ignores_failures`, nor an
  ablation, trait `ablation`) with the lowest (geometric) mean time to target, preferring methods that reached
  the target in every replication (a mean over the replications that happened to finish is biased
  low);
- its paired speed-ups over each `speedup_baseline` method (checkpoint, redundant) with their 95 %
  intervals, read from the summary's `speedup_vs_<baseline>_*` columns;
- the real methods it *cannot be told apart from*: those whose 95 % time-to-target interval overlaps
  the winner's. Overlapping marginal intervals is a conservative test (the paired speed-up interval
  may still exclude 1); it is the one a reader can check against the table.

At a large data-parallel degree a stage is lost only when all its replicas are down within one heal
window, which may not happen once in a run: `rare_stage_loss_note` then says, in one sentence, that
the methods' stage-loss recoveries cannot be told apart there (an estimate, from the replica rule's
stage-loss rate).

Every interval is the one rule for positive quantities (`calibration.statistics.positive_mean_with_ci95`);
below `MIN_REPLICATIONS_FOR_INTERVALS` replications the verdict carries a caveat that its intervals,
and so its ties, are unreliable.

The CLI formats this; scripts get it as JSON (`Verdict.to_json`), with null where a number is
missing, never NaN.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal, Protocol, Sequence

import pandas as pd

from churnsim.calibration.churn import SECONDS_PER_HOUR, PoissonChurn, StageHourlyChurn, WeibullChurn, stage_hourly_probability_to_rate_per_s
from churnsim.calibration.methods import METHOD_CONFIGS, METHOD_NAMES, reference_method, speedup_baselines
from churnsim.calibration.replica_rule import stage_loss_rate_per_s
from churnsim.calibration.scenario import Scenario, UniformNetwork
from churnsim.calibration.statistics import intervals_unreliable, positive_mean_with_ci95, small_sample_caveat
from churnsim.calibration.tables import TUNED_INTERVAL_COLUMNS, speedup_at_most_column, speedup_columns

Role = Literal["method", "reference", "ablation"]
RATE_COLUMN = "failure_probability_per_stage_hour"

STEADY_OVERHEAD_NOTE_RATIO = 1.10
"""A failure-free iteration this much slower than the plain pipeline's is worth a caveat: the method
pays it on every iteration, whatever the failure rate."""


STAGE_LOSSES_TO_TELL_METHODS_APART = 1.0
"""Fewer expected stage losses than this over a run, and most replications see none: the methods that
differ only in how they recover a lost stage then finish alike, whatever their recoveries cost."""


HEAL_WINDOW_SHARE_OF_RUN_FOR_ESTIMATE = 0.1
"""The stage-loss rate is a long-run one (each node up and missing in turn); over a run hardly
longer than one heal a node lost early stays missing, and the estimate would be far too low."""


def heal_window_estimate_s(scenario: Scenario) -> float:
    """Seconds from a node's loss until its replacement holds its stage's state again: the join delay
    plus the copy of the largest stage's state (`model.checkpoint_bytes_per_parameter` per parameter,
    weights and optimizer state) over the link between replicas (the all-reduce bandwidth where the
    scenario gives one, else the link between nodes). An estimate: it ignores latency, contention and
    a ZeRO-1 shard read from a checkpoint instead."""
    network = scenario.network
    bandwidth = network.allreduce_bandwidth_bytes_per_s
    if not math.isfinite(bandwidth):
        bandwidth = network.bandwidth_bytes_per_s if isinstance(network, UniformNetwork) else network.same_site_bandwidth_bytes_per_s
    largest_stage = max(scenario.stage_parameters(stage) for stage in range(scenario.pipeline.num_stages))
    return scenario.recovery.join_delay_s + largest_stage * scenario.model.checkpoint_bytes_per_parameter / bandwidth


def node_failure_rate_per_s(scenario: Scenario) -> float | None:
    """Failures per second of one node under the scenario's churn, for the memoryless and renewal
    models (Weibull: 1 / mean lifetime, in the long run); None for bursts, traces and schedules, whose
    failures are not one independent rate per node."""
    churn = scenario.churn
    if isinstance(churn, PoissonChurn):
        return churn.failures_per_node_hour / SECONDS_PER_HOUR
    if isinstance(churn, StageHourlyChurn):
        return stage_hourly_probability_to_rate_per_s(churn.failure_probability_per_stage_hour)
    if isinstance(churn, WeibullChurn):
        return 1.0 / churn.mean_lifetime_s
    return None


def expected_stage_losses(scenario: Scenario) -> tuple[float, float] | None:
    """(stage losses, node failures) expected over one failure-free run to the target: every stage at
    the replica rule's stage-loss rate (`replica_rule.stage_loss_rate_per_s`, with
    `heal_window_estimate_s`), over the healthy iteration time × the target's iterations. An estimate:
    failures lengthen a run, and the rate's own approximation holds while stage losses are rare.
    None where the churn has no per-node rate (`node_failure_rate_per_s`), and where the heal window
    is not short against the run (`HEAL_WINDOW_SHARE_OF_RUN_FOR_ESTIMATE`): the rate is a long-run
    one, and a run not much longer than a heal never reaches it."""
    from ..model.iteration import simulate_iteration
    from ..model.pipeline_state import build_pipeline_state

    rate = node_failure_rate_per_s(scenario)
    if rate is None:
        return None
    pipeline = scenario.pipeline
    run_s = scenario.target_iterations * simulate_iteration(build_pipeline_state(scenario)).time_s
    heal_window_s = heal_window_estimate_s(scenario)
    if heal_window_s > HEAL_WINDOW_SHARE_OF_RUN_FOR_ESTIMATE * run_s:
        return None
    per_stage = stage_loss_rate_per_s(
        rate,
        data_parallel_degree=pipeline.data_parallel_degree,
        heal_window_s=heal_window_s,
        replicas_fail_together=pipeline.replicas_fail_together,
    )
    return per_stage * pipeline.num_stages * run_s, rate * pipeline.num_nodes * run_s


def rare_stage_loss_note(scenario: Scenario) -> str | None:
    """One sentence where data parallelism makes a stage loss so rare over a run (fewer than
    `STAGE_LOSSES_TO_TELL_METHODS_APART` expected) that the methods' stage-loss recoveries cannot be
    told apart; None with one replica, with replicas failing together (every failure is a stage
    loss), without failures, or where the churn has no per-node rate."""
    pipeline = scenario.pipeline
    if pipeline.data_parallel_degree == 1 or pipeline.replicas_fail_together:
        return None
    expected = expected_stage_losses(scenario)
    if expected is None:
        return None
    stage_losses, node_failures = expected
    if not node_failures > 0 or stage_losses >= STAGE_LOSSES_TO_TELL_METHODS_APART:
        return None
    window_s = heal_window_estimate_s(scenario)
    unit, seconds = duration_unit(window_s)
    window = f"about {window_s / seconds:.2g} {unit}" if window_s >= 0.01 else "under 0.01 s"
    expected_words = f"about {stage_losses:.2g}" if stage_losses >= 0.001 else "fewer than 0.001"
    return (
        f"with {pipeline.data_parallel_degree} data-parallel replicas a stage is lost only when all of them are down within one "
        f"heal window ({window}: join delay plus copy), {expected_words} stage losses expected in a run (an estimate) against "
        f"{node_failures:.3g} node failures that heal from a surviving replica: too few for the stage-loss methods (rebuild, "
        "rollback, redundant take-over) to be told apart by how they recover; here they differ by what they cost without failures"
    )


def finite_or_none(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A (geometric) mean over replications of a positive quantity and its 95 % interval on the log
    scale (`positive_mean_with_ci95`); None where there is no number."""

    mean: float | None
    ci95_low: float | None
    ci95_high: float | None

    @classmethod
    def of_values(cls, values: Iterable[float]) -> "Estimate":
        """The geometric mean of the finite, positive `values` and its 95 % interval, never below zero."""
        mean, low, high = positive_mean_with_ci95(values)
        return cls(mean=finite_or_none(mean), ci95_low=finite_or_none(low), ci95_high=finite_or_none(high))

    @classmethod
    def from_row(cls, row: pd.Series, mean: str, low: str, high: str) -> "Estimate":
        values = [finite_or_none(row.get(column)) for column in (mean, low, high)]
        # One replication has no spread: its interval collapses to the mean rather than vanishing.
        return cls(mean=values[0], ci95_low=values[1] if values[1] is not None else values[0], ci95_high=values[2] if values[2] is not None else values[0])

    def overlaps(self, other: "Estimate") -> bool:
        if None in (self.ci95_low, self.ci95_high, other.ci95_low, other.ci95_high):
            return False
        return self.ci95_low <= other.ci95_high and other.ci95_low <= self.ci95_high  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True)
class MethodStanding:
    """One method at one failure rate."""

    method: str
    label: str
    role: Role
    fraction_reached: float | None
    time_to_target_s: Estimate
    speedup: dict[str, Estimate]
    """Paired speed-up T_baseline / T_method over each speed-up baseline."""
    time_to_target_at_least_s: float | None = None
    """A lower bound on the mean over every replication, the runs that missed the target counted at
    the time they were stopped; the mean itself where every run reached it (None when unknown)."""
    speedup_at_most: dict[str, float | None] = field(default_factory=dict)
    """The matching upper bound on each speed-up; None where the baseline missed the target too."""


@dataclass(frozen=True, kw_only=True)
class IntervalRerun:
    """A method run again at a better checkpoint interval at one point (sim/studies/untuned_intervals.py)."""

    method: str
    interval_field: str
    configured_interval_iterations: int
    tuned_interval_iterations: int
    tuned_by: str
    """"Daly's optimum" (a method that blocks training to checkpoint) or "search" (one that does not)."""
    intervals_tried: tuple[int, ...]
    fraction_reached: float
    time_to_target_s: Estimate
    """At the tuned interval: the mean over the replications that reached the target."""


@dataclass(frozen=True, kw_only=True)
class PointVerdict:
    """The answer at one failure rate of one scenario (one grid point of a sweep)."""

    scenario: str
    failure_probability_per_stage_hour: float | None
    grid: dict[str, Any]
    """The swept fields' values at this point (empty outside sweeps)."""
    winner: str | None
    """None when no real method reached the target."""
    winner_label: str | None
    winner_time_to_target_s: Estimate | None
    winner_speedup: dict[str, Estimate | None]
    """The winner's speed-up over each baseline; None where the baseline did not run or never reached the target."""
    cannot_be_told_apart_from: tuple[str, ...]
    standings: tuple[MethodStanding, ...]
    """Real methods by mean time to target, then the reference, then the ablations."""
    caveats: tuple[str, ...]
    interval_reruns: tuple[IntervalRerun, ...] = ()
    """Methods whose checkpoint interval, tuned here, was clearly better (a caveat lists them)."""
    with_tuned_intervals: "PointVerdict | None" = None
    """The answer again with those methods at their tuned intervals; None where none was."""
    num_replications: int | None = None
    """The fewest replications of any method here; below `MIN_REPLICATIONS_FOR_INTERVALS` the
    intervals, and the ties read from them, are unreliable (`intervals_unreliable`)."""

    @property
    def intervals_unreliable(self) -> bool:
        return intervals_unreliable(self.num_replications)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    points: tuple[PointVerdict, ...]
    caveats: tuple[str, ...] = field(default_factory=tuple)
    """Caveats that apply to every point (uncalibrated setbacks, a method's steady overhead, ...)."""

    def to_json(self) -> dict[str, Any]:
        """Plain data for `json.dumps(..., allow_nan=False)`: every missing number is None."""
        return _json_safe(asdict(self))


def method_role(method: str) -> Role:
    traits = METHOD_CONFIGS.get(method)
    if traits is None:
        return "method"  # saved results may name a method this installation does not register
    if traits.ignores_failures:
        return "reference"
    return "ablation" if traits.ablation else "method"


def method_label(method: str) -> str:
    traits = METHOD_CONFIGS.get(method)
    return traits.label if traits is not None else method


def _standing(row: pd.Series) -> MethodStanding:
    method = str(row["method"])
    return MethodStanding(
        method=method,
        label=method_label(method),
        role=method_role(method),
        fraction_reached=finite_or_none(row.get("fraction_reached")),
        time_to_target_s=Estimate.from_row(row, "time_to_target_mean_s", "time_to_target_ci95_low_s", "time_to_target_ci95_high_s"),
        speedup={baseline: Estimate.from_row(row, *speedup_columns(baseline)) for baseline in speedup_baselines() if speedup_columns(baseline)[0] in row},
        time_to_target_at_least_s=finite_or_none(row.get("time_to_target_at_least_s")),
        speedup_at_most={
            baseline: finite_or_none(row.get(speedup_at_most_column(baseline)))
            for baseline in speedup_baselines()
            if speedup_at_most_column(baseline) in row
        },
    )


def _registry_order(method: str) -> int:
    names = list(METHOD_NAMES)
    return names.index(method) if method in names else len(names)


def _ordered(standings: Iterable[MethodStanding]) -> tuple[MethodStanding, ...]:
    """Real methods fastest first (those that missed the target in some replications after those that
    never did, by their lower bounds; those that never reached it last), then the reference, then
    ablations in registry order."""
    standings = list(standings)

    def by_time(standing: MethodStanding) -> tuple:
        time = ranking_time_s(standing)
        return (time is None, not _reached_everywhere(standing), time if time is not None else 0.0, _registry_order(standing.method))

    real = sorted((s for s in standings if s.role == "method"), key=by_time)
    reference = [s for s in standings if s.role == "reference"]
    ablations = sorted((s for s in standings if s.role == "ablation"), key=lambda s: _registry_order(s.method))
    return tuple(real + reference + ablations)


def _reached_everywhere(standing: TimedToTarget) -> bool:
    return standing.fraction_reached is not None and standing.fraction_reached >= 1.0


def duration_unit(largest_s: float) -> tuple[str, float]:
    """Hours from 3 h, minutes from 3 min, else seconds: (name, seconds per unit)."""
    return ("h", 3600.0) if largest_s >= 3 * 3600 else ("min", 60.0) if largest_s >= 180 else ("s", 1.0)


class TimedToTarget(Protocol):
    """What the tie rule reads: a `MethodStanding`, or a recommendation's candidate."""

    @property
    def fraction_reached(self) -> float | None: ...
    @property
    def time_to_target_s(self) -> Estimate: ...
    @property
    def time_to_target_at_least_s(self) -> float | None: ...


def ranking_time_s(timed: TimedToTarget) -> float | None:
    """What methods are ranked by: the mean time to target, or for one that missed the target in
    some replications its lower bound, which counts the runs it missed (the mean of those it reached
    flatters it); None where it never reached the target."""
    time = timed.time_to_target_s.mean
    if time is not None and not _reached_everywhere(timed) and timed.time_to_target_at_least_s is not None:
        return timed.time_to_target_at_least_s
    return time


def cannot_be_told_apart(winner: TimedToTarget, other: TimedToTarget) -> bool:
    """Their 95 % intervals overlap, and where `other` missed the target in some replications (its
    interval covers only the runs that reached it) its lower bound is within the winner's interval.

    Also `sim.studies.recommend`'s rule for its candidates, which carry the same three fields."""
    if not winner.time_to_target_s.overlaps(other.time_to_target_s):
        return False
    at_least, winner_high = other.time_to_target_at_least_s, winner.time_to_target_s.ci95_high
    return _reached_everywhere(other) or at_least is None or winner_high is None or at_least <= winner_high


def _point_caveats(standings: Sequence[MethodStanding]) -> list[str]:
    caveats = []
    for standing in standings:
        if standing.role == "ablation" or standing.fraction_reached is None or standing.fraction_reached >= 1.0:
            continue
        if standing.time_to_target_s.mean is None:
            caveats.append(f"{standing.method} never reached the target (target.max_wall_clock_s ends such runs)")
            continue
        caveat = (
            f"{standing.method} reached the target in {standing.fraction_reached:.0%} of replications; "
            "its time to target is the mean of those that did, so it is optimistic"
        )
        at_least = standing.time_to_target_at_least_s
        if at_least is not None:
            name, seconds = duration_unit(at_least)
            caveat += f"; counting the others at the time they were stopped (target.max_wall_clock_s), at least {at_least / seconds:.1f} {name}"
        caveats.append(caveat)
    return caveats


def point_verdict(rows: pd.DataFrame, *, grid_columns: Sequence[str] = ()) -> PointVerdict:
    """The verdict over the rows of one scenario at one failure rate (one row per method)."""
    first = rows.iloc[0]
    standings = _ordered(_standing(row) for _, row in rows.iterrows())
    candidates = [s for s in standings if s.role == "method" and s.time_to_target_s.mean is not None]
    winner = candidates[0] if candidates else None
    tied: tuple[str, ...] = ()
    speedup: dict[str, Estimate | None] = {}
    if winner is not None:
        tied = tuple(s.method for s in candidates[1:] if cannot_be_told_apart(winner, s))
        for baseline in speedup_baselines():
            estimate = winner.speedup.get(baseline)
            speedup[baseline] = estimate if estimate is not None and estimate.mean is not None else None
    return PointVerdict(
        scenario=str(first["scenario"]),
        failure_probability_per_stage_hour=finite_or_none(first.get(RATE_COLUMN)),
        grid={column: _plain(first[column]) for column in grid_columns if column in rows.columns},
        winner=winner.method if winner else None,
        winner_label=winner.label if winner else None,
        winner_time_to_target_s=winner.time_to_target_s if winner else None,
        winner_speedup=speedup,
        cannot_be_told_apart_from=tied,
        standings=standings,
        caveats=tuple(_point_caveats(standings)),
        num_replications=_fewest_replications(rows),
    )


def verdict_from_summary(
    summary: pd.DataFrame,
    *,
    grid_columns: Sequence[str] = (),
    notes: Sequence[str] = (),
    runs: pd.DataFrame | None = None,
) -> Verdict:
    """One `PointVerdict` per (scenario, failure rate), rates ascending within each scenario.

    `notes` are the scenario's caveats (`sim.studies.outputs.scenario_notes`); with `runs` (runs.csv) the
    methods whose failure-free iteration is markedly slower than the plain pipeline's get one too.
    """
    points = []
    for _, scenario_rows in summary.groupby("scenario", sort=False):
        rates = scenario_rows[RATE_COLUMN].astype(float)
        for rate in sorted(set(rates[rates.notna()])) + ([math.nan] if rates.isna().any() else []):
            rows = scenario_rows[rates.isna()] if math.isnan(rate) else scenario_rows[rates == rate]
            points.append(point_verdict(rows, grid_columns=grid_columns))
    caveats = list(notes) + (steady_overhead_caveats(runs) if runs is not None else []) + small_sample_caveats(summary)
    return Verdict(points=tuple(points), caveats=tuple(dict.fromkeys(caveats)))


def tuned_intervals_table(verdict: Verdict) -> pd.DataFrame:
    """tuned_intervals.csv: every point's tuned intervals (`PointVerdict.interval_reruns`)."""
    grid_columns = list(dict.fromkeys(column for point in verdict.points for column in point.grid))
    rows = [
        {
            "scenario": point.scenario,
            **{column: point.grid.get(column) for column in grid_columns},
            "failure_probability_per_stage_hour": point.failure_probability_per_stage_hour,
            "method": rerun.method,
            "interval_field": rerun.interval_field,
            "configured_interval_iterations": rerun.configured_interval_iterations,
            "tuned_interval_iterations": rerun.tuned_interval_iterations,
            "tuned_by": rerun.tuned_by,
            "intervals_tried": " ".join(map(str, rerun.intervals_tried)),
            "fraction_reached": rerun.fraction_reached,
            "time_to_target_mean_s": rerun.time_to_target_s.mean,
            "time_to_target_ci95_low_s": rerun.time_to_target_s.ci95_low,
            "time_to_target_ci95_high_s": rerun.time_to_target_s.ci95_high,
        }
        for point in verdict.points
        for rerun in point.interval_reruns
    ]
    columns = list(TUNED_INTERVAL_COLUMNS)
    return pd.DataFrame(rows, columns=columns[:1] + grid_columns + columns[1:])


def _fewest_replications(rows: pd.DataFrame) -> int | None:
    """The fewest replications of any row (summary.csv's `num_replications`); None where unknown."""
    counts = pd.to_numeric(rows["num_replications"], errors="coerce") if "num_replications" in rows else pd.Series(dtype=float)
    counts = counts[counts.notna()]
    return int(counts.min()) if not counts.empty else None


def small_sample_caveats(summary: pd.DataFrame) -> list[str]:
    """The caveat that the intervals are unreliable, where some row has fewer replications than
    `MIN_REPLICATIONS_FOR_INTERVALS` (named at the fewest)."""
    fewest = _fewest_replications(summary)
    return [small_sample_caveat(fewest)] if fewest is not None and intervals_unreliable(fewest) else []


def steady_overhead_caveats(runs: pd.DataFrame) -> list[str]:
    """Methods whose failure-free iteration takes markedly longer than the no-failure reference's.

    That cost is paid at every failure rate and depends on this scenario's pipeline and links (for
    example CheckFree+'s swapped microbatches crossing slow links), so an answer that turns on it
    should be read with it in mind.
    """
    if runs.empty or "healthy_iteration_time_s" not in runs:
        return []
    iteration_s = runs.groupby("method", sort=False)["healthy_iteration_time_s"].median()
    reference = reference_method()
    if reference not in iteration_s or not iteration_s[reference] > 0:
        return []
    caveats = []
    for method, seconds in iteration_s.items():
        ratio = seconds / iteration_s[reference]
        if method != reference and method_role(str(method)) != "ablation" and ratio >= STEADY_OVERHEAD_NOTE_RATIO:
            caveats.append(
                f"{method}: a failure-free iteration takes {ratio:.2f}× the plain pipeline's "
                f"({seconds:.3g} s against {iteration_s[reference]:.3g} s), a cost it pays at every failure rate "
                "(method_overhead_s in runs.csv)"
            )
    return caveats


def _plain(value: Any) -> Any:
    """numpy scalars → Python scalars, for JSON."""
    return value.item() if hasattr(value, "item") else value


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    value = _plain(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
