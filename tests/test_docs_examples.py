"""Every example of README.md and docs/ runs, and where it shows output, that output is what the
command prints today: examples cannot drift.

The convention (also in the docs' contributing notes):
- ```` ```bash ```` (or `sh`, `shell`): every command runs through bash (`-e -o pipefail`) in one
  temporary working directory per page, the page's blocks in order; output not checked.
- ```` ```console ````: each `$ command` line runs (a line ending in `\\` continues on the next) and
  the lines shown under it are compared with what it prints on stdout, or on stdout with its stderr
  before or after (an error or a warning; progress messages need not be shown). A line `...` stands
  for any number of lines, `...` inside a line for any text; trailing whitespace and trailing blank
  lines are ignored. `--update-examples` rewrites shown output that no longer matches, with stdout
  (and stderr after it when the command fails).
- ```` ```python ````: executed in the page's working directory, a page's blocks in order in one
  namespace, in a Python process of the page's own (what an example registers stays out of the
  test session).
- Other languages (`text`, `json`, `yaml`, ...) are shown only.
- `<!-- example: skip reason="..." -->` just above a block leaves it out; `pip install ...` (treated
  as already satisfied) and runs of this test suite (`python -m pytest`, which would run itself) are
  left out of bash blocks. Each is listed, with its reason, at the end of the pytest run.

Pages whose examples calibrate, validate, reproduce or run real pipelines are marked `slow`, as the
other multi-process tests are; a plain `python -m pytest` runs them too.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]

LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "console", "python": "python", "py": "python"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
SKIP_MARKER = re.compile(r'^\s*<!--\s*example:\s*skip\s+reason="(?P<reason>[^"]+)"\s*-->\s*$')
PIP_INSTALL = re.compile(r"^\s*(python3?\s+-m\s+)?pip3?\s+install\b")
TEST_SUITE = re.compile(r"^\s*(python3?\s+-m\s+)?pytest\b")
SLOW_EXAMPLE = re.compile(r"\bchurnsim\s+(calibrate|validate|reproduce|real)\b")
COMMAND_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    lines: tuple[str, ...]
    """The block's content, the fence's indentation removed."""
    indent: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{_shown_path(self.page)}:{self.line}"


def _shown_path(page: Path) -> str:
    try:
        return str(page.relative_to(REPOSITORY))
    except ValueError:
        return str(page)


def extract_blocks(page: Path) -> list[Block]:
    """The fenced blocks of a markdown page, in order (nested fences of fewer backticks stay content)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].strip().lstrip("{").strip().lstrip(".")
        language = info.split()[0].lower() if info else ""
        end = index + 1
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{_shown_path(page)}:{index + 1}: the {fence} fence is never closed")
        content = tuple(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[index + 1 : end])
        blocks.append(Block(page, index + 1, language, content, indent, _skip_reason(lines, index)))
        index = end + 1
    return blocks


def _closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    """The reason of a skip marker above the fence (blank lines between them allowed)."""
    index = fence_index - 1
    while index >= 0 and not lines[index].strip():
        index -= 1
    marker = SKIP_MARKER.match(lines[index]) if index >= 0 else None
    return marker["reason"] if marker else None


def runnable(block: Block) -> bool:
    return block.language in LANGUAGES


# --- console output ------------------------------------------------------------------------------


def _line_matches(expected: str, actual: str) -> bool:
    if "..." not in expected:
        return expected == actual
    return re.fullmatch(".*".join(re.escape(part) for part in expected.split("...")), actual) is not None


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Shown output against printed output: `...` alone elides lines, `...` in a line elides text;
    trailing whitespace and trailing blank lines do not count."""
    shown, printed = _trimmed(expected), _trimmed(actual)

    @lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(shown):
            return j == len(printed)
        if shown[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(printed) + 1))
        return j < len(printed) and _line_matches(shown[i], printed[j]) and match(i + 1, j + 1)

    return match(0, 0)


def _trimmed(lines: list[str]) -> tuple[str, ...]:
    stripped = [line.rstrip() for line in lines]
    while stripped and not stripped[-1]:
        stripped.pop()
    return tuple(stripped)


@dataclass(frozen=True)
class ConsoleCommand:
    offset: int
    """Index in the block's lines of its `$ ` line."""
    command: str
    output_start: int
    output_end: int
    """The shown output is block.lines[output_start:output_end]."""


def console_commands(block: Block) -> list[ConsoleCommand]:
    commands, index, lines = [], 0, block.lines
    while index < len(lines):
        if not lines[index].startswith("$ "):
            raise AssertionError(f"{block.where}: a console block starts each command with `$ `; line {block.line + 1 + index} does not")
        offset, command = index, lines[index][2:]
        while command.endswith("\\") and index + 1 < len(lines):
            index += 1
            command = command[:-1] + " " + re.sub(r"^>\s?", "", lines[index])
        output_start = index = index + 1
        while index < len(lines) and not lines[index].startswith("$ "):
            index += 1
        commands.append(ConsoleCommand(offset, command, output_start, index))
    return commands


# --- running a page ------------------------------------------------------------------------------


def example_environment() -> dict[str, str]:
    """This interpreter's `churnsim` and `python` first on PATH; plain, 80-column, colourless output."""
    environment = dict(os.environ)
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    environment.update({"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb", "MPLBACKEND": "Agg"})
    return environment


def _shell(script: str, workdir: Path, **options) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-o", "pipefail", *options.pop("flags", []), "-c", script],
        cwd=workdir, env=example_environment(), text=True, timeout=COMMAND_TIMEOUT_S, **options,
    )


def _tail(text: str, characters: int = 3000) -> str:
    return text if len(text) <= characters else "..." + text[-characters:]


FAILED_AT = "docs-example-failed-at-line:"


def bash_script(block: Block, not_run: list[str]) -> str:
    """The block as one bash script: `pip install` and test-suite runs left out (and noted), a trap
    that names the failing line."""
    script = [f"trap 'echo \"{FAILED_AT}$LINENO: $BASH_COMMAND\" >&2' ERR"]
    for offset, line in enumerate(block.lines):
        kept = []
        for command in line.split("&&"):
            reason = "pip install (taken as already satisfied)" if PIP_INSTALL.match(command) else None
            reason = reason or ("runs the test suite that runs this example" if TEST_SUITE.match(command) else None)
            if reason:
                not_run.append(f"{_shown_path(block.page)}:{block.line + 1 + offset}: `{command.strip()}`: {reason}")
            else:
                kept.append(command)
        script.append("&&".join(kept) if kept else ":")
    return "\n".join(script)


def run_bash(block: Block, workdir: Path, not_run: list[str]) -> None:
    result = _shell(bash_script(block, not_run), workdir, flags=["-e"], capture_output=True)
    if result.returncode:
        failed = re.search(rf"{FAILED_AT}(\d+): (.*)", result.stderr)
        where = f"{_shown_path(block.page)}:{block.line + int(failed[1]) - 1}" if failed else block.where
        command = f" `{failed[2]}`" if failed else ""
        raise AssertionError(
            f"{where}: bash example{command} exited with {result.returncode}\n"
            f"--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n{_tail(result.stderr.replace(failed[0], '') if failed else result.stderr)}"
        )


def run_console(block: Block, workdir: Path, update: bool, replacements: list[tuple[int, int, list[str]]]) -> None:
    """Run each `$ ` command and check its output; with `update`, note the new output of a command
    whose output no longer matches (file line range, new lines) instead of failing."""
    for command in console_commands(block):
        result = _shell(command.command, workdir, capture_output=True)
        shown = list(block.lines[command.output_start : command.output_end])
        # A page shows what the command prints on stdout, or that with what it says on stderr
        # (an error, a warning) before or after it; progress on stderr need not be shown.
        stdout, stderr = result.stdout.splitlines(), result.stderr.splitlines()
        if any(output_matches(shown, printed) for printed in (stdout, stdout + stderr, stderr + stdout)):
            continue
        printed = stdout if result.returncode == 0 else stdout + stderr
        first_line = block.line + 1 + command.offset
        if update:
            start, end = block.line + command.output_start, block.line + command.output_end  # 0-based file lines
            replacements.append((start, end, [line.rstrip() for line in _trimmed(printed)]))
            continue
        raise AssertionError(
            f"{_shown_path(block.page)}:{first_line}: `$ {command.command}` (exit code {result.returncode}) printed something else than "
            f"the page shows (refresh with `python -m pytest tests/test_docs_examples.py --update-examples`)\n"
            f"--- shown ---\n" + "\n".join(shown) + f"\n--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n{_tail(result.stderr)}"
        )


# A page's python blocks run in one Python process of their own, in order and in one namespace, so
# that what an example registers or changes (a method registry, a global setting) stays out of the
# test session. The blocks' own output goes to a file; the protocol uses the process's stdout.
PYTHON_SESSION = r"""
import json, os, sys, traceback
replies = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # the examples' own prints (and their child processes') go to the log, not the replies
sys.stdout = sys.stderr
namespace = {"__name__": "__main__"}
for request in sys.stdin:
    request = json.loads(request)
    try:
        exec(compile(request["source"], request["where"], "exec"), namespace)
        reply = {"ok": True}
    except BaseException:
        reply = {"ok": False, "traceback": traceback.format_exc()}
    sys.stderr.flush()
    replies.write(json.dumps(reply) + "\n")
    replies.flush()
"""


class PythonSession:
    """The Python process of one page's python blocks, started at its first block."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.process: subprocess.Popen | None = None
        descriptor, log = tempfile.mkstemp(prefix="docs-example-python-", suffix=".log")  # outside the page's directory
        os.close(descriptor)
        self.log = Path(log)

    def run(self, block: Block) -> None:
        if self.process is None:
            self.process = subprocess.Popen(
                [sys.executable, "-c", PYTHON_SESSION], cwd=self.workdir, env=example_environment(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True,
            )
        source = "\n".join(block.lines) + "\n"
        self.process.stdin.write(json.dumps({"source": source, "where": block.where}) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], COMMAND_TIMEOUT_S)
        if not ready:
            self.process.kill()
            raise AssertionError(f"{block.where}: python example still running after {COMMAND_TIMEOUT_S} s")
        reply_line = self.process.stdout.readline()
        reply = json.loads(reply_line) if reply_line else {"ok": False, "traceback": "the Python process ended"}
        if not reply["ok"]:
            raise AssertionError(f"{block.where}: python example failed\n{reply['traceback']}\n--- output ---\n{_tail(self.log.read_text())}")

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process.stdout.close()
        self.log.unlink(missing_ok=True)


def apply_replacements(page: Path, indent_by_start: dict[int, str], replacements: list[tuple[int, int, list[str]]]) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    for start, end, new_lines in sorted(replacements, reverse=True):
        indent = indent_by_start.get(start, "")
        lines[start:end] = [f"{indent}{line}" if line else "" for line in new_lines]
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_page(page: Path, workdir: Path, not_run: list[str], update: bool = False) -> int:
    """Run every example of `page` in `workdir`, in order; returns how many blocks ran."""
    python = PythonSession(workdir)
    replacements: list[tuple[int, int, list[str]]] = []
    indents: dict[int, str] = {}
    ran = 0
    try:
        for block in extract_blocks(page):
            if not runnable(block):
                continue
            if block.skip_reason:
                not_run.append(f"{block.where}: {block.skip_reason}")
                continue
            kind = LANGUAGES[block.language]
            if kind == "bash":
                run_bash(block, workdir, not_run)
            elif kind == "console":
                before = len(replacements)
                run_console(block, workdir, update, replacements)
                for start, _, _ in replacements[before:]:
                    indents[start] = block.indent
            else:
                python.run(block)
            ran += 1
    finally:
        python.close()
    if replacements:
        apply_replacements(page, indents, replacements)
    return ran


# --- the pages -----------------------------------------------------------------------------------


def example_pages() -> list[Path]:
    docs = REPOSITORY / "docs"
    pages = [REPOSITORY / "README.md", *sorted(docs.rglob("*.md"))] if docs.is_dir() else [REPOSITORY / "README.md"]
    return [page for page in pages if page.is_file() and "hooks" not in page.relative_to(REPOSITORY).parts]


def _page_parameters() -> list:
    parameters = []
    for page in example_pages():
        blocks = [block for block in extract_blocks(page) if runnable(block)]
        if not blocks:
            continue
        slow = any(SLOW_EXAMPLE.search("\n".join(block.lines)) for block in blocks if not block.skip_reason)
        parameters.append(pytest.param(page, id=_shown_path(page), marks=[pytest.mark.slow] if slow else []))
    return parameters


@pytest.mark.parametrize("page", _page_parameters())
def test_page_examples_run_and_print_what_they_show(page, tmp_path, request, examples_not_run):
    run_page(page, tmp_path, examples_not_run, update=request.config.getoption("--update-examples"))


def test_api_docstring_examples():
    """The `>>>` examples in churnsim.api's docstrings (doctest): the API's own example cannot drift."""
    import churnsim.api

    result = doctest.testmod(churnsim.api, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, "churnsim/api.py has no `>>>` examples left to check"
    assert result.failed == 0, f"{result.failed} of churnsim.api's docstring examples print something else (see above)"


# --- the machinery itself, on small pages --------------------------------------------------------


def test_output_matching_elides_with_dots_and_ignores_trailing_whitespace():
    assert output_matches(["a", "...", "d"], ["a", "b", "c", "d  ", ""])
    assert output_matches(["a", "...", "b"], ["a", "b"])
    assert output_matches(["took ... s"], ["took 1.25 s"])
    assert not output_matches(["a", "b"], ["a", "c"])
    assert not output_matches(["a"], ["a", "extra"])
    assert not output_matches(["a", "...", "d"], ["a", "b"])


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_blocks_keep_order_language_indentation_and_skip_reasons(tmp_path):
    page = _page(
        tmp_path,
        "# Title\n\n```bash\necho one\n```\n\n1. A step:\n\n    ```console\n    $ echo two\n    two\n    ```\n\n"
        '<!-- example: skip reason="needs a GPU" -->\n```python\nimport torch\n```\n\n````markdown\n```bash\nnot a block\n```\n````\n',
    )
    blocks = extract_blocks(page)
    assert [(block.line, block.language, block.skip_reason) for block in blocks] == [
        (3, "bash", None), (9, "console", None), (15, "python", "needs a GPU"), (19, "markdown", None),
    ]
    assert blocks[1].lines == ("$ echo two", "two") and blocks[1].indent == "    "
    assert blocks[3].lines == ("```bash", "not a block", "```")


def test_a_failing_bash_command_is_named_with_its_page_line(tmp_path):
    page = _page(tmp_path, "# T\n\n```bash\ntouch made.txt\ntest -f made.txt\nfalse\necho never\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:6: bash example `false` exited with 1"):
        run_page(page, tmp_path, [])


def test_blocks_of_a_page_share_the_working_directory_and_namespace(tmp_path):
    page = _page(
        tmp_path,
        "```bash\necho 42 > answer.txt\n```\n\n```python\nvalue = int(open('answer.txt').read())\n```\n\n"
        "```python\nassert value == 42\n```\n\n```console\n$ cat answer.txt\n42\n```\n",
    )
    assert run_page(page, tmp_path, []) == 4


def test_console_output_is_checked_and_refreshed_on_request(tmp_path):
    text = "Intro\n\n- item\n\n  ```console\n  $ printf 'hello\\nworld\\n'\n  bye\n  $ echo same\n  same\n  ```\n\nEnd\n"
    page = _page(tmp_path, text)
    with pytest.raises(AssertionError, match=r"page\.md:6: `\$ printf"):
        run_page(page, tmp_path, [])
    assert page.read_text() == text  # checking writes nothing
    run_page(page, tmp_path, [], update=True)
    assert page.read_text() == text.replace("  bye\n", "  hello\n  world\n")
    run_page(page, tmp_path, [])  # what was refreshed now passes


def test_skips_pip_install_and_the_test_suite_are_reported(tmp_path):
    page = _page(
        tmp_path,
        '<!-- example: skip reason="needs several machines" -->\n```bash\nexit 1\n```\n\n'
        '```bash\npip install -e ".[test]" && python -m pytest\necho ran > ran.txt\n```\n',
    )
    not_run: list[str] = []
    assert run_page(page, tmp_path, not_run) == 1
    assert (tmp_path / "ran.txt").read_text() == "ran\n"
    assert not_run == [
        f"{page}:2: needs several machines",
        f'{page}:7: `pip install -e ".[test]"`: pip install (taken as already satisfied)',
        f"{page}:7: `python -m pytest`: runs the test suite that runs this example",
    ]


def test_python_examples_run_apart_from_the_test_session(tmp_path):
    import churnsim.calibration.methods as methods

    page = _page(
        tmp_path,
        "```python\nimport churnsim.calibration.methods as methods\nmethods.METHOD_CONFIGS['leaked'] = None\nprint('to the log')\n```\n\n"
        "```python\nassert 'leaked' in methods.METHOD_CONFIGS\nraise ValueError('second block')\n```\n",
    )
    with pytest.raises(AssertionError, match=r"(?s)page\.md:7: python example failed\n.*ValueError: second block.*--- output ---\nto the log"):
        run_page(page, tmp_path, [])
    assert "leaked" not in methods.METHOD_CONFIGS
    assert sorted(path.name for path in tmp_path.iterdir()) == ["page.md"]  # nothing of the runner's in the page's directory


def test_console_blocks_may_show_stderr_but_need_not_show_progress(tmp_path):
    page = _page(
        tmp_path,
        "```console\n$ sh -c 'echo working >&2; echo answer'\nanswer\n$ sh -c 'echo \"churnsim: error: bad\" >&2; exit 2'\n"
        "churnsim: error: bad\n```\n",
    )
    assert run_page(page, tmp_path, []) == 1
    wrong = _page(tmp_path, "```console\n$ sh -c 'echo answer; echo warning: few >&2'\nanswer\nwarning: many\n```\n")
    with pytest.raises(AssertionError, match=r"(?s)page\.md:2: .*--- stderr ---\nwarning: few"):
        run_page(wrong, tmp_path, [])
