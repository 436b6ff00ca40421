"""Closed-form twins of `sim/model/methods/rebuild.py`: CheckFree, CheckFree+ and the rebuild ablations.

A rebuild is a sequence of waits (join delay, restart, weight transfers over the node links with any
edge checkpoint reads), each one comparison with the next failure; a failure during it re-enters it
with the merged set of lost stages, as the event model does. The plan of a set of lost stages is the
contract's pure function (`plan_rebuild`), so it is computed once per set. CheckFree+'s replica
refresh is a background transfer group whose completion (and span) the engine books when the run
reaches it; a rebuild transfer that shares its link delays it exactly as in the event model.
"""

from __future__ import annotations

from churnsim.calibration.rebuild_plan import leaves_no_trained_weights
from churnsim.calibration.scenario import Scenario

from ..methods.base import embedding_weight_bytes, head_weight_bytes
from ..methods.checkpointing import stale_stage_loss_iterations
from ..methods.rebuild import CheckFreePlusPolicy, RebuildPolicy
from .checkpointing import SyncCheckpointerTwin
from .engine import ClosedFormPolicy, ClosedFormRun
from .transfers import NodeTransfers, TransferGroup


class _LostSet:
    """What a set of stages lost together costs, worked out once (the plan is a pure function of the set)."""

    __slots__ = ("plans", "restored", "sends", "label", "copies_edge", "transfers", "constant_setback")

    def __init__(self, policy: RebuildPolicy, lost: set[int]) -> None:
        self.plans = plans = policy.plan(lost)
        self.restored = sorted(stage for stage, plan in plans.items() if plan.blocks_from == "edge_checkpoint")
        self.sends = [
            (source, stage, policy.source_bytes(plan, index)) for stage, plan in plans.items() for index, source in enumerate(plan.sources)
        ]
        """(source stage, lost stage, bytes) of every weight transfer, in the event model's order."""
        self.label = f"rebuild of stages {sorted(lost)}"
        self.copies_edge = any(plan.edge_part == "random_init" and plan.sources for plan in plans.values())
        """Whether `RebuildPolicy._note_random_edge_parts` may have something to say."""
        self.transfers: NodeTransfers | None = None
        """The weight transfers on their node links, once resolved (node links never change)."""
        self.constant_setback: float | None = None
        """The setback at any progress, where it does not depend on it (None: ask the policy each time)."""
        if (
            type(policy).rebuild_setback_iterations is RebuildPolicy.rebuild_setback_iterations
            and type(policy).setback_iterations is RebuildPolicy.setback_iterations
            and not (policy.scenario.convergence.restart_from_scratch_costs_progress and leaves_no_trained_weights(plans, policy.num_stages))
            and not any(policy.setback_grows_with_progress(plan) for plan in plans.values())
        ):
            # The sum `on_failures` forms, in its order, at any progress.
            self.constant_setback = 0
            for plan in plans.values():
                self.constant_setback += policy.setback_iterations(plan, 0.0)


class RebuildTwin(ClosedFormPolicy):
    """`RebuildPolicy.on_failures` and the edge checkpoints of CheckFree (`edge_fallback = "checkpoint"`)."""

    policy: RebuildPolicy

    def __init__(self, policy: RebuildPolicy, scenario: Scenario) -> None:
        super().__init__(policy, scenario)
        edge = policy.edge_checkpointer
        self.edge_checkpointer = self.periodic_writer = SyncCheckpointerTwin(edge, scenario) if edge is not None else None
        self._lost_sets: dict[frozenset[int], _LostSet] = {}
        self.restart_s = scenario.recovery.restart_s_for(policy.config.name)

    def at_boundary(self, run: ClosedFormRun) -> None:
        if self.edge_checkpointer is not None:
            self.edge_checkpointer.write(run)

    def on_failures(self, run: ClosedFormRun, failures) -> None:
        policy = self.policy
        rebuilding = policy.rebuilding
        for event in failures:
            rebuilding.add(event.stage)
        lost = set(rebuilding)
        key = frozenset(lost)
        known = self._lost_sets.get(key)
        if known is None:
            known = self._lost_sets[key] = _LostSet(policy, lost)
        plans, restored = known.plans, known.restored
        for event in failures:
            run.record_failure(event, plans[event.stage].handled_as)
        if known.copies_edge and not policy._noted_random_edge_parts:
            policy._note_random_edge_parts(run, plans)  # type: ignore[arg-type]  # a run offers the RunContext API it uses
        if restored:
            assert policy.edge_checkpointer is not None
            policy.edge_checkpointer.node_lost()
        start_s = run.now
        transfers = known.transfers
        if transfers is None:
            transfers = known.transfers = NodeTransfers([(run.links.node_link(source, stage), num_bytes) for source, stage, num_bytes in known.sends])
        transfer_label = "weight transfer"
        if restored:
            assert self.edge_checkpointer is not None
            # The edge checkpoints are read from this incarnation's links, fixed at the failures' arrival.
            transfers = NodeTransfers(transfers.requests + self.edge_checkpointer.read_requests(run, restored))
            transfer_label = "weight transfer and edge checkpoint read"
        if not run.recover_unstopped(lost, self.restart_s, transfers, transfer_label):
            # Something can stop it (a failure, a background event, the deadline) or a link is busy: step by step.
            run.wait_for_replacements(lost)
            run.wait(self.restart_s, "recovery_downtime_s", "restart")
            if transfers.requests:
                run.links.wait_transfers(transfers, "recovery_downtime_s", transfer_label)
        stale_iterations = 0.0
        if restored:
            assert policy.edge_checkpointer is not None
            stale_iterations = max(run.progress - policy.edge_checkpointer.committed_progress, 0.0)
        setback = known.constant_setback
        if setback is None:
            setback = policy.rebuild_setback_iterations(run, plans)  # type: ignore[arg-type]  # a run offers the RunContext API it uses
        run.apply_setback(setback)
        if restored:
            run.lose_iterations(stale_stage_loss_iterations(stale_iterations, len(restored), self.num_stages))
            policy.num_edge_restores += len(restored)
        run.span(known.label, "recovery", start_s)
        policy.num_rebuilds += len(lost)
        rebuilding.clear()


class CheckFreePlusTwin(RebuildTwin):
    """CheckFree+: the (de)embedding replica refresh in the background, instead of edge checkpoints.

    A refresh is a background transfer group with no completion event: the event model's `done`
    is processed exactly when the run has reached the group's end (which later flows on its links
    may move), so the next boundary and `finish` read `end_s` against `now`, and its span is booked
    as a background span (placed where the event model books it, `ClosedFormRun.background_span`).
    """

    policy: CheckFreePlusPolicy

    def __init__(self, policy: CheckFreePlusPolicy, scenario: Scenario) -> None:
        super().__init__(policy, scenario)
        self.periodic_writer = None  # its boundary is the refresh
        self._refresh: TransferGroup | None = None
        """The refresh whose span is not booked yet (None once it is)."""
        self._refresh_started: tuple[float, int] = (0.0, 0)
        """(start, timeline length then) of that refresh, for its span."""
        last = self.num_stages - 1
        self._refresh_track = f"links 0→1, {last}→{last - 1}"
        self._refresh_bytes = (embedding_weight_bytes(scenario), head_weight_bytes(scenario))

    def _book_refresh(self, run: ClosedFormRun) -> None:
        assert self._refresh is not None
        start_s, marker = self._refresh_started
        run.background_span("(de)embedding replica refresh", "flush", start_s, self._refresh.end_s, marker, track=self._refresh_track)
        self._refresh = None

    def at_boundary(self, run: ClosedFormRun) -> None:
        policy = self.policy
        refresh = self._refresh
        if refresh is not None:
            if refresh.end_s > run.now:
                run.wait_until(refresh.end_s, "method_overhead_s", "replica refresh backlog")
            self._book_refresh(run)
        last = self.num_stages - 1
        self._refresh_started = (run.now, run.timeline_length())
        self._refresh = run.links.start_transfers(
            [(run.links.node_link(0, 1), self._refresh_bytes[0]), (run.links.node_link(last, last - 1), self._refresh_bytes[1])],
            background=True,
        )
        policy._refresh_origin = run.iterations_executed
        policy.num_refreshes += 1

    def finish(self, run: ClosedFormRun) -> None:
        if self._refresh is not None and self._refresh.end_s <= run.now:
            self._book_refresh(run)
