"""The verdict: which real method reaches the target first, by how much, and whom it cannot be told apart from."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from rich.console import Console

from churnsim.calibration.base import strict_json_loads
from churnsim.calibration.tables import SUMMARY_COLUMNS
from churnsim.report import answer_text, print_point_table
from churnsim.sim.studies.replicate import summary_table
from churnsim.sim.studies.verdict import steady_overhead_caveats, verdict_from_summary


def summary_row(method: str, mean_h: float, half_width_h: float, *, rate: float = 0.1, reached: float = 1.0, **speedups) -> dict:
    row = {column: math.nan for column in SUMMARY_COLUMNS}
    row.update(
        scenario="s",
        failure_probability_per_stage_hour=rate,
        method=method,
        num_replications=5,
        fraction_reached=reached,
        time_to_target_mean_s=3600.0 * mean_h,
        time_to_target_ci95_low_s=3600.0 * (mean_h - half_width_h),
        time_to_target_ci95_high_s=3600.0 * (mean_h + half_width_h),
        setbacks_calibrated=False,
    )
    for baseline, (mean, low, high) in speedups.items():
        row.update({f"speedup_vs_{baseline}_mean": mean, f"speedup_vs_{baseline}_ci95_low": low, f"speedup_vs_{baseline}_ci95_high": high})
    return row


def frame(*rows: dict) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=list(SUMMARY_COLUMNS))


def test_the_winner_is_the_real_method_with_the_lowest_mean_time_and_carries_its_paired_speedups():
    summary = frame(
        summary_row("checkpoint", 260.0, 2.0, checkpoint=(1.0, 1.0, 1.0), redundant=(0.77, 0.76, 0.78)),
        summary_row("redundant", 203.0, 2.0, checkpoint=(1.29, 1.28, 1.31), redundant=(1.0, 1.0, 1.0)),
        summary_row("checkfree", 194.5, 1.0, checkpoint=(1.35, 1.34, 1.36), redundant=(1.05, 1.04, 1.05)),
        summary_row("checkfree_plus", 284.0, 1.0),
    )
    (point,) = verdict_from_summary(summary).points
    assert point.winner == "checkfree"
    assert point.winner_time_to_target_s.mean == pytest.approx(3600.0 * 194.5)
    assert point.winner_speedup["checkpoint"].mean == pytest.approx(1.35)
    assert (point.winner_speedup["redundant"].ci95_low, point.winner_speedup["redundant"].ci95_high) == (1.04, 1.05)
    assert point.cannot_be_told_apart_from == ()
    assert [s.method for s in point.standings] == ["checkfree", "redundant", "checkpoint", "checkfree_plus"]


def test_overlapping_intervals_are_reported_as_cannot_be_told_apart():
    summary = frame(
        summary_row("checkpoint", 100.0, 1.0),
        summary_row("async_checkpoint", 59.9, 0.4),
        summary_row("checkfree", 60.2, 0.3),  # [59.9, 60.5] overlaps [59.5, 60.3]
        summary_row("redundant", 62.5, 0.5),  # [62.0, 63.0] does not
    )
    (point,) = verdict_from_summary(summary).points
    assert point.winner == "async_checkpoint"
    assert point.cannot_be_told_apart_from == ("checkfree",)


def test_the_reference_and_ablations_never_win_and_are_listed_after_the_real_methods():
    summary = frame(
        summary_row("uniform", 50.0, 0.1),
        summary_row("none", 40.0, 0.1),
        summary_row("checkpoint", 70.0, 0.1),
        summary_row("checkfree", 60.0, 0.1),
        summary_row("random", 90.0, 0.1),
    )
    (point,) = verdict_from_summary(summary).points
    assert point.winner == "checkfree"
    assert point.cannot_be_told_apart_from == ()  # the reference and the ablations are not competitors
    assert [(s.method, s.role) for s in point.standings] == [
        ("checkfree", "method"), ("checkpoint", "method"), ("none", "reference"), ("uniform", "ablation"), ("random", "ablation"),
    ]


def test_a_method_that_missed_the_target_in_some_replications_does_not_win_on_its_biased_mean():
    summary = frame(summary_row("checkfree", 50.0, 1.0, reached=0.6), summary_row("checkpoint", 80.0, 1.0))
    (point,) = verdict_from_summary(summary).points
    assert point.winner == "checkpoint"
    assert any("checkfree reached the target in 60% of replications" in caveat for caveat in point.caveats)


def _runs_with_two_stopped_checkfree_runs(*, checkpoint_missed_once: bool = False) -> pd.DataFrame:
    """Five replications: checkpoint reaches the target in 80 h; checkfree in 48, 50, 52 h three
    times and is stopped at a 30-day limit twice."""
    hour = 3600.0
    checkpoint_times = [80 * hour] * 5
    if checkpoint_missed_once:
        checkpoint_times[0] = math.nan
    rows = [
        {"method": "checkfree", "replication": r, "reached_target": math.isfinite(t), "time_to_target_s": t, "wall_clock_s": w}
        for r, (t, w) in enumerate(zip([48 * hour, 50 * hour, 52 * hour, math.nan, math.nan], [48 * hour, 50 * hour, 52 * hour, 720 * hour, 720 * hour]))
    ] + [
        {"method": "checkpoint", "replication": r, "reached_target": math.isfinite(t), "time_to_target_s": t, "wall_clock_s": 720 * hour if math.isnan(t) else t}
        for r, t in enumerate(checkpoint_times)
    ]
    return pd.DataFrame(rows).assign(scenario="s", failure_probability_per_stage_hour=0.1, setbacks_calibrated=False)


AT_LEAST_H = (48 * 50 * 52 * 720 * 720) ** (1 / 5)
"""The lower bound of checkfree's geometric mean time to target above, in hours: its stopped runs at 720 h."""


def test_a_method_that_missed_the_target_gets_bounds_counting_its_stopped_runs():
    summary = summary_table(_runs_with_two_stopped_checkfree_runs()).set_index("method")
    hour = 3600.0
    assert summary.loc["checkfree", "time_to_target_mean_s"] == pytest.approx((48 * 50 * 52) ** (1 / 3) * hour)  # the three that reached: optimistic
    # Geometric means, as the summary's means are: (48 × 50 × 52 × 720²)^(1/5) ≈ 145.3 h.
    assert summary.loc["checkfree", "time_to_target_at_least_s"] == pytest.approx(AT_LEAST_H * hour)
    at_most = (80 / 48 * 80 / 50 * 80 / 52 * (80 / 720) ** 2) ** (1 / 5)
    assert summary.loc["checkfree", "speedup_vs_checkpoint_at_most"] == pytest.approx(at_most)
    assert summary.loc["checkfree", "speedup_vs_checkpoint_mean"] > 1.5 > at_most  # the paired mean over three reads faster
    # Where every run reached the target the bounds are the estimates themselves.
    assert summary.loc["checkpoint", "time_to_target_at_least_s"] == pytest.approx(80 * hour)
    assert summary.loc["checkpoint", "speedup_vs_checkpoint_at_most"] == pytest.approx(1.0)

    (point,) = verdict_from_summary(summary.reset_index()).points
    (caveat,) = [caveat for caveat in point.caveats if caveat.startswith("checkfree reached the target in 60%")]
    assert caveat.endswith("counting the others at the time they were stopped (target.max_wall_clock_s), at least 145.3 h")
    (standing,) = [s for s in point.standings if s.method == "checkfree"]
    assert standing.time_to_target_at_least_s == pytest.approx(AT_LEAST_H * hour)
    assert standing.speedup_at_most["checkpoint"] == pytest.approx(at_most)


def test_nothing_bounds_a_speedup_over_a_baseline_that_missed_the_target_too():
    summary = summary_table(_runs_with_two_stopped_checkfree_runs(checkpoint_missed_once=True)).set_index("method")
    assert math.isnan(summary.loc["checkfree", "speedup_vs_checkpoint_at_most"])
    assert summary.loc["checkfree", "time_to_target_at_least_s"] == pytest.approx(AT_LEAST_H * 3600.0)


def test_a_partly_reached_method_whose_lower_bound_is_past_the_winners_interval_can_be_told_apart():
    hour = 3600.0
    winner = summary_row("checkpoint", 80.0, 1.0)
    slower_for_sure = summary_row("checkfree", 79.0, 3.0, reached=0.6) | {"time_to_target_at_least_s": 318 * hour}
    maybe_faster = summary_row("async_checkpoint", 79.5, 3.0, reached=0.8) | {"time_to_target_at_least_s": 80.5 * hour}
    (point,) = verdict_from_summary(frame(winner, slower_for_sure, maybe_faster)).points
    assert point.winner == "checkpoint"
    assert point.cannot_be_told_apart_from == ("async_checkpoint",)  # its bound lies within checkpoint's [79, 81] h


def test_the_table_shows_bounds_for_a_method_that_missed_the_target():
    console = Console(width=160, record=True)
    (point,) = verdict_from_summary(summary_table(_runs_with_two_stopped_checkfree_runs())).points
    print_point_table(point, console)
    text = console.export_text()
    (checkfree_line,) = [line for line in text.splitlines() if "checkfree" in line]
    assert "60%" in checkfree_line and "≥ 145.3" in checkfree_line and "≤ 0.55" in checkfree_line
    assert "50.0" not in checkfree_line  # the optimistic mean of the three that reached is only in the caveat
    assert "missed runs counted at the time they were stopped" in " ".join(text.split())


def test_no_winner_when_no_real_method_reached_the_target():
    row = summary_row("checkpoint", 1.0, 0.0, reached=0.0)
    row.update(time_to_target_mean_s=math.nan, time_to_target_ci95_low_s=math.nan, time_to_target_ci95_high_s=math.nan)
    (point,) = verdict_from_summary(frame(row, summary_row("none", 10.0, 0.0))).points
    assert point.winner is None and point.winner_speedup == {}


def test_one_point_per_failure_rate_in_ascending_order_with_the_swept_fields():
    summary = frame(summary_row("checkfree", 60.0, 1.0, rate=0.33), summary_row("checkfree", 50.0, 1.0, rate=0.0))
    summary.insert(1, "pipeline.num_microbatches", 8)
    verdict = verdict_from_summary(summary, grid_columns=["pipeline.num_microbatches"], notes=["a caveat"])
    assert [p.failure_probability_per_stage_hour for p in verdict.points] == [0.0, 0.33]
    assert verdict.points[0].grid == {"pipeline.num_microbatches": 8}
    assert verdict.caveats == ("a caveat",)


def test_the_json_form_is_strict_json_with_null_for_missing_numbers():
    summary = frame(summary_row("checkfree", 60.0, 1.0), summary_row("checkpoint", 70.0, 1.0))  # no speed-up columns filled
    text = json.dumps(verdict_from_summary(summary).to_json(), allow_nan=False)
    data = strict_json_loads(text)
    assert data["points"][0]["winner"] == "checkfree"
    assert data["points"][0]["winner_speedup"] == {"checkpoint": None, "redundant": None}
    with pytest.raises(ValueError):
        strict_json_loads('{"x": NaN}')


def test_a_method_with_a_markedly_slower_healthy_iteration_gets_a_caveat():
    runs = pd.DataFrame(
        {"method": ["none", "checkfree", "checkfree_plus", "random"], "healthy_iteration_time_s": [20.0, 20.5, 35.0, 40.0]}
    )
    caveats = steady_overhead_caveats(runs)
    assert len(caveats) == 1 and caveats[0].startswith("checkfree_plus: a failure-free iteration takes 1.75×")


def test_when_every_method_missed_the_target_somewhere_the_first_is_the_lowest_bound_and_the_answer_says_so():
    hour = 3600.0
    fast_but_rarely = summary_row("checkfree", 50.0, 1.0, reached=0.2) | {"time_to_target_at_least_s": 586 * hour}
    slower_but_mostly = summary_row("checkpoint", 150.0, 5.0, reached=0.8) | {
        "time_to_target_at_least_s": 264 * hour, "speedup_vs_checkpoint_at_most": 1.0, "speedup_vs_redundant_at_most": math.nan,
    }
    (point,) = verdict_from_summary(frame(fast_but_rarely, slower_but_mostly)).points
    assert point.winner == "checkpoint"  # by 264 h at least against 586 h, not by the means over the runs that reached
    assert [s.method for s in point.standings] == ["checkpoint", "checkfree"]
    assert answer_text(point) == (
        "no method reached the target in every replication; checkpoint (sync) comes first by its lower bound, "
        "at least 264.0 h (it reached the target in 80% of replications; the others counted at the time they were stopped); "
        "it is the checkpoint (sync) baseline, redundant not run."
    )


def test_few_replications_make_the_summary_the_verdict_and_the_answer_say_the_intervals_are_unreliable():
    """Two replications: no interval below zero, a column saying so in summary.csv, a caveat, and a
    tie marked unreliable."""
    hour = 3600.0
    runs = pd.DataFrame(
        {
            "scenario": "s", "failure_probability_per_stage_hour": 0.1, "replication": [0, 0, 1, 1],
            "method": ["checkpoint", "checkfree", "checkpoint", "checkfree"],
            "time_to_target_s": [1.0 * hour, 9.0 * hour, 30.0 * hour, 12.0 * hour], "wall_clock_s": [1.0 * hour, 9.0 * hour, 30.0 * hour, 12.0 * hour],
            "reached_target": True, "setbacks_calibrated": False,
        }
    )  # fmt: skip
    summary = summary_table(runs)
    interval_columns = [column for column in summary.columns if "_ci95_" in column]
    assert (summary[interval_columns].dropna(how="all", axis=1).fillna(1.0) > 0).all().all()
    assert not summary["intervals_reliable"].any()
    verdict = verdict_from_summary(summary)
    (point,) = verdict.points
    assert point.num_replications == 2 and point.intervals_unreliable
    assert any("from 2 replications" in caveat and "unreliable" in caveat for caveat in verdict.caveats)
    assert point.cannot_be_told_apart_from, "the two methods' wide intervals overlap"
    assert "95 % intervals overlap, unreliable at 2 replications" in answer_text(point)


def test_enough_replications_carry_no_small_sample_caveat():
    verdict = verdict_from_summary(frame(summary_row("checkpoint", 80.0, 1.0), summary_row("checkfree", 80.5, 1.0)))  # 5 replications each
    (point,) = verdict.points
    assert not point.intervals_unreliable
    assert not any("unreliable" in caveat for caveat in verdict.caveats)
    assert "unreliable" not in answer_text(point)
