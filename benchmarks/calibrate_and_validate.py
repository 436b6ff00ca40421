"""End to end on this machine: calibrate --quick, held-out real runs, validate; the error tables.

    python benchmarks/calibrate_and_validate.py [--out DIR] [--calibration FILE] [--max-rounds 3] [--recalibrate-each-round]
    python benchmarks/calibrate_and_validate.py --out DIR --revalidate   # the same runs, the current validator
    python benchmarks/calibrate_and_validate.py --out DIR --revalidate --refit   # and each round's calibration fitted again
    python benchmarks/calibrate_and_validate.py --resummarize           # the committed tables, the current figures

1. `churnsim calibrate --quick` into OUT/cpu-tiny.json (fit runs in OUT/calibration-runs): the
   procedure that makes the built-in calibration's timing half, so the tables validate it.
2. Rounds of held-out real runs, each with seeds no calibration run and no earlier round used:
   - the calibrated setup (the `cpu-tiny` preset: 4 stages × 4 microbatches of 8, 1F1B): every
     method, at 120 and 360 failures per node-hour in turn;
   - setups the calibration did not run (`OTHER_SETUPS`): 6 and 3 stages of a 6-layer model, 6
     microbatches, the GPipe schedule, a 4× longer run, and bursts of two stages failing at once;
     checkpoint, checkfree and redundant on each;
   - a no-failure twin (method none, same seed and setup) for every setup: the time-to-target goal.
   The setups' runs are interleaved (`interleaved`), so that a spell of the machine is not one setup's.
   Each run injects the failure path `churnsim simulate` samples for the same scenario.
3. `churnsim validate` of each round; per group the median |relative error| of the total
   wall-clock (absolute and load-normalised, sim/validate.py) and of the time to target, and how
   many runs fell inside the prediction's 95 % interval of the machine's speed (its spread between
   the calibration's runs, calibration/speed_uncertainty.py).
   Beside them, how fast the machine ran (`sim.validate.machine_speed`): each run's measured steady
   step over the predicted one, its median and its scatter. An exact model calibrated at the
   round's typical speed would still show the scatter as its median absolute error.
   With `--recalibrate-each-round`, every round starts with its own `calibrate --quick`: each round
   is then the whole procedure (calibrate, then predict runs of the next minutes), so a slow or fast
   spell of this 2-core machine between one calibration and a later round does not count as model
   error, and the rounds are independent replicates of what a user does.
   With `CHURNSIM_PIN_STAGES=1` in the environment every stage process runs pinned to a core of its
   own (real/cpu_placement.py); the results say whether they did (`stage_processes_pinned`).
4. The result is every round's runs pooled: per group the median |relative error| with a 95 %
   interval that takes rounds, not runs, as the independent units (each has its own calibration
   and its own spell of the machine: a two-stage bootstrap, `pooled_figures`), and a verdict per
   target: met (the whole interval within it), missed (the whole interval beyond it), or not
   decided at this precision. Rounds repeat until the latest one's headline figures each lie in
   the spread the earlier rounds state for one more round (at least three rounds; or
   `--max-rounds`). A fresh run also says whether it reproduces the committed run before it: each
   run's pooled figure inside the other's interval (`earlier_run` in the results).
   Beside them, whether the calibrated setup's worst method stands out from the others or is the
   worst of several alike (`methods_compared`, a permutation test inside the rounds).
   `--resummarize --pool DIR` pools an earlier run's committed rounds with the current ones, into
   benchmarks/results/calibrate-and-validate-pooled.json (`--pooled-out FILE`: into FILE, for a pool
   of some runs only, such as those made by the current compute model). Earlier runs' committed
   results are in benchmarks/results/calibrate-and-validate-runs/<date>-<commit>/.

Targets (issue 9): calibrated setup ≤ 5 % per method, other setups ≤ 10 %, time to target ≤ 10 %.
Results: benchmarks/results/calibrate-and-validate.json, and each round's validation table as
benchmarks/results/calibrate-and-validate-round-N.csv; a dated report of either in benchmarks/reports/
(benchmarks/report.py; `--no-report`: none). A benchmark, not a test: it takes tens of
minutes and its numbers depend on the machine's load; run nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_report_option, report_if_asked  # noqa: E402

RESULTS_FILE = Path(__file__).parent / "results" / "calibrate-and-validate.json"
POOLED_FILE = RESULTS_FILE.with_name("calibrate-and-validate-pooled.json")
"""Where `--resummarize --pool DIR` writes the figures of several runs' rounds pooled."""
CALIBRATED_RATES_PER_NODE_HOUR = (120.0, 360.0)
OTHER_SETUP_RATE_PER_NODE_HOUR = 240.0
OTHER_SETUP_METHODS = ("checkpoint", "checkfree", "redundant")
TARGETS = {"calibrated setup": 0.05, "other setups": 0.10, "time to target": 0.10}

OTHER_SETUPS: dict[str, dict[str, object]] = {
    "6-stages": {"model.num_layers": 6, "pipeline.num_stages": 6},
    "3-stages": {"model.num_layers": 6, "pipeline.num_stages": 3},
    "6-microbatches": {"pipeline.num_microbatches": 6},
    "gpipe": {"pipeline.schedule": "gpipe"},
    "4x-longer": {"target.loss": None, "target.iterations": 320},
    "double-failures": {},  # churn replaced by bursts of exactly two stages (`_scenario`)
}


def _churnsim(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "churnsim", *arguments], check=True)


def _scenario(setup: str, *, rate: float, seed: int, method: str, failures: bool):
    from churnsim.calibration.churn import BurstChurn, NoChurn
    from churnsim.calibration.presets import preset

    settings = dict(OTHER_SETUPS.get(setup, {}))
    settings.update({"churn.failures_per_node_hour": rate, "seed": seed})
    # One method: others may not fit the setup (CheckFree+ needs 4 stages). Another setup takes the
    # built-in calibration's compute model, as `real run --preset cpu-tiny --set ...` does.
    scenario = preset("cpu-tiny", settings, methods=(method,))
    if not failures:
        scenario = scenario.model_copy(update={"churn": NoChurn(kind="none")})
    elif setup == "double-failures":
        # As many stage failures as single failures at `rate` would give, in pairs.
        bursts_per_hour = rate * scenario.pipeline.num_stages / 2
        scenario = scenario.model_copy(update={"churn": BurstChurn(kind="burst", bursts_per_hour=bursts_per_hour, burst_size_probabilities=(0.0, 1.0))})
    return scenario


def round_plan(round_index: int, seeds: tuple[int, int], *, other_setups: bool = True):
    from churnsim.calibration.presets import preset
    from churnsim.real.calibration_suite import SuiteRun
    from churnsim.real.scenario_run import training_config

    def run(run_id: str, setup: str, method: str, *, rate: float, seed: int, failures: bool = True) -> SuiteRun:
        scenario = _scenario(setup, rate=rate, seed=seed, method=method, failures=failures)
        return SuiteRun(run_id=f"r{round_index}-{run_id}", purpose="held_out", config=training_config(scenario, scenario.methods[0]), scenario=scenario)

    calibrated = [run(f"calibrated-none-twin-s{seed}", "calibrated", "none", rate=0.0, seed=seed, failures=False) for seed in seeds]
    methods = [method.name for method in preset("cpu-tiny").methods if method.name != "none"]
    for index, method in enumerate(methods):
        rate = CALIBRATED_RATES_PER_NODE_HOUR[index % len(CALIBRATED_RATES_PER_NODE_HOUR)]
        seed = seeds[index % len(seeds)]
        calibrated.append(run(f"calibrated-{method}-{rate:g}-per-hour-s{seed}", "calibrated", method, rate=rate, seed=seed))
    seed = seeds[0]
    groups = [calibrated]
    for setup in OTHER_SETUPS if other_setups else ():
        group = [run(f"{setup}-none-twin-s{seed}", setup, "none", rate=0.0, seed=seed, failures=False)]
        for method in OTHER_SETUP_METHODS:
            group.append(run(f"{setup}-{method}-s{seed}", setup, method, rate=OTHER_SETUP_RATE_PER_NODE_HOUR, seed=seed))
        groups.append(group)
    return interleaved(groups)


def interleaved(groups: list[list]) -> list:
    """The runs of every group spread evenly over the round, each at its place within its group, so
    that a slow or fast spell of the machine falls on runs of several setups rather than on one
    setup whole. In order, the calibrated setup's runs came first, right after its calibration: a
    spell of a minute or two (its runs 1.17× the prediction while the other setups' ran at 0.99×, in
    one round of an earlier run) moved that group's median by the whole spell."""
    placed = [((index + 0.5) / len(group), order, run) for order, group in enumerate(groups) for index, run in enumerate(group)]
    return [run for _, _, run in sorted(placed, key=lambda item: item[:2])]


def headline_rows(table) -> dict:
    """The runs behind each headline figure of one round's validation table, by group: the
    wall-clock rows of the runs with failures (per method of the calibrated setup, per other setup,
    and both groups whole) and their time-to-target rows."""
    with_failures = table[~table["run_id"].str.contains("-none-twin-")]
    wall = with_failures[with_failures["quantity"] == "total_wall_clock_s"]
    calibrated = wall[wall["run_id"].str.contains("-calibrated-")]
    groups = {f"calibrated setup / {method}": rows for method, rows in calibrated.groupby("method")}
    groups["calibrated setup"] = calibrated
    others = wall[~wall["run_id"].str.contains("-calibrated-")]
    for setup in OTHER_SETUPS:
        groups[f"other setup / {setup}"] = others[others["run_id"].str.contains(f"-{setup}-")]
    groups["other setups"] = others
    groups["time to target"] = with_failures[with_failures["quantity"] == "time_to_target_s"]
    return groups


def _absolute_errors(rows, column: str):
    return rows[column].abs().dropna().to_numpy()


def _median(values) -> float:
    return float(np.median(values)) if len(values) else float("nan")


def summarize(table) -> dict[str, dict[str, float]]:
    """Headline figures of one round's validation table (fractions, not percent): per group the
    median |relative error|, absolute with its 95 % bootstrap interval over the round's runs, and
    load-normalised."""
    import dataclasses

    from churnsim.calibration.statistics import median_with_ci95
    from churnsim.sim.checks.validate import interval_coverage

    summary: dict[str, dict[str, float]] = {}
    for group, rows in headline_rows(table).items():
        absolute, low, high = median_with_ci95([_absolute_errors(rows, "relative_error")])
        figures: dict[str, object] = {
            "absolute": absolute,
            "absolute_ci95": [low, high],
            "load_normalised": _median(_absolute_errors(rows, "load_normalised_relative_error")),
            "runs": int(rows["relative_error"].notna().sum()),
        }
        # Tables of validators before the speed interval existed lack its columns.
        coverage = interval_coverage(rows, rows["quantity"].iloc[0]) if "predicted_ci95_low" in rows and not rows.empty else None
        if coverage is not None:
            figures["speed_interval"] = dataclasses.asdict(coverage)
        summary[group] = figures
    return summary


def pooled_figures(tables, groups: tuple[str, ...] | None = None) -> dict[str, dict[str, object]]:
    """Per group, the median |relative error| of every round's runs pooled, with two 95 % intervals
    that take the rounds, not the runs, as the independent units (each round has its own
    calibration and its own spell of the machine's speed; `median_with_ci95`):
    - `*_ci95`: of the pooled median itself, what the benchmark states as its result;
    - `*_round_spread`: where the median of one more round would fall, the spread a single round
      is held to (`round_reproduces`).
    `groups` limits the figures to those groups (all of them by default)."""
    from churnsim.calibration.statistics import median_with_ci95

    per_round = [headline_rows(table) for table in tables]
    if groups is None:
        groups = tuple(dict.fromkeys(group for rows in per_round for group in rows))
    pooled: dict[str, dict[str, object]] = {}
    for group in groups:
        figures: dict[str, object] = {}
        for kind, column in (("absolute", "relative_error"), ("load_normalised", "load_normalised_relative_error")):
            errors = [_absolute_errors(rows[group], column) for rows in per_round if group in rows]
            median, low, high = median_with_ci95(errors)
            figures[kind] = median
            figures[f"{kind}_ci95"] = [low, high]
            figures[f"{kind}_round_spread"] = list(median_with_ci95(errors, groups_per_resample=1)[1:])
        figures["runs"] = int(sum(rows[group]["relative_error"].notna().sum() for rows in per_round if group in rows))
        figures["rounds"] = sum(1 for rows in per_round if group in rows and not rows[group].empty)
        pooled[group] = figures
    return pooled


def methods_compared(tables) -> dict[str, object] | None:
    """Whether the calibrated setup's worst method differs from the others, or is the worst of
    several alike: the methods' |relative errors| of the wall-clock, relabelled inside each round
    (`largest_median_if_labels_alike`). The target holds each method's median to 5 %; with eight
    methods of some 36 runs each, the worst median lies above the common one by chance alone, and
    `worst_median_if_methods_alike` says by how much."""
    from churnsim.calibration.statistics import largest_median_if_labels_alike

    rounds = []
    for rows in map(headline_rows, tables):
        calibrated = rows["calibrated setup"]
        rounds.append(list(zip(calibrated["method"], calibrated["relative_error"].abs())))
    test = largest_median_if_labels_alike(rounds)
    if test is None:
        return None
    return {
        "worst_method": test.largest_label,
        "worst_median": test.medians[test.largest_label],
        "p_value": test.p_value,
        "worst_median_if_methods_alike": list(test.largest_if_alike),
        "medians": test.medians,
    }


def carry_by_setup(tables) -> dict[str, dict[str, object]]:
    """Per setup the calibration did not run, how far the compute model's carry to it misses, apart
    from the machine's drift: in each round, the median steady step of the setup's runs over its
    prediction, divided by the same median of the calibrated setup's runs (both sets share the
    round's calibration and its spell of the machine, which cancels); then the median over the
    rounds, with a 95 % interval that resamples rounds. 1.10: the setup's steps run 10 % longer than
    the carry predicts, where the calibrated setup's run as predicted."""
    from churnsim.calibration.statistics import median_with_ci95
    from churnsim.sim.checks.validate import steady_step_carry

    per_setup: dict[str, list[float]] = {}
    for table in tables:
        setup_of_run = table["run_id"].str.extract(f"^r\\d+-({'|'.join(OTHER_SETUPS)})-", expand=False)
        carry_of_round = steady_step_carry(table, table["run_id"].str.contains("-calibrated-"), setup_of_run)
        for setup in OTHER_SETUPS:
            if setup in carry_of_round:
                per_setup.setdefault(setup, []).append(carry_of_round[setup])
    carry = {}
    for setup, ratios in per_setup.items():
        median, low, high = median_with_ci95([np.asarray(ratios)])
        carry[setup] = {"steady_step_over_prediction": median, "ci95": [low, high], "rounds": len(ratios)}
    return carry


def _print_carry(carry: dict) -> None:
    print("\nsteady step over the prediction, over the calibrated setup's in the same round (the carry, apart from the machine's drift):")
    for setup, figures in carry.items():
        low, high = figures["ci95"]
        print(f"  {setup:<16} {figures['steady_step_over_prediction']:.3f}× [{low:.3f}–{high:.3f}]   {figures['rounds']} rounds")


def _print_methods_compared(compared: dict | None) -> None:
    if compared is None:
        return
    low, middle, high = compared["worst_median_if_methods_alike"]
    print(f"\ncalibrated setup, worst method: {compared['worst_method']} at {100 * compared['worst_median']:.1f} %; "
          f"the worst of the methods relabelled inside each round: {100 * middle:.1f} % [{100 * low:.1f}–{100 * high:.1f}], "
          f"p = {compared['p_value']:.2f} (the share of relabellings whose worst is at least as bad)")


def target_verdict(figures: dict, limit: float) -> str:
    """Met when the pooled median's whole 95 % interval is within the target, missed when the whole
    interval is beyond it; otherwise the runs cannot tell at this precision."""
    if not figures["runs"]:
        return "no runs (--calibrated-only)"
    low, high = figures["absolute_ci95"]
    if high <= limit:
        return "met"
    if low > limit:
        return "missed"
    return "met by the median, not by its interval" if figures["absolute"] <= limit else "missed by the median, not by its interval"


def machine_speeds(table) -> dict[str, dict[str, float]]:
    """Per group, how fast the machine ran during the round's runs against the calibration
    (`sim.validate.machine_speed`): for the calibrated setup this is the machine alone; for the other
    setups it also holds the compute model's error at those setups."""
    import dataclasses

    from churnsim.sim.checks.validate import machine_speed

    calibrated = table["run_id"].str.contains("-calibrated-")
    speeds = {}
    for group, rows in (("calibrated setup", table[calibrated]), ("other setups", table[~calibrated])):
        speed = machine_speed(rows)
        if speed is not None:
            speeds[group] = dataclasses.asdict(speed)
    return speeds


MIN_ROUNDS_TO_STATE_SPREAD = 2
"""Rounds whose spread a further round is held to (`round_reproduces`): with fewer, a round's spread is unknown."""


def round_reproduces(earlier_tables, latest_table) -> bool:
    """Whether the latest round's headline figures, absolute and load-normalised, each lie in the
    spread the earlier rounds state for one more round (`pooled_figures`, `*_round_spread`)."""
    if len(earlier_tables) < MIN_ROUNDS_TO_STATE_SPREAD:
        return False
    headline = tuple(TARGETS)
    spread = pooled_figures(earlier_tables, headline)
    latest = pooled_figures([latest_table], headline)
    for group in TARGETS:
        if not latest[group]["runs"]:  # --calibrated-only: no other setups
            continue
        for kind in ("absolute", "load_normalised"):
            low, high = spread[group][f"{kind}_round_spread"]
            if not low <= latest[group][kind] <= high:
                return False
    return True


def runs_agree(earlier: dict, later: dict) -> bool:
    """Whether two benchmark runs' pooled results reproduce each other: each one's pooled absolute
    median of every headline group lies inside the other's 95 % interval."""
    for group in TARGETS:
        if group not in earlier or group not in later or bool(earlier[group]["runs"]) != bool(later[group]["runs"]):
            return False
        if not later[group]["runs"]:
            continue
        for this, other in ((earlier, later), (later, earlier)):
            low, high = other[group]["absolute_ci95"]
            if not low <= this[group]["absolute"] <= high:
                return False
    return True


def _print_pooled(label: str, pooled: dict) -> None:
    print(f"\n{label}: median |relative error| of every round's runs pooled, [95 % interval], round spread")
    for group, figures in pooled.items():
        low, high = figures["absolute_ci95"]
        spread_low, spread_high = figures["absolute_round_spread"]
        normalised_low, normalised_high = figures["load_normalised_ci95"]
        print(f"  {group:34s} {100 * figures['absolute']:5.1f} % [{100 * low:.1f}–{100 * high:.1f}], a round {100 * spread_low:.1f}–{100 * spread_high:.1f}"
              f"   load-normalised {100 * figures['load_normalised']:.1f} % [{100 * normalised_low:.1f}–{100 * normalised_high:.1f}]"
              f"   n={figures['runs']} in {figures['rounds']} rounds")


def _print_summary(label: str, summary: dict) -> None:
    print(f"\n{label}: median |relative error| (absolute / load-normalised), runs")
    for group, figures in summary.items():
        coverage = figures.get("speed_interval")
        inside = (
            f"   inside the speed interval: {coverage['num_inside']} of {coverage['num_runs']} "
            f"({coverage['num_slower']} slower, {coverage['num_faster']} faster)"
            if coverage
            else ""
        )
        low, high = figures.get("absolute_ci95", (float("nan"), float("nan")))
        print(f"  {group:34s} {100 * figures['absolute']:6.1f} % [{100 * low:.1f}–{100 * high:.1f}] / {100 * figures['load_normalised']:6.1f} %"
              f"   n={figures['runs']}{inside}")


def recorded_calibration(calibration: Path, out: Path) -> str:
    """The calibration's path as the results record it: relative to `out` where it lies inside (a
    round's own `round-N/cpu-tiny.json`), so that no machine's directories land in committed results."""
    try:
        return str(Path(calibration).resolve().relative_to(Path(out).resolve()))
    except ValueError:
        return str(calibration)


def round_seeds(first_seed: int, round_index: int) -> tuple[int, int]:
    """The two seeds of a round's held-out runs: no calibration run and no other round uses them."""
    return first_seed + 2 * round_index, first_seed + 2 * round_index + 1


def validate_runs(held_out: Path, calibration: Path, validation: Path):
    """`churnsim validate` of the run records in `held_out` into `validation`; its table."""
    import pandas as pd

    _churnsim("validate", "--calibration", str(calibration), str(held_out), "--out", str(validation), "--overwrite")
    return pd.read_csv(validation / "validation.csv")


def validate_round(out: Path, round_index: int, calibration: Path):
    """`churnsim validate` of one round's held-out runs; its table, also committed."""
    directory = out / f"round-{round_index}"
    table = validate_runs(directory / "held-out", calibration, directory / "validation")
    table.to_csv(round_table_file(round_index), index=False)
    return table


def round_figures(table, label: str) -> dict:
    """A round's headline figures from its validation table (`summary`, `machine_speed`), printed."""
    summary, speeds = summarize(table), machine_speeds(table)
    _print_summary(label, summary)
    _print_machine_speeds(speeds)
    return {"summary": summary, "machine_speed": speeds}


def round_table_file(round_index: int, results_file: Path = RESULTS_FILE) -> Path:
    return results_file.with_name(f"calibrate-and-validate-round-{round_index}.csv")


def _print_machine_speeds(speeds: dict) -> None:
    for group, speed in speeds.items():
        print(f"  machine speed, {group}: steady step {speed['lowest_factor']:.2f}–{speed['highest_factor']:.2f}× predicted "
              f"(median {speed['median_factor']:.2f}×, single runs {100 * speed['scatter']:.1f} % from it)")


REFITTED_CALIBRATION_NAME = "cpu-tiny-refitted.json"
"""With `--refit`, where a round's calibration fitted again by the current `calibrate --runs` goes."""


def refitted_calibration(round_directory: Path) -> Path:
    """The round's calibration fitted again from its own calibration runs by the current code."""
    runs = round_directory / "calibration-runs"
    if not runs.is_dir():
        raise SystemExit(f"--refit: {runs} is missing; only runs made with --recalibrate-each-round keep each round's calibration runs")
    calibration_file = round_directory / REFITTED_CALIBRATION_NAME
    _churnsim("calibrate", "--runs", str(runs), "--out", str(calibration_file))
    return calibration_file


def revalidated_rounds(out: Path, earlier_result: dict, *, refit: bool = False) -> tuple[list[dict], list]:
    """The rounds of an earlier run in `out`, validated again by the current validator (same runs, and
    the same calibrations or, with `refit`, each fitted again from the round's calibration runs by the
    current code), and their tables; what the earlier run recorded of each round (seeds, times) is kept."""
    earlier = {entry["round"]: entry for entry in earlier_result.get("rounds", [])}
    rounds, tables = [], []
    round_index = 0
    while (out / f"round-{round_index}" / "held-out").is_dir():
        own = out / f"round-{round_index}" / "cpu-tiny.json"
        calibration = refitted_calibration(out / f"round-{round_index}") if refit else own if own.exists() else out / "cpu-tiny.json"
        tables.append(validate_round(out, round_index, calibration))
        figures = round_figures(tables[-1], f"round {round_index} (revalidated)")
        rounds.append({**earlier.get(round_index, {"round": round_index}), "calibration": recorded_calibration(calibration, out), **figures,
                       "revalidated": True, **({"refitted": True} if refit else {})})
        round_index += 1
    return rounds, tables


def committed_tables(results_file: Path, result: dict) -> list:
    """The validation tables of the rounds a results file records, from beside it."""
    import pandas as pd

    return [pd.read_csv(round_table_file(entry["round"], results_file)) for entry in result.get("rounds", [])]


def resummarized_rounds(earlier_result: dict) -> tuple[list[dict], list]:
    """The committed rounds' summaries and machine speeds computed again from their committed
    validation tables (no runs, no validator), and the tables: for a new figure of the same measurement."""
    tables = committed_tables(RESULTS_FILE, earlier_result)
    rounds = [
        {**entry, **round_figures(table, f"round {entry['round']} (from its committed table)")}
        for entry, table in zip(earlier_result.get("rounds", []), tables)
    ]
    return rounds, tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("churnsim-benchmark-calibration"))
    parser.add_argument("--calibration", type=Path, default=None, help="reuse this calibration instead of running calibrate --quick")
    parser.add_argument("--max-rounds", type=int, default=4)
    parser.add_argument("--recalibrate-each-round", action="store_true", help="run calibrate --quick at the start of every round")
    parser.add_argument("--revalidate", action="store_true",
                        help="validate the rounds already in --out again with the current validator (no new runs)")
    parser.add_argument("--refit", action="store_true",
                        help="with --revalidate: first fit each round's calibration again from its calibration runs (current calibrate --runs)")
    parser.add_argument("--resummarize", action="store_true",
                        help="recompute the committed rounds' figures from their committed tables (no runs, no validation)")
    parser.add_argument("--calibrated-only", action="store_true",
                        help="held-out runs of the calibrated setup only (a short check: about 10 runs a round)")
    parser.add_argument("--first-seed", type=int, default=100, help="seeds of the held-out runs start here (never the calibration's 0, 1)")
    parser.add_argument("--pool", type=Path, action="append", default=[], metavar="DIR",
                        help="with --resummarize: pool the rounds of the earlier run whose results DIR holds "
                        f"({RESULTS_FILE.name} and its round tables) with the committed ones, into {POOLED_FILE.name}; repeatable")
    parser.add_argument("--pooled-out", type=Path, default=None, metavar="FILE",
                        help=f"with --pool: write the pooled figures here instead of {POOLED_FILE.name} (a pool of some runs only)")
    add_report_option(parser)
    arguments = parser.parse_args()
    if arguments.pool and not arguments.resummarize:
        parser.error("--pool goes with --resummarize: a fresh run's figures are its own rounds'")
    if arguments.pooled_out is not None and not arguments.pool:
        parser.error("--pooled-out goes with --pool: without it there is nothing pooled to write")
    if arguments.refit and not arguments.revalidate:
        parser.error("--refit goes with --revalidate: a fresh run calibrates with the current code anyway")
    out: Path = arguments.out
    if not arguments.resummarize:
        out.mkdir(parents=True, exist_ok=True)
    started_all = time.perf_counter()

    if arguments.recalibrate_each_round and arguments.calibration is not None:
        parser.error("--recalibrate-each-round and --calibration exclude each other")

    def calibrate(directory: Path) -> tuple[Path, float]:
        calibration_file = directory / "cpu-tiny.json"
        started = time.perf_counter()
        _churnsim("calibrate", "--quick", "--out", str(calibration_file), "--runs-out", str(directory / "calibration-runs"))
        seconds = time.perf_counter() - started
        print(f"calibrate --quick took {seconds:.0f} s", flush=True)
        return calibration_file, seconds

    calibration = arguments.calibration
    calibrate_s = None
    earlier = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else {}
    again = arguments.revalidate or arguments.resummarize
    if arguments.revalidate and arguments.resummarize:
        parser.error("--revalidate and --resummarize exclude each other")
    earlier_pooled = None
    if not again and earlier.get("rounds"):
        # Before this run overwrites them: what the committed run stated, to check this one against.
        try:
            earlier_pooled = earlier.get("pooled") or pooled_figures(committed_tables(RESULTS_FILE, earlier))
        except FileNotFoundError:
            earlier_pooled = None
    if again:
        rounds, tables = revalidated_rounds(out, earlier, refit=arguments.refit) if arguments.revalidate else resummarized_rounds(earlier)
        if not rounds:
            parser.error(f"--revalidate: {out} holds no round-N/held-out directory of an earlier run" if arguments.revalidate
                         else f"--resummarize: {RESULTS_FILE} records no rounds")
        calibrate_s = earlier.get("calibrate_s")
    elif calibration is None and not arguments.recalibrate_each_round:
        calibration, calibrate_s = calibrate(out)

    from churnsim.real.calibration_suite import run_suite
    from churnsim.real.cpu_placement import pinning_requested

    if not again:
        rounds, tables = [], []
    for round_index in range(0 if again else arguments.max_rounds):
        seeds = round_seeds(arguments.first_seed, round_index)
        round_calibrate_s = None
        if arguments.recalibrate_each_round:
            calibration, round_calibrate_s = calibrate(out / f"round-{round_index}")
        plan = round_plan(round_index, seeds, other_setups=not arguments.calibrated_only)
        held_out = out / f"round-{round_index}" / "held-out"
        print(f"round {round_index}: {len(plan)} held-out runs, seeds {seeds} ...", flush=True)
        started = time.perf_counter()
        run_suite(plan, held_out, on_run_done=lambda run, seconds: print(f"  {run.run_id}: {seconds:.1f} s", flush=True))
        table = validate_round(out, round_index, calibration)
        tables.append(table)
        runs_s = time.perf_counter() - started
        figures = round_figures(table, f"round {round_index}")
        rounds.append({"round": round_index, "seeds": list(seeds), "calibration": recorded_calibration(calibration, out), "calibrate_s": round_calibrate_s,
                       "runs_s": runs_s, **figures, "load_average_1_5_15_min": list(os.getloadavg())})
        reproduced = round_reproduces(tables[:-1], tables[-1])
        if reproduced:
            break
    if not again:
        # A round table beyond this run's rounds belongs to an earlier, longer run.
        stale = len(rounds)
        while round_table_file(stale).exists():
            round_table_file(stale).unlink()
            stale += 1

    # A pool of several runs names where the committed one lies; a run's own results list its rounds below.
    pooled_over = [f"{RESULTS_FILE.parent.parent.name}/{RESULTS_FILE.parent.name} (the committed run)" if arguments.pool else "the rounds below"]
    pooled_tables = list(tables)
    for directory in arguments.pool:
        results_file = directory / RESULTS_FILE.name
        if not results_file.exists():
            parser.error(f"--pool {directory}: holds no {RESULTS_FILE.name}; give a directory of an earlier run's committed results")
        pooled_tables += committed_tables(results_file, json.loads(results_file.read_text()))
        pooled_over.append(str(directory))
    pooled = pooled_figures(pooled_tables)
    _print_pooled("pooled over " + ", ".join(pooled_over), pooled)
    compared = methods_compared(pooled_tables)
    _print_methods_compared(compared)
    carry = carry_by_setup(pooled_tables)
    _print_carry(carry)
    if arguments.pool:
        # Several runs pooled are a figure of their own: the committed run's results stay as they are.
        pooled_out = arguments.pooled_out or POOLED_FILE
        pooled_out.write_text(json.dumps({
            "pooled_over": pooled_over,
            "rounds": len(pooled_tables),
            "targets": TARGETS,
            "target_verdicts": {group: target_verdict(pooled[group], limit) for group, limit in TARGETS.items() if group in pooled},
            "pooled": pooled,
            "calibrated_setup_methods_compared": compared,
            "carry_by_setup": carry,
        }, indent=2) + "\n")
        print(f"\nwrote {pooled_out}")
        if pooled_out == POOLED_FILE:  # a pool of some runs only, elsewhere, is not the benchmark's figure
            report_if_asked(arguments, "calibrate-and-validate-pooled", pooled_out)
        return

    recalibrated = all(Path(entry["calibration"]).parent.name.startswith("round-") for entry in rounds)
    calibrated_only = all(entry["summary"].get("other setups", {}).get("runs", 0) == 0 for entry in rounds)
    if again:
        reproduced = round_reproduces(tables[:-1], tables[-1])
    result = {
        "benchmark": "calibrate --quick, then held-out real runs of the calibrated and other setups, validated",
        "command": "python benchmarks/calibrate_and_validate.py" + (" --recalibrate-each-round" if recalibrated else "")
        + (" --calibrated-only" if calibrated_only else ""),
        "stage_processes_pinned": earlier.get("stage_processes_pinned", False) if again else pinning_requested(),
        "recalibrated_each_round": recalibrated,
        "revalidated_by_the_current_validator": arguments.revalidate or (arguments.resummarize and earlier.get("revalidated_by_the_current_validator", False)),
        "refitted_by_the_current_calibrate": (arguments.revalidate and arguments.refit)
        or (arguments.resummarize and earlier.get("refitted_by_the_current_calibrate", False)),
        "machine": {"python": platform.python_version(), "cpu_count": os.cpu_count(), "processor": platform.machine()},
        "calibration": None if recalibrated else str(rounds[-1]["calibration"]),
        "calibrate_s": calibrate_s,
        "targets": TARGETS,
        "target_verdicts": {group: target_verdict(pooled[group], limit) for group, limit in TARGETS.items() if group in pooled},
        "pooled_over": pooled_over,
        "pooled": pooled,
        "calibrated_setup_methods_compared": compared,
        "carry_by_setup": carry,
        "last_round_within_the_spread_of_the_earlier": reproduced,
        "rounds": rounds,
        "total_s": earlier.get("total_s") if again else time.perf_counter() - started_all,
    }
    if earlier_pooled is not None:
        result["earlier_run"] = {
            "pooled_over": earlier.get("pooled_over", ["its rounds"]),
            "pooled": {group: earlier_pooled[group] for group in TARGETS if group in earlier_pooled},
            "reproduced_by_this_run": runs_agree(earlier_pooled, pooled),
        }
    elif again and "earlier_run" in earlier:
        result["earlier_run"] = earlier["earlier_run"]
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nthe last round within the spread of the earlier rounds: {reproduced}; wrote {RESULTS_FILE}")
    report_if_asked(arguments, "calibrate-and-validate", RESULTS_FILE)
    if "earlier_run" in result:
        print(f"this run reproduces the committed run before it (each pooled figure inside the other's interval): "
              f"{result['earlier_run']['reproduced_by_this_run']}")
    for group, verdict in result["target_verdicts"].items():
        figures = pooled[group]
        low, high = figures["absolute_ci95"]
        print(f"  {group}: {100 * figures['absolute']:.1f} % [{100 * low:.1f}–{100 * high:.1f}] absolute, "
              f"{100 * figures['load_normalised']:.1f} % load-normalised (target ≤ {100 * TARGETS[group]:.0f} %: {verdict})")


if __name__ == "__main__":
    main()
