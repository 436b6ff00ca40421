"""The cluster recipes (recipes/slurm, recipes/kubernetes) against docs/how-to/cluster.md.

The SLURM script runs as sbatch would start it on the first node, on this machine: a stand-in
`srun` starts each step's command once per node of the step, here and at the same time, with the
node's SLURM_NODEID/SLURM_PROCID; `scontrol` names every node as loopback; `torchrun` is this
Python's torch.distributed.run. `churnsim calibrate` and `churnsim validate` are recorded and not
run (the calibration suite takes minutes); `churnsim real run --write-config` and both torchrun
runs (two agents meeting through c10d, soft failures by the failure schedule) run for real.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
SBATCH_SCRIPT = REPOSITORY / "recipes" / "slurm" / "calibrate-and-validate.sbatch"
PYTORCHJOB = REPOSITORY / "recipes" / "kubernetes" / "pytorchjob.yaml"
CLUSTER_PAGE = REPOSITORY / "docs" / "how-to" / "cluster.md"
WRITE_CONFIG_LINE = "torchrun --nnodes=N:N --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=RUN_ID --rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3 --max-restarts=R -m churnsim.real.launch"

STANDIN_SRUN = '''
"""Stand-in srun: the step's command once per node (--nodes, else SLURM_NNODES; --ntasks=1: once), here, at once."""
import json, os, subprocess, sys
arguments = sys.argv[1:]
options = []
while arguments and arguments[0].startswith("-"):
    options.append(arguments.pop(0))
settings = dict(option.split("=", 1) for option in options)
unknown = set(settings) - {"--nodes", "--ntasks", "--ntasks-per-node"}
if unknown:
    sys.exit(f"stand-in srun: options not understood: {sorted(unknown)}")
nodes = int(settings.get("--nodes", os.environ["SLURM_NNODES"]))
tasks = int(settings["--ntasks"]) if "--ntasks" in settings else nodes * int(settings.get("--ntasks-per-node", "1"))
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"program": "srun", "options": options, "command": arguments}) + "\\n")
processes = [subprocess.Popen(arguments, env=dict(os.environ, SLURM_NODEID=str(task), SLURM_PROCID=str(task), SLURM_LOCALID="0",
                                                  SLURM_STEP_NUM_NODES=str(nodes)))
             for task in range(tasks)]
sys.exit(max(process.wait() for process in processes))
'''

STANDIN_SCONTROL = '''
"""Stand-in scontrol: `show hostnames LIST` names each of the job's nodes as loopback."""
import os, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(["127.0.0.1"] * int(os.environ["SLURM_NNODES"])))
'''

STANDIN_CHURNSIM = '''
"""Stand-in churnsim: records every call; runs all but calibrate and validate (recorded only)."""
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"program": "churnsim", "argv": sys.argv[1:]}) + "\\n")
if sys.argv[1] in ("calibrate", "validate"):
    sys.exit(0)
os.execv(sys.executable, [sys.executable, "-m", "churnsim.cli", *sys.argv[1:]])
'''

STANDIN_TORCHRUN = '''
"""torchrun of this Python (torch.distributed.run), recording its command line and the variables it got."""
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"program": "torchrun", "argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID"),
                          "token_set": bool(os.environ.get("CHURNSIM_RUN_TOKEN")),
                          "pythonsafepath": os.environ.get("PYTHONSAFEPATH")}) + "\\n")
os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *sys.argv[1:]])
'''


def _install_standins(directory: Path) -> None:
    directory.mkdir()
    for name, body in (("srun", STANDIN_SRUN), ("scontrol", STANDIN_SCONTROL), ("churnsim", STANDIN_CHURNSIM), ("torchrun", STANDIN_TORCHRUN)):
        path = directory / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _documented_commands() -> list[str]:
    """The ```text block of cluster.md that lists what the SLURM script runs."""
    text = CLUSTER_PAGE.read_text()
    section = text.split("## SLURM", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```text\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "cluster.md's SLURM section should list the script's commands in one text block"
    return [line for line in blocks[0].splitlines() if line.strip()]


ENVIRONMENT_VARIABLES = frozenset({"CHURNSIM_RUN_TOKEN", "PYTHONSAFEPATH", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})


def _pattern(template: str) -> re.Pattern:
    """A documented command as a pattern: each UPPER_CASE placeholder is any text, the same text wherever it recurs."""
    pattern, seen = "", set()
    for piece in re.split(r"(\b[A-Z][A-Z_]*\b)", template):
        if re.fullmatch(r"[A-Z][A-Z_]*", piece) and piece not in ENVIRONMENT_VARIABLES:
            pattern += f"(?P={piece})" if piece in seen else f"(?P<{piece}>.+?)"
            seen.add(piece)
        else:
            pattern += re.escape(piece)
    return re.compile(pattern + r"\Z")


@pytest.mark.slow
def test_the_slurm_recipe_runs_the_documented_commands_and_its_torchrun_runs_finish(tmp_path):
    standins, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    _install_standins(standins)
    submit = tmp_path / "submit"
    submit.mkdir()
    # Soft failures: one of stage 1 early in the run (the schedule replays by seconds since the start).
    (submit / "kills.csv").write_text("# churnsim failure schedule, schema_version 1\ntime_s,iteration,stage,kind\n0.5,,1,scheduled\n")
    job_id, port = "4242", _free_port()
    environment = dict(
        os.environ,
        PATH=f"{standins}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPOSITORY),
        STANDIN_LOG=str(log),
        SLURM_JOB_ID=job_id,
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_SUBMIT_DIR=str(submit),
        CHURNSIM_DEVICE="cpu",
        CHURNSIM_PROCS_PER_NODE="2",
        CHURNSIM_FAILURE_MODE="soft",
        CHURNSIM_ITERATIONS="20",
        CHURNSIM_RDZV_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    finished = subprocess.run(["bash", str(SBATCH_SCRIPT)], cwd=submit, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]

    # Every command in the documented order (torchrun once per node), placeholders consistent.
    commands = []
    for call in calls:
        if call["program"] == "churnsim":
            commands.append("churnsim " + " ".join(call["argv"]))
        elif call["program"] == "torchrun":
            commands.append("torchrun " + " ".join(call["argv"]))
    collapsed = [command for index, command in enumerate(commands) if index == 0 or command != commands[index - 1]]
    documented = _documented_commands()
    assert len(collapsed) == len(documented), "\n".join(collapsed)
    values: dict[str, str] = {}
    for command, template in zip(collapsed, documented):
        match = _pattern(template).match(command)
        assert match, f"ran:  {command}\ndocs: {template}"
        for name, value in match.groupdict().items():
            assert values.setdefault(name, value) == value, f"{name} is {value} here and {values[name]} before"
    assert values["N"] == "2" and values["P"] == "2" and values["STAGES"] == "4"
    assert values["HOST"] == "127.0.0.1" and values["PORT"] == str(port) and values["JOB"] == job_id
    assert values["METHOD"] == "checkfree" and values["MODE"] == "soft" and values["R"] == "2"
    assert values["SCENARIO"] == "--preset cpu-tiny --set model.num_layers=4"
    # The agreed form of `--write-config`'s command is what the torchrun lines run.
    torchrun_lines = [command for command in collapsed if command.startswith("torchrun")]
    assert all(_pattern(WRITE_CONFIG_LINE + " --scenario CONFIG --run-dir DIR").match(line) for line in torchrun_lines)

    # srun: calibrate on one node, each torchrun on both, with the token and a safe import path.
    steps = [call for call in calls if call["program"] == "srun"]
    assert [(step["options"], step["command"][:2]) for step in steps] == [
        (["--nodes=1", "--ntasks=1"], ["churnsim", "calibrate"]),
        (["--nodes=2", "--ntasks-per-node=1"], ["bash", "-c"]),
        (["--nodes=2", "--ntasks-per-node=1"], ["bash", "-c"]),
    ]
    agents = [call for call in calls if call["program"] == "torchrun"]
    assert sorted(agent["node"] for agent in agents) == ["0", "0", "1", "1"]
    assert all(agent["token_set"] and agent["pythonsafepath"] == "1" for agent in agents)

    # Both runs finished as run records, the one with failures recovering from them.
    work = submit / f"churnsim-{job_id}"
    for run in ("none", "checkfree"):
        manifest = json.loads((work / "runs" / run / "manifest.json").read_text())
        assert manifest["method"] == run
    recoveries = (work / "runs" / "checkfree" / "recoveries.csv").read_text().splitlines()
    assert len(recoveries) >= 2 and ",soft,[1]," in recoveries[1]


def test_write_config_prints_the_command_the_docs_and_recipes_use(tmp_path):
    finished = subprocess.run(
        [sys.executable, "-m", "churnsim.cli", "real", "run", "--preset", "cpu-tiny", "--method", "checkfree",
         "--write-config", "scenario.json", "--out", "runs/checkfree"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPOSITORY)), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    (printed,) = [line.strip() for line in (finished.stdout + finished.stderr).splitlines() if "torchrun" in line]
    if "--rdzv-backend" not in printed:
        pytest.skip("this checkout's --write-config prints torchrun's default (static) rendezvous; the recipes use the c10d form")
    section = CLUSTER_PAGE.read_text().split("## The command on every machine", 1)[1].split("\n## ", 1)[0]
    (documented,) = re.findall(r"```text\n(.*?)\n```", section, flags=re.S)
    assert _pattern(documented).match(printed), f"printed: {printed}\ndocs:    {documented}"
    assert _pattern(WRITE_CONFIG_LINE + " --scenario CONFIG --run-dir DIR").search(printed)


def test_the_slurm_recipe_outside_sbatch_says_how_to_run_it(tmp_path):
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    finished = subprocess.run(["bash", str(SBATCH_SCRIPT)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2
    assert finished.stderr.strip() == "calibrate-and-validate.sbatch: run it with sbatch (SLURM_JOB_ID and SLURM_NNODES are not set)"
    assert not any(tmp_path.iterdir())


def test_the_pytorchjob_is_elastic_on_c10d_and_runs_the_write_config_command():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["minReplicas"] == elastic["maxReplicas"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # elastic jobs have no Master
    assert worker["replicas"] == elastic["maxReplicas"]
    (container,) = worker["template"]["spec"]["containers"]
    (line,) = container["args"]
    words = shlex.split(line)
    assert words[:2] == ["exec", "torchrun"]
    match = _pattern(WRITE_CONFIG_LINE + " --scenario CONFIG --run-dir DIR").match(" ".join(words[1:]))
    assert match, line
    assert match["N"] == str(worker["replicas"]) and match["P"] == str(elastic["nProcPerNode"])
    assert match["R"] == str(elastic["maxRestarts"]) and match["RUN_ID"] == job["metadata"]["name"]
    # The operator's service of the first worker, at the policy's port.
    assert (match["HOST"], match["PORT"]) == (f"{job['metadata']['name']}-worker-0", str(elastic["rdzvPort"]))
    environment = {variable["name"]: variable for variable in container["env"]}
    assert environment["CHURNSIM_RUN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "churnsim-run-token"
    assert environment["PYTHONSAFEPATH"]["value"] == "1"
    assert environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"  # a replacement pod can join a later round
    mounted = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert match["CONFIG"].startswith("/churnsim/config/") and "/churnsim/config" in mounted
    assert match["DIR"].startswith("/churnsim/runs/") and "/churnsim/runs" in mounted
