"""A finished real run: the per-rank results merged over ranks (`merge_rank_results`) and written as
a run record (`write_record`, calibration/run_record.py), with its recoveries beside it
(`write_recoveries`: recoveries.csv)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .trainer import RankResult, TrainingConfig

if TYPE_CHECKING:
    import pandas as pd

# pandas and the run-record module are imported where used: spawned ranks never need them, and
# each import costs every rank start-up time.
FAILURE_TABLE_COLUMNS = ("time_s", "iteration", "stage", "kind")
NODE_FAILURE_TABLE_COLUMNS = ("time_s", "iteration", "stage", "replica", "kind")
"""The failure table of a data-parallel run: each row names the lost node (stage, replica)."""
DATA_PARALLEL_SPAN_COLUMNS = ("replica", "bytes")
RECOVERY_TABLE_COLUMNS = (
    "step", "iteration", "failure_mode", "failed_stages", "degraded", "resume_iteration", "rebuilt_from",
    "join_s", "rendezvous_s", "transfer_s", "load_s", "rebuild_s", "recovery_s", "stalled_s",
    "network_bytes", "file_bytes", "levels_read", "notes",
    "replica", "handled_as", "failed_nodes", "heals", "heal_s", "heal_bytes", "replicas_waited",
    "restart_round", "detection_s", "agent_restart_s", "process_start_s", "survivor_reload_s", "survivor_reload_bytes",
    "survivor_restart_s",
)  # fmt: skip
"""recoveries.csv: per recovery, seconds of each phase (max over ranks: they work in parallel) and
bytes moved (sum over ranks): `network_bytes` received over the process group, `file_bytes` read
from checkpoint files, `levels_read` which level each stage read them from. `join_s`: a replacement
process from its predecessor's death to ready (hard failures); `rendezvous_s`: barrier and process
group formation; `recovery_s`: the method's recovery; `stalled_s`: a survivor's whole stop, from
leaving its group to training again (waiting for the replacement included).

Data parallelism adds (empty in one-pipeline runs): `handled_as` (`replica_heal`: lost nodes copied
from a surviving replica of their stage; `stage_loss`: the method's recovery, one row per replica
pipeline, `replica` naming it), `failed_nodes` ([stage, replica] pairs lost at that boundary),
`heals` (each healed node and its source replica), `heal_s` (the slowest heal's copy), `heal_bytes`
(bytes the replacements received) and `replicas_waited` (every replica waited for the heal).

Under torchrun's agent (real/agent_membership.py; empty otherwise), where every worker restarts:
`restart_round` the rendezvous round; `detection_s` from the injector's kill to the first worker an
agent stopped (empty for a kill from outside); `agent_restart_s` from that stop to the last new
worker process started (the agents stopping their workers, torch's c10d rendezvous round, the
spawn); `process_start_s` the slowest new process from its start to ready (interpreter, imports,
model build, snapshot reload); `survivor_reload_s` / `survivor_reload_bytes` reading the survivors'
snapshots back from node memory (slowest, and bytes summed); `survivor_restart_s` from the death's
detection to the last survivor ready again."""


@dataclass(kw_only=True)
class RunResult:
    """A finished real run, merged over ranks."""

    config: TrainingConfig
    metrics: pd.DataFrame
    """step, iteration, wall_time_s, train_loss, eval_loss (+ blocked_s: max over ranks)."""
    spans: pd.DataFrame
    failures: pd.DataFrame
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    run_dir: Path | None = None


def _metrics_table(results: list[RankResult], num_stages: int) -> pd.DataFrame:
    """step, iteration, wall_time_s, train_loss, eval_loss, blocked_s: one row per step the head ran
    (replica 0's head under data parallelism: it holds the loss averaged over the replicas)."""
    import pandas as pd

    rows = pd.DataFrame([row | {"stage": r.stage, "replica": r.replica} for r in results for row in r.iteration_rows])
    if rows.empty:
        return pd.DataFrame(columns=["step", "iteration", "wall_time_s", "train_loss", "eval_loss", "blocked_s"])
    # The loss comes from whichever process ran the head: the last stage, or its host while it was down.
    runs_head = rows["runs_head"].fillna(False).astype(bool) if "runs_head" in rows else rows["stage"] == num_stages - 1
    head = rows[runs_head & (rows["replica"] == 0)].sort_values("step", kind="stable").set_index("step")
    grouped = rows.groupby("step")
    return pd.DataFrame(
        {
            "step": head.index.to_numpy(),
            "iteration": head["iteration"].to_numpy(),
            "wall_time_s": grouped["end_s"].max().loc[head.index].to_numpy(),
            "train_loss": head["train_loss"].to_numpy(),
            "eval_loss": head["eval_loss"].to_numpy(),
            "blocked_s": grouped["blocked_s"].max().loc[head.index].to_numpy(),
        }
    )


def merge_rank_results(config: TrainingConfig, results: list[RankResult]) -> RunResult:
    """One table per kind: a step ends when its slowest rank ends; losses come from the last stage."""
    import pandas as pd

    from churnsim.calibration.run_record import SPANS_COLUMNS, SPANS_CPU_COLUMNS

    metrics = _metrics_table(results, config.num_stages)
    data_parallel = config.data_parallel_degree > 1
    span_columns = SPANS_COLUMNS + SPANS_CPU_COLUMNS + (DATA_PARALLEL_SPAN_COLUMNS if data_parallel else ())
    spans = pd.DataFrame([row | {"replica": r.replica} for r in results for row in r.spans], columns=list(span_columns))
    spans = spans.sort_values(["start_s", "rank"], kind="stable").reset_index(drop=True)
    failure_columns = NODE_FAILURE_TABLE_COLUMNS if data_parallel else FAILURE_TABLE_COLUMNS
    failures = pd.DataFrame([row for r in results for row in r.failures], columns=list(failure_columns))
    # Stage 0 records every failure in the order it handed them out (the failure path's order).
    failures = failures.sort_values(["iteration"], kind="stable").reset_index(drop=True)
    recoveries = [row for r in results for row in r.recoveries]
    return RunResult(config=config, metrics=metrics, spans=spans, failures=failures, recoveries=recoveries)


def join_attempts(attempts: list[list[Any]]) -> list[RankResult]:
    """One result per stage for a run made of several attempts (its start, then each `--resume`),
    from every stage's rows of every attempt, oldest first (RankResult, or real/journal.py's rows).

    Resuming appends: an attempt's steps follow the earlier attempts' kept steps, numbered on from
    them, and its clock continues from the last step an earlier attempt recorded (the time between
    that step and the kill, and the run being down, is not counted; its own start-up is, as a fresh
    run's). Nothing an earlier attempt recorded is dropped, so the iterations it ran after its last
    durable checkpoint appear twice in metrics.csv, as after any rollback in a run (a step counts
    executed iterations): once as run before the interruption, once as run again. The resume's row in
    recoveries.csv says which: its `iteration` is where the earlier attempt stopped, its
    `resume_iteration` the checkpoint it went back to, and its note names the iterations run again.
    Rows of steps the head never finished (a stage's last step when the kill came) are left out; an
    attempt that finished no step adds nothing.
    """
    if len(attempts) == 1 and all(isinstance(each, RankResult) for each in attempts[0]):
        return list(attempts[0])
    num_stages = max((len(attempt) for attempt in attempts), default=0)
    joined = [RankResult(rank=stage, stage=stage) for stage in range(num_stages)]
    next_step, clock_s = 0, 0.0
    stopped_at: int | None = None  # the iteration the previous kept attempt would have run next
    for attempt in attempts:
        stages = [_rows_of(each) for each in attempt]
        rows = [row for stage in stages for row in stage["iteration"]]
        head = [row for stage_index, stage in enumerate(stages) for row in stage["iteration"]
                if row.get("runs_head", stage_index == num_stages - 1)]  # fmt: skip
        if not head:
            continue
        first, last = min(row["step"] for row in head), max(row["step"] for row in head)
        shift = next_step - first

        def step_of(step: int, first: int = first, shift: int = shift) -> int:
            return max(step, first) + shift  # a resume's own rows come before its first step

        for stage_index, stage in enumerate(stages):
            target = joined[stage_index]
            for row in stage["iteration"]:
                if row["step"] <= last:
                    target.iteration_rows.append(row | {"step": step_of(row["step"]), "end_s": row["end_s"] + clock_s})
            for row in stage["span"]:
                if row["iteration"] <= last:
                    target.spans.append(row | {"iteration": step_of(row["iteration"]), "start_s": row["start_s"] + clock_s, "end_s": row["end_s"] + clock_s})
            for row in stage["failure"]:
                if row["iteration"] <= last:
                    target.failures.append(row | {"iteration": step_of(row["iteration"]), "time_s": row["time_s"] + clock_s})
            for row in stage["recovery"]:
                if row["step"] > last:
                    continue
                row = row | {"step": step_of(row["step"])}
                if "failure_mode" not in row and stopped_at is not None:  # this attempt's resume
                    row = _resume_row(row, stopped_at)
                target.recoveries.append(row)
        next_step = last + shift + 1
        clock_s += max(row["end_s"] for row in rows if row["step"] == last)
        stopped_at = max(row["iteration"] for row in head if row["step"] == last) + 1
    return joined


def _rows_of(result: Any) -> dict[str, list[dict[str, Any]]]:
    if isinstance(result, RankResult):
        return {"iteration": result.iteration_rows, "span": result.spans, "failure": result.failures, "recovery": result.recoveries}
    return result


def _resume_row(row: dict[str, Any], stopped_at: int) -> dict[str, Any]:
    resumed_at = row.get("resume_iteration") or 0
    notes = list(row.get("notes") or ())
    if resumed_at < stopped_at:
        notes.append(
            f"the run stopped before iteration {stopped_at} and resumed from iteration {resumed_at}: iterations "
            f"{resumed_at}-{stopped_at - 1} ran again (both runs of them are in metrics.csv)"
        )
    return row | {"iteration": stopped_at, "notes": notes}


def kept_metrics(run_dir: str | Path) -> pd.DataFrame:
    """The steps a run in `run_dir` kept so far, every attempt joined (`join_attempts`): what a killed
    or still running run holds on disk (step, iteration, wall_time_s, train_loss, eval_loss, blocked_s)."""
    from .journal import attempt_directories, read_attempt
    from .run_directory import read_run_file

    run_file = read_run_file(Path(run_dir)) or {}
    num_stages = run_file.get("config", {}).get("num_stages")
    directories = attempt_directories(run_dir)
    if not isinstance(num_stages, int):
        num_stages = max((len(list(directory.glob("stage-*.jsonl"))) for directory in directories), default=0)
    return _metrics_table(join_attempts([read_attempt(directory, num_stages) for directory in directories]), num_stages)


def write_record(
    result: RunResult,
    run_dir: str | Path,
    *,
    run_id: str | None = None,
    checkpoint_directory: str | None = None,
    failure_rate_per_stage_hour: float | None = None,
    scenario: Any = None,
    replication: int = 0,
    extra_entries: tuple[str, ...] = (),
) -> Path:
    """Write `result` as a run record directory (manifest, metrics, spans, failures); `extra_entries` stay.

    `scenario` (a contract Scenario) is the scenario the run was made from, kept in the manifest so
    that the simulator can replay the run from the same file.
    """
    from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
    from churnsim.calibration.run_record import (
        METRICS_COLUMNS,
        RealRunSettings,
        RunManifest,
        make_run_record,
        provenance_fields,
        write_run_record,
    )
    from churnsim.calibration.scenario import PipelineSpec

    from .cpu_placement import placement_plan
    from .scenario_run import model_spec

    config = result.config
    model = config.model
    settings = RealRunSettings(
        model=model_spec(model),
        pipeline=PipelineSpec(
            num_stages=config.num_stages,
            data_parallel_degree=config.data_parallel_degree,
            # A real run heals a lost replica at an iteration boundary while every replica waits.
            while_replica_missing="wait",
            schedule=config.schedule,  # type: ignore[arg-type]
            microbatch_size=config.microbatch_size,
            num_microbatches=config.num_microbatches,
        ),
        method=config.method,
        num_iterations=config.num_iterations,
        learning_rate=config.learning_rate,
        eval_every_iterations=config.eval_interval_iterations or config.num_iterations,
        device=config.device,  # type: ignore[arg-type]
        corpus=config.corpus or "python-stdlib",
        deterministic=config.deterministic,
        checkpoint_directory=checkpoint_directory,
        failure_rate_per_stage_hour=failure_rate_per_stage_hour,
    )
    placement = placement_plan(config.num_nodes, config.num_threads, config.pin_stages_to_cores)
    manifest = RunManifest(
        run_id=run_id or uuid.uuid4().hex[:12],
        source="real",
        method=config.method.name,
        seed=config.seed,
        replication=replication,
        scenario=scenario,
        real_settings=settings,
        **provenance_fields(stage_placement=placement),
        notes=tuple(
            (
                f"step {row['step']}: nodes {[tuple(h) for h in row.get('failed_nodes', ())]} lost, healed from {row['rebuilt_from']}"
                if row.get("handled_as") == "replica_heal"
                else f"step {row['step']}: stages {row['failed_stages']} rebuilt from {row['rebuilt_from']}"
                + (f" (replica {row['replica']})" if "replica" in row else "")
            )
            + (f"; {'; '.join(row['notes'])}" if row["notes"] else "")
            for row in result.recoveries
        )
        + data_parallel_notes(config, scenario),
        summary={
            "num_steps": int(len(result.metrics)),
            "final_train_loss": _finite_or_none(result.metrics["train_loss"].iloc[-1]),
            "final_eval_loss": _finite_or_none(result.metrics["eval_loss"].iloc[-1]),
            "wall_time_s": float(result.metrics["wall_time_s"].iloc[-1]),
            "num_failures": int(len(result.failures)),
        },
    )
    failures = FailureSchedule(
        failures=tuple(
            ScheduledFailure(
                time_s=float(row.time_s), iteration=int(row.iteration), stage=int(row.stage), kind=str(row.kind),
                replica=int(row.replica) if "replica" in result.failures.columns else 0,
            )  # fmt: skip
            for row in result.failures.itertuples()
        )
    )
    record = make_run_record(manifest, result.metrics.loc[:, list(METRICS_COLUMNS)], result.spans, failures)
    return write_run_record(record, run_dir, extra_entries=extra_entries)


def data_parallel_notes(config: TrainingConfig, scenario: Any) -> tuple[str, ...]:
    """What a reader of a data-parallel real run must know that its settings do not say."""
    if config.data_parallel_degree == 1:
        return ()
    notes = [
        "data parallelism: every replica waits at the iteration boundary while a lost replica heals "
        "(pipeline.while_replica_missing = wait); each replica keeps its own copy of its stage's checkpoints"
    ]
    asked = getattr(getattr(scenario, "pipeline", None), "while_replica_missing", "wait")
    if asked != "wait":
        notes.append(f"the scenario asks pipeline.while_replica_missing = {asked}; a real run waits (the simulator does what the scenario asks)")
    return tuple(notes)


def write_recoveries(result: RunResult, path: str | Path) -> Path:
    """recoveries.csv (RECOVERY_TABLE_COLUMNS): one row per recovery, lists and maps as JSON."""
    import json

    import pandas as pd

    rows = []
    for recovery in result.recoveries:
        row = {column: recovery.get(column) for column in RECOVERY_TABLE_COLUMNS}
        row["failure_mode"] = recovery.get("failure_mode", "resume")  # only a resumed run's start has no mode
        for column in ("failed_stages", "rebuilt_from", "levels_read", "notes", "failed_nodes", "heals"):
            row[column] = json.dumps(recovery.get(column), default=str, sort_keys=True)
        rows.append(row)
    path = Path(path)
    pd.DataFrame(rows, columns=list(RECOVERY_TABLE_COLUMNS)).to_csv(path, index=False)
    return path


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
