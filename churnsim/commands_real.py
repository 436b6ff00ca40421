"""Commands that run real PyTorch pipelines: `real run` (torch is imported only inside the command)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from churnsim.app import real_app


def summary_paragraph(result: Any, *, out: Path) -> str:
    """One paragraph: iterations, final losses, each failure and what it was rebuilt from, wall time."""
    metrics = result.metrics

    def loss(value: float) -> str:
        return "n/a" if not math.isfinite(value) else f"{value:.4f}"

    eval_losses = metrics["eval_loss"].dropna()
    parts = [
        f"{result.config.method.name}: {result.config.num_iterations} iterations in {len(metrics)} executed steps, "
        f"{metrics['wall_time_s'].iloc[-1]:.1f} s wall time; final train loss {loss(float(metrics['train_loss'].iloc[-1]))}, "
        f"final eval loss {loss(float(eval_losses.iloc[-1]) if len(eval_losses) else math.nan)}."
    ]
    if not result.recoveries:
        parts.append(f"No failures{' recovered' if len(result.failures) else ''}.")
    else:
        parts.append(f"{len(result.failures)} stage failure(s):")
        descriptions = []
        for row in result.recoveries:
            sources = ", ".join(f"stage {stage} from {source}" for stage, source in row["rebuilt_from"].items())
            resume = f", resumed at iteration {row['resume_iteration']}" if row["resume_iteration"] is not None else ""
            descriptions.append(f"step {row['step']}: {sources}{resume}")
        parts.append("; ".join(descriptions) + ".")
    parts.append(f"Run record: {out}")
    return " ".join(parts)


def resolve_real_scenario(scenario_path: Optional[Path], preset_name: Optional[str], method_name: Optional[str], settings: list[str]) -> Any:
    """The scenario a real run takes, with `--set` overrides, narrowed to the one method it performs."""
    from churnsim.calibration.presets import build_scenario
    from churnsim.calibration.scenario_overrides import parse_settings
    from churnsim.options import scenario_argument

    source = scenario_argument(scenario_path, preset_name)
    method = build_scenario(source).only_method(method_name).methods[0].name  # one of the scenario's methods
    # Narrowed first, so that an override such as fewer stages is checked against this method only.
    return build_scenario(source, methods=(method,), settings=parse_settings(settings))


def torchrun_command(scenario: Any, scenario_file: Path, token_file: Path, token: str, *, nodes: int, host: str, port: int, replication: int, out: Path) -> str:
    """The torchrun line every machine of a run starts: c10d rendezvous (nodes can leave and join; a
    replacement started with the same line takes a lost stage), restarts up to the scenario's
    `recovery.max_replacements`, a dead machine noticed after 3 missed 1 s keep-alives (torch's
    default: 15 s). The rendezvous id derives from the run's token, so two runs never meet. The
    workers get a store of their own in each round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with the
    shared one, an agent that joins a later round (a replacement machine) waits forever for the
    workers' address, which the rank-0 agent publishes only when it first creates that store."""
    from churnsim.real.run_secret import TOKEN_VARIABLE, derive

    num_workers = scenario.pipeline.num_nodes  # one per (stage, replica)
    return (
        f"{TOKEN_VARIABLE}=$(cat {token_file}) PYTHONSAFEPATH=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes={nodes}:{nodes} --nproc-per-node={num_workers // nodes} "
        f"--rdzv-backend=c10d --rdzv-endpoint={host}:{port} --rdzv-id=churnsim-{derive(token, 'rendezvous-id')[:16]} "
        f"--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3 --max-restarts={scenario.recovery.max_replacements} "
        f"-m churnsim.real.launch --scenario {scenario_file}{f' --replication {replication}' if replication else ''} --run-dir {out}"
    )


@real_app.command("run")
def real_run_command(
    scenario_path: Optional[Path] = typer.Argument(None, help="Scenario JSON file (the same file `churnsim simulate` takes)."),
    preset_name: Optional[str] = typer.Option(None, "--preset", help="A built-in scenario instead of a file, e.g. cpu-tiny."),
    method: Optional[str] = typer.Option(None, "--method", help="The method to perform, one of the scenario's methods."),
    settings: list[str] = typer.Option([], "--set", help="FIELD=VALUE override of a scenario field (dotted path, as in `sweep`), e.g. pipeline.num_stages=2; repeatable."),
    replication: int = typer.Option(0, "--replication", help="Which replication's failure path to inject (simulate's replication k samples the same one)."),
    out: Path = typer.Option(
        ..., "--out", help="The run's directory: new, empty or a churnsim run record (anything else is refused); checkpoints from the start, the record when it finishes."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out, or an existing --write-config file."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished (failed or killed) run in --out from its durable checkpoints; same scenario and options."),
    write_config: Optional[Path] = typer.Option(
        None, "--write-config", help="Write the resolved scenario for torchrun on several machines, and print the command, instead of running."
    ),
    rendezvous_host: str = typer.Option(
        "127.0.0.1", "--rendezvous-host", help="Address this machine's run store listens on; loopback unless you name one (only processes holding the run's token may use it)."
    ),
    nodes: Optional[int] = typer.Option(
        None, "--nodes", help="With --write-config: how many machines (torchrun agents) share the stage processes; default one per stage process (stage × replica)."
    ),
    rendezvous_port: int = typer.Option(
        29400, "--rendezvous-port", help="With --write-config: the port of the torchrun rendezvous on --rendezvous-host."
    ),
    agent: bool = typer.Option(
        False, "--agent", help="No effect, kept so that older command lines work: hard failures always run through torchrun's elastic agent (one agent on this machine)."
    ),
) -> None:
    """A real pipeline run of a scenario on this machine: its model, pipeline, method, churn and target → a run record."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from churnsim.calibration.errors import InputError

    if replication < 0:
        raise InputError(f"--replication {replication}: must be >= 0")
    scenario = resolve_real_scenario(scenario_path, preset_name, method, settings)
    from churnsim.jobs import check_up_front
    from churnsim.options import scenario_source

    check_up_front([scenario], source=scenario_source(scenario_path, preset_name))
    scenario.check_real_run_layout()
    method_config = scenario.methods[0]
    if write_config is not None:
        from churnsim.calibration.scenario import save_scenario
        from churnsim.out_directory import check_writable_file

        check_writable_file(write_config, flag="--write-config", overwrite=overwrite)

        from churnsim.real.run_secret import TOKEN_VARIABLE, new_token, write_secret_file

        num_workers = scenario.pipeline.num_nodes  # one per (stage, replica)
        nodes = num_workers if nodes is None else nodes
        if nodes < 1 or num_workers % nodes:
            raise InputError(
                f"--nodes {nodes}: must divide pipeline.num_stages × pipeline.data_parallel_degree = {num_workers} (each machine runs as many stage processes)"
            )
        if not 0 < rendezvous_port < 65536:
            raise InputError(f"--rendezvous-port {rendezvous_port}: give a port between 1 and 65535")
        token_file = write_config.with_name(write_config.name + ".token")
        check_writable_file(token_file, flag="--write-config (its token file)", overwrite=overwrite)
        token = new_token()
        save_scenario(scenario, str(write_config))
        write_secret_file(token_file, token)
        Console().print(
            f"wrote {write_config} and the run's token {token_file} (mode 0600: copy it to every machine over a channel you trust); "
            f"on each of the {nodes} machines (and on any machine that replaces one), run:\n"
            f"  {torchrun_command(scenario, write_config, token_file, token, nodes=nodes, host=rendezvous_host, port=rendezvous_port, replication=replication, out=out)}",
            soft_wrap=True,
        )
        return
    from churnsim.out_directory import check_real_run_inputs, check_writable_directory
    from churnsim.real.run_directory import check_run_directory
    from churnsim.real.run_secret import check_listen_address

    check_listen_address(rendezvous_host)
    check_real_run_inputs(scenario, out, overwrite=overwrite, resume=resume)  # corpus, remote directory, links, reuse
    check_writable_directory(out, flag="--out")
    check_run_directory(out, resume=resume)  # before torch and before any process starts

    # torch and the trainer only from here on.
    from churnsim.extras import require_torch

    require_torch("a real run")
    from churnsim.real.launch import RunAborted, check_temporary_directory_fits_a_socket, launch_local
    from churnsim.real.scenario_run import check_fits_machine, training_config

    check_fits_machine(scenario)
    check_temporary_directory_fits_a_socket()
    del agent  # hard failures run under torchrun's agent with or without it (real/agent_launch.py)
    config = training_config(scenario, method_config, replication=replication)
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("training.device = 'cuda': CUDA is not available on this machine; use --set training.device=cpu")
    console = Console(stderr=True)
    label = f"{method_config.name} × {config.num_stages} stages"
    aborted = None
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task(label, total=config.num_iterations)

        def on_progress(row: dict[str, Any]) -> None:
            progress.update(
                task, completed=row["iteration"] + 1, description=f"{label}, step {row['step']}, loss {row['train_loss']:.3f}"
            )

        try:
            result = launch_local(
                config, run_dir=out, on_progress=on_progress, scenario=scenario, replication=replication, resume=resume,
                rendezvous_host=rendezvous_host,
                on_warning=lambda line: progress.console.print(line, markup=False, highlight=False, soft_wrap=True),
            )
        except RunAborted as error:
            aborted = error
    if aborted is not None:  # one line, after the progress bar is gone, and how to continue where the run can
        sys.stderr.write("".join(f"{line}\n" for line in (f"churnsim: error: {aborted}", *getattr(aborted, "__notes__", ()))))
        raise typer.Exit(1)
    Console().print(summary_paragraph(result, out=out), soft_wrap=True)
