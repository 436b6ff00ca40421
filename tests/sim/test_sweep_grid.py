"""A sweep keeps its grid: one column per swept field, titles that name the point, a figure per point."""

from __future__ import annotations

import pandas as pd

from churnsim import api
from churnsim.calibration.tables import RUN_COLUMNS, SUMMARY_COLUMNS
from churnsim.cli import main
from churnsim.report import point_title

SWEEP = [
    "sweep", "--preset", "checkfree-124m-geo-33pct", "--set", "pipeline.num_microbatches=4,8",
    "--set", "churn.failure_probability_per_stage_hour=0.1,0.33", "--method", "checkpoint", "--method", "checkfree",
    "--replications", "2", "--workers", "1",
]
SWEPT = ["pipeline.num_microbatches", "churn.failure_probability_per_stage_hour"]


def test_a_sweeps_tables_have_one_column_per_swept_field(tmp_path):
    main([*SWEEP, "--out", str(tmp_path / "out")])
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    runs = pd.read_csv(tmp_path / "out" / "runs.csv")
    assert list(summary.columns) == ["scenario", *SWEPT, *SUMMARY_COLUMNS[1:]]
    assert list(runs.columns) == ["scenario", *SWEPT, *RUN_COLUMNS[1:]]
    assert sorted(set(zip(summary["pipeline.num_microbatches"], summary["churn.failure_probability_per_stage_hour"]))) == [
        (4, 0.1), (4, 0.33), (8, 0.1), (8, 0.33)
    ]
    assert (summary["churn.failure_probability_per_stage_hour"] == summary["failure_probability_per_stage_hour"]).all()
    assert len(summary) == 8 and (summary["num_replications"] == 2).all()


def test_plot_on_a_sweep_draws_one_figure_per_grid_point_with_every_rate(tmp_path):
    out = tmp_path / "out"
    main([*SWEEP, "--out", str(out)])
    main(["plot", str(out)])
    # The swept rate is the x axis; the other swept field splits the figures.
    folders = sorted(path.name for path in (out / "figures").iterdir())
    assert folders == ["pipeline.num_microbatches-4", "pipeline.num_microbatches-8"]
    for folder in folders:
        assert (out / "figures" / folder / "time_to_target.png").is_file()
        assert (out / "figures" / folder / "speedup.png").is_file()


def test_the_api_sweep_names_each_grid_point_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = api.sweep("checkfree-124m-geo-33pct", {"pipeline.num_microbatches": [4, 8]}, methods=["checkpoint", "checkfree"], replications=2)
    assert not any(tmp_path.iterdir())
    assert list(result.summary["pipeline.num_microbatches"]) == [4, 4, 8, 8]
    titles = [point_title(point) for point in result.verdict.points]
    assert titles == [
        "checkfree-124m-geo-33pct, pipeline.num_microbatches = 4, at 33 %/h per stage",
        "checkfree-124m-geo-33pct, pipeline.num_microbatches = 8, at 33 %/h per stage",
    ]


def test_the_api_returns_dataframes_without_writing_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    simulated = api.simulate("checkfree-124m-geo-33pct", methods=["checkpoint", "checkfree"], replications=2)
    assert list(simulated.summary.columns) == list(SUMMARY_COLUMNS) and set(simulated.summary["method"]) == {"checkpoint", "checkfree"}
    assert simulated.verdict.points[0].winner in {"checkpoint", "checkfree"}
    whatif = api.whatif("checkfree-124m-geo-10pct", failure_rates=[0.0, 0.33], methods=["checkpoint", "checkfree"], replications=2, interval_study=False)
    assert sorted(whatif.summary["failure_probability_per_stage_hour"].unique()) == [0.0, 0.33]
    assert [point.failure_probability_per_stage_hour for point in whatif.verdict.points] == [0.0, 0.33]
    assert not any(tmp_path.iterdir())


def test_a_sweep_states_each_point_s_own_caveats_after_its_settings(tmp_path):
    """A curve carried to another model size at some points only: said for those points, after their
    settings; the setback source, which every point shares, once."""
    import json

    out = tmp_path / "out"
    main(["sweep", "--preset", "checkfree-500m-geo-10pct", "--set", "model.num_layers=24,48", "--method", "checkfree",
          "--replications", "1", "--workers", "1", "--out", str(out)])  # fmt: skip
    notes = json.loads((out / "manifest.json").read_text())["notes"]
    sized = [note for note in notes if "model of 468M parameters" in note]
    assert len(sized) == 1 and sized[0].startswith("model.num_layers = 48: the loss curve is given for a model of 468M")
    assert sum("convergence setbacks" in note for note in notes) == 1
    assert not any(note.startswith("model.num_layers = 24") for note in notes)


def test_a_sweep_of_a_poisson_churn_s_rate_puts_it_on_the_x_axis_in_seconds(tmp_path):
    """A tiny model's runs take seconds at hundreds of failures per node-hour: the figures put that
    rate on their x axis (one figure, not one per rate) and time in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from churnsim.calibration.tables import SUMMARY_COLUMNS
    from churnsim.figures.grid import grid_points
    from churnsim.figures.time_to_target import plot_time_to_target

    out = tmp_path / "out"
    main(["sweep", "--preset", "cpu-tiny", "--set", "churn.failures_per_node_hour=0,240,480", "--method", "checkpoint", "--method", "checkfree",
          "--replications", "2", "--workers", "1", "--out", str(out)])  # fmt: skip
    main(["plot", str(out)])
    figures = sorted(path.name for path in (out / "figures").iterdir())
    assert "time_to_target.png" in figures and not any((out / "figures" / name).is_dir() for name in figures)
    _, ax = plt.subplots()
    (point,) = grid_points(pd.read_csv(out / "summary.csv"), SUMMARY_COLUMNS)  # what `plot` draws: every rate in one figure
    drawn = plot_time_to_target(ax, point.rows)
    assert ax.get_xlabel() == "failures per node-hour" and ax.get_ylabel() == "time to target loss (seconds)"
    assert sorted(drawn["lines"][0].get_xdata()) == [0.0, 240.0, 480.0]
    plt.close("all")


def test_a_sweep_of_a_traces_own_time_scale_draws_one_figure_with_it_on_the_x_axis(tmp_path):
    """A sweep of a trace's own time scale (`whatif` asks at such values without --rates) puts every
    point on one x axis, as a swept hourly probability's does."""
    import matplotlib.pyplot as plt

    from churnsim.calibration.churn import rate_sweep
    from churnsim.calibration.presets import preset
    from churnsim.calibration.tables import SUMMARY_COLUMNS
    from churnsim.figures.grid import grid_points
    from churnsim.figures.time_to_target import plot_time_to_target

    setting = "churn.time_scale=" + ",".join(f"{value:g}" for value in rate_sweep(preset("spot-p3-trace").churn)[1])
    assert setting == "churn.time_scale=2,1,0.5"
    out = tmp_path / "out"
    main(["sweep", "--preset", "spot-p3-trace", "--set", setting, "--method", "checkpoint", "--method", "redundant",
          "--replications", "2", "--workers", "1", "--out", str(out)])  # fmt: skip
    _, ax = plt.subplots()
    (point,) = grid_points(pd.read_csv(out / "summary.csv"), SUMMARY_COLUMNS)
    drawn = plot_time_to_target(ax, point.rows)
    assert ax.get_xlabel() == "trace time scale (larger: fewer preemptions)"
    assert sorted(drawn["lines"][0].get_xdata()) == [0.5, 1.0, 2.0]
    plt.close("all")


def test_a_sweep_over_a_list_field_keeps_each_list_whole(tmp_path):
    # `--set` splits values at the commas outside brackets, and a table cell holds a list as its JSON text.
    out = tmp_path / "out"
    main([
        "sweep", "--preset", "checkfree-124m-geo-10pct", "--set", "pipeline.layers_per_stage=[3,3,3,3],[2,3,3,4]",
        "--method", "checkpoint", "--method", "redundant", "--replications", "2", "--workers", "1", "--out", str(out),
    ])
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["pipeline.layers_per_stage"]) == ["[3,3,3,3]", "[3,3,3,3]", "[2,3,3,4]", "[2,3,3,4]"]
    assert set(summary["method"]) == {"checkpoint", "redundant"}
    assert set(pd.read_csv(out / "runs.csv")["pipeline.layers_per_stage"]) == {"[3,3,3,3]", "[2,3,3,4]"}
