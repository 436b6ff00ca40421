"""Perfetto timelines: every track named, slices on one track nested or apart (never partly overlapping)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from churnsim.calibration.churn import StageHourlyChurn
from churnsim.calibration.failure_sampling import failures_for_replication
from churnsim.calibration.methods import METHOD_NAMES, method_from_name
from churnsim.calibration.presets import preset
from churnsim.sim.model.iteration import IterationModel, simulate_iteration
from churnsim.sim.model.methods import build_policy
from churnsim.sim.studies.outputs import PIPELINE_TRACK, _Slice, chrome_trace, nested_lanes
from churnsim.sim.model.run import simulate_run

MODEL = IterationModel()


def geo_at(rate: float):
    scenario = preset("checkfree-500m-geo-10pct")
    return scenario.model_copy(update={"churn": StageHourlyChurn(kind="stage_hourly", failure_probability_per_stage_hour=rate)})


def assert_tracks_named_and_nested(trace: dict) -> dict[tuple[int, int], str]:
    events = trace["traceEvents"]
    json.dumps(events, allow_nan=False)  # strict JSON
    names = {(event["pid"], event["tid"]): event["args"]["name"] for event in events if event["name"] == "thread_name"}
    per_process = defaultdict(list)
    for (pid, _tid), name in names.items():
        per_process[pid].append(name)
    for pid, track_names in per_process.items():
        assert len(track_names) == len(set(track_names)), f"process {pid} has two tracks of one name"
    slices = defaultdict(list)
    for event in events:
        if event["ph"] in ("X", "i"):
            assert (event["pid"], event["tid"]) in names, f"unnamed track for {event['name']!r}"
        if event["ph"] == "X":
            slices[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"], event["name"]))
    for track, pieces in slices.items():
        pieces.sort(key=lambda piece: (piece[0], -piece[1]))
        open_ends: list[float] = []
        for start, end, name in pieces:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{names[track]!r}: {name!r} partly overlaps an enclosing slice"
            open_ends.append(end)
    return names


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_s_timeline_has_named_tracks_and_nested_slices(method):
    scenario = geo_at(0.33)
    failures = failures_for_replication(scenario, replication=0)
    result = simulate_run(scenario, method_from_name(method), failures, iteration_model=MODEL)
    iteration = simulate_iteration(build_policy(method_from_name(method), scenario).healthy_state())
    names = assert_tracks_named_and_nested(chrome_trace(result, iteration))
    run_tracks = {name for (pid, _tid), name in names.items() if pid == 0}
    assert PIPELINE_TRACK in run_tracks
    assert {f"stage {stage}" for stage in range(scenario.pipeline.num_stages)} <= run_tracks
    iteration_tracks = {name for (pid, _tid), name in names.items() if pid == 1}
    assert {"stage 0 compute", "stage 0 communication"} <= iteration_tracks


def test_background_flushes_and_refreshes_get_a_track_per_storage_tier_and_link():
    scenario = geo_at(0.10)
    failures = failures_for_replication(scenario, replication=0)
    lazy = simulate_run(scenario, method_from_name("async_checkpoint"), failures, iteration_model=MODEL)
    tracks = set(assert_tracks_named_and_nested(chrome_trace(lazy)).values())
    levels = method_from_name("async_checkpoint").levels
    assert {f"storage tier {level}" for level in levels} <= {track.split(" #")[0] for track in tracks}
    plus = simulate_run(scenario, method_from_name("checkfree_plus"), failures, iteration_model=MODEL)
    last = scenario.pipeline.num_stages - 1
    assert f"links 0→1, {last}→{last - 1}" in set(assert_tracks_named_and_nested(chrome_trace(plus)).values())


def piece(start: float, end: float) -> _Slice:
    return _Slice(name=f"{start}-{end}", category="test", start_us=start, end_us=end)


def test_partly_overlapping_slices_go_to_an_overflow_lane_and_nested_ones_stay():
    lanes = nested_lanes([piece(0, 10), piece(2, 5), piece(5, 9), piece(8, 12), piece(12, 13), piece(3, 3)])
    assert [[(p.start_us, p.end_us) for p in lane] for lane in lanes] == [
        [(0, 10), (2, 5), (3, 3), (5, 9), (12, 13)],
        [(8, 12)],
    ]
    assert nested_lanes([]) == [[]]


def test_an_overflow_lane_is_a_named_track_of_its_own():
    from churnsim.sim.model.results import RunResult, TimelineEvent

    timeline = (
        TimelineEvent(name="checkpoint 1 durable at remote", category="flush", stage=-1, start_s=0.0, end_s=10.0, track="storage tier remote"),
        TimelineEvent(name="checkpoint 2 durable at remote", category="flush", stage=-1, start_s=5.0, end_s=15.0, track="storage tier remote"),
    )
    result = RunResult(
        method="async_checkpoint", replication=0, seed=0, reached_target=True, wall_clock_s=15.0, target_iterations=1,
        progress_iterations=1.0, iterations_executed=1, healthy_iteration_time_s=1.0, reference_iteration_time_s=1.0,
        goodput_s=15.0, badput={}, failures=(), trajectory=((0.0, 0.0),), timeline=timeline,
    )  # fmt: skip
    names = assert_tracks_named_and_nested(chrome_trace(result))
    assert {"storage tier remote", "storage tier remote #2"} <= set(names.values())
