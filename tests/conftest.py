"""Shared test settings (in CI, property tests are derandomized so a run can be reproduced) and the
check of the bad-input contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """Bad input's contract: exit code 2, one line `churnsim: error: ...` holding every fragment, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("churnsim: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def short_temp_dir():
    """A fresh, short directory for a launcher's TMPDIR: Python's forkserver listens on a Unix socket
    under TMPDIR, whose path may not exceed 107 bytes, which a test's tmp_path (long under pytest-xdist
    workers) can. Removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="cs-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def assert_one_line_error():
    return _assert_one_line_error


_EXAMPLES_NOT_RUN = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption(
        "--update-examples",
        action="store_true",
        default=False,
        help="tests/test_docs_examples.py: rewrite the shown output of console blocks in README.md and docs/ with what the commands print now",
    )


@pytest.fixture
def examples_not_run(request) -> list:
    """Where tests/test_docs_examples.py notes each example it did not run, with the reason; listed at the end of the run."""
    return request.config.stash.setdefault(_EXAMPLES_NOT_RUN, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    not_run = config.stash.get(_EXAMPLES_NOT_RUN, [])
    if not_run:
        terminalreporter.section("docs examples not run")
        for line in not_run:
            terminalreporter.write_line(line)
