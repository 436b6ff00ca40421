"""Does a rebuild that leaves no trained weight restart training, as the simulator charges it?

Two real runs of `cpu-tiny` in one stage (the model whole on one process), seed 3: one under
`random` whose only stage is lost once (a failure schedule with one failure at `--failure-at` seconds,
so the step it strikes at follows the machine's speed), and its no-failure twin (`none`, the same
failure ignored). Prints the step of the failure, the train loss just before and just after it, the
final loss beside the twin's after as many steps and at the same step, and the mean gap between the
run's losses since the failure and the twin's from its start or at the same steps: training started
again from random weights follows the first (the batches differ, so no gap is 0). The README's
"How the simulator works" quotes it (`calibration.rebuild_plan.leaves_no_trained_weights`).
A real-run check, not a test: about 20 s on 2 cores; run nothing else beside it.

    python benchmarks/restart_from_scratch.py [--failure-at 4.0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failure-at", type=float, default=4.0, help="seconds into the run at which the stage is lost")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        preset = subprocess.run([sys.executable, "-m", "churnsim", "presets", "--show", "cpu-tiny"], check=True, capture_output=True, text=True)
        scenario = json.loads(preset.stdout)
        scenario["pipeline"]["num_stages"] = 1
        scenario["methods"] = [method for method in scenario["methods"] if method["name"] in ("none", "random")]
        scenario["seed"] = 3
        scenario["churn"] = {"kind": "schedule", "path": "failures.csv"}
        for field in ("block_forward_s", "block_backward_s"):
            if isinstance(scenario["compute"].get(field), list):
                scenario["compute"][field] = scenario["compute"][field][0]
        (work / "scenario.json").write_text(json.dumps(scenario))
        (work / "failures.csv").write_text(f"# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind\n{arguments.failure_at},,0,\n")
        for method in ("random", "none"):
            subprocess.run(
                [sys.executable, "-m", "churnsim", "real", "run", "scenario.json", "--method", method, "--out", f"runs/{method}"],
                check=True, cwd=work, stdout=subprocess.DEVNULL,
            )
        lost = pd.read_csv(work / "runs/random/metrics.csv")
        twin = pd.read_csv(work / "runs/none/metrics.csv")
        failure_step = int(pd.read_csv(work / "runs/random/failures.csv", comment="#")["iteration"].iloc[0])
    loss = lost.set_index("step")["train_loss"]
    twin_loss = twin.set_index("step")["train_loss"]
    after = loss[loss.index >= failure_step]
    since = after.index - failure_step
    # After a restart from random weights the run should follow the twin from its first step, not
    # the twin at the same step: the mean gap to each (the batches differ, so neither is 0).
    gap_to_start = float((after.to_numpy() - twin_loss.reindex(since).to_numpy()).__abs__().mean())
    gap_to_same_step = float((after.to_numpy() - twin_loss.reindex(after.index).to_numpy()).__abs__().mean())
    print(f"stage lost at step {failure_step} of {len(loss)}: train loss {loss[failure_step - 1]:.3f} before, {loss[failure_step]:.3f} after")
    print(f"final loss {float(loss.iloc[-1]):.3f}; the no-failure twin's after {int(since[-1])} steps: {float(twin_loss[int(since[-1])]):.3f}, at the same step: {float(twin_loss.iloc[-1]):.3f}")
    print(f"mean |loss gap| over the {len(after)} steps since the failure: {gap_to_start:.3f} to the twin from its start, {gap_to_same_step:.3f} to the twin at the same step")

if __name__ == "__main__":
    main()
