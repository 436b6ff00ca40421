"""The iteration model with stage processes sharing a host's cores (processor sharing)."""

from __future__ import annotations

import pytest

from churnsim.sim.iteration import simulate_iteration
from churnsim.sim.pipeline_state import PipelineState

FORWARD_S, BACKWARD_S, OPTIMIZER_S = 0.01, 0.02, 0.005


def _state(*, cores: int | None, redundant: bool = False, schedule: str = "1f1b", num_stages: int = 4, num_microbatches: int = 4) -> PipelineState:
    return PipelineState.uniform(
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        forward_s=FORWARD_S,
        backward_s=BACKWARD_S,
        optimizer_step_s=OPTIMIZER_S,
        redundant_forward=redundant,
        shared_cores=cores,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("redundant", [False, True])
def test_as_many_cores_as_stages_is_a_processor_per_stage(schedule, redundant):
    own = simulate_iteration(_state(cores=None, redundant=redundant, schedule=schedule))
    shared = simulate_iteration(_state(cores=4, redundant=redundant, schedule=schedule))
    assert shared.time_s == pytest.approx(own.time_s, rel=1e-12)
    assert shared.busy_s == pytest.approx(own.busy_s, rel=1e-12)


@pytest.mark.parametrize("redundant", [False, True])
def test_one_core_does_all_the_work_one_thing_at_a_time(redundant):
    state = _state(cores=1, redundant=redundant)
    work_s = 4 * 4 * (FORWARD_S + BACKWARD_S) + 4 * OPTIMIZER_S
    if redundant:
        work_s += 3 * 4 * FORWARD_S  # stages 0..2 each run their successor's forward of every microbatch
    assert simulate_iteration(state).time_s == pytest.approx(work_s, rel=1e-9)


def test_fewer_cores_never_speed_an_iteration_up():
    times = [simulate_iteration(_state(cores=cores, num_stages=6, num_microbatches=8)).time_s for cores in (6, 4, 3, 2, 1)]
    assert times == sorted(times)
    assert times[-1] > times[0]


def test_shared_cores_must_be_a_positive_integer():
    from churnsim.calibration.errors import InputError

    with pytest.raises(InputError, match="shared_cores"):
        _state(cores=0)
