"""No runtime message, docstring or comment of the library quotes a lab measurement, a date or a run
ordinal: such figures go stale with every run, and live in the dated reports of benchmarks/reports/.

Scans every module of sim/, calibration/, real/, churnsim/ and figures/: its string literals and
docstrings (`ast`) and its comments (`tokenize`). A paper's year in a citation ("NSDI'23", "(2025)")
and a date inside a file name (a trace's `...-2020-11-20-to-...csv`) are not dates of ours."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
LIBRARY_FOLDERS = ("sim", "calibration", "real", "churnsim", "figures")

_MONTH = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
_LATE_ORDINAL = (r"(?:eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
                 r"|twenty-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)|thirtieth)")
_ORDINAL = rf"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|{_LATE_ORDINAL}|\d+(?:st|nd|rd|th))"
# A percentage, duration or ratio; not part of a longer number (1e300), and not a conventional
# statistical level (a 95 % interval, its 2.5 % and 97.5 % bounds).
_FIGURE = (r"(?<![\w.])(?!(?:2\.5|95|97\.5|99)\s*%)\d+(?:\.\d+)?(?:\s*(?:[-–]|to)\s*\d+(?:\.\d+)?)?"
           r"\s*(?:%|percent\b|ms\b|µs\b|s\b|seconds?\b|min\b|minutes?\b|x\b|×)")
_LAB_WORDS = (r"(?:\bmeasured\b|\bon (?:this|our|the test|churnsim's [\w-]+ test) machine\b|\btest machine\b|\bour (?:runs|machine|measurements)\b"
              r"|\b\d+ (?:benchmark )?rounds\b|\b(?:2|two)-core\b|\bon \d+ (?:CPU )?cores\b|\bin a quiet spell\b|\bslow spell\b)")
_NEAR = 100
"""A figure within this many characters of a lab word, in the same string or comment, is a lab figure."""

PATTERNS = {
    # A date of ours, not one inside a file name or identifier (letters, digits, '-' or '_' either side),
    # nor the name of a JSON Schema draft ("draft 2020-12", ".../draft/2020-12/schema").
    "a date": re.compile(r"(?<![\w-])(?<!draft )(?<!draft/)(?:19|20)\d{2}-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?(?![\w-])"),
    "a month and year": re.compile(rf"\b{_MONTH}\.?\s+(?:\d{{1,2}},?\s+)?(?:19|20)\d{{2}}\b"),
    "a run ordinal": re.compile(rf"\b{_LATE_ORDINAL}\b|\b{_ORDINAL}\s+(?:session|sitting)s?\b"
                                r"|\b(?:fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th))\s+(?:benchmark\s+|calibrate-and-validate\s+)?(?:run|pass)\b",
                                re.IGNORECASE),
    "a reference to HISTORY.md": re.compile(r"HISTORY\.md"),
    "a lab figure": re.compile(rf"{_FIGURE}.{{0,{_NEAR}}}?{_LAB_WORDS}|{_LAB_WORDS}.{{0,{_NEAR}}}?{_FIGURE}", re.IGNORECASE | re.DOTALL),
}


_CITED = re.compile(r"\(\s*[A-Z][\w-]*(?: et al\.)?(?: \([^()]*\))?[:,]")
"""A parenthesis that opens with a cited source, "(Parcae: 6.6 s measured)": the paper's figure, not ours."""


def _cited(text: str, offset: int) -> bool:
    opening = text.rfind("(", 0, offset)
    return opening >= 0 and ")" not in text[opening:offset] and bool(_CITED.match(text, opening))


def findings(text: str) -> list[tuple[str, int, str]]:
    """(what, offset, the matched text) for every lab number in one string or comment."""
    return [(what, match.start(), match.group(0)) for what, pattern in PATTERNS.items() for match in pattern.finditer(text)
            if not (what == "a lab figure" and _cited(text, match.start()))]


def _texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every string literal, docstring, f-string part and comment of a module."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append((node.lineno, node.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    return texts


def scan(path: Path) -> list[str]:
    """'file:line: what: «text»' for every lab number in the module."""
    relative = path.relative_to(REPOSITORY).as_posix()
    found = []
    for line, text in _texts(path.read_text(encoding="utf-8")):
        for what, offset, matched in findings(text):
            shown = " ".join(matched.split())
            found.append(f"{relative}:{line + text[:offset].count(chr(10))}: {what}: «{shown}»")
    return found


def library_modules() -> list[Path]:
    return sorted(path for folder in LIBRARY_FOLDERS for path in (REPOSITORY / folder).rglob("*.py"))


def test_the_library_quotes_no_dates_run_ordinals_or_lab_figures():
    modules = library_modules()
    assert len(modules) > 50, "the scan found too few library modules to be looking in the right place"
    found = [finding for path in modules for finding in scan(path)]
    assert not found, "lab numbers in library strings or comments (move them to a benchmark report):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("made before 2026-11-29, so it has none", "a date"),
        ("measured on a 2-core machine (2026-11): one iteration takes", "a date"),
        ("as of November 2026 the fit", "a month and year"),
        ("on Nov. 27, 2026 it ran", "a month and year"),
        ("the twelfth run pooled with the others", "a run ordinal"),
        ("since the twenty-sixth, the carry", "a run ordinal"),
        ("moved here in the first session", "a run ordinal"),
        ("the 14th benchmark run's rounds", "a run ordinal"),
        ("see benchmarks/HISTORY.md, 'The recovery step'", "a reference to HISTORY.md"),
        ("on churnsim's 2-core test machine carried setups ran 3.1 % slower", "a lab figure"),
        ("3-stage runs came out 0.6-2.1 % off over 58 rounds", "a lab figure"),
        ("the median per event was 45 ms as measured", "a lab figure"),
        ("in our runs it took 9.2 s", "a lab figure"),
        ("the slope came out 18 to 335 µs over 12 benchmark rounds", "a lab figure"),
        ("(approximation; 6–17 ms per event measured on 2 cores)", "a lab figure"),
        ("2 seeds × 1,000 iterations took 10 min on 2 CPU cores", "a lab figure"),
    ],
)
def test_a_planted_lab_number_is_found(text, what):
    assert what in {found for found, _, _ in findings(text)}


@pytest.mark.parametrize(
    "text",
    [
        "Blagoev et al., All is Not Lost (arXiv 2506.15461, 2025)",
        "Bamboo (NSDI'23) and Oobleck (SOSP '23)",
        "DataStates-LLM (HPDC'24)",
        "failures per node-hour; e.g. 0.16 = 16 %/h per stage",
        "seconds between checkpoints (s); default 30 s",
        "Bamboo's aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv trace",
        "the first run of a preset, then the second pass over the runs",
        "the median |relative error| of the measured wall-clock against the predicted one",
        "rounds repeat until the latest one lies in the spread of the earlier rounds",
        "schema_version 2026",
        "Rendezvous and process-group rebuild (Parcae: 6.6 s measured).",
        "the 95 % interval of a measured quantity; its 2.5 % and 97.5 % speed bounds, as the calibration measured them",
        "a warm-up of 1e300 s that runs measured",
        "The JSON Schema of a scenario file (draft 2020-12): https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_legitimate_content_passes(text):
    assert findings(text) == []


def test_a_planted_module_is_named_by_file_and_line(tmp_path, monkeypatch):
    module = tmp_path / "sim" / "planted.py"
    module.parent.mkdir()
    module.write_text('"""A module."""\n\n# calibrations made before 2026-11-27 (eleventh session)\nX = 1\n'
                      'ADVICE = ("calibrate on the setup:\\n"\n          "on the test machine it was 2.1 % off")\n')
    monkeypatch.setattr(__import__(__name__), "REPOSITORY", tmp_path)
    found = scan(module)
    assert "sim/planted.py:3: a date: «2026-11-27»" in found
    assert "sim/planted.py:3: a run ordinal: «eleventh»" in found
    assert any(entry.startswith("sim/planted.py:6: a lab figure") for entry in found), found
