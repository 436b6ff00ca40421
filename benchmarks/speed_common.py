"""Shared by the speed benchmarks (`sim_*speed*.py`): repeated timings that agree, and result files.

The machine these run on has two cores shared with other work, and its speed drifts, so every
measurement is repeated until two consecutive repetitions agree within 20 % (at most `max_rounds`),
and reported with all its repetitions, their median and spread. A closed-form timing and its
event-model reference (`simulate_run(..., reference_events=True)`) are taken in the same round, one
after the other, so their ratio is measured under the same conditions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

RESULTS_DIRECTORY = Path(__file__).resolve().parent / "results"
AGREEMENT = 0.20


@dataclass
class Timing:
    """Wall-clock seconds (and CPU seconds of this process) of every repetition of one measurement."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def add(self, wall_s: float, cpu_s: float) -> None:
        self.wall_s.append(wall_s)
        self.cpu_s.append(cpu_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def agreed_s(self) -> float:
        """The mean of the last two repetitions (the pair that agreed)."""
        return sum(self.wall_s[-2:]) / len(self.wall_s[-2:])

    def agrees(self) -> bool:
        if len(self.wall_s) < 2:
            return False
        a, b = self.wall_s[-2:]
        return abs(a - b) <= AGREEMENT * max(a, b)

    def summary(self) -> dict:
        return {
            "wall_s": [round(value, 6) for value in self.wall_s],
            "cpu_s": [round(value, 6) for value in self.cpu_s],
            "agreed_s": round(self.agreed_s, 6),
            "median_s": round(self.median_s, 6),
            "min_s": round(min(self.wall_s), 6),
            "max_s": round(max(self.wall_s), 6),
            "last_two_agree_within_20_percent": self.agrees(),
        }


def timed(function: Callable[[], object]) -> tuple[float, float, object]:
    """Wall-clock and CPU seconds of one call, from a clean heap: earlier measurements' garbage (the
    event model leaves reference cycles by the million) is collected first, so that its collection
    is not charged to whichever later run happens to trigger it. The call's own collections count."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    value = function()
    return time.perf_counter() - wall, time.process_time() - cpu, value


def repeat_until_agreed(measure: Callable[[], dict[str, tuple[float, float]]], *, max_rounds: int = 6, min_rounds: int = 2) -> dict[str, Timing]:
    """Call `measure` (one round: name → (wall_s, cpu_s)) until every name's last two rounds agree."""
    timings: dict[str, Timing] = {}
    for round_index in range(max_rounds):
        for name, (wall_s, cpu_s) in measure().items():
            timings.setdefault(name, Timing()).add(wall_s, cpu_s)
        if round_index + 1 >= min_rounds and all(timing.agrees() for timing in timings.values()):
            break
    return timings


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": [round(value, 2) for value in load],
        "git_head": commit,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "closed_form_engine": closed_form_engine(),
    }


def closed_form_engine() -> str:
    """Which build of the closed-form engine this process runs: a regular install's, compiled by mypyc
    (setup.py), or an editable install's source."""
    from churnsim.sim.model.closed_form import COMPILED

    return "compiled (mypyc)" if COMPILED else "source (pure Python)"


def write_result(name: str, payload: dict, *, report: bool = True) -> Path:
    """The result file `results/<name>.json` and, with `report`, its dated report (benchmarks/report.py)."""
    RESULTS_DIRECTORY.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIRECTORY / f"{name}.json"
    print(f"closed-form engine: {closed_form_engine()}")
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    if report:
        from report import write_report

        variant = "closed-form-only" if name.endswith("-closed-form-only") else ""
        print(f"wrote {write_report(name.removesuffix('-closed-form-only'), path, variant=variant)}")
    return path
