"""`churnsim reproduce PAPER`: a report whose table lists every published claim with churnsim's number
and a verdict; bad arguments give one line and exit code 2, and write nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from churnsim.cli import main
from churnsim.sim.checks import reproduce_checkfree
from churnsim.sim.checks.reproduce_claims import Claim, agreement, verdict_of
from churnsim.sim.checks.reproduce_datastates import reproduce_datastates

VERDICT = re.compile(r"^(agrees( within (10|25) %)?|disagrees( \(.*\))?|fitted: .*|not checked.*)$")


def run_cli(arguments: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "churnsim", *arguments], capture_output=True, text=True, timeout=600)


def table_rows(report: str) -> dict[str, list[str]]:
    """Rows of the report's claims table (the first markdown table), by claim id."""
    rows = {}
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and re.fullmatch(r"[CD]\d+", cells[0]):
            rows[cells[0]] = cells
    return rows


def check_report(out, expected_ids: list[str]) -> pd.DataFrame:
    report = (out / "report.md").read_text()
    rows = table_rows(report)
    assert list(rows) == expected_ids
    claims = pd.read_csv(out / "claims.csv")
    assert list(claims["id"]) == expected_ids
    for _, claim in claims.iterrows():
        assert VERDICT.match(claim["verdict"]), claim["verdict"]
        assert rows[claim["id"]][-1] == claim["verdict"]
        if claim["verdict"].startswith(("disagrees", "fitted")):
            assert f"**{claim['id']}** ({claim['verdict']}): " in report  # every disagreement is explained
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"] == "reproduce" and manifest["counts"]["claims"] == len(expected_ids)
    return claims


def test_reproduce_datastates_lists_every_claim_with_the_published_numbers(tmp_path):
    out = tmp_path / "ds"
    main(["reproduce", "datastates", "--out", str(out)])
    expected = [claim.id for claim in reproduce_datastates().claims]
    assert expected == [f"D{index}" for index in range(1, 14)]
    claims = check_report(out, expected)
    paper = dict(zip(claims["id"], claims["paper"]))
    assert (paper["D1"], paper["D2"], paper["D11"]) == ("631 s", "282 s", "48×")  # DataStates-LLM (HPDC'24) §6, figure labels
    by_id = claims.set_index("id")
    # torch.save's rate is fitted to D1: the fit and the constant in the preset agree.
    assert by_id.loc["D1", "churnsim_value"] == pytest.approx(631.0, rel=0.01)
    assert by_id.loc["D1", "verdict"].startswith("fitted")
    assert by_id.loc["D13", "verdict"] == "not checked"
    for figure in ("reproduce_end_to_end.png", "reproduce_dp_scaling.png"):
        assert (out / "figures" / figure).is_file()
    grid = pd.read_csv(out / "end_to_end.csv")
    assert len(grid) == 24 and set(grid["engine"]) == {"DeepSpeed", "DataStates-LLM"}
    # The same reproduction again into the same directory replaces the report, with --overwrite only.
    with pytest.raises(SystemExit):
        main(["reproduce", "datastates", "--out", str(out), "--no-figures"])
    assert (out / "figures").exists()
    main(["reproduce", "datastates", "--out", str(out), "--no-figures", "--overwrite"])
    assert not (out / "figures").exists()


def test_reproduce_checkfree_lists_every_claim(tmp_path, monkeypatch):
    # A small plan keeps the test short; every claim is listed whatever the plan.
    small = reproduce_checkfree.CheckFreePlan(replications=2, sizes=("124m",), rates=(0.05, 0.33), layouts=("separate_node",))
    monkeypatch.setattr(reproduce_checkfree, "QUICK_PLAN", small)
    out = tmp_path / "cf"
    main(["reproduce", "checkfree", "--quick", "--workers", "1", "--out", str(out)])
    claims = check_report(out, [f"C{index}" for index in range(1, 8)])
    paper = dict(zip(claims["id"], claims["paper"]))
    assert (paper["C1"], paper["C3"], paper["C4"]) == ("> 1.12×", "up to 1.6×", "up to 1.2×")
    assert (paper["C5"], paper["C6"], paper["C7"]) == ("22.60", "29.24", "121.03")  # the CheckFree authors' plot_perplexity.py (its ablation)
    assert all(verdict.startswith("fitted") for verdict in claims["verdict"][4:])
    speedups = pd.read_csv(out / "speedups.csv")
    assert set(speedups["method"]) == {"checkfree", "checkfree_plus"} and set(speedups["layout"]) == {"separate_node"}
    assert (out / "figures" / "reproduce_speedups.png").is_file()


@pytest.mark.parametrize(
    "arguments, fragments",
    [
        (["reproduce", "bamboo"], ("unknown paper 'bamboo'", "checkfree, datastates")),
        (["reproduce", "checkfree", "--replications", "1"], ("--replications 1", "at least 2")),
        (["reproduce", "datastates", "--replications", "3"], ("--replications", "no failures")),
        (["reproduce", "datastates", "--workers", "0"], ("--workers 0",)),
        # Both used to start the reproduction: 100,001 replications of every setting, or 100,000 processes.
        (["reproduce", "checkfree", "--replications", "100001"], ("--replications 100001", "limit of 100,000")),
        (["reproduce", "checkfree", "--quick", "--workers", "100000"], ("--workers 100000", "between 1 and 1024")),
        (["reproduce", "datastates", "--quick"], ("--quick", "no quicker form")),
        (["reproduce"], ("Missing argument 'PAPER'",)),
    ],
)
def test_bad_arguments_give_one_line_and_write_nothing(tmp_path, arguments, fragments, assert_one_line_error):
    out = tmp_path / "out"
    result = run_cli([*arguments, "--out", str(out)])
    assert_one_line_error(result, *fragments)
    assert not out.exists()


def test_another_papers_results_are_not_mixed_in(tmp_path, assert_one_line_error):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"command": "reproduce", "scenario": {"name": "checkfree"}}))
    (out / "report.md").write_text("the CheckFree report")
    result = run_cli(["reproduce", "datastates", "--out", str(out)])
    assert_one_line_error(result, "holds churnsim reproduce results for 'checkfree'", "--overwrite")
    assert (out / "report.md").read_text() == "the CheckFree report"
    assert sorted(path.name for path in out.iterdir()) == ["manifest.json", "report.md"]


def test_verdict_rules():
    assert agreement(105.0, 100.0) == "agrees within 10 %"
    assert agreement(80.0, 100.0) == "agrees within 25 %"
    assert agreement(50.0, 100.0) == "disagrees (-50 %)"
    # A speed-up is judged on its gain: 1.01× is far from a 1.2× claim.
    assert verdict_of("speedup", 1.2, 1.01) == "disagrees (-95 %)"
    assert verdict_of("speedup", 2.2, 2.14) == "agrees within 10 %"
    assert verdict_of("at_least", 1.12, 1.13) == "agrees" and verdict_of("at_least", 1.12, 1.05) == "disagrees"
    assert verdict_of("range", (1.3, 2.2), (1.14, 2.46)) == "disagrees (low end -53 %; high end agrees within 25 %)"
    assert verdict_of("input", 631.0, 631.4).startswith("fitted: agrees")
    claim = Claim(id="X1", claim="c", source="s", setting="t", paper_value=2.0, paper_text="2×", churnsim_value=None,
                  churnsim_text="—", comparison="speedup", preset="p")
    assert claim.verdict == "not checked (no churnsim number)"
