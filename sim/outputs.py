"""Files a simulation leaves behind: run records, a Chrome/Perfetto timeline, tidy tables."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from churnsim.calibration.base import atomic_write_text, strict_json_dumps
from churnsim.calibration.failures import ScheduledFailure
from churnsim.calibration.run_record import RunManifest, make_run_record, provenance_fields, write_run_record
from churnsim.calibration.scenario import Scenario
from churnsim.calibration.setback_uncertainty import setback_source_note

from .iteration import IterationResult
from .results import RunResult
from .route_notes import swapped_route_notes

def scenario_notes(scenario: Scenario) -> tuple[str, ...]:
    """Caveats every output of this scenario must carry; the first names where its convergence
    setbacks come from (measured, paper-fitted or default) when a method uses them."""
    uses_setbacks = any(method.uses_setbacks for method in scenario.methods)
    setbacks = (setback_source_note(scenario.convergence),) if uses_setbacks else ()
    return setbacks + swapped_route_notes(scenario)


def chrome_trace(result: RunResult, iteration: IterationResult | None = None) -> dict:
    """The run's timeline in the Trace Event Format (opens in Perfetto and chrome://tracing).

    Process 0 is the run (one thread per stage, thread S for the whole pipeline); process 1, when
    given, is one healthy iteration at microbatch resolution.
    """
    events: list[dict] = []
    pipeline_thread = 1 + max([event.stage for event in result.timeline] + [0])
    for event in result.timeline:
        thread = pipeline_thread if event.stage < 0 else event.stage
        common = {"name": event.name, "cat": event.category, "pid": 0, "tid": thread, "ts": event.start_s * 1e6}
        if event.end_s > event.start_s:
            events.append({**common, "ph": "X", "dur": (event.end_s - event.start_s) * 1e6})
        else:
            events.append({**common, "ph": "i", "s": "t"})
    if iteration is not None:
        for span in iteration.spans:
            events.append(
                {
                    "name": f"{span.kind} mb{span.microbatch}" if span.microbatch >= 0 else span.kind,
                    "cat": span.kind,
                    "ph": "X",
                    "pid": 1,
                    "tid": span.stage,
                    "ts": span.start_s * 1e6,
                    "dur": (span.end_s - span.start_s) * 1e6,
                }
            )
    names = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"run: {result.method}, replication {result.replication}"}}]
    names += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": pipeline_thread, "args": {"name": "pipeline"}}]
    if iteration is not None:
        names.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "one healthy iteration"}})
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, result: RunResult, iteration: IterationResult | None = None) -> Path:
    path = Path(path)
    atomic_write_text(path, strict_json_dumps(chrome_trace(result, iteration), indent=None))
    return path


MANIFEST_FILE = "manifest.json"


def write_manifest(directory: str | Path, *, command: str, scenario: Scenario | None, **fields: object) -> Path:
    """`directory/manifest.json` for a results directory: the command, its scenario, provenance, `fields`.

    Strict JSON: the scenario goes through pydantic's JSON mode (infinite bandwidths as the string
    "Infinity", which `Scenario` reads back), and a NaN or infinity among `fields` is an error.
    """
    path = Path(directory) / MANIFEST_FILE
    manifest = {
        "command": command,
        **({"scenario": json.loads(scenario.model_dump_json())} if scenario is not None else {}),
        **fields,
        **provenance_fields(),
    }
    atomic_write_text(path, strict_json_dumps(manifest) + "\n")
    return path


def iteration_spans_table(iteration: IterationResult, *, iteration_index: int = 0) -> pd.DataFrame:
    """The spans of one simulated iteration in the run-record span columns (rank = stage)."""
    return pd.DataFrame(
        [
            dict(rank=s.stage, stage=s.stage, iteration=iteration_index, kind=s.kind, microbatch=s.microbatch, start_s=s.start_s, end_s=s.end_s)
            for s in iteration.spans
        ],
        columns=["rank", "stage", "iteration", "kind", "microbatch", "start_s", "end_s"],
    )


def simulated_run_record_rows(scenario: Scenario, result: RunResult) -> tuple[list[dict], list[ScheduledFailure]]:
    """Metrics rows (one per trajectory point; progress is linear between them) and failures."""
    curve = scenario.convergence.baseline
    metrics = [
        dict(step=index, iteration=progress, wall_time_s=time_s, train_loss=curve.loss(progress), eval_loss=math.nan)
        for index, (time_s, progress) in enumerate(result.trajectory)
    ]
    failures = [
        ScheduledFailure(time_s=failure.time_s, iteration=failure.iteration, stage=failure.stage, kind=failure.kind)
        for failure in result.failures
    ]
    return metrics, failures


def write_simulated_run_records(
    directory: str | Path,
    scenario: Scenario,
    results: Sequence[RunResult],
    iterations: dict[str, IterationResult],
) -> list[Path]:
    """One run record per result under `directory/<method>-r<replication>`."""
    directory = Path(directory)
    provenance = provenance_fields()
    written = []
    for result in results:
        metrics, failures = simulated_run_record_rows(scenario, result)
        manifest = RunManifest(
            run_id=f"{scenario.name}-{result.method}-r{result.replication}",
            source="simulated",
            method=result.method,
            seed=result.seed,
            replication=result.replication,
            scenario=scenario,
            **provenance,
            notes=scenario_notes(scenario) + tuple(result.notes),
            # JSON has no NaN: a target never reached leaves time_to_target_s out.
            summary={key: value for key, value in result.summary().items() if not (isinstance(value, float) and math.isnan(value))},
        )
        iteration = iterations.get(result.method)
        spans = iteration_spans_table(iteration) if iteration is not None else []
        record = make_run_record(manifest, metrics, spans, failures)
        written.append(write_run_record(record, directory / f"{result.method}-r{result.replication}"))
    return written


def methods_in(results: Iterable[RunResult]) -> list[str]:
    seen: list[str] = []
    for result in results:
        if result.method not in seen:
            seen.append(result.method)
    return seen
