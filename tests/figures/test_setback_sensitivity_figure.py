"""The setback-sensitivity figure, from a small synthetic table with the columns of calibration/tables.py."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
from matplotlib.figure import Figure

from churnsim.calibration.errors import InputError
from churnsim.calibration.tables import CROSSOVER_COLUMNS, SENSITIVITY_COLUMNS
from churnsim.figures import make_figures, plot_setback_sensitivity

SCALES = (0.5, 1.0, 2.0, 3.0)
RATES = (0.1, 0.33)


def _table() -> pd.DataFrame:
    rows = []
    for rate in RATES:
        for scale in SCALES:
            times = {"redundant": 200.0 * 3600, "checkfree": (150.0 + 40.0 * scale) * 3600}
            winner = min(times, key=times.get)
            for method, time_s in times.items():
                row = {column: math.nan for column in SENSITIVITY_COLUMNS}
                row.update(
                    scenario="geo", failure_probability_per_stage_hour=rate, setback_scale=scale, method=method, num_replications=3,
                    fraction_reached=1.0, time_to_target_mean_s=time_s, time_to_target_ci95_low_s=0.95 * time_s,
                    time_to_target_ci95_high_s=1.05 * time_s, setbacks_calibrated=False, setback_source="paper_fitted", winner=method == winner,
                )
                rows.append(row)
    return pd.DataFrame(rows, columns=list(SENSITIVITY_COLUMNS))


def _crossovers() -> pd.DataFrame:
    return pd.DataFrame(
        [dict(scenario="geo", failure_probability_per_stage_hour=rate, scale_low=1.0, scale_high=2.0, winner_below="checkfree",
              winner_above="redundant", crossover_scale=1.25) for rate in RATES],
        columns=list(CROSSOVER_COLUMNS),
    )


def test_sensitivity_figure_draws_a_line_per_method_the_winners_and_the_crossover():
    ax = Figure().add_subplot()
    drawn = plot_setback_sensitivity(ax, _table(), failure_probability=0.1, crossovers=_crossovers())
    assert sorted(line.get_gid() for line in drawn["lines"]) == ["checkfree", "redundant"]
    assert len(drawn["bands"]) == 2
    (checkfree,) = [line for line in drawn["lines"] if line.get_gid() == "checkfree"]
    assert list(checkfree.get_xdata()) == list(SCALES)
    assert list(checkfree.get_ydata()) == pytest.approx([150.0 + 40.0 * s for s in SCALES])
    (rings,) = drawn["winners"]
    assert len(rings.get_offsets()) == len(SCALES)
    (crossover,) = drawn["crossovers"]
    assert list(crossover.get_xdata()) == [1.25, 1.25]
    assert "10 %/h" in ax.get_title() and "hours" in ax.get_ylabel()


def test_sensitivity_figure_defaults_to_the_highest_rate_and_rejects_other_tables():
    ax = Figure().add_subplot()
    plot_setback_sensitivity(ax, _table())
    assert "33 %/h" in ax.get_title()
    with pytest.raises(InputError, match="lacks column"):
        plot_setback_sensitivity(Figure().add_subplot(), _table().drop(columns=["setback_scale"]))


def test_make_figures_draws_the_sensitivity_figure_when_its_table_is_there(tmp_path):
    _table().to_csv(tmp_path / "setback_sensitivity.csv", index=False)
    _crossovers().to_csv(tmp_path / "setback_crossovers.csv", index=False)
    report = make_figures(tmp_path)
    assert tmp_path / "figures" / "setback_sensitivity.png" in report.written
