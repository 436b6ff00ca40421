"""Hard failures have one code path, torch.distributed.elastic's agent (issue 47): no module in real/
coordinates through files, and the local launcher's own supervisor is gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REAL = Path(__file__).resolve().parents[2] / "real"

MARKER_FILES = {
    "workers.json": r"""["']workers\.json["']""",
    "generation": r"""\bGENERATION_FILE\b|join\([^)]*["']generation["']""",
    "generation-<g>.json": r"""["']generation-\{[^}]*\}\.json""",
    "abort-<g>": r"""["']abort-""",
    "started": r"""join\([^)]*["']started["']""",
    "result-<stage>.bin": r"""["']result-""",
    "error-<stage>-<incarnation>.json": r"""["']error-\{[^}]*\}-\{""",
}
"""The files through which the old local launcher and its stage processes coordinated (as a path
in a string literal, where code names them, not a word in prose)."""
SUPERVISION = r"\b(_Supervisor|HardFailureOptions|ElasticSettings|WORKERS_FILE|STARTED_FILE|announce|abandon)\b"


def _coordination_lines(sources: dict[str, str]) -> list[str]:
    found = []
    for name, text in sources.items():
        for line_number, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(re.search(pattern, code) for pattern in MARKER_FILES.values()) or re.search(SUPERVISION, code):
                found.append(f"{name}:{line_number}: {line.strip()}")
    return found


def test_no_module_in_real_coordinates_through_marker_files_or_supervises_stage_processes():
    sources = {path.relative_to(REAL.parent).as_posix(): path.read_text() for path in sorted(REAL.rglob("*.py"))}
    assert "real/launch.py" in sources and "real/agent_launch.py" in sources  # the scan reads the real tree
    assert not (REAL / "elastic.py").exists()
    assert _coordination_lines(sources) == []


def test_the_scan_finds_the_old_protocol_where_code_names_its_files():
    # Lines of the deleted real/elastic.py and of launch.py's supervisor: each is found.
    old = {
        "elastic.py": 'GENERATION_FILE = "generation"\nSTARTED_FILE = "started"\n'
        'return os.path.join(directory, f"abort-{generation}")\nreturn os.path.join(directory, f"result-{stage}.bin")\n'
        'return os.path.join(directory, f"generation-{generation}.json")',
        "launch.py": 'WORKERS_FILE = "workers.json"\nclass _Supervisor:\nreturn os.path.join(directory, f"error-{stage}-{incarnation}.json")',
    }
    assert len(_coordination_lines(old)) == 8
    # Prose about generations, and a record's fields, are not a protocol.
    prose = '"""a generation is abandoned when a member died"""\nrun = {"started_unix_ns": 1}\nrow = {"generation": 2}'
    assert _coordination_lines({"prose.py": prose}) == []


def test_progress_is_looked_for_at_a_positive_interval():
    from churnsim.calibration.errors import InputError
    from churnsim.real.launch import launch_local
    from churnsim.real.trainer import TrainingConfig

    with pytest.raises(InputError, match="progress_interval_s"):
        launch_local(object.__new__(TrainingConfig), progress_interval_s=0.0)
