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
"""

from __future__ import annotations

import json
import os
from typing import Any

from .safe_codec import from_json_tree, to_json_tree



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
        try:
            with open(self.path, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            return
        previous: dict[str, list[dict[str, Any]]] = {kind: [] for kind in self.lists}
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill: the rows before it are complete
            if entry.get("kind") == "truncate":
                from_step = int(entry["from_step"])
                previous["iteration"] = [row for row in previous["iteration"] if row["step"] < from_step]
            elif entry.get("kind") in previous:
                previous[entry["kind"]].append(from_json_tree(entry["row"], where="journal row"))
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

