"""Routes and per-stage operation orders shared by the simulator and the real pipeline."""

from __future__ import annotations

import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.pipeline_schedule import microbatch_route, stage_operation_order, swapped_block_order


@pytest.mark.parametrize(
    "num_stages, expected",
    [(4, (1, 0, 3, 2)), (5, (1, 0, 2, 4, 3)), (8, (1, 0, 2, 3, 4, 5, 7, 6))],
)
def test_checkfree_plus_swaps_the_first_two_and_the_last_two_stages(num_stages, expected):
    assert swapped_block_order(num_stages) == expected
    route = microbatch_route(num_stages, 1, swap_odd_microbatches=True)
    assert tuple(hop.stage for hop in route if hop.runs_blocks) == expected
    # The embedding stays on stage 0 and the head on the last stage, as their own hops.
    assert (route[0].stage, route[0].runs_embedding, route[0].runs_blocks) == (0, True, False)
    assert (route[-1].stage, route[-1].runs_head, route[-1].runs_blocks) == (num_stages - 1, True, False)


def test_even_microbatches_and_unswapped_runs_go_in_order():
    for microbatch, swap in ((0, True), (2, True), (1, False)):
        route = microbatch_route(6, microbatch, swap_odd_microbatches=swap)
        assert [hop.stage for hop in route] == list(range(6))
        assert route[0].runs_embedding and route[-1].runs_head


def test_swaps_need_four_stages():
    with pytest.raises(InputError, match="num_stages >= 4"):
        swapped_block_order(3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("swap", [False, True])
def test_every_stage_does_each_hop_forward_then_backward_exactly_once(schedule, swap):
    num_stages, num_microbatches = 5, 7
    for stage in range(num_stages):
        operations = stage_operation_order(schedule, num_stages=num_stages, num_microbatches=num_microbatches, stage=stage, swap_odd_microbatches=swap)
        seen = [(op.direction, op.microbatch, op.hop_index) for op in operations]
        assert len(seen) == len(set(seen))
        for direction, microbatch, hop in seen:
            if direction == "backward":
                assert seen.index(("forward", microbatch, hop)) < seen.index((direction, microbatch, hop))
        expected_hops = sum(
            1 for m in range(num_microbatches) for hop in microbatch_route(num_stages, m, swap_odd_microbatches=swap) if hop.stage == stage
        )
        assert len(seen) == 2 * expected_hops


def test_1f1b_warms_up_by_the_distance_to_the_last_stage():
    operations = stage_operation_order("1f1b", num_stages=4, num_microbatches=8, stage=1)
    directions = [op.direction for op in operations]
    assert directions[:4] == ["forward"] * 3 + ["backward"]  # 2 warm-up forwards, then one forward, one backward
    last = stage_operation_order("1f1b", num_stages=4, num_microbatches=8, stage=3)
    assert [op.direction for op in last[:4]] == ["forward", "backward", "forward", "backward"]


def test_unknown_schedule_is_an_input_error():
    with pytest.raises(InputError, match="unknown schedule 'interleaved'"):
        stage_operation_order("interleaved", num_stages=2, num_microbatches=2, stage=0)
