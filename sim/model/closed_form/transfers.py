"""The transfers of a closed-form run: checkpoint writes and reads, weight transfers and replica
refreshes on the run's links (`RunLinks`), and the idle-link closed form that times most of them.

A transfer group (checkpoint writes, reads, weight transfers) on idle links ends at the instant the
event model's wake-up chain gives (`fluid_links.processor_sharing_end_s`), computed as a number,
worked out once per set of transfers and added to each start (`IdleDuration`). A group abandoned by
the trainer (a failure struck first) goes on in the event model and slows whatever later shares its
links: it is remembered, and put on its links (`FluidLink`) only if a later group finds them still
busy; that group is then timed with it. Background groups (replica refreshes, a redundant
replacement's weights) are always put on their links. Where a flow would move the end of a group
the trainer is waiting for, the run goes to the event model (`NeedsEventModel`).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING, Callable

from churnsim.calibration.scenario import Scenario

from .fluid_links import FlowBatch, FluidLink, processor_sharing_end_s
from .interrupts import INTERRUPTED, Interrupted, NeedsEventModel

if TYPE_CHECKING:
    from .engine import ClosedFormRun

_INFINITY = math.inf
_LINK_OF_REQUEST = operator.itemgetter(0)


class TransferGroup:
    """Transfers started together and waited for together (the event model's `all_transfers_done`)."""

    __slots__ = ("batches", "instant_end_s", "end_s", "unregistered", "background", "on_done", "version", "waited")

    def __init__(self, on_done: Callable[[], None] | None = None, *, background: bool = False) -> None:
        self.batches: list[FlowBatch] = []
        self.instant_end_s = -_INFINITY
        """Latest end of its latency-only transfers (zero bytes, infinite bandwidth)."""
        self.end_s = -_INFINITY
        self.unregistered: list[FlowBatch] = []
        """Batches timed in closed form on idle links and not (yet) known to them."""
        self.background = background or on_done is not None
        """Nobody waits for it as it starts: its batches are put on their links, and a later flow
        that shares one re-times its `end_s`."""
        self.on_done = on_done
        """A background group's completion callback (called at `end_s`), if it has one."""
        self.version = 0
        self.waited = False
        """True while the trainer waits for it: a later flow that moves its end is out of the closed form."""

    def refresh_end(self) -> None:
        end_s = self.instant_end_s
        for batch in self.batches:
            if batch.end_s > end_s:
                end_s = batch.end_s
        self.end_s = end_s

class TierTransfers:
    """One stage set's transfers to one storage tier in one direction, with their idle-link closed form.

    The event model resolves one link per stage (or one shared link) and waits for all; when no
    registered flow is in flight, `idle_end_s` gives the instant it would resume at, without
    resolving the links (this runs for every checkpoint write, read and flush round): the
    `IdleDuration` of one batch per stage, or of one batch of every part on a shared link. Per-stage
    links give the event model's instant to the bit; unequal parts on a shared link to a few units
    in the last place (their chain is run once, see `IdleDuration`).
    """

    __slots__ = ("tier_name", "direction", "stages", "sizes", "shared", "generation", "family", "_idle")

    def __init__(self, scenario: Scenario, tier_name: str, direction: str, stages, sizes, *, generation: int = 0) -> None:
        tier = scenario.tier(tier_name)
        self.tier_name = tier_name
        self.direction = direction
        self.stages = tuple(stages)
        self.sizes = tuple(float(size) for size in sizes)
        self.shared = tier.shared
        self.generation = generation
        self.family = (tier_name, direction, generation)
        latency_s = float(tier.total_latency_s)
        bandwidth = float(tier.write_bandwidth_bytes_per_s if direction == "write" else tier.read_bandwidth_bytes_per_s)
        if self.shared:
            batches = [(latency_s, bandwidth, self.sizes)] if self.stages else []
        else:
            batches = [(latency_s, bandwidth, (size,)) for size in self.sizes]
        self._idle = IdleDuration(batches)

    def idle_end_s(self, now_s: float) -> float:
        return self._idle.end_s(now_s)

    def idle_from(self, links: "RunLinks", start_s: float) -> bool:
        """Whether `wait_tier_group` started at `start_s` would take its closed form (no flow of the tier in flight)."""
        return not (links._busy_until_s > start_s and links._family_busy_until_s.get(self.family, -_INFINITY) > start_s)

    def requests(self, links: "RunLinks", generations) -> list[tuple[FluidLink, float]]:
        if self.shared and self.stages:
            link = links.tier_link(self.tier_name, self.direction, self.stages[0], generation=self.generation)
            return [(link, size) for size in self.sizes]
        return [
            (links.tier_link(self.tier_name, self.direction, stage, generation=self.generation, node_generation=generations[stage]), size)
            for stage, size in zip(self.stages, self.sizes)
        ]


class NodeTransfers:
    """Transfers between stages' nodes ((node link, bytes) pairs, in order) with their idle-link closed form."""

    __slots__ = ("requests", "idle_duration")

    def __init__(self, requests: list[tuple[FluidLink, float]]) -> None:
        self.requests = requests
        self.idle_duration = IdleDuration.of_requests(requests)

    def idle_end_s(self, now_s: float) -> float:
        return self.idle_duration.end_s(now_s)

    def idle_from(self, links: "RunLinks", start_s: float) -> bool:
        """Whether `wait_transfers` started at `start_s` would take its closed form (each link idle)."""
        if links._busy_until_s <= start_s:
            return True
        return not links._abandoned and all(link.busy_until_s <= start_s for link, _ in self.requests)


class RunLinks:
    """The links of one closed-form run and the transfers on them (the event model's links and
    `all_transfers_done`): a link per storage tier, direction and node incarnation, and per pair of
    stages, made when first used; the groups the trainer waits for, timed in closed form on idle
    links; the groups it abandoned and the background groups, put on their links when a later flow
    meets them. Waits book their time on the run (`ClosedFormRun.advance`, `book_wait`), which
    raises `Interrupted` out of them as out of its own waits.
    """

    def __init__(self, run: "ClosedFormRun") -> None:
        self.run: ClosedFormRun | None = run
        """The run these links belong to, until it ends (`release`)."""
        self._scenario = run.scenario
        self._node_generation = run.node_generation  # the run's list, changed in place
        self._healthy_state = run.healthy_state
        # Links: registered flows exist only after an abandoned or background group.
        self._links: dict[tuple, FluidLink] = {}
        self._busy_until_s = -_INFINITY
        self._family_busy_until_s: dict[object, float] = {}
        """Per storage tier and direction (a link family): when its last flow in flight arrives."""
        self._abandoned: dict[object, list[tuple]] = {}
        """Per family, abandoned tier transfers not yet registered on their links: (transfers, node
        incarnations, start, end). Most never meet a later transfer (their links are idle again
        first), so they are registered only when a later group finds the family busy."""
        self._tiers = {tier.name: tier for tier in run.scenario.storage}
        self._waited_group: TransferGroup | None = None
        self._tier_link_ids: set[int] = set()
        self._fast_wait: str | list[tuple[FluidLink, float]] | None = None
        """While the trainer waits on transfers timed in closed form and not registered: "tier" (their
        links not resolved: any storage link) or their requests. A background transfer joining one of
        their links would slow them, which the closed form did not count."""

    def tier_link(self, tier_name: str, direction: str, stage: int, *, generation: int = 0, node_generation: int | None = None) -> FluidLink:
        """The link to tier `tier_name` of `stage`'s node (of its incarnation `node_generation`, default the current)."""
        tier = self._tiers.get(tier_name) or self._scenario.tier(tier_name)
        incarnation = self._node_generation[stage] if node_generation is None else node_generation
        owner = ("shared",) if tier.shared else (stage, incarnation)
        key = ("tier", tier_name, direction, owner, generation)
        link = self._links.get(key)
        if link is None:
            bandwidth = tier.write_bandwidth_bytes_per_s if direction == "write" else tier.read_bandwidth_bytes_per_s
            link = FluidLink(
                bandwidth_bytes_per_s=bandwidth,
                latency_s=tier.total_latency_s,
                name=f"{tier_name}-{direction}-{owner}",
                family=(tier_name, direction, generation),
            )
            self._links[key] = link
            self._tier_link_ids.add(id(link))
        return link

    def node_link(self, source_stage: int, destination_stage: int) -> FluidLink:
        key = ("node", source_stage, destination_stage)
        link = self._links.get(key)
        if link is None:
            bandwidths, latencies = self._healthy_state.link_bandwidth_bytes_per_s, self._healthy_state.link_latency_s
            assert bandwidths is not None and latencies is not None, "a built pipeline state has its link matrices"
            link = FluidLink(
                bandwidth_bytes_per_s=bandwidths[source_stage][destination_stage],
                latency_s=latencies[source_stage][destination_stage],
                name=f"link-{source_stage}-{destination_stage}",
            )
            self._links[key] = link
        return link

    def start_transfers(self, requests, *, on_done: Callable[[], None] | None = None, background: bool = False) -> TransferGroup:
        """Start `requests` ((link, bytes) pairs, in order) now, as `all_transfers_done` does.

        For the trainer to wait for (neither argument), a batch on an idle link is timed in closed
        form and not registered. In the background (`background`, or an `on_done`) every batch is
        registered and the group's `end_s` follows later flows that delay it; `on_done`, if given,
        is called when the last transfer arrives. A background group without one costs no event:
        its owner reads `end_s` when it gets there.
        """
        run = self._the_run()
        if self._abandoned:
            for link, _ in requests:
                if link.family in self._abandoned:
                    self._register_abandoned(link.family)
        now = run.now
        group = TransferGroup(on_done, background=background)
        background = group.background
        end_s = now
        if len(requests) == 1:
            link, num_bytes = requests[0]
            end_s = max(end_s, self._start_batch(group, link, [num_bytes], now, background))
        else:
            for link, same_link in itertools.groupby(requests, key=_LINK_OF_REQUEST):  # consecutive requests on one link: one batch
                end_s = max(end_s, self._start_batch(group, link, [num_bytes for _, num_bytes in same_link], now, background))
        group.end_s = end_s
        if on_done is not None:
            self._schedule_group(group)
        return group

    def _start_batch(self, group: TransferGroup, link: FluidLink, sizes: list[float], now: float, background: bool) -> float:
        latency_s = link.latency_s
        positive: tuple[float, ...]
        if len(sizes) == 1:
            positive = (sizes[0],) if sizes[0] > 0 else ()
        else:
            positive = tuple(size for size in sizes if size > 0)
        end_s = -_INFINITY
        if link.instant or len(positive) < len(sizes):
            end_s = now + latency_s
            if end_s > group.instant_end_s:
                group.instant_end_s = end_s
        if link.instant or not positive:
            return end_s
        admit_s = now + latency_s if latency_s > 0 else now
        batch = FlowBatch(admit_s, positive, group, link)
        group.batches.append(batch)
        if not background and link.busy_until_s <= admit_s:
            batch.end_s = processor_sharing_end_s(admit_s, positive, link.bandwidth_bytes_per_s)
            group.unregistered.append(batch)
        else:
            if background:
                fast_wait = self._fast_wait
                if fast_wait is not None and (
                    id(link) in self._tier_link_ids if isinstance(fast_wait, str) else any(link is used for used, _ in fast_wait)
                ):
                    raise NeedsEventModel(f"a background transfer joins {link.name} during a transfer the trainer waits for")
                self._check_trainer_group_untouched(link, admit_s)
            self._add_to_link(batch)
        return max(end_s, batch.end_s)

    def _check_trainer_group_untouched(self, link: FluidLink, admit_s: float) -> None:
        waited = self._waited_group
        if waited is not None:
            for batch in waited.unregistered:
                if batch.link is link and batch.end_s > admit_s:
                    raise NeedsEventModel(f"a background transfer joins {link.name}, which the trainer is waiting on")

    def _add_to_link(self, batch: FlowBatch) -> None:
        link = batch.link
        # Re-time only the batches something waits for: a background group's, the trainer's.
        watched: list[FlowBatch] | tuple[()]
        if batch.admit_s >= link.busy_until_s:
            watched = ()  # an idle link: nothing earlier to re-time
        else:
            watched = [
                earlier for earlier in link.batches
                if earlier.group is not None and (earlier.group.background or earlier.group.waited)
            ]
        moved = link.add(batch, watched=watched)
        if link.busy_until_s > self._busy_until_s:
            self._busy_until_s = link.busy_until_s
        family = link.family
        if family is not None and link.busy_until_s > self._family_busy_until_s.get(family, -_INFINITY):
            self._family_busy_until_s[family] = link.busy_until_s
        for earlier in moved:
            group = earlier.group
            if group is None:
                continue
            group.refresh_end()
            if group.waited:
                raise NeedsEventModel(f"a transfer joins {link.name} while the trainer waits for an earlier one there")
            if group.on_done is not None:
                self._schedule_group(group)

    def _schedule_group(self, group: TransferGroup) -> None:
        group.version += 1
        version = group.version

        on_done = group.on_done
        assert on_done is not None

        def done() -> None:
            if group.version == version:
                on_done()

        self._the_run().schedule(group.end_s, done)

    def _register(self, group: TransferGroup) -> None:
        """The trainer abandoned `group`: its flows go on, and slow whatever later shares their links."""
        for batch in group.unregistered:
            self._add_to_link(batch)
        group.unregistered = []

    def wait_group(self, group: TransferGroup, category: str, name: str) -> None:
        """Wait for `group` (started with `start_transfers` without `on_done`) to complete."""
        group.waited = True
        self._waited_group = group
        try:
            self._the_run().wait_until(group.end_s, category, name)
        except Interrupted:
            self._register(group)
            raise
        finally:
            group.waited = False
            self._waited_group = None

    def wait_transfers(self, transfers: NodeTransfers, category: str, name: str) -> None:
        """Start `transfers` and wait for them all; timed by their idle-link closed form when every link is idle."""
        run = self._the_run()
        requests = transfers.requests
        now = run.now
        if self._busy_until_s > now:
            if self._abandoned:
                for link, _ in requests:
                    if link.family in self._abandoned:
                        self._register_abandoned(link.family)
            for link, _ in requests:
                if link.busy_until_s > now:
                    self.wait_group(self.start_transfers(requests), category, name)
                    return
        # Every link is idle: each link's batch ends at its closed form; nothing to register unless abandoned.
        end_s = transfers.idle_end_s(now)
        if end_s > now:
            self._fast_wait = requests
            stopped_s = run.advance(end_s)
            self._fast_wait = None
            if stopped_s is not None:
                run.now = now
                self._register(self.start_transfers(requests))
                run.now = stopped_s
                run.book_wait(category, name, -1, None, now, True)
                raise INTERRUPTED.with_traceback(None)
            run.book_completed_wait(category, name, now, end_s)

    def wait_tier_group(self, transfers: TierTransfers, category: str, name: str) -> None:
        """Start `transfers` and wait for them; in closed form, without resolving links, when no flow is in flight."""
        run = self._the_run()
        now = run.now
        family = transfers.family
        if not transfers.idle_from(self, now):
            self._register_abandoned(family)
            self.wait_group(self.start_transfers(transfers.requests(self, run.node_generation)), category, name)
            return
        end_s = transfers.idle_end_s(now)
        if end_s > now:
            generations = run.node_generation[:]  # the incarnations it writes from (a failure changes them)
            self._fast_wait = "tier"
            stopped_s = None if end_s < run.next_stop_s else run.advance(end_s)
            self._fast_wait = None
            if stopped_s is not None:
                # Its flows go on, on the links of the node incarnations at the start.
                self._abandoned.setdefault(family, []).append((transfers, generations, now, end_s))
                if end_s > self._busy_until_s:
                    self._busy_until_s = end_s
                if end_s > self._family_busy_until_s.get(family, -_INFINITY):
                    self._family_busy_until_s[family] = end_s
                run.now = stopped_s
                run.book_wait(category, name, -1, None, now, True)
                raise INTERRUPTED.with_traceback(None)
            run.book_completed_wait(category, name, now, end_s)

    def _register_abandoned(self, family: object) -> None:
        """Register the abandoned transfers of `family` still in flight on their links, in start order."""
        run = self._the_run()
        pending = self._abandoned.pop(family, None)
        if not pending:
            return
        now = run.now
        for transfers, generations, start_s, end_s in pending:
            if end_s > now:  # one that has arrived can slow nothing any more
                run.now = start_s
                self._register(self.start_transfers(transfers.requests(self, generations)))
        run.now = now

    def _the_run(self) -> "ClosedFormRun":
        run = self.run
        assert run is not None, "the run has ended"
        return run

    def release(self) -> None:
        """At the end of the run: drop the reference cycles that would keep it alive until a
        collection (the run and its links, the last busy periods' batch ↔ group)."""
        self.run = None
        for link in self._links.values():
            for finished in link.batches:
                finished.group = None


class IdleDuration:
    """When batches of transfers started together on idle links have all arrived, worked out once.

    A batch is (latency, bandwidth, sizes): the flows one link starts together. Its instant part (a
    zero-byte transfer, an infinite bandwidth) ends one latency after the start, its flows one
    latency plus their processor-sharing chain later: one flow's quotient bytes / bandwidth, as the
    event model computes it (to the bit); equal flows' one step, size × count / bandwidth (to the
    bit); unequal flows' chain length, run once from admission 0 (the event model runs it from the
    admission instant: a few units in the last place). Batches of one latency keep only their
    longest flows, which rounding, being monotonic, makes the latest end.
    """

    __slots__ = ("_instant_latency_s", "_flows")

    def __init__(self, batches) -> None:
        instant_latency_s: float | None = None
        longest_flows_s: dict[float, float] = {}
        for latency_s, bandwidth_bytes_per_s, sizes in batches:
            positive = [size for size in sizes if size > 0]
            instant = bandwidth_bytes_per_s == _INFINITY
            if instant or len(positive) < len(sizes):
                instant_latency_s = latency_s if instant_latency_s is None else max(instant_latency_s, latency_s)
            if instant or not positive:
                continue
            if len(positive) == 1:
                flows_s = max(positive[0], 0.0) * 1 / bandwidth_bytes_per_s
            else:
                flows_s = processor_sharing_end_s(0.0, positive, bandwidth_bytes_per_s)
            longest_flows_s[latency_s] = max(longest_flows_s.get(latency_s, flows_s), flows_s)
        self._instant_latency_s = instant_latency_s
        self._flows = tuple(longest_flows_s.items())

    @classmethod
    def of_requests(cls, requests) -> "IdleDuration":
        """For (link, bytes) pairs in order: consecutive ones on one link start as one batch."""
        batches: list[tuple[FluidLink, list[float]]] = []
        for link, num_bytes in requests:
            if batches and batches[-1][0] is link:
                batches[-1][1].append(num_bytes)
            else:
                batches.append((link, [num_bytes]))
        return cls((link.latency_s, link.bandwidth_bytes_per_s, sizes) for link, sizes in batches)

    def end_s(self, now: float) -> float:
        end_s = now
        if self._instant_latency_s is not None and now + self._instant_latency_s > end_s:
            end_s = now + self._instant_latency_s
        for latency_s, flows_s in self._flows:
            batch_end_s = (now + latency_s if latency_s > 0 else now) + flows_s
            if batch_end_s > end_s:
                end_s = batch_end_s
        return end_s
