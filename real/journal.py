"""Hard failures: one stage's results survive the death of its process.

A killed process takes its memory with it: the iteration rows (the last stage's losses), spans,
failure and recovery rows it gathered for the run record. Each stage process therefore appends what
it records to `journal-<stage>.jsonl` in the launcher's directory (one JSON tree per line,
real/safe_codec.py's encoding, no pickle), at every iteration's end and before anything that may
end the process. A replacement reads its predecessors' journal first and continues it, so the final
result of a stage covers every incarnation.

Entries: {"kind": "iteration" | "span" | "failure" | "recovery", "row": {...}}, and
{"kind": "truncate", "from_step": k}: steps >= k were abandoned (a re-formed group resumed at k),
so their iteration rows are dropped.

A launcher holding a run directory keeps the journals there, one folder per attempt of the run
(`<run_dir>/journal/attempt-<n>/stage-<s>.jsonl`; `--resume` starts the next attempt), so a run
whose launcher is killed (SIGKILL, a lost machine session) keeps every step any stage wrote before:
each row is written (one `write` of whole lines, no buffering in the process) as soon as the step
ends. That survives the death of every process; it is not fsynced per step, so a crash of the
machine itself may lose the last steps. `read_attempt` reads an attempt back; results.py joins
the attempts into one record.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .safe_codec import from_json_tree, to_json_tree

JOURNAL_DIRECTORY = "journal"
"""`<run_dir>/journal/`: the journals of every attempt of the run (= run_directory.JOURNAL_DIRECTORY)."""
KINDS = ("iteration", "span", "failure", "recovery")
_ATTEMPT = re.compile(r"attempt-(\d{1,6})")


def stage_journal_path(directory: str | Path, stage: int) -> str:
    """The journal of `stage` in an attempt's folder."""
    return os.path.join(directory, f"stage-{stage}.jsonl")


def memory_journal_path(directory: str | Path, slot: int) -> str:
    """A hard-failure worker's journal when the run has no run directory: in its node's memory folder."""
    return os.path.join(directory, f"journal-{slot}.jsonl")


def node_journal_path(directory: str | Path, stage: int, replica: int) -> str:
    """The journal of node (stage, replica): replica 0's is its stage's journal (the one `read_attempt`
    reads: it holds the run's failures and losses); other replicas keep theirs beside it."""
    return stage_journal_path(directory, stage) if replica == 0 else os.path.join(directory, f"replica-{replica}-stage-{stage}.jsonl")


def attempt_directories(run_dir: str | Path) -> list[Path]:
    """The attempt folders of a run, oldest first (`attempt-0` is the run's start, then each `--resume`)."""
    root = Path(run_dir) / JOURNAL_DIRECTORY
    try:
        names = [(int(match.group(1)), entry) for entry in root.iterdir() if (match := _ATTEMPT.fullmatch(entry.name)) and entry.is_dir()]
    except FileNotFoundError:
        return []
    return [entry for _, entry in sorted(names)]


def new_attempt_directory(run_dir: str | Path) -> Path:
    """Create the folder of the next attempt of the run in `run_dir` (the launcher holds its lock)."""
    earlier = attempt_directories(run_dir)
    number = int(earlier[-1].name.split("-")[1]) + 1 if earlier else 0
    path = Path(run_dir) / JOURNAL_DIRECTORY / f"attempt-{number}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def read_journal(path: str | Path) -> dict[str, list[dict[str, Any]]] | None:
    """The rows a journal file holds by kind (truncations applied), or None when there is no file.

    A last line cut short by a kill is skipped: the rows before it are complete."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except FileNotFoundError:
        return None
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if entry.get("kind") == "truncate":
            from_step = int(entry["from_step"])
            rows["iteration"] = [row for row in rows["iteration"] if row["step"] < from_step]
        elif entry.get("kind") in rows and isinstance(entry.get("row"), dict):
            row = from_json_tree(entry["row"], where="journal row")
            kept = rows[entry["kind"]]
            if entry["kind"] == "iteration" and kept and kept[-1]["step"] == row["step"]:
                kept[-1] = row  # the step's full row replaces the early one (`RankJournal.write_now`)
            else:
                kept.append(row)
    return rows


def read_attempt(directory: str | Path, num_stages: int) -> list[dict[str, list[dict[str, Any]]]]:
    """Every stage's rows of one attempt (a stage without a journal: no rows)."""
    return [read_journal(stage_journal_path(directory, stage)) or {kind: [] for kind in KINDS} for stage in range(num_stages)]



class RankJournal:
    """Mirrors a stage's result lists into an append-only file."""

    def __init__(self, path: str, lists: dict[str, list[dict[str, Any]]]) -> None:
        """`lists`: kind -> the live list the trainer appends rows to (iteration rows, spans, ...)."""
        self.path = path
        self.lists = lists
        self._written = {kind: len(rows) for kind, rows in lists.items()}
        self._pending: list[str] = []

    def replay(self) -> None:
        """Prepend the rows earlier incarnations of this stage wrote (call before recording anything)."""
        previous = read_journal(self.path)
        if previous is None:
            return
        for kind, rows in self.lists.items():
            rows[:0] = previous[kind]
            self._written[kind] = len(rows)

    def truncate_from(self, step: int) -> None:
        """Drop iteration rows of steps >= `step` here and in the file."""
        rows = self.lists["iteration"]
        self.flush()
        kept = [row for row in rows if row["step"] < step]
        if len(kept) != len(rows):
            rows[:] = kept
            self._written["iteration"] = len(rows)
            self._pending.append(json.dumps({"kind": "truncate", "from_step": step}))
            self.flush()

    def write_now(self, kind: str, row: dict[str, Any]) -> None:
        """Write `row` at once without adding it to the lists: an early version of an iteration row
        (the step's update applied, its held-out loss not yet known); the full row of the same step,
        added to the list later, replaces it when the journal is read back."""
        self.flush()  # keep the file in the lists' order
        self._pending.append(json.dumps({"kind": kind, "row": to_json_tree(row, where="journal row")}))
        self.flush()

    def flush(self) -> None:
        """Append every row recorded since the last flush (rows are not changed after they are added)."""
        for kind, rows in self.lists.items():
            start, end = self._written[kind], len(rows)  # a background thread may append meanwhile
            for row in rows[start:end]:
                self._pending.append(json.dumps({"kind": kind, "row": to_json_tree(row, where="journal row")}))
            self._written[kind] = end
        if not self._pending:
            return
        data = "".join(line + "\n" for line in self._pending).encode()
        self._pending.clear()
        # One write of whole lines: a kill can cut only the last one short (replay skips it).
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, data)
        finally:
            os.close(descriptor)

