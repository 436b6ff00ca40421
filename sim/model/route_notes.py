"""Caveats about links a method's own pipeline route uses and the plain pipeline never does.

CheckFree+ sends odd microbatches through the first two and the last two stages in swapped order
(calibration/pipeline_schedule.py), so they cross the stage pairs (0, 2) and (S-3, S-1) twice per
iteration, forward and backward. Where those pairs sit on slow links (on the CheckFree geo testbed:
Australia ↔ Germany) that cost dominates the method's time, and the CheckFree paper's emulator did
not measure it. The note names the slowest such link, so a reader can tell a slow method from a slow
placement. With a separate (de)embedding node (`pipeline.embedding_placement = "separate_node"`)
the swap adds no trip, but the swapped route still crosses pairs the plain one does not.
"""

from __future__ import annotations

from churnsim.calibration.errors import InputError
from churnsim.calibration.network import link_between, site_of_node
from churnsim.calibration.pipeline_schedule import microbatch_route
from churnsim.calibration.scenario import Scenario, SiteNetwork

from .methods import POLICIES


def _hops(num_stages: int, num_microbatches: int, swap: bool, placement: str = "edge_stages") -> set[tuple[int, int]]:
    """Unordered stage pairs that exchange activations (forward) and gradients (backward); stage S
    is the separate (de)embedding node under `placement = "separate_node"`."""
    pairs: set[tuple[int, int]] = set()
    for microbatch in range(min(num_microbatches, 2)):  # routes repeat with period 2
        route = microbatch_route(num_stages, microbatch, swap_odd_microbatches=swap, embedding_placement=placement)
        stages = [hop.stage for hop in route]
        pairs.update((min(a, b), max(a, b)) for a, b in zip(stages, stages[1:]) if a != b)
    return pairs


def _where(scenario: Scenario, stage: int) -> str:
    network = scenario.network
    name = "the embedding node" if stage == scenario.pipeline.num_stages else f"stage {stage}"
    return f"{name} ({site_of_node(network, stage)})" if isinstance(network, SiteNetwork) else name


def swapped_route_notes(scenario: Scenario) -> tuple[str, ...]:
    """One note per method of `scenario` whose route crosses stage pairs of a site network the plain route does not.

    On a uniform network the extra hops cost what any hop costs and the steady-overhead caveat
    (`sim.studies.verdict.steady_overhead_caveats`) covers them; on a site network they may cross an ocean.
    """
    num_stages, num_microbatches = scenario.pipeline.num_stages, scenario.pipeline.num_microbatches
    if not isinstance(scenario.network, SiteNetwork):
        return ()
    notes = []
    for method in scenario.methods:
        policy = POLICIES.get(method.name)
        if policy is None or not policy.swap_odd_microbatches:
            continue
        placement = scenario.pipeline.embedding_placement
        try:
            plain = _hops(num_stages, num_microbatches, False, placement)
            extra = _hops(num_stages, num_microbatches, True, placement) - plain
        except InputError:
            continue  # too few stages to swap: the scenario check reports it
        if not extra:
            continue
        slowest_plain_bytes_per_s = min(link_between(scenario.network, a, b)[1] for a, b in plain) if plain else float("inf")
        a, b = min(extra, key=lambda pair: link_between(scenario.network, *pair)[1])
        latency_s, bandwidth_bytes_per_s = link_between(scenario.network, a, b)
        trips = "two extra trips per iteration" if placement == "edge_stages" else "no extra trip, but some"
        notes.append(
            f"{method.name}: odd microbatches take the swapped route, {trips} over links the plain "
            f"pipeline never uses, the slowest {_where(scenario, a)} ↔ {_where(scenario, b)} at {8 * bandwidth_bytes_per_s / 1e6:.0f} Mb/s "
            f"and {1e3 * latency_s:.0f} ms (the plain route's slowest: {8 * slowest_plain_bytes_per_s / 1e6:.0f} Mb/s); "
            + (
                "the CheckFree paper's emulator kept the (de)embedding on a node of its own, where these trips vanish "
                "(pipeline.embedding_placement=separate_node); another stage placement changes the cost too"
                if placement == "edge_stages"
                else "another stage placement changes this cost"
            )
        )
    return tuple(notes)
