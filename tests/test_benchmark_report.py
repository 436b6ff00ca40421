"""The benchmarks' dated reports (benchmarks/report.py): what a report holds, from a result file."""

from __future__ import annotations

import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

_MODULE = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("benchmark_report", _MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up by name
    spec.loader.exec_module(module)
    return module


def _timing(*wall_s: float) -> dict:
    return {"wall_s": list(wall_s), "cpu_s": list(wall_s), "agreed_s": sum(wall_s[-2:]) / 2, "median_s": sorted(wall_s)[len(wall_s) // 2],
            "min_s": min(wall_s), "max_s": max(wall_s), "last_two_agree_within_20_percent": True}


def test_a_fresh_report_names_command_machine_commit_spread_and_target(tmp_path):
    report = _report()
    result_file = tmp_path / "sim-aire-speed.json"
    result_file.write_text(json.dumps({"closed_form": _timing(0.9, 0.7, 0.72), "target_s": 0.65, "meets_target": False}))
    path = report.write_report("sim-aire-speed", result_file, command="python benchmarks/sim_aire_speed.py --max-rounds 3",
                               reports_directory=tmp_path / "reports")
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    assert path == tmp_path / "reports" / f"{today}-sim-aire-speed.md"
    text = path.read_text()
    assert "python benchmarks/sim_aire_speed.py --max-rounds 3" in text
    for field in ("- cpu:", "- cores:", "- memory gib:", "- os:", "- python:", "- numpy:", "- torch:"):
        assert field in text
    assert re.search(r"- commit: `[0-9a-f]{40}` \((clean tree|the tree had uncommitted changes)\)", text)
    assert f"- date: {today}" in text
    assert "| the benchmark | ≤ 0.65 s | 0.71 s (min–max 0.7–0.9, 3 repetitions) | not met |" in text
    assert "| closed_form | 0.71 s (min–max 0.7–0.9, 3 repetitions) |" in text


def test_validation_targets_are_judged_in_percent_with_their_interval(tmp_path):
    report = _report()
    result = {"targets": {"calibrated setup": 0.05, "other setups": 0.1},
              "target_verdicts": {"calibrated setup": "met", "other setups": "not met"},
              "pooled": {"calibrated setup": {"absolute": 0.03, "absolute_ci95": [0.02, 0.045], "absolute_round_spread": [0.01, 0.08], "runs": 32},
                         "other setups": {"absolute": 0.12, "absolute_ci95": [0.09, 0.15], "runs": 72}}}
    targets = report.target_rows(result)
    assert ("calibrated setup: median |relative error|", "≤ 5 %", "3 % [2, 4.5] (95 % interval)", "met") in targets
    assert ("other setups: median |relative error|", "≤ 10 %", "12 % [9, 15] (95 % interval)", "not met") in targets
    rows = dict(report.table_rows(result))
    assert rows["pooled / calibrated setup / absolute"] == "0.03 [0.02, 0.045] (95 % interval); rounds 0.01–0.08"
    assert rows["pooled / other setups / runs"] == "72"


def test_a_committed_result_is_reported_with_the_date_and_commit_it_records(tmp_path):
    report = _report()
    earlier = {"machine": {"python": "3.11.7", "cpu_count": 2, "git_head": "abc1234", "measured_at": "2026-01-02T03:04:05+0000"},
               "runs": [{"median_step_s": 0.1}], "median_step_range_s": [0.1, 0.2]}
    latest = {**earlier, "machine": {**earlier["machine"], "measured_at": "2026-02-03T00:00:00+0000"}, "median_step_range_s": [0.3, 0.4]}
    result_file = tmp_path / "identical-runs-spread.json"
    result_file.write_text(json.dumps([earlier, latest]))
    path = report.write_committed_report("identical-runs-spread", result_file, reports_directory=tmp_path)
    text = path.read_text()
    assert path.name == "2026-02-03-identical-runs-spread.md"
    assert "- commit: `abc1234`" in text and "whether its tree was clean was not recorded" in text
    assert "| median_step_range_s | 0.3, 0.4 |" in text and "0.1, 0.2" not in text
    assert "the latest of the 2 entries" in text


def test_every_benchmark_that_writes_a_result_file_writes_its_report():
    benchmarks = _MODULE.parent
    scripts = [path for path in benchmarks.glob("*.py") if path.name not in ("report.py", "speed_common.py")]
    writers = [path for path in scripts if re.search(r"RESULTS_FILE\.write_text|write_result\(|result\.json\"\)\.write_text|args\.out\.write_text", path.read_text())]
    assert len(writers) >= 12
    for path in writers:
        source = path.read_text()
        assert "add_report_option(parser)" in source, f"{path.name} offers no --no-report"
        assert "report_if_asked(" in source or "report=arguments.report" in source, f"{path.name} writes no report"
    names = {benchmark.script for benchmark in _report().BENCHMARKS.values()}
    assert {path.name for path in writers} <= names
