"""The command line: what it writes, and one clear line with exit code 2 for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from churnsim.calibration.presets import preset
from churnsim.calibration.run_record import read_run_record
from churnsim.calibration.tables import RUN_COLUMNS, SUMMARY_COLUMNS
from churnsim.cli import main


def run_cli(arguments: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True, timeout=600)


def test_whatif_quick_writes_tables_figures_and_manifest(tmp_path):
    out = tmp_path / "whatif"
    main(["whatif", "--quick", "--preset", "checkfree-124m-geo-10pct", "--workers", "1", "--out", str(out)])
    for name in ("runs.csv", "summary.csv", "trajectories.csv", "checkpoint_intervals.csv", "iteration_spans.csv", "manifest.json"):
        assert (out / name).is_file(), name
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns) == list(SUMMARY_COLUMNS)
    assert sorted(summary["failure_probability_per_stage_hour"].unique()) == [0.0, 0.10, 0.33]
    assert set(summary["method"]) == {method.name for method in preset("checkfree-124m-geo-10pct").methods}
    assert (summary["num_replications"] == 3).all()
    for figure in ("time_to_target", "speedup", "badput_breakdown", "loss_vs_wallclock", "pipeline_gantt", "checkpoint_interval", "optimal_interval"):
        assert (out / "figures" / f"{figure}.png").is_file(), figure
    manifest = json.loads((out / "manifest.json").read_text())
    # Uncalibrated setbacks are flagged (the paper presets take cpu-tiny's setbacks when it is shipped).
    assert manifest["replications"] == 3
    assert any("uncalibrated" in note for note in manifest["notes"]) == (not preset("checkfree-124m-geo-10pct").convergence.calibrated)


def test_whatif_takes_set_overrides_and_methods_that_fit_the_setup(tmp_path):
    out = tmp_path / "whatif"
    main(["whatif", "--quick", "--preset", "checkfree-124m-geo-10pct", "--set", "recovery.join_delay_s=600", "--method", "checkpoint",
          "--method", "checkfree", "--rates", "0.33", "--workers", "1", "--no-figures", "--out", str(out)])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["scenario"]["recovery"]["join_delay_s"] == 600
    assert set(pd.read_csv(out / "summary.csv")["method"]) == {"checkpoint", "checkfree"}
    # The calibrated preset at 3 stages: CheckFree+ (4 stages or more) left out by --method, not refused.
    main(["whatif", "--quick", "--preset", "cpu-tiny", "--set", "pipeline.num_stages=3", "--set", "model.num_layers=6",
          "--method", "checkfree", "--method", "redundant", "--rates", "0.1", "--workers", "1", "--no-figures", "--out", str(tmp_path / "three")])
    manifest = json.loads((tmp_path / "three" / "manifest.json").read_text())
    assert manifest["scenario"]["pipeline"]["num_stages"] == 3


def test_a_setup_some_methods_cannot_take_leaves_them_out_and_says_so(tmp_path, assert_one_line_error):
    """No --method at 3 stages: every method but CheckFree+ (4 stages or more) is compared, and the
    caveats say why it is missing; rates far below a 10-second run's scale say how to reach it."""
    three = ["--preset", "cpu-tiny", "--set", "pipeline.num_stages=3", "--set", "model.num_layers=6"]
    main(["whatif", "--quick", *three, "--rates", "0,0.33", "--workers", "1", "--no-figures", "--out", str(tmp_path / "whatif")])
    manifest = json.loads((tmp_path / "whatif" / "manifest.json").read_text())
    assert "checkfree_plus" not in manifest["methods"] and {"checkpoint", "checkfree", "redundant"} <= set(manifest["methods"])
    assert "checkfree_plus is not compared: it needs at least 4 pipeline stages, got 3" in manifest["notes"]
    (few,) = [note for note in manifest["notes"] if note.startswith("even at 33 %/h per stage a run saw")]
    assert few.endswith("to ask at the scale of this run, leave out --rates: whatif then asks under the scenario's own churn")
    # ... and that the rates stood in for that churn.
    (replaced,) = [note for note in manifest["notes"] if note.startswith("the rates replace the scenario's own churn (poisson)")]
    assert replaced.endswith("without --rates, `churnsim whatif` asks under its own churn at 0.5, 1, 2, 4 times its rate")
    main(["sweep", *three, "--set", "churn.failures_per_node_hour=0,240", "--replications", "1", "--workers", "1", "--out", str(tmp_path / "sweep")])
    summary = pd.read_csv(tmp_path / "sweep" / "summary.csv")
    assert "checkfree_plus" not in set(summary["method"]) and len(set(summary["method"])) == 8
    # Named, it is refused as before.
    result = subprocess.run([sys.executable, "-m", "churnsim", "simulate", *three, "--method", "checkfree_plus", "--out", str(tmp_path / "refused")],
                            capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, "method 'checkfree_plus' needs at least 4 pipeline stages, got 3")


def test_simulate_writes_one_record_per_run_and_a_perfetto_timeline(tmp_path):
    out = tmp_path / "sim"
    main(["simulate", "--preset", "checkfree-124m-geo-16pct", "--method", "checkpoint", "--method", "checkfree", "--replications", "2", "--out", str(out)])
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs.columns) == list(RUN_COLUMNS) and len(runs) == 4
    # Common random numbers: in each replication the shorter run's failures are the first ones the
    # longer run saw (same times, same stages).
    for replication in (0, 1):
        schedules = [
            read_run_record(out / "records" / f"{method}-r{replication}").failures.failures for method in ("checkpoint", "checkfree")
        ]
        shorter, longer = sorted(schedules, key=len)
        assert shorter and [(f.time_s, f.stage) for f in longer[: len(shorter)]] == [(f.time_s, f.stage) for f in shorter]
    assert sorted(p.name for p in (out / "records").iterdir()) == ["checkfree-r0", "checkfree-r1", "checkpoint-r0", "checkpoint-r1"]
    trace = json.loads((out / "timelines" / "checkfree-r0.json").read_text())
    assert {event["ph"] for event in trace["traceEvents"]} >= {"X", "M"}


@pytest.mark.parametrize(
    "arguments, fragments",
    [
        (["whatif", "--preset", "no-such-preset"], ("unknown preset 'no-such-preset'",)),
        (["simulate", "--preset", "checkfree-124m-geo-10pct", "--method", "magic", "--out", "x"], ("unknown method 'magic'",)),
        (["simulate", "--out", "x"], ("give a scenario file or --preset",)),
        (["sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "pipeline.num_stages=", "--out", "x"], ("grid is empty",)),
        (["sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "pipeline.stages=2", "--out", "x"], ("no field 'stages'",)),
        (["whatif", "--rates", "0.1,abc"], ("--rates",)),
        (["whatif", "--rates", "0.1,,0.2"], ("--rates", "value 2 is empty")),
        (["whatif", "--rates", "", "--out", "x"], ("--rates", "give at least one value")),
        (["sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "seed=1,2", "--scheduler", "", "--out", "x"], ("--scheduler",)),
        # Used to run the whole what-if first and then stop, its results written.
        (["whatif", "--preset", "spot-p3-trace", "--quick", "--method", "checkpoint", "--setback-sensitivity", "--out", "x"],
         ("setback sensitivity needs a method with convergence setbacks",)),
        (["whatif", "--rates", "0.1,0.10", "--out", "x"], ("--rates", "0.1 is given twice")),
        (["sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "pipeline.num_microbatches=4,8,", "--out", "x"], ("value 3 is empty",)),
        (["sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "pipeline.num_microbatches=4,8,4", "--out", "x"], ("the value 4 is given twice",)),
        (["whatif", "--bogus-flag"], ("No such option: --bogus-flag",)),
        (["plot", "does-not-exist"], ("not a results directory",)),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(arguments, fragments, tmp_path, assert_one_line_error):
    result = subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_broken_scenario_file_names_the_field(tmp_path, assert_one_line_error):
    data = json.loads(preset("checkfree-124m-geo-10pct").model_dump_json())
    data["churn"]["failure_probability_per_stage_hour"] = 1.5
    (tmp_path / "scenario.json").write_text(json.dumps(data))
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "simulate", "scenario.json", "--out", "out"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert_one_line_error(result, "scenario.json", "churn.stage_hourly.failure_probability_per_stage_hour")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("section", "field", "value", "fragments"),
    [
        # Found by the input fuzzer: an infinite latency passed validation and failed after the
        # progress line; a hop of 10^308 s overflowed the iteration's clock and simulate hung.
        ("network", "latency_s", "Infinity", ("scenario.json", "network.uniform.latency_s")),
        ("compute", "block_forward_s", [0.003, 0.003, 0.003, 1e308], ("scenario.json", "block_forward_s", "31.7 years")),
        # Found by scanning extreme values: a link of 1e-300 B/s made an iteration of inf s (the time
        # accounting failed on NaN); 1e300 bytes a parameter made a checkpoint of inf bytes, which
        # hung a processor-sharing link.
        ("network", "bandwidth_bytes_per_s", 1e-300, ("scenario.json", "slowest link (1e-300 B/s)", "31.7 years")),
        ("model", "checkpoint_bytes_per_parameter", 1e305, ("scenario.json", "model.checkpoint_bytes_per_parameter 1e+305", "overflow")),
    ],
)
def test_a_time_the_simulator_cannot_run_is_refused_before_any_progress_line(section, field, value, fragments, tmp_path, assert_one_line_error):
    data = json.loads(preset("cpu-tiny").model_dump_json())
    data[section][field] = value
    (tmp_path / "scenario.json").write_text(json.dumps(data))
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "simulate", "scenario.json", "--out", "out"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert_one_line_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def test_unreachable_dask_scheduler_is_one_clear_line(tmp_path, assert_one_line_error):
    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "replications=1",
         "--scheduler", "tcp://127.0.0.1:1", "--out", "x"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert_one_line_error(result, "cannot reach a Dask scheduler")


def test_a_shown_preset_is_a_scenario_file_simulate_accepts(tmp_path):
    shown = subprocess.run([sys.executable, "-m", "churnsim", "presets", "--show", "checkfree-124m-geo-16pct"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0
    (tmp_path / "scenario.json").write_text(shown.stdout)
    main(["simulate", str(tmp_path / "scenario.json"), "--method", "checkfree", "--replications", "1", "--out", str(tmp_path / "out")])
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert list(runs["method"]) == ["checkfree"] and runs["scenario"].iloc[0] == "checkfree-124m-geo-16pct"


def test_simulate_and_sweep_take_another_setup_of_the_calibrated_preset(tmp_path):
    """`--set` on cpu-tiny goes in before its calibration: six or eight stages get the calibration's
    compute model (one time per stage), not a refusal of its four per-stage times."""
    from churnsim.calibration.apply import calibrated_compute
    from churnsim.calibration.builtin import load_builtin_calibration

    calibration, _ = load_builtin_calibration("cpu-tiny")
    main(["simulate", "--preset", "cpu-tiny", "--set", "pipeline.num_stages=6", "--set", "model.num_layers=6", "--method", "none",
          "--replications", "1", "--out", str(tmp_path / "simulated")])
    runs = pd.read_csv(tmp_path / "simulated" / "runs.csv")
    six = preset("cpu-tiny", {"pipeline.num_stages": 6, "model.num_layers": 6})
    assert len(six.compute.block_forward_s) == 6 and six.compute == calibrated_compute(six, calibration)
    from churnsim.sim.studies.replicate import replication_scenario
    from churnsim.sim.model.run import simulate_run

    # Replication 0 runs at its drawn machine speed (calibration/speed_uncertainty.py).
    drawn = replication_scenario(six, 0)
    expected_step_s = simulate_run(drawn, drawn.methods[0], ()).healthy_iteration_time_s
    assert runs["healthy_iteration_time_s"].to_numpy() == pytest.approx(expected_step_s, rel=1e-12)
    main(["sweep", "--preset", "cpu-tiny", "--set", "pipeline.num_stages=4,8", "--set", "model.num_layers=8", "--method", "none",
          "--replications", "1", "--workers", "1", "--out", str(tmp_path / "swept")])
    swept = pd.read_csv(tmp_path / "swept" / "runs.csv")
    assert sorted(swept["pipeline.num_stages"]) == [4, 8]


@pytest.mark.parametrize(
    "arguments",
    [
        ["simulate", "--preset", "cpu-tiny", "--replications", "2"],
        ["whatif", "--preset", "cpu-tiny", "--quick"],
        ["sweep", "--preset", "cpu-tiny", "--set", "seed=1,2", "--replications", "2", "--workers", "1"],
    ],
)
def test_parquet_without_an_engine_is_refused_before_anything_runs(arguments, tmp_path, capsys, monkeypatch):
    # simulate used to run, write runs.csv and then stop at the first Parquet file.
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name in ("pyarrow", "fastparquet") else find_spec(name, *rest))
    with pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--parquet", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["churnsim: error: Parquet output needs pyarrow: pip install 'churnsim[parquet]', or drop --parquet"]
    assert not (tmp_path / "out").exists()
