"""A stale stage reload costs progress only where the scenario says so (wall-clock replays do not)."""

from __future__ import annotations

import pytest

from churnsim.calibration.failure_sampling import FailureEvent
from churnsim.calibration.presets import preset
from churnsim.sim.model.calibrated import without_setbacks
from churnsim.sim.model.run import simulate_run


@pytest.mark.parametrize("reference_events", [False, True])
def test_an_edge_reload_from_its_checkpoint_repeats_no_iteration_in_a_wall_clock_replay(reference_events):
    scenario = preset("cpu-tiny").only_method("checkfree")
    method = scenario.methods[0]
    assert method.edge_fallback == "checkpoint"
    # An edge stage fails well after its last edge checkpoint: reloading it is stale.
    failures = (FailureEvent(time_s=0.5 * scenario.target_iterations * 0.14, stage=scenario.pipeline.num_stages - 1, kind="poisson"),)
    charged = simulate_run(scenario, method, failures, seed=1, reference_events=reference_events)
    replay = simulate_run(without_setbacks(scenario), method, failures, seed=1, reference_events=reference_events)
    iteration_s = replay.healthy_iteration_time_s
    # Only the interrupted part of the iteration in flight is lost in the replay; charged, the
    # reload also costs Δ/S iterations of progress (the convergence stand-in), which are repeated.
    assert replay.summary()["lost_work_s"] <= iteration_s
    assert charged.summary()["lost_work_s"] > replay.summary()["lost_work_s"] + iteration_s
    assert replay.iterations_executed <= scenario.target_iterations + 1 < charged.iterations_executed
    assert replay.wall_clock_s < charged.wall_clock_s
