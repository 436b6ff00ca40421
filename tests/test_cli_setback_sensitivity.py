"""`churnsim whatif --setback-sensitivity`: the study's tables beside the what-if's, its table on stderr."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd

from churnsim.calibration.base import strict_json_loads
from churnsim.calibration.tables import CROSSOVER_COLUMNS, SENSITIVITY_COLUMNS


def test_whatif_setback_sensitivity_writes_its_tables_and_keeps_stdout_to_the_answer(tmp_path):
    command = [
        sys.executable, "-m", "churnsim", "whatif", "--quick", "--preset", "checkfree-124m-geo-10pct", "--rates", "0,0.33",
        "--method", "redundant", "--method", "checkfree", "--method", "copy", "--workers", "1", "--no-figures",
        "--out", str(tmp_path / "out"), "--json", "--setback-sensitivity",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    strict_json_loads(result.stdout)  # the answer alone on stdout
    assert "winner as every setback is scaled" in result.stderr
    table = pd.read_csv(tmp_path / "out" / "setback_sensitivity.csv")
    crossovers = pd.read_csv(tmp_path / "out" / "setback_crossovers.csv")
    assert list(table.columns) == list(SENSITIVITY_COLUMNS) and list(crossovers.columns) == list(CROSSOVER_COLUMNS)
    # The nonzero rate only, every default scale, the methods that can win (the ablation left out).
    assert set(table["failure_probability_per_stage_hour"]) == {0.33}
    assert sorted(set(table["setback_scale"])) == [0.5, 1.0, 2.0, 3.0, 5.0]
    assert set(table["method"]) == {"redundant", "checkfree"}
    assert (table.groupby("setback_scale")["winner"].sum() == 1).all()
    # Redundant computation has no setbacks: one set of runs, the same at every scale; CheckFree slows.
    redundant = table[table["method"] == "redundant"]["time_to_target_mean_s"]
    assert redundant.nunique() == 1
    checkfree = table[table["method"] == "checkfree"].sort_values("setback_scale")["time_to_target_mean_s"]
    assert checkfree.is_monotonic_increasing
