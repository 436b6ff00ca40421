"""A results folder that stands alone (report.md, a self-contained report.html, a manifest that says
how it was made), `presets --json`, and intervals that respect small replication counts."""

from __future__ import annotations

import base64
import html
import json
import re
from html.parser import HTMLParser
from importlib import metadata

import pandas as pd
import pytest

from churnsim.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WHATIF_ARGUMENTS = ["whatif", "--quick", "--preset", "cpu-tiny", "--replications", "2", "--workers", "1"]


@pytest.fixture(scope="module")
def whatif_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "whatif"
    main([*WHATIF_ARGUMENTS, "--out", str(out)])
    return out


class _Page(HTMLParser):
    """What a browser would fetch: every src and href, and the tags that load something."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.references: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        values = dict(attrs)
        if tag == "img":
            self.images.append(values.get("src") or "")
        for name in ("src", "href"):
            if values.get(name) and tag != "img":
                self.references.append(values[name])


def test_a_whatif_folder_holds_a_report_in_markdown_and_html(whatif_folder):
    markdown = (whatif_folder / "report.md").read_text(encoding="utf-8")
    manifest = json.loads((whatif_folder / "manifest.json").read_text())
    for heading in ("## The question", "## The answer", "## Caveats", "## Tables", "## Figures"):
        assert heading in markdown, heading
    assert "churnsim " + " ".join(WHATIF_ARGUMENTS) in markdown  # the command that produced it
    assert "Scenario cpu-tiny" in markdown and "Churn: " in markdown
    for note in manifest["notes"]:
        assert note in markdown
    figures = sorted(path.relative_to(whatif_folder).as_posix() for path in (whatif_folder / "figures").rglob("*.png"))
    assert figures, "whatif draws figures"
    for figure in figures:
        assert f"]({figure})" in markdown, figure


def test_the_html_report_parses_and_embeds_every_figure_as_a_png(whatif_folder):
    page_text = (whatif_folder / "report.html").read_text(encoding="utf-8")
    page = _Page()
    page.feed(page_text)
    page.close()
    assert not page.references and not {"script", "link", "iframe"} & page.tags, "nothing outside the file"
    embedded = []
    for source in page.images:
        assert source.startswith("data:image/png;base64,"), source[:40]
        data = base64.b64decode(source.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_SIGNATURE)
        embedded.append(data)
    figure_files = sorted((whatif_folder / "figures").rglob("*.png"))
    assert sorted(embedded) == sorted(path.read_bytes() for path in figure_files)
    manifest = json.loads((whatif_folder / "manifest.json").read_text())
    assert any(line.startswith("cpu-tiny") for line in re.findall(r"<li>([^<]*)</li>", page_text))  # the answer lines
    for note in manifest["notes"]:
        assert html.escape(note) in page_text, note
    assert "<table>" in page_text and "time to target" in page_text


def test_the_manifest_says_how_the_folder_was_made(whatif_folder):
    manifest = json.loads((whatif_folder / "manifest.json").read_text())
    assert manifest["argv"] == ["churnsim", *WHATIF_ARGUMENTS, "--out", str(whatif_folder)]
    assert manifest["run_time_s"] > 0
    revision, version = manifest["git_revision"], manifest["churnsim_version"]
    assert revision or version
    assert revision != "unknown" and version == metadata.version("churnsim")
    versions = manifest["package_versions"]
    direct = [re.match(r"[A-Za-z0-9._-]+", requirement).group(0) for requirement in metadata.requires("churnsim") if "extra" not in requirement]
    for name in direct:
        assert versions[re.sub(r"[-_.]+", "-", name).lower()] == metadata.version(name), name
    try:
        assert versions["torch"] == metadata.version("torch")
    except metadata.PackageNotFoundError:
        assert "torch" not in versions


def test_outside_a_git_checkout_the_manifest_names_the_installed_version(tmp_path, monkeypatch):
    import churnsim.sim.studies.outputs as outputs
    from churnsim.calibration.presets import preset

    monkeypatch.setattr(outputs, "provenance_fields", lambda: {"git_revision": "unknown", "created_utc": "now"})
    manifest = json.loads(outputs.write_manifest(tmp_path, command="simulate", scenario=preset("cpu-tiny")).read_text())
    assert manifest["git_revision"] is None and manifest["churnsim_version"] == metadata.version("churnsim")


def test_two_replications_print_no_negative_interval_and_warn(tmp_path, capsys):
    out = tmp_path / "simulated"
    main(["simulate", "--preset", "cpu-tiny", "--replications", "2", "--out", str(out)])
    captured = capsys.readouterr()
    intervals = re.findall(r"\[(-?[\d.]+), (-?[\d.]+)\]", captured.out)
    assert intervals, "the answer and tables show intervals"
    assert all(float(low) >= 0 and float(high) >= 0 for low, high in intervals)
    assert "warning: the 95 % intervals come from 2 replications, fewer than 5: they are unreliable" in captured.err
    summary = pd.read_csv(out / "summary.csv")
    interval_columns = [column for column in summary.columns if "_ci95_" in column]
    assert (summary[interval_columns].fillna(0.0) >= 0).all().all()
    assert not summary["intervals_reliable"].any()
    assert "unreliable" in (out / "report.md").read_text(encoding="utf-8")


def test_recommend_says_its_ties_are_unreliable_at_few_replications():
    from churnsim.recommend_report import recommendation_lines
    from churnsim.sim.studies.recommend import Candidate, Recommendation
    from churnsim.sim.studies.verdict import Estimate

    def candidate(method, mean_s):
        return Candidate(method=method, knobs={}, fraction_reached=1.0, time_to_target_s=Estimate(mean=mean_s, ci95_low=mean_s / 2, ci95_high=mean_s * 2))

    best = (candidate("checkfree", 100.0), candidate("checkpoint", 110.0))

    def lines(replications):
        return recommendation_lines(
            Recommendation(scenario="s", replications=replications, winner="checkfree", winner_knobs={}, winner_time_to_target_s=best[0].time_to_target_s,
                           cannot_be_told_apart_from=("checkpoint",), best_per_method=best, interval_studies=(), edge_fallbacks=(), robustness=())
        )  # fmt: skip

    (tie,) = [line for line in lines(3) if "cannot be told apart" in line]
    assert tie.endswith("checkpoint (unreliable at 3 replications, see the notes)")
    (tie,) = [line for line in lines(5) if "cannot be told apart" in line]
    assert "unreliable" not in tie


def test_presets_json_lists_every_preset_by_its_full_name(capsys):
    from churnsim.calibration.presets import PRESETS

    main(["presets", "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert [entry["name"] for entry in listed] == sorted(PRESETS)
    for entry in listed:
        assert {"description", "model", "num_stages", "churn", "methods", "replications"} <= set(entry)
        assert entry["target_loss"] is not None or entry["target_iterations"] is not None


def test_the_presets_table_never_cuts_a_name(capsys, monkeypatch):
    from churnsim.calibration.presets import PRESETS

    monkeypatch.setenv("COLUMNS", "60")
    main(["presets"])
    text = capsys.readouterr().out
    for name in PRESETS:
        assert re.search(rf"│ {re.escape(name)}\s+│", text), name
