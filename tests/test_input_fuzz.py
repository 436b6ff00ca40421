"""Fuzz: every kind of input, mutated at random, meets the promise for bad input.

Kinds: a scenario file, a calibration file, a failure schedule, a spot-instance trace (two formats),
a run record (its manifest and tables), command-line flags, and bad paths (a device, a FIFO, a link
loop, a path too long, JSON nested too deep or with a huge integer, ...) in every path slot of every
command; plus the bad inputs issue 45 names, each refused in one line. Each case mutates one valid input
(a value swapped for a wrong type, an extreme or a non-number; a key deleted or added; the file
truncated, emptied or filled with bytes that are not UTF-8; a CSV cell, header or row broken) and runs
the command that reads it, in this process. The promise: the command either succeeds (exit 0; many
mutations are still valid inputs) or exits with code 2 after exactly one stderr line
`churnsim: error: ...`, with no traceback and nothing written. An exception escaping `main` fails
the case with its traceback.

The cases are drawn from a seeded generator (deterministic under CI); `CHURNSIM_FUZZ_CASES` sets how
many per kind, `CHURNSIM_FUZZ_SEED` the seed, to hunt with more.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from churnsim.calibration.builtin import CALIBRATION_DIRECTORY
from churnsim.calibration.churn import TRACE_DIRECTORY
from churnsim.calibration.presets import preset
from churnsim.cli import main

CASES_PER_KIND = int(os.environ.get("CHURNSIM_FUZZ_CASES", "24"))
SEED = int(os.environ.get("CHURNSIM_FUZZ_SEED", "20261126"))

BAD_VALUES = (
    None, -1, 0, -0.5, 1e308, 1e-300, 10**12, -(10**15), "", "abc", "1e999", "NaN", [], [1, "x"], {}, {"kind": "nope"},
    True, 2.5, 10**9, "../../etc/passwd", "\u0000", "ü" * 200,
)
BAD_CELLS = ("", "nan", "inf", "-1", "-1e9", "1e309", "1e-300", "abc", "12abc", "99999999999999999999", "0x10", " ", "1,2", '"', "\x00")


# -- mutations ---------------------------------------------------------------------------------------


def _leaf_paths(value, prefix=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaf_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaf_paths(item, (*prefix, index))
    if prefix:
        yield prefix


def _container(data, path):
    for key in path[:-1]:
        data = data[key]
    return data


def mutate_json_text(text: str, rng: random.Random) -> bytes:
    """One mutation of a JSON document: a value, a deleted or added key, or broken bytes."""
    choice = rng.random()
    if choice < 0.15:
        return _mutate_bytes(text.encode(), rng)
    data = json.loads(text)
    paths = list(_leaf_paths(data))
    path = rng.choice(paths)
    container = _container(data, path)
    if choice < 0.30:
        if isinstance(container, dict):
            del container[path[-1]]
        else:
            container.pop(path[-1])
    elif choice < 0.40 and isinstance(container, dict):
        container[rng.choice(["extra", "Kind", "num_stagez", "__class__"])] = rng.choice(BAD_VALUES)
    else:
        container[path[-1]] = rng.choice(BAD_VALUES)
    # json.dumps writes NaN/Infinity for floats that are not finite; strict readers must refuse them.
    return json.dumps(data).encode()


def mutate_lines_text(text: str, rng: random.Random, separator: str | None = ",") -> bytes:
    """One mutation of a line-based file (CSV or JSON lines): a cell, the header, rows, or bytes."""
    choice = rng.random()
    if choice < 0.15:
        return _mutate_bytes(text.encode(), rng)
    lines = text.splitlines()
    data_lines = [i for i, line in enumerate(lines) if line and not line.startswith("#")]
    index = rng.choice(data_lines)
    if choice < 0.25:
        del lines[index]
    elif choice < 0.35:
        lines.insert(index, lines[index])  # a duplicated row (or header)
    elif choice < 0.45:
        lines = lines[: index + 1] + lines[index + 1 :][::-1]  # rows out of order
    elif separator is None:  # JSON lines: break one record
        lines[index] = mutate_json_text(lines[index], rng).decode("utf-8", "replace").replace("\n", " ")
    else:
        cells = lines[index].split(separator)
        cell = rng.randrange(len(cells))
        if rng.random() < 0.2 and len(cells) > 1:
            cells.pop(cell)
        else:
            cells[cell] = rng.choice(BAD_CELLS)
        lines[index] = separator.join(cells)
    return ("\n".join(lines) + "\n").encode()


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    choice = rng.random()
    if choice < 0.25:
        return b""
    if choice < 0.5:
        return data[: rng.randrange(max(1, len(data)))]
    if choice < 0.75:
        position = rng.randrange(max(1, len(data)))
        return data[:position] + bytes(rng.randrange(256) for _ in range(8)) + data[position:]
    return b"\xff\xfe\x00garbage\x80\x81" * 4


# -- running one case --------------------------------------------------------------------------------


def _listing(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*")}


def assert_promise(arguments: list[str], directory: Path, capsys, description: str) -> tuple[int, str]:
    """Run `churnsim ARGUMENTS` in `directory`: exit 0, or exit 2 with one line and nothing written.

    Returns the exit code and stderr."""
    before = _listing(directory)
    previous = Path.cwd()
    os.chdir(directory)
    try:
        with pytest.raises(SystemExit) as ended:
            main(arguments)
            raise SystemExit(0)
    finally:
        os.chdir(previous)
    stderr = capsys.readouterr().err
    code = ended.value.code
    assert code in (0, 2), f"{description}: exit code {code}\n{stderr}"
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("churnsim: error: "), f"{description}: {stderr!r}"
        assert "Traceback" not in stderr and "object has no attribute" not in stderr, f"{description}: {stderr!r}"
        assert _listing(directory) == before, f"{description}: wrote {sorted(_listing(directory) - before)}"
    return code, stderr


def _cases(kind: str) -> list[int]:
    return [pytest.param(index, id=f"{kind}-{index}") for index in range(CASES_PER_KIND)]


def _rng(kind: str, index: int) -> random.Random:
    return random.Random(f"{SEED}-{kind}-{index}")


# -- a small valid scenario the mutations start from -------------------------------------------------


def _base_scenario() -> dict:
    """cpu-tiny narrowed so that a mutation that stays valid simulates in well under a second."""
    data = json.loads(preset("cpu-tiny").model_dump_json())
    data["methods"] = [method for method in data["methods"] if method["name"] == "checkfree"]
    data["replications"] = 1
    data["target"] = {"loss": None, "iterations": 40, "max_wall_clock_s": 4 * 3600.0}
    return data


def _scenario_with_churn(churn: dict) -> dict:
    data = _base_scenario()
    data["churn"] = churn
    return data


@pytest.mark.parametrize("index", _cases("scenario"))
def test_a_mutated_scenario_file(index, tmp_path, capsys):
    rng = _rng("scenario", index)
    (tmp_path / "scenario.json").write_bytes(mutate_json_text(json.dumps(_base_scenario()), rng))
    command = rng.choice([["simulate", "scenario.json", "--out", "out"], ["real", "run", "scenario.json", "--write-config", "x.json", "--out", "out"]])
    assert_promise(command, tmp_path, capsys, f"scenario case {index}")


@pytest.mark.parametrize("index", _cases("schedule"))
def test_a_mutated_failure_schedule(index, tmp_path, capsys):
    rng = _rng("schedule", index)
    schedule = "# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind\n1.5,,1,scheduled\n30,,2,scheduled\n95.25,,0,scheduled\n"
    (tmp_path / "failures.csv").write_bytes(mutate_lines_text(schedule, rng))
    (tmp_path / "scenario.json").write_text(json.dumps(_scenario_with_churn({"kind": "schedule", "path": "failures.csv"})))
    assert_promise(["simulate", "scenario.json", "--out", "out"], tmp_path, capsys, f"schedule case {index}")


@pytest.mark.parametrize("index", _cases("schedule-replica"))
def test_a_mutated_failure_schedule_with_a_replica_column(index, tmp_path, capsys):
    rng = _rng("schedule-replica", index)
    schedule = "# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind,replica\n1.5,,1,scheduled,0\n30,,2,scheduled,\n95.25,,0,scheduled,0\n"
    (tmp_path / "failures.csv").write_bytes(mutate_lines_text(schedule, rng))
    (tmp_path / "scenario.json").write_text(json.dumps(_scenario_with_churn({"kind": "schedule", "path": "failures.csv"})))
    assert_promise(["simulate", "scenario.json", "--out", "out"], tmp_path, capsys, f"schedule-replica case {index}")


@pytest.mark.parametrize("index", _cases("trace"))
def test_a_mutated_trace(index, tmp_path, capsys):
    rng = _rng("trace", index)
    if rng.random() < 0.5:
        text = (TRACE_DIRECTORY / "bamboo" / "p3-trace.csv").read_text()
        (tmp_path / "trace.csv").write_bytes(mutate_lines_text("\n".join(text.splitlines()[:60]), rng))
        churn = {"kind": "trace", "path": "trace.csv", "format": "bamboo_csv"}
    else:
        text = (TRACE_DIRECTORY / "parcae" / "gpt-1.5b_trace_hl_15_25.jsonl").read_text()
        (tmp_path / "trace.jsonl").write_bytes(mutate_lines_text("\n".join(text.splitlines()[:30]), rng, separator=None))
        churn = {"kind": "trace", "path": "trace.jsonl", "format": "parcae_jsonl"}
    (tmp_path / "scenario.json").write_text(json.dumps(_scenario_with_churn(churn)))
    assert_promise(["simulate", "scenario.json", "--out", "out"], tmp_path, capsys, f"trace case {index}")


@pytest.fixture(scope="module")
def run_record(tmp_path_factory) -> Path:
    """A simulated run record of cpu-tiny (the same format a real run writes)."""
    directory = tmp_path_factory.mktemp("record")
    (directory / "scenario.json").write_text(json.dumps(_base_scenario()))
    previous = Path.cwd()
    os.chdir(directory)
    try:
        with pytest.raises(SystemExit) as ended:
            main(["simulate", "scenario.json", "--out", "simulated"])
            raise SystemExit(0)
    finally:
        os.chdir(previous)
    assert ended.value.code == 0
    return directory / "simulated" / "records" / "checkfree-r0"


@pytest.mark.parametrize("index", _cases("record"))
def test_a_mutated_run_record(index, tmp_path, capsys, run_record):
    rng = _rng("record", index)
    record = tmp_path / "record"
    shutil.copytree(run_record, record)
    victim = rng.choice(sorted(path for path in record.iterdir() if path.is_file()))
    text = victim.read_text()
    victim.write_bytes(mutate_json_text(text, rng) if victim.suffix == ".json" else mutate_lines_text(text, rng))
    assert_promise(["validate", "--calibration", "cpu-tiny", "record", "--out", "out", "--no-figures"], tmp_path, capsys, f"record case {index} ({victim.name})")


@pytest.mark.parametrize("index", _cases("calibration"))
def test_a_mutated_calibration_file(index, tmp_path, capsys, run_record):
    rng = _rng("calibration", index)
    text = (CALIBRATION_DIRECTORY / "cpu-tiny.json").read_text()
    (tmp_path / "calibration.json").write_bytes(mutate_json_text(text, rng))
    shutil.copytree(run_record, tmp_path / "record")
    assert_promise(["validate", "--calibration", "calibration.json", "record", "--out", "out", "--no-figures"], tmp_path, capsys, f"calibration case {index}")


FLAG_COMMANDS = (  # on the small scenario, so that a command whose flags stay valid finishes in seconds
    ["simulate", "tiny.json", "--method", "checkfree", "--replications", "1", "--out", "out"],
    ["whatif", "--scenario", "tiny.json", "--quick", "--rates", "0.1", "--workers", "1", "--no-figures", "--max-work", "1", "--out", "out"],
    ["sweep", "tiny.json", "--replications", "1", "--set", "pipeline.num_microbatches=2,4", "--out", "out"],
    ["recommend", "tiny.json", "--replications", "1", "--workers", "1"],
    ["real", "run", "tiny.json", "--method", "checkfree", "--write-config", "x.json", "--out", "out"],
    ["plot", "missing-results"],
)
FLAG_VALUES = (
    "-1", "0", "abc", "", "1e999", "nan", "99999999999999999999", "/proc/x", "--", "=", "a=b=c", "pipeline.num_stages=",
    # Lists of values: empty, repeated and bracketed ones.
    "0.1,,0.2", "0.1,", "0.1,0.10", "pipeline.num_microbatches=4,4", "pipeline.layers_per_stage=[1,1,1,1],[1,1,2", '"a,b"',
)


@pytest.mark.parametrize("index", _cases("flags"))
def test_mutated_flags(index, tmp_path, capsys):
    rng = _rng("flags", index)
    (tmp_path / "tiny.json").write_text(json.dumps(_base_scenario()))
    command = list(rng.choice(FLAG_COMMANDS))
    flag_positions = [i for i, word in enumerate(command) if word.startswith("--") and i + 1 < len(command) and not command[i + 1].startswith("--")]
    choice = rng.random()
    if choice < 0.5 and flag_positions:
        command[rng.choice(flag_positions) + 1] = rng.choice(FLAG_VALUES)  # a bad value for a real flag
    elif choice < 0.7:
        command.append(rng.choice(["--set", "--rates", "--seed", "--replications", "--workers", "--method", "--out"]))  # a flag without its value
        if rng.random() < 0.5:
            command.append(rng.choice(FLAG_VALUES))
    elif choice < 0.85:
        command.insert(rng.randrange(1, len(command) + 1), rng.choice(["--no-such-flag", "-x", "--preset", "extra-argument"]))
    else:
        command += ["--set", rng.choice(["pipeline.num_microbatches=1000000000000", "churn.failure_probability_per_stage_hour=1",
                                         "target.max_wall_clock_s=1e15", "replications=1000000000", "model.num_layers=-3",
                                         "pipeline.num_stages=100000", "seed=nan", "pipeline.layers_per_stage=[1,1,1,1]",
                                         "pipeline.layers_per_stage=[1,[2]]", 'name="a,b"'])]
    assert_promise(command, tmp_path, capsys, f"flags case {index}: {command}")


def test_the_mutations_are_not_all_trivially_refused(tmp_path):
    """Guards the fuzzer itself: some mutated scenarios must still be valid scenario files."""
    from churnsim.calibration.errors import InputError
    from churnsim.calibration.scenario import load_scenario

    valid = 0
    for index in range(40):
        path = tmp_path / f"s{index}.json"
        path.write_bytes(mutate_json_text(json.dumps(_base_scenario()), _rng("guard", index)))
        try:
            load_scenario(str(path))
            valid += 1
        except InputError:
            pass
    assert 0 < valid < 40


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        (["simulate", "tiny.json", "--set", "pipeline.num_microbatches=1000000000000", "--out", "out"], "pipeline.num_microbatches = 1000000000000"),
        (["simulate", "poisson.json", "--out", "out"], "expected to fail 1.6e+10 stages"),
        (["simulate", "tiny.json", "--set", "replications=100000000", "--out", "out"], "replications = 100000000"),
        (["sweep", "tiny.json", "--set", "replications=1,100000000", "--out", "out"], "grid point"),
        (["recommend", "tiny.json", "--replications", "100000000"], "100,000,000 replications"),
        (["whatif", "--scenario", "tiny.json", "--replications", "100000000", "--out", "out"], "100,000,000 replications"),
        (["whatif", "--scenario", "tiny.json", "--workers", "99999999999", "--out", "out"], "--workers 99999999999"),
        (["simulate", "tiny.json", "--out", "/proc/churnsim-out"], "cannot write there"),
        (["real", "run", "tiny.json", "--method", "checkfree", "--write-config", "/proc/x.json", "--out", "out"], "cannot write a file"),
    ],
)
def test_sizes_that_would_exhaust_memory_or_time_are_refused_up_front(arguments, fragment, tmp_path, capsys):
    (tmp_path / "tiny.json").write_text(json.dumps(_base_scenario()))
    (tmp_path / "poisson.json").write_text(json.dumps(_scenario_with_churn({"kind": "poisson", "failures_per_node_hour": 1e9})))
    code, stderr = assert_promise(arguments, tmp_path, capsys, " ".join(arguments))
    assert code == 2 and fragment in stderr, stderr


@pytest.mark.parametrize("stages", [10_000])
def test_ten_thousand_stages_are_refused_naming_the_field(stages, tmp_path, capsys):
    data = _base_scenario()
    data["model"]["num_layers"] = stages
    data["pipeline"]["num_stages"] = stages
    data["compute"]["block_forward_s"] = data["compute"]["block_backward_s"] = 0.001  # one time for every stage
    (tmp_path / "big.json").write_text(json.dumps(data))
    code, stderr = assert_promise(["simulate", "big.json", "--out", "out"], tmp_path, capsys, "10,000 stages")
    assert code == 2 and "pipeline.num_stages = 10000" in stderr, stderr


# -- bad paths and file kinds, every command ---------------------------------------------------------
#
# Each case puts one bad path (a device, a FIFO, a symlink loop, a dangling link, a directory, a file
# where a directory belongs, a path too long, a file nested too deep or with a huge integer, binary
# bytes) in one path slot of one command. The promise is the same as above, and no case may block:
# an alarm turns a hang (a FIFO read) into a failure.

BAD_PATH_KINDS = ("dev-zero", "fifo", "loop", "dangling", "directory", "long", "deep-json", "big-integer", "binary", "empty")


def _make_bad_path(kind: str, directory: Path) -> str:
    if kind == "dev-zero":
        return "/dev/zero"
    path = directory / f"bad-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "dangling":
        path.symlink_to("nowhere-at-all")
    elif kind == "directory":
        path.mkdir()
    elif kind == "long":
        return "p" * 10_000
    elif kind == "deep-json":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "big-integer":
        path.write_text('{"schema_version": 1, "seed": ' + "7" * 5000 + "}")
    elif kind == "binary":
        path.write_bytes(b"\x00\xff\xfe garbage \x80" * 64)
    elif kind == "empty":
        path.write_bytes(b"")
    return path.name


def _scenario_with(directory: Path, section: str, field: str, value) -> str:
    data = _base_scenario()
    data.setdefault(section, {})[field] = value
    (directory / "with-field.json").write_text(json.dumps(data))
    return "with-field.json"


# One entry per path slot: the command line with PATH where the bad path goes (a function of the
# directory for slots inside a scenario file). Commands that would start real work with a good path
# in that slot are given one that fails before any work.
PATH_SLOTS = {
    "simulate-scenario": ["simulate", "PATH", "--out", "out"],
    "simulate-out": ["simulate", "tiny.json", "--out", "PATH"],
    "simulate-calibration": ["simulate", "tiny.json", "--calibration", "PATH", "--out", "out"],
    "whatif-scenario": ["whatif", "--scenario", "PATH", "--quick", "--workers", "1", "--no-figures", "--out", "out"],
    "whatif-out": ["whatif", "--scenario", "tiny.json", "--quick", "--rates", "0.1", "--workers", "1", "--no-figures", "--out", "PATH"],
    "whatif-calibration": ["whatif", "--scenario", "tiny.json", "--calibration", "PATH", "--quick", "--out", "out"],
    "sweep-scenario": ["sweep", "PATH", "--set", "pipeline.num_microbatches=2", "--out", "out"],
    "sweep-out": ["sweep", "tiny.json", "--set", "pipeline.num_microbatches=2", "--replications", "1", "--out", "PATH"],
    "recommend-scenario": ["recommend", "PATH", "--replications", "1", "--workers", "1"],
    "recommend-calibration": ["recommend", "tiny.json", "--calibration", "PATH"],
    "real-run-scenario": ["real", "run", "PATH", "--method", "checkfree", "--write-config", "x.json", "--out", "out"],
    "real-run-out": ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=bad-missing", "--out", "PATH"],
    "real-run-write-config": ["real", "run", "tiny.json", "--method", "checkfree", "--write-config", "PATH", "--out", "out"],
    # A good corpus would start a real run: the remote directory (checked after the corpus) stops it.
    "real-run-corpus": ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=PATH",
                        "--set", "training.remote_checkpoint_dir=/dev/null", "--out", "out"],
    "real-run-remote": ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=bad-missing",
                        "--set", "training.remote_checkpoint_dir=PATH", "--out", "out"],
    "validate-calibration": ["validate", "--calibration", "PATH", "record", "--out", "out", "--no-figures"],
    "validate-record": ["validate", "--calibration", "cpu-tiny", "PATH", "--out", "out", "--no-figures"],
    "validate-out": ["validate", "--calibration", "cpu-tiny", "record", "--out", "PATH", "--no-figures"],
    "calibrate-runs": ["calibrate", "--runs", "PATH", "--out", "c.json"],
    "calibrate-out": ["calibrate", "--runs", "record", "--out", "PATH"],
    "calibrate-setback-table": ["calibrate", "--convergence", "--setback-table", "PATH", "--out", "c.json"],
    "plot-results": ["plot", "PATH"],
    "plot-out": ["plot", "results", "--out", "PATH"],
    "reproduce-out": ["reproduce", "datastates", "--no-figures", "--out", "PATH"],
    "presets-show": ["presets", "--show", "PATH"],
    "schedule-path": lambda directory, path: ["simulate", _scenario_with(directory, "churn", "path", path), "--out", "out"],
    "trace-path": lambda directory, path: ["simulate", _scenario_with(directory, "churn", "path", path), "--out", "out"],
}
"""Where a good path would start minutes of work (reproduce, a real run), the slot is one whose bad value stops it first."""


class _Hang(Exception):
    pass


def _alarm(signal_number, frame):
    raise _Hang("the command blocked (a FIFO read?)")


def _run_with_alarm(arguments, directory, capsys, description, seconds=60):
    import signal

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return assert_promise(arguments, directory, capsys, description)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _path_case_arguments(slot: str, kind: str, directory: Path) -> list[str]:
    (directory / "tiny.json").write_text(json.dumps(_base_scenario()))
    bad = _make_bad_path(kind, directory)
    template = PATH_SLOTS[slot]
    if callable(template):
        churn_kind = "schedule" if slot == "schedule-path" else "trace"
        data = _base_scenario()
        data["churn"] = {"kind": churn_kind, "path": bad} | ({"format": "bamboo_csv"} if churn_kind == "trace" else {})
        (directory / "with-field.json").write_text(json.dumps(data))
        return ["simulate", "with-field.json", "--out", "out"]
    return [word.replace("PATH", bad) for word in template]


def _path_cases() -> list:
    rng = random.Random(f"{SEED}-paths")
    cases = [(slot, kind) for slot in PATH_SLOTS for kind in BAD_PATH_KINDS]
    rng.shuffle(cases)
    count = int(os.environ.get("CHURNSIM_FUZZ_PATH_CASES", str(2 * CASES_PER_KIND)))
    return [pytest.param(slot, kind, id=f"path-{slot}-{kind}") for slot, kind in sorted(cases[:count])]


@pytest.fixture
def path_case_directory(tmp_path, run_record) -> Path:
    shutil.copytree(run_record, tmp_path / "record")
    shutil.copytree(run_record.parent.parent, tmp_path / "results", ignore=shutil.ignore_patterns("records", "timelines"))
    return tmp_path


@pytest.mark.parametrize("slot, kind", _path_cases())
def test_a_bad_path_in_any_slot_of_any_command(slot, kind, path_case_directory, capsys):
    arguments = _path_case_arguments(slot, kind, path_case_directory)
    code, stderr = _run_with_alarm(arguments, path_case_directory, capsys, f"{slot} with a {kind} path")
    text_kinds = ("deep-json", "big-integer")  # text files: a fine corpus
    if kind in ("dev-zero", "fifo", "loop", "long", *text_kinds) and slot != "presets-show" and not (slot == "real-run-corpus" and kind in text_kinds):
        assert code == 2, f"{slot} with a {kind} path was accepted: {stderr}"


def test_every_command_has_a_path_slot():
    """The slots above cover every command churnsim has."""
    from churnsim.app import app, real_app
    from churnsim.cli import _register_commands

    _register_commands()
    commands = {command.name for command in app.registered_commands} | {f"real {command.name}" for command in real_app.registered_commands}
    covered = {" ".join(template[:2]) if template[0] == "real" else template[0]
               for template in PATH_SLOTS.values() if not callable(template)}
    assert commands <= covered, sorted(commands - covered)


# -- the issue's named cases (issue 45): each must be refused in one line, at once ---------------------


def _deep(directory: Path) -> None:
    (directory / "deep.json").write_text("[" * 200_000 + "]" * 200_000)


def _big_seed(directory: Path) -> None:
    text = json.dumps(_base_scenario())
    data = json.loads(text)
    (directory / "big-seed.json").write_text(text.replace(f'"seed": {data["seed"]}', '"seed": ' + "7" * 5000))


def _schedule_at(path: str):
    def setup(directory: Path) -> None:
        (directory / "at.json").write_text(json.dumps(_scenario_with_churn({"kind": "schedule", "path": path})))
    return setup


def _fifo(directory: Path) -> None:
    os.mkfifo(directory / "fifo")


def _loop(directory: Path) -> None:
    (directory / "loop").symlink_to("loop")


def _escaping_trace(directory: Path) -> None:
    """A relative trace path that leads out of the current directory through a link."""
    import tempfile

    elsewhere = Path(tempfile.mkdtemp(prefix="churnsim-fuzz-elsewhere-"))
    (elsewhere / "secret.csv").write_text("the first line of a secret,with,commas\n")
    (directory / "elsewhere").symlink_to(elsewhere, target_is_directory=True)
    (directory / "escape.json").write_text(json.dumps(_scenario_with_churn({"kind": "trace", "path": "elsewhere/secret.csv", "format": "bamboo_csv"})))


def _a_file(directory: Path) -> None:
    (directory / "a-file").write_text("x")


def _backwards_span(directory: Path) -> None:
    spans = directory / "record" / "spans.csv"
    lines = spans.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[1].split(",")
    start, end = header.index("start_s"), header.index("end_s")
    cells[start], cells[end] = "5.0", "1.0"
    lines[1] = ",".join(cells)
    spans.write_text("\n".join(lines) + "\n")


def _empty_corpus_directory(directory: Path) -> None:
    (directory / "corpus").mkdir()


NAMED_CASES = [
    ("dev-zero-scenario", None, ["simulate", "/dev/zero", "--out", "out"], "is a device"),
    ("dev-zero-scenario-whatif", None, ["whatif", "--scenario", "/dev/zero", "--out", "out"], "is a device"),
    ("dev-zero-schedule", _schedule_at("/dev/zero"), ["simulate", "at.json", "--out", "out"], "is a device"),
    ("dev-zero-calibration", None, ["validate", "--calibration", "/dev/zero", "record", "--out", "out"], "--calibration"),
    ("fifo-scenario", _fifo, ["simulate", "fifo", "--out", "out"], "FIFO"),
    ("fifo-schedule", lambda d: (_fifo(d), _schedule_at("fifo")(d)), ["simulate", "at.json", "--out", "out"], "FIFO"),
    ("fifo-scenario-recommend", _fifo, ["recommend", "fifo"], "FIFO"),
    ("symlink-loop-scenario", _loop, ["sweep", "loop", "--set", "seed=1,2", "--out", "out"], "symbolic link loop"),
    ("symlink-loop-out", _loop, ["simulate", "tiny.json", "--out", "loop"], "symbolic link loop"),
    ("long-out", None, ["simulate", "tiny.json", "--out", "o" * 10_000], "10,000 characters"),
    ("long-out-real-run", None, ["real", "run", "tiny.json", "--method", "checkfree", "--out", "o" * 10_000], "10,000 characters"),
    ("json-200000-deep", _deep, ["simulate", "deep.json", "--out", "out"], "nested more than"),
    ("json-200000-deep-calibration", _deep, ["validate", "--calibration", "deep.json", "record", "--out", "out"], "nested more than"),
    ("seed-5000-digits-file", _big_seed, ["simulate", "big-seed.json", "--out", "out"], "5000 digits"),
    ("seed-5000-digits-set", None, ["simulate", "tiny.json", "--set", "seed=" + "7" * 5000, "--out", "out"], "5000 digits"),
    ("seed-5000-digits-flag", None, ["simulate", "tiny.json", "--seed", "7" * 5000, "--out", "out"], "--seed"),
    ("plot-out-at-a-file", _a_file, ["plot", "results", "--out", "a-file"], "is a file"),
    ("corpus-missing", None, ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=nothing-here", "--out", "out"], "training.corpus"),
    ("corpus-dev-zero", None, ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=/dev/zero", "--out", "out"], "is a device"),
    ("corpus-fifo", _fifo, ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=fifo", "--out", "out"], "FIFO"),
    ("corpus-empty-directory", _empty_corpus_directory, ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.corpus=corpus", "--out", "out"], "holds no files"),
    ("remote-directory-a-file", _a_file, ["real", "run", "tiny.json", "--method", "checkfree", "--set", "training.remote_checkpoint_dir=a-file", "--out", "out"], "is a file"),
    ("span-ends-before-it-starts", _backwards_span, ["validate", "--calibration", "cpu-tiny", "record", "--out", "out", "--no-figures"], "before it starts"),
    ("trace-path-escapes", _escaping_trace, ["simulate", "escape.json", "--out", "out"], "leads outside"),
    ("whatif-100000-replications", None, ["whatif", "--preset", "cpu-tiny", "--replications", "100000", "--out", "out"], "simulated runs"),
    ("whatif-5000-rates", None, ["whatif", "--preset", "cpu-tiny", "--rates", ",".join(f"{i / 5001:.6f}" for i in range(5000)), "--out", "out"], "--max-work"),
    ("sweep-a-million-points", None, ["sweep", "tiny.json", "--set", "seed=" + ",".join(map(str, range(1000))),
                                      "--set", "pipeline.microbatch_size=" + ",".join(map(str, range(1, 1001))), "--out", "out"], "1,000,000 grid point"),
    ("recommend-100000-replications", None, ["recommend", "--preset", "cpu-tiny", "--replications", "100000"], "simulated runs"),
    ("presets-unknown", None, ["presets", "--show", "x" * 5000], "preset"),
    ("reproduce-unknown-paper", None, ["reproduce", "x" * 300], ""),
    ("calibrate-runs-dev-zero", None, ["calibrate", "--runs", "/dev/zero", "--out", "c.json"], ""),
]


@pytest.mark.parametrize("name, setup, arguments, fragment", NAMED_CASES, ids=[case[0] for case in NAMED_CASES])
def test_the_issues_named_bad_inputs_are_refused_in_one_line(name, setup, arguments, fragment, path_case_directory, capsys):
    (path_case_directory / "tiny.json").write_text(json.dumps(_base_scenario()))
    if setup is not None:
        setup(path_case_directory)
    code, stderr = _run_with_alarm(arguments, path_case_directory, capsys, name)
    assert code == 2 and fragment in stderr, f"{name}: {stderr}"
    assert "first line of a secret" not in stderr
