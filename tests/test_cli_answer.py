"""What the commands end with: one answer line per failure rate, its caveats, and the same as strict JSON."""

from __future__ import annotations

import json
from pathlib import Path
import math
import subprocess
import sys

import pandas as pd

from churnsim.calibration.base import strict_json_loads
from churnsim.calibration.presets import preset
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.tables import SUMMARY_COLUMNS
from churnsim.report import answer_line
from churnsim.sim.model.route_notes import swapped_route_notes
from churnsim.sim.studies.verdict import verdict_from_summary



def quick_whatif(preset_name: str = "checkfree-124m-geo-10pct") -> list[str]:
    return [
        "whatif", "--quick", "--preset", preset_name, "--workers", "1", "--no-figures",
        "--method", "checkpoint", "--method", "redundant", "--method", "checkfree", "--method", "none",
    ]


def run_cli(arguments: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_the_answer_line_names_winner_speedups_and_ties():
    rows = []
    for method, mean_h, speedups in (("checkpoint", 62.6, (1.0, 0.97)), ("redundant", 61.0, (1.03, 1.0)), ("checkfree", 60.8, (1.05, 1.03))):
        row = {column: math.nan for column in SUMMARY_COLUMNS}
        row.update(
            scenario="geo", failure_probability_per_stage_hour=0.1, method=method, fraction_reached=1.0,
            time_to_target_mean_s=3600 * mean_h, time_to_target_ci95_low_s=3600 * (mean_h - 0.5), time_to_target_ci95_high_s=3600 * (mean_h + 0.5),
            speedup_vs_checkpoint_mean=speedups[0], speedup_vs_checkpoint_ci95_low=speedups[0] - 0.01, speedup_vs_checkpoint_ci95_high=speedups[0] + 0.01,
            speedup_vs_redundant_mean=speedups[1], speedup_vs_redundant_ci95_low=speedups[1] - 0.01, speedup_vs_redundant_ci95_high=speedups[1] + 0.01,
        )
        rows.append(row)
    (point,) = verdict_from_summary(pd.DataFrame(rows)).points
    line = answer_line(point)
    assert line.startswith("geo, at 10 %/h per stage: CheckFree reaches the target first, in 60.8 h [60.3, 61.3]")
    assert "speed-up 1.05× [1.04, 1.06] over checkpoint (sync)" in line
    assert "speed-up 1.03× [1.02, 1.04] over redundant (Bamboo)" in line
    assert line.endswith("cannot be told apart from redundant (Bamboo) (95 % intervals overlap).")


def test_whatif_json_is_strict_json_alone_on_stdout(tmp_path):
    result = run_cli([*quick_whatif(), "--out", "out", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    answer = strict_json_loads(result.stdout)  # the whole of stdout, nothing else
    assert answer["command"] == "whatif"
    assert [point["failure_probability_per_stage_hour"] for point in answer["points"]] == [0.0, 0.1, 0.33]
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    for point in answer["points"]:
        rows = summary[(summary["failure_probability_per_stage_hour"] == point["failure_probability_per_stage_hour"]) & (summary["method"] != "none")]
        assert point["winner"] == rows.loc[rows["time_to_target_mean_s"].idxmin(), "method"]
        assert point["answer"].startswith("checkfree-124m-geo, at ")
        assert set(point["winner_speedup"]) == {"checkpoint", "redundant"}
    assert any(caveat.startswith("convergence setbacks") for caveat in answer["caveats"])


def test_whatif_ends_with_one_answer_line_per_rate_and_the_caveats(tmp_path):
    result = run_cli([*quick_whatif(), "--out", "out"], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    answers = [line for line in lines[lines.index("Answer") + 1 : lines.index("Caveats")] if not line.startswith("  with checkpoint intervals tuned")]
    assert len(answers) == 3 and all(line.startswith("checkfree-124m-geo, at ") and "reaches the target first" in line for line in answers)
    assert any(line.startswith("- convergence setbacks") for line in lines[lines.index("Caveats") :])


def test_the_whatif_manifest_is_strict_json_and_its_scenario_reads_back(tmp_path):
    result = run_cli([*quick_whatif("checkfree-500m-geo-10pct"), "--out", "out"], tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = strict_json_loads((tmp_path / "out" / "manifest.json").read_text())
    scenario = Scenario.model_validate(manifest["scenario"])
    assert scenario == preset("checkfree-500m-geo-10pct")  # infinite bandwidths included
    assert manifest["verdict"]["points"][0]["winner"] in {"checkpoint", "redundant", "checkfree"}


def test_checkfree_plus_on_the_geo_testbed_names_its_extra_links():
    (note,) = swapped_route_notes(preset("checkfree-500m-geo-10pct"))
    assert note.startswith("checkfree_plus: odd microbatches take the swapped route")
    assert "stage 0 (Australia)" in note
    assert swapped_route_notes(preset("spot-p3-trace")) == ()  # uniform links: no such caveat


def test_simulate_writes_a_manifest_and_its_json_answer(tmp_path):
    result = run_cli(
        ["simulate", "--preset", "checkfree-124m-geo-33pct", "--method", "checkpoint", "--method", "checkfree",
         "--replications", "2", "--out", "out", "--json"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    answer = strict_json_loads(result.stdout)
    manifest = strict_json_loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["command"] == "simulate" and manifest["scenario"]["name"] == "checkfree-124m-geo-33pct"
    assert manifest["methods"] == ["checkpoint", "checkfree"] and manifest["git_revision"]
    assert answer["points"][0]["winner"] == manifest["verdict"]["points"][0]["winner"]
    json.dumps(manifest, allow_nan=False)


def test_an_answer_with_tuned_intervals_follows_the_answer_and_is_in_the_json(tmp_path):
    # One stage checkpointing every 1000 iterations with M = 2000 s between failures: Daly's
    # interval (~190) is clearly faster, so the answer is given a second time with it.
    sys.path.insert(0, str(Path(__file__).parent / "sim"))
    from test_analytic import one_stage_scenario

    scenario = one_stage_scenario(mean_time_between_failures_s=2000.0, target_iterations=20_000)
    scenario = scenario.model_copy(update={
        "target": scenario.target.model_copy(update={"max_wall_clock_s": 100_000.0}), "replications": 5,
        "methods": (scenario.methods[0].model_copy(update={"interval_iterations": 1000}),),
    })
    (tmp_path / "scenario.json").write_text(scenario.model_dump_json())
    text = run_cli(["simulate", "scenario.json", "--out", "text"], tmp_path)
    assert text.returncode == 0, text.stderr
    answer = text.stdout.split("Answer\n", 1)[1].splitlines()
    assert answer[1].startswith("  with checkpoint intervals tuned here (see the caveats): checkpoint")
    assert any("interval_iterations 1000 → " in line and "(Daly's optimum)" in line for line in answer)
    as_json = run_cli(["simulate", "scenario.json", "--out", "json", "--json"], tmp_path)
    (point,) = strict_json_loads(as_json.stdout)["points"]
    assert point["answer_with_tuned_intervals"].startswith("checkpoint") and point["with_tuned_intervals"]["winner"] == "checkpoint"
    (rerun,) = point["interval_reruns"]
    assert rerun["configured_interval_iterations"] == 1000 and rerun["tuned_by"] == "Daly's optimum"


def test_whatif_says_when_rates_given_replace_the_scenarios_own_churn():
    from churnsim.sim.studies.whatif import churn_replaced_note

    trace = churn_replaced_note(preset("spot-p3-trace"))
    assert trace is not None and trace.startswith("the rates replace the scenario's own churn (trace)")
    assert trace.endswith("without --rates, `churnsim whatif` asks under its own churn at 0.5, 1, 2, 4 times its rate")
    assert churn_replaced_note(preset("checkfree-500m-geo-10pct")) is None  # the rates are its own unit
    assert churn_replaced_note(preset("datastates-7b")) is None  # no churn to replace


def test_a_point_at_a_churns_own_rate_names_the_rate_in_words():
    from churnsim.report import point_title

    def title(grid: dict, **columns) -> str:
        row = {column: math.nan for column in SUMMARY_COLUMNS}
        row.update(scenario="tiny[x]", method="checkpoint", fraction_reached=1.0, time_to_target_mean_s=7.0, **grid, **columns)
        (point,) = verdict_from_summary(pd.DataFrame([row]), grid_columns=list(grid)).points
        return point_title(point)

    assert title({"churn.failures_per_node_hour": 240.0}) == "tiny, at 240 failures per node-hour"
    assert title({"churn.mean_lifetime_s": 5400.0}) == "tiny, at a mean lifetime of 1.5 h"
    assert title({"pipeline.num_microbatches": 8, "churn.time_scale": 0.5}) == "tiny, pipeline.num_microbatches = 8, at trace time scale 0.5"
    # A grid over the stage-hourly rate names it once, not again as the point's rate.
    assert title({"churn.failure_probability_per_stage_hour": 0.1}, failure_probability_per_stage_hour=0.1) == "tiny, at 10 %/h per stage"


def test_simulate_names_the_scenarios_own_churn_rate_in_its_answer():
    from churnsim import api
    from churnsim.report import point_title

    poisson = api.simulate("cpu-tiny", methods=["none", "checkpoint"], replications=2)
    (point,) = poisson.verdict.points
    assert point.grid == {"churn.failures_per_node_hour": 240.0}
    assert point_title(point) == "cpu-tiny, at 240 failures per node-hour"
    hourly = api.simulate("checkfree-124m-geo-10pct", methods=["none", "checkpoint"], replications=2)
    (point,) = hourly.verdict.points
    assert point.grid == {} and point_title(point) == "checkfree-124m-geo-10pct, at 10 %/h per stage"
