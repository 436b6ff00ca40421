"""The one rebuild rule of the contract, on hand-picked patterns, and the edge-checkpoint knobs."""

from __future__ import annotations

import pytest

from churnsim.calibration.base import validate_model
from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import checkfree_124m_geo
from churnsim.calibration.rebuild_plan import edge_checkpoint_stages, leaves_no_trained_weights, plan_rebuild, reliable_stages
from churnsim.calibration.scenario import Scenario


def _descriptions(name: str, lost: set[int], num_stages: int, **parameters) -> dict[int, str]:
    plans = plan_rebuild(method_from_name(name, **parameters), lost, num_stages)
    return {stage: plan.description for stage, plan in plans.items()}


def test_checkfree_rebuilds_interior_stage_as_gradient_weighted_average_of_surviving_neighbours():
    (plan,) = plan_rebuild(method_from_name("checkfree"), {2}, 5).values()
    assert (plan.sources, plan.weighting, plan.handled_as) == ((1, 3), "gradient", "rebuild_interior")
    assert (plan.setback_method, plan.setback_position, plan.fresh_optimizer) == ("checkfree", "interior", True)


def test_a_stage_with_no_surviving_neighbour_copies_the_nearest_surviving_stage_previous_first():
    assert _descriptions("checkfree", {1, 2, 3}, 5, edge_fallback="copy") == {1: "copy(0)", 2: "copy(0)", 3: "copy(4)"}
    assert _descriptions("uniform", {2, 3}, 6) == {2: "copy(1)", 3: "copy(4)"}
    assert _descriptions("copy", {0, 1}, 4) == {0: "copy(2)", 1: "copy(2)"}
    assert _descriptions("copy", set(range(4)), 4) == {stage: "random" for stage in range(4)}


@pytest.mark.parametrize(
    ("name", "parameters", "lost", "num_stages", "from_scratch"),
    [
        ("random", {}, {0}, 1, True),  # the only stage
        ("copy", {}, {0}, 1, True),  # nothing to copy from
        ("checkfree", {"edge_fallback": "copy"}, {0}, 1, True),
        ("checkfree", {}, {0}, 1, False),  # its edge checkpoint is reloaded
        ("uniform", {}, {0, 1}, 2, True),
        ("uniform", {}, {0}, 2, False),  # stage 1 survives and is copied
        ("random", {}, {0, 1, 2}, 4, False),  # stage 3 keeps its trained weights
        ("checkfree", {}, {0, 1, 2, 3}, 4, False),  # the edges reload, the interior is random
        ("checkfree", {"edge_fallback": "random"}, {0, 1, 2, 3}, 4, True),
    ],
)
def test_no_trained_weights_are_left_only_when_every_stage_restarts_from_random_init(name, parameters, lost, num_stages, from_scratch):
    plans = plan_rebuild(method_from_name(name, **parameters), lost, num_stages)
    assert leaves_no_trained_weights(plans, num_stages) is from_scratch


def test_checkfree_edge_fallbacks():
    restored = plan_rebuild(method_from_name("checkfree"), {0, 3}, 4)
    assert {plan.handled_as for plan in restored.values()} == {"edge_checkpoint_restore"}
    assert {plan.edge_part for plan in restored.values()} == {"edge_checkpoint"}
    assert all(plan.setback_method is None and not plan.fresh_optimizer for plan in restored.values())
    copied = plan_rebuild(method_from_name("checkfree", edge_fallback="copy"), {0}, 4)[0]
    assert (copied.description, copied.edge_part, copied.setback_method) == ("copy(1)", "random_init", "checkfree")
    randomised = plan_rebuild(method_from_name("checkfree", edge_fallback="random"), {0, 1}, 4)
    assert {plan.handled_as for plan in randomised.values()} == {"rebuild_random"}
    assert {plan.setback_method for plan in randomised.values()} == {"random"}
    # Edge checkpoints cover only the edges: an interior stage with a lost neighbour copies.
    assert _descriptions("checkfree", {0, 1}, 4) == {0: "edge_checkpoint", 1: "copy(2)"}


def test_checkfree_plus_edges_copy_the_swap_partner_with_the_replica_or_start_random_without_it():
    (plan,) = plan_rebuild(method_from_name("checkfree_plus"), {3}, 4).values()
    assert (plan.sources, plan.edge_part, plan.handled_as) == ((2,), "replica", "rebuild_edge_swap")
    assert _descriptions("checkfree_plus", {0, 1}, 4) == {0: "random", 1: "copy(2)"}
    with pytest.raises(ValueError, match="at least 4 stages"):
        plan_rebuild(method_from_name("checkfree_plus"), {0}, 3)


def test_reliable_edge_stages_are_never_planned_and_write_no_edge_checkpoints():
    reliable = method_from_name("checkfree", edge_stages_reliable=True)
    assert reliable_stages(reliable, 6) == {0, 5}
    assert _descriptions("checkfree", {0, 1, 5}, 6, edge_stages_reliable=True) == {1: "weighted_average(0,2)"}
    assert edge_checkpoint_stages(reliable, 6) == ()
    assert edge_checkpoint_stages(method_from_name("checkfree"), 6) == (0, 5)
    assert edge_checkpoint_stages(method_from_name("checkfree", edge_fallback="copy"), 6) == ()
    assert reliable_stages(method_from_name("copy"), 6) == frozenset()


def test_plan_rebuild_rejects_methods_that_do_not_rebuild_and_stages_out_of_range():
    with pytest.raises(ValueError, match="does not rebuild"):
        plan_rebuild(method_from_name("checkpoint"), {0}, 4)
    with pytest.raises(ValueError, match="outside 0..3"):
        plan_rebuild(method_from_name("copy"), {4}, 4)


def test_scenario_checks_the_edge_checkpoint_tier_only_when_edge_checkpoints_are_written():
    data = checkfree_124m_geo().model_dump(mode="json")
    data["methods"] = [{"name": "checkfree", "edge_checkpoint_tier": "nvme"}]
    with pytest.raises(InputError, match="nvme"):
        validate_model(Scenario, data, "scenario")
    data["methods"] = [{"name": "checkfree", "edge_checkpoint_tier": "nvme", "edge_fallback": "copy"}]
    validate_model(Scenario, data, "scenario")
