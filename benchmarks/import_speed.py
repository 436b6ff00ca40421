"""How long do a CLI process's help and an import of the simulator take? (issue 11, target ≤ 0.3 s)

Each command runs in a fresh interpreter (`subprocess`), wall clock from start to exit, repeated
until two runs agree within 20 % (benchmarks/speed_common.py):
- `churnsim simulate --help` (the console script: typer and the command modules; rich, pydantic and
  the simulator load only when a command runs);
- `python -c "import churnsim.sim"` (the package, as the target names it);
- `python -c "import churnsim.sim.model.run"` (what a script that calls `simulate_run` imports);
- `python -c "pass"` (the interpreter's own start, for scale);
- a script's first simulated run (`FIRST_RUN`: imports, a preset, its failure path, a short run of
  checkfree), no target: what the imports cost a script, with whatever a run imports on first use.
Also lists the ten heaviest imports of `churnsim.sim.model.run` (`python -X importtime`). There is no
event-model reference here: imports are the same in both engines. Writes
benchmarks/results/import-speed.json.

Bytecode: a user's second command finds churnsim's modules compiled in `__pycache__` (Python writes
them on the first import), so the timed commands run with bytecode writing allowed, after one
warm-up that writes them, even where the environment sets PYTHONDONTWRITEBYTECODE (this machine
does: without the caches every import compiles churnsim's ~30 modules from source, ≈ 75 ms of an
import of `churnsim.sim.model.run` by cProfile; the first command after an install pays that).

    python benchmarks/import_speed.py [--max-rounds 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from speed_common import repeat_until_agreed, timed, write_result  # noqa: E402
from report import add_report_option  # noqa: E402

TARGET_S = 0.3
FIRST_RUN = """
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.sim.model.run import simulate_run
scenario = preset("checkfree-500m-geo-16pct", {"target.loss": None, "target.iterations": 300})
simulate_run(scenario, method_from_name("checkfree"), failures_for_replication(scenario))
"""
"""A script's first simulated run: the simulator, a preset, its failure path and a 300-iteration run."""
UNTARGETED = ("python (empty)", "first run of a preset")
WORKING_DIRECTORY = tempfile.gettempdir()
"""Where the commands run: outside the checkout, whose churnsim/ folder would shadow a regular
(non-editable) install's package for `python -c` (sys.path starts with the current directory)."""


def commands() -> dict[str, list[str]]:
    console_script = shutil.which("churnsim") or str(Path(sys.executable).with_name("churnsim"))
    return {
        "churnsim simulate --help": [console_script, "simulate", "--help"],
        "import churnsim.sim": [sys.executable, "-c", "import churnsim.sim"],
        "import churnsim.sim.model.run": [sys.executable, "-c", "import churnsim.sim.model.run"],
        "python (empty)": [sys.executable, "-c", "pass"],
        "first run of a preset": [sys.executable, "-c", FIRST_RUN],
    }


def cached_bytecode_environment() -> dict[str, str]:
    """The environment of a user's shell: bytecode written to (and read from) `__pycache__`."""
    environment = dict(os.environ)
    environment.pop("PYTHONDONTWRITEBYTECODE", None)
    return environment


def heaviest_imports(module: str, count: int = 10) -> list[tuple[str, float]]:
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        env=cached_bytecode_environment(), cwd=WORKING_DIRECTORY, capture_output=True, text=True, check=True,
    )
    rows = []
    for line in completed.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line.split("|"))
        rows.append((name.strip(), int(cumulative.split(":")[-1]) / 1e6))
    top_level = [(name, seconds) for name, seconds in rows]
    return sorted(top_level, key=lambda row: -row[1])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-rounds", type=int, default=8)
    add_report_option(parser)
    arguments = parser.parse_args()
    to_run = commands()
    environment = cached_bytecode_environment()
    for command in to_run.values():  # the warm-up: writes the bytecode caches
        subprocess.run(command, env=environment, cwd=WORKING_DIRECTORY, capture_output=True, check=True)

    def one_round() -> dict:
        result = {}
        for name, command in to_run.items():
            wall, cpu, completed = timed(
                lambda: subprocess.run(command, env=environment, cwd=WORKING_DIRECTORY, capture_output=True, check=True)
            )
            result[name] = (wall, cpu)
        return result

    timings = repeat_until_agreed(one_round, max_rounds=arguments.max_rounds, min_rounds=3)
    rows = {}
    for name, timing in timings.items():
        seconds = timing.agreed_s
        target = None if name in UNTARGETED else TARGET_S
        rows[name] = {**timing.summary(), "target_s": target, "meets_target": None if target is None else seconds <= target}
        verdict = "" if target is None else ("met" if seconds <= target else "NOT met")
        print(f"{name:28s} {seconds:6.3f} s  [{min(timing.wall_s):.3f}–{max(timing.wall_s):.3f}]  {verdict}")
    heavy = heaviest_imports("churnsim.sim.model.run")
    print("heaviest imports of churnsim.sim.model.run (cumulative s):", ", ".join(f"{name} {seconds:.3f}" for name, seconds in heavy))
    path = write_result(
        "import-speed",
        {"benchmark": "fresh-interpreter wall clock of CLI help and simulator imports", "commands": rows,
         "heaviest_imports_of_churnsim.sim.run_s": heavy},
        report=arguments.report,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
