"""Files a simulation leaves behind: run records, a Chrome/Perfetto timeline, tidy tables."""

from __future__ import annotations

import json
import math
import platform
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from churnsim.calibration.base import atomic_write_text, strict_json_dumps
from churnsim.calibration.compute_cost import compute_carry_note
from churnsim.calibration.failures import ScheduledFailure
from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.calibration.run_record import RunManifest, make_run_record, provenance_fields, utc_now, write_run_record
from churnsim.calibration.scenario import Scenario, method_pipeline_problem
from churnsim.calibration.setback_uncertainty import setback_source_note
from churnsim.calibration.speed_uncertainty import speed_spread_note
from churnsim.calibration.tables import COMMUNICATION_SPAN_KINDS

from ..model.iteration import IterationResult
from ..model.results import RunResult
from ..model.route_notes import swapped_route_notes
from .verdict import rare_stage_loss_note


def scenario_notes(scenario: Scenario) -> tuple[str, ...]:
    """Caveats every output of this scenario must carry; the first names where its convergence
    setbacks come from (measured, paper-fitted or default) when a method uses them; then the machine
    speed's spread, compute carried from another setup, a loss curve carried to another batch or model size,
    methods the pipeline cannot take, CheckFree+'s swapped routes, and stage losses too rare to tell
    the methods apart (`verdict.rare_stage_loss_note`)."""
    uses_setbacks = any(method.uses_setbacks for method in scenario.methods)
    setbacks = (setback_source_note(scenario.convergence),) if uses_setbacks else ()
    speed = speed_spread_note(scenario)
    carried = compute_carry_note(scenario)
    batch = scenario.convergence.batch_note()
    size = scenario.convergence.model_size_note(scenario.target.loss)
    notes = tuple(note for note in (speed, carried, batch, size) if note is not None)
    rare_stage_losses = tuple(note for note in (rare_stage_loss_note(scenario),) if note is not None)
    return setbacks + notes + left_out_method_notes(scenario) + swapped_route_notes(scenario) + rare_stage_losses


def left_out_method_notes(scenario: Scenario) -> tuple[str, ...]:
    """A note for each built-in method the scenario does not compare because its pipeline cannot
    take it (`scenario.method_pipeline_problem`), so that an absent method is never a mystery."""
    present = {method.name for method in scenario.methods}
    notes = []
    for name in METHOD_NAMES:
        problem = None if name in present else method_pipeline_problem(method_from_name(name), scenario.model, scenario.pipeline)
        if problem is not None:
            notes.append(f"{name} is not compared: it {problem[0]}")
    return tuple(notes)


PIPELINE_TRACK = "pipeline (training, stalls, recoveries)"


@dataclass(frozen=True, kw_only=True)
class _Slice:
    name: str
    category: str
    start_us: float
    end_us: float  # == start_us for an instant


def chrome_trace(result: RunResult, iteration: IterationResult | None = None) -> dict:
    """The run's timeline in the Trace Event Format (opens in Perfetto and chrome://tracing).

    Process 0 is the run, one named track (thread) each for the pipeline's trainer (training,
    stalls, recoveries), every stage (its failures, the time another node ran it), every storage
    tier (background flushes) and link (replica refreshes). Process 1, when given, is one healthy
    iteration at microbatch resolution: per stage a compute track and a communication track.
    Slices on one track nest properly (one inside another or apart, never partly overlapping):
    a slice that would partly overlap goes to a numbered overflow track of the same name ("… #2").
    """
    run_tracks: dict[str, list[_Slice]] = {PIPELINE_TRACK: []}
    num_stages = 1 + max([event.stage for event in result.timeline] + [-1])
    for stage in range(num_stages):
        run_tracks[f"stage {stage}"] = []
    for event in result.timeline:
        track = event.track or (PIPELINE_TRACK if event.stage < 0 else f"stage {event.stage}")
        run_tracks.setdefault(track, []).append(
            _Slice(name=event.name, category=event.category, start_us=event.start_s * 1e6, end_us=max(event.end_s, event.start_s) * 1e6)
        )
    processes = [(f"run: {result.method}, replication {result.replication}", run_tracks)]
    if iteration is not None:
        iteration_tracks: dict[str, list[_Slice]] = {}
        for stage in sorted({span.stage for span in iteration.spans}):
            iteration_tracks[f"stage {stage} compute"] = []
            iteration_tracks[f"stage {stage} communication"] = []
        for span in iteration.spans:
            part = "communication" if span.kind in COMMUNICATION_SPAN_KINDS else "compute"
            iteration_tracks[f"stage {span.stage} {part}"].append(
                _Slice(
                    name=f"{span.kind} mb{span.microbatch}" if span.microbatch >= 0 else span.kind,
                    category=span.kind,
                    start_us=span.start_s * 1e6,
                    end_us=span.end_s * 1e6,
                )
            )
        processes.append(("one healthy iteration", iteration_tracks))

    metadata: list[dict] = []
    events: list[dict] = []
    for pid, (process_name, tracks) in enumerate(processes):
        metadata.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}})
        metadata.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        tid = 0
        for track_name, slices in tracks.items():
            for lane_index, lane in enumerate(nested_lanes(slices)):
                name = track_name if lane_index == 0 else f"{track_name} #{lane_index + 1}"
                metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
                metadata.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
                for piece in lane:
                    common = {"name": piece.name, "cat": piece.category, "pid": pid, "tid": tid, "ts": piece.start_us}
                    if piece.end_us > piece.start_us:
                        events.append({**common, "ph": "X", "dur": piece.end_us - piece.start_us})
                    else:
                        events.append({**common, "ph": "i", "s": "t"})
                tid += 1
    return {"traceEvents": metadata + events, "displayTimeUnit": "ms"}


def nested_lanes(slices: Iterable[_Slice]) -> list[list[_Slice]]:
    """Split one track's slices into lanes in which any two slices nest or are apart; at least one lane.

    Greedy, in start order (longer first on a tie, so an enclosing slice comes before what it
    encloses): a slice goes to the first lane whose innermost open slice still open at its start
    encloses it entirely, or where no slice is open then.
    """
    lanes: list[list[_Slice]] = [[]]
    open_ends: list[list[float]] = [[]]  # per lane, the ends of the slices enclosing the current time
    for piece in sorted(slices, key=lambda piece: (piece.start_us, -piece.end_us)):
        for lane, ends in zip(lanes, open_ends):
            while ends and ends[-1] <= piece.start_us:
                ends.pop()
            if not ends or piece.end_us <= ends[-1]:
                break
        else:
            lanes.append([])
            open_ends.append([])
            lane, ends = lanes[-1], open_ends[-1]
        lane.append(piece)
        if piece.end_us > piece.start_us:
            ends.append(piece.end_us)
    return lanes


def write_chrome_trace(path: str | Path, result: RunResult, iteration: IterationResult | None = None) -> Path:
    path = Path(path)
    atomic_write_text(path, strict_json_dumps(chrome_trace(result, iteration), indent=None))
    return path


MANIFEST_FILE = "manifest.json"
DISTRIBUTION = "churnsim"
OPTIONAL_DEPENDENCIES: tuple[str, ...] = ("torch", "pyarrow", "dask", "distributed")
"""Extras' packages recorded where installed: a result may depend on them (torch for calibrations)."""


def _requirement_name(requirement: str) -> str | None:
    """The distribution a requirement string names (`numpy>=1.24; python_version<'4'` → numpy), or
    None for one that only an extra pulls in."""
    name, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", name)
    return match.group(1) if match else None


def dependency_versions(root: str = DISTRIBUTION) -> dict[str, str]:
    """Python's version and that of every installed distribution `root` needs, recursively (what
    its requirements need too), and of `OPTIONAL_DEPENDENCIES` where installed; read from the
    installed packages' metadata (importlib.metadata), so nothing is imported."""
    versions: dict[str, str] = {"python": platform.python_version()}
    pending = [root, *OPTIONAL_DEPENDENCIES]
    while pending:
        name = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in versions:
            continue
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional package, or a requirement whose marker excludes this platform
        versions[key] = distribution.version
        pending += [found for found in map(_requirement_name, distribution.requires or ()) if found is not None]
    return dict(sorted(versions.items()))


def churnsim_version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def write_manifest(directory: str | Path, *, command: str, scenario: Scenario | None, **fields: object) -> Path:
    """`directory/manifest.json` for a results directory: the command, its scenario, provenance, `fields`.

    Provenance: the git revision where churnsim runs from a git checkout (None otherwise, never a
    made-up "unknown"), the installed churnsim version, every dependency's version
    (`dependency_versions`), the machine and the time. The command line and the run time are added
    by the command that wrote the directory (`add_to_manifest`), which alone knows them.

    Strict JSON: the scenario goes through pydantic's JSON mode (infinite bandwidths as the string
    "Infinity", which `Scenario` reads back), and a NaN or infinity among `fields` is an error.
    """
    path = Path(directory) / MANIFEST_FILE
    provenance = provenance_fields()
    revision = provenance["git_revision"]
    manifest = {
        "command": command,
        **({"scenario": json.loads(scenario.model_dump_json())} if scenario is not None else {}),
        **fields,
        **provenance,
        "git_revision": revision if revision != "unknown" else None,
        "churnsim_version": churnsim_version(),
        "package_versions": dependency_versions(),
    }
    atomic_write_text(path, strict_json_dumps(manifest) + "\n")
    return path


def add_to_manifest(directory: str | Path, **fields: object) -> Path:
    """Add `fields` to `directory/manifest.json` (the command line and run time once the command
    knows them), rewriting it atomically."""
    path = Path(directory) / MANIFEST_FILE
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest.update(fields, updated_utc=utc_now())
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
        ScheduledFailure(time_s=failure.time_s, iteration=failure.iteration, stage=failure.stage, replica=failure.replica, kind=failure.kind)
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
