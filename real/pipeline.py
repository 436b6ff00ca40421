"""One pipeline stage's share of an iteration: forward and backward hops with point-to-point sends.

Each process executes `stage_operation_order(...)` (calibration/pipeline_schedule.py) for its stage.
A forward hop receives the previous hop's activation (or embeds tokens), runs the parts the `Hop`
names, and sends its output to the next hop's stage; the head hop computes the microbatch loss
divided by M, so the gradients summed over microbatches are those of the mean loss. A backward hop
receives the output gradient (or starts from the loss), backpropagates, and sends the input
gradient to the previous hop's stage.

Deadlock freedom: sends are non-blocking (`isend`, waited at the end of the iteration) and every
operation waits only for its own input, so a stage never blocks on a message it has not yet
needed. `message_flow_completes` replays the operation orders of all stages under exactly these
rules and tells whether every stage finishes; the tests run it for GPipe and 1F1B with and without
CheckFree+'s swapped routes.

Placement (hard failures, `redundant` running degraded): while stage s's process is down, its
predecessor runs stage s too, with its replica. `placement[t]` names the process (by its own stage)
that runs stage t; a process runs the schedule of its position among the processes, each of its
forward operations covering its stages' hops in route order (backward: reversed), and consecutive
hops on one process pass the activation in memory. In-order routes only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from churnsim.calibration.pipeline_schedule import Hop, StageOperation, microbatch_route, stage_operation_order

from .distributed import Communicator
from .model import StageModule
from .spans import SpanRecorder

_FORWARD, _BACKWARD, _EVAL = 0, 1, 2


def _tag(microbatch: int, hop_index: int, direction: int, num_hops: int) -> int:
    """A tag unique within an iteration for the message that arrives at (microbatch, hop_index)."""
    return (microbatch * num_hops + hop_index) * 3 + direction


AfterForwardHop = Callable[..., None]


class PipelineStage:
    """The work of stage `stage` in every iteration: holds the routes and the operation order."""

    def __init__(
        self,
        *,
        module: StageModule,
        communicator: Communicator,
        spans: SpanRecorder,
        schedule: str,
        num_microbatches: int,
        microbatch_size: int,
        swap_odd_microbatches: bool = False,
        after_forward_hop: AfterForwardHop | None = None,
        placement: tuple[int, ...] | None = None,
        hosted_modules: dict[int, StageModule] | None = None,
    ) -> None:
        self.module = module
        self.stage = module.stage
        """This process's own stage, which names it as a peer."""
        self.num_stages = module.num_stages
        self.communicator = communicator
        self.spans = spans
        self.num_microbatches = num_microbatches
        self.after_forward_hop = after_forward_hop
        identity = tuple(range(self.num_stages))
        self.placement = identity if placement is None else tuple(placement)
        self.modules: dict[int, StageModule] = {self.stage: module, **(hosted_modules or {})}
        if sorted(stage for stage, process in enumerate(self.placement) if process == self.stage) != sorted(self.modules):
            raise ValueError(f"placement {self.placement} does not match the stages {sorted(self.modules)} process {self.stage} holds")
        if self.placement == identity:
            self.operations: tuple[StageOperation, ...] = stage_operation_order(
                schedule,
                num_stages=self.num_stages,
                num_microbatches=num_microbatches,
                stage=self.stage,
                swap_odd_microbatches=swap_odd_microbatches,
            )
        else:
            if swap_odd_microbatches:
                raise ValueError("swapped routes cannot run with merged stages")
            self.operations = placed_operation_order(
                schedule, num_stages=self.num_stages, num_microbatches=num_microbatches, placement=self.placement, process=self.stage
            )
        self.routes = [
            microbatch_route(self.num_stages, m, swap_odd_microbatches=swap_odd_microbatches)
            for m in range(num_microbatches)
        ]
        self.in_order_route = microbatch_route(self.num_stages, 0, swap_odd_microbatches=False)
        self.num_hops = max(len(route) for route in self.routes)
        config = module.config
        self.activation_shape = (microbatch_size, config.seq_len, config.dim)
        self._pending_sends: list[tuple[Any, torch.Tensor]] = []
        self._local_messages: dict[int, torch.Tensor] = {}
        # Messages from each peer in the order that peer sends them; receiving in this order and
        # holding early arrivals back works without tags (NCCL) and cannot deadlock, because the
        # peer sends everything before the wanted message without waiting (isend).
        sent, _ = pair_message_orders(
            schedule,
            num_stages=self.num_stages,
            num_microbatches=num_microbatches,
            swap_odd_microbatches=swap_odd_microbatches,
            placement=None if self.placement == identity else self.placement,
        )
        directions = {"forward": _FORWARD, "backward": _BACKWARD}
        self._send_order_of: dict[int, list[int]] = {
            source: [_tag(m, index, directions[direction], self.num_hops) for direction, m, index in keys]
            for (source, destination), keys in sent.items()
            if destination == self.stage
        }
        self._next_from: dict[int, int] = {}
        self._early: dict[int, torch.Tensor] = {}

    # -- messages ------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, destination: int, tag: int, iteration: int, microbatch: int) -> None:
        tensor = tensor.detach().contiguous()  # the very tensor sent, kept alive below
        if destination == self.stage:  # consecutive hops on one stage: no message needed
            self._local_messages[tag] = tensor
            return
        with self.spans.span("send", iteration, microbatch):
            work = self.communicator.isend(tensor, destination, tag)
        self._pending_sends.append((work, tensor))  # keep the tensor alive until the send completes

    def _receive(self, source: int, tag: int, iteration: int, microbatch: int) -> torch.Tensor:
        if source == self.stage:
            return self._local_messages.pop(tag)
        if tag in self._early:
            return self._early.pop(tag)
        with self.spans.span("receive", iteration, microbatch):
            while True:
                position = self._next_from.get(source, 0)
                next_tag = self._send_order_of[source][position]
                self._next_from[source] = position + 1
                message = self.communicator.recv(self.activation_shape, torch.float32, source, next_tag)
                if next_tag == tag:
                    return message
                self._early[next_tag] = message

    def wait_for_sends(self, iteration: int) -> None:
        """Block until this iteration's sends are delivered (before the optimizer changes weights)."""
        if not self._pending_sends:
            return
        with self.spans.span("send_wait", iteration):
            for work, _ in self._pending_sends:
                self.communicator.wait(work)
        self._pending_sends.clear()

    # -- training ------------------------------------------------------------------------------
    def run_iteration(
        self,
        iteration: int,
        *,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
    ) -> float | None:
        """Forward and backward of all microbatches; gradients accumulate in the module's `.grad`.

        `inputs` (stage 0) and `targets` (last stage) are the M microbatches of token ids. Returns
        the mean loss over microbatches on the stage that runs the head, None elsewhere.
        """
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        total_loss = 0.0
        has_head = False
        for operation in self.operations:
            route = self.routes[operation.microbatch]
            hop = route[operation.hop_index]
            if operation.direction == "forward":
                loss = self._forward(iteration, operation, route, hop, inputs, targets, saved)
                if loss is not None:
                    total_loss += loss
                    has_head = True
            else:
                self._backward(iteration, operation, route, hop, saved)
        assert not saved and not self._early, "every forward hop must have had its backward"
        self._next_from.clear()
        self.wait_for_sends(iteration)
        return total_loss if has_head else None

    def _forward(
        self,
        iteration: int,
        operation: StageOperation,
        route: tuple[Hop, ...],
        hop: Hop,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]],
    ) -> float | None:
        m, index = operation.microbatch, operation.hop_index
        module = self.modules[hop.stage]
        hop_input: torch.Tensor | None = None
        if hop.runs_embedding:
            assert inputs is not None, "stage 0 needs the input tokens"
        else:
            tag = _tag(m, index, _FORWARD, self.num_hops)
            hop_input = self._receive(self.placement[route[index - 1].stage], tag, iteration, m).requires_grad_(True)
        with self.spans.span("forward", iteration, m):
            hidden = module.embed(inputs[m].to(self.communicator.device)) if inputs is not None and hop.runs_embedding else hop_input
            assert hidden is not None
            if hop.runs_blocks:
                hidden = module.run_blocks(hidden)
            loss_value: float | None = None
            if hop.runs_head:
                assert targets is not None, "the head stage needs the targets"
                output = module.head_loss(hidden, targets[m].to(self.communicator.device)) / self.num_microbatches
                loss_value = float(output.detach())
            else:
                output = hidden
        saved[(m, index)] = (hop_input, output)
        if self.after_forward_hop is not None:
            self.after_forward_hop(
                iteration=iteration, microbatch=m, hop_index=index, hop=hop, hop_input=hop_input, hop_output=output
            )
        if not hop.runs_head:
            self._send(output, self.placement[route[index + 1].stage], _tag(m, index + 1, _FORWARD, self.num_hops), iteration, m)
        return loss_value

    def _backward(
        self,
        iteration: int,
        operation: StageOperation,
        route: tuple[Hop, ...],
        hop: Hop,
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]],
    ) -> None:
        m, index = operation.microbatch, operation.hop_index
        hop_input, output = saved.pop((m, index))
        if hop.runs_head:
            output_gradient = None
        else:
            tag = _tag(m, index, _BACKWARD, self.num_hops)
            output_gradient = self._receive(self.placement[route[index + 1].stage], tag, iteration, m)
        with self.spans.span("backward", iteration, m):
            torch.autograd.backward(output, output_gradient)
        if hop_input is not None:
            assert hop_input.grad is not None
            destination = self.placement[route[index - 1].stage]
            self._send(hop_input.grad, destination, _tag(m, index - 1, _BACKWARD, self.num_hops), iteration, m)

    # -- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self,
        iteration: int,
        *,
        num_batches: int,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
    ) -> float | None:
        """Mean held-out loss over `num_batches` batches of `microbatch_size` sequences, forward only,
        along the in-order route (also under CheckFree+). Returns the loss on the process running the head."""
        total = 0.0
        route = self.in_order_route
        runs_head = self.placement[route[-1].stage] == self.stage
        with self.spans.span("eval", iteration):
            for batch in range(num_batches):
                hidden: torch.Tensor | None = None
                for index, hop in enumerate(route):
                    if self.placement[hop.stage] != self.stage:
                        continue
                    module = self.modules[hop.stage]
                    if hop.runs_embedding:
                        assert inputs is not None
                        hidden = module.embed(inputs[batch].to(self.communicator.device))
                    elif hidden is None:
                        tag = _tag(batch, index, _EVAL, self.num_stages)
                        source = self.placement[route[index - 1].stage]
                        hidden = self.communicator.recv(self.activation_shape, torch.float32, source, tag)
                    hidden = module.run_blocks(hidden)
                    if hop.runs_head:
                        assert targets is not None
                        total += float(module.head_loss(hidden, targets[batch].to(self.communicator.device)))
                    elif self.placement[route[index + 1].stage] != self.stage:
                        destination = self.placement[route[index + 1].stage]
                        self.communicator.send(hidden, destination, _tag(batch, index + 1, _EVAL, self.num_stages))
                        hidden = None
        return total / num_batches if runs_head and num_batches else None

    @property
    def runs_head(self) -> bool:
        """Whether this process computes the loss (the last stage, or its host while it is down)."""
        return self.placement[self.num_stages - 1] == self.stage

    def reset(self) -> None:
        """Forget an interrupted iteration: unsent work, early messages, gradients (hard failures)."""
        self._pending_sends.clear()
        self._local_messages.clear()
        self._early.clear()
        self._next_from.clear()
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)


def message_flow_completes(
    schedule: str,
    *,
    num_stages: int,
    num_microbatches: int,
    swap_odd_microbatches: bool,
    placement: tuple[int, ...] | None = None,
) -> bool:
    """Replay every process's operation order with non-blocking sends and blocking receives.

    Returns True when all processes finish, False on a deadlock (none can make progress). Pure:
    used by the tests to show the orders of pipeline_schedule.py cannot hang this executor, also with
    merged stages (`placement`, stage -> process).
    """
    where = placement if placement is not None else tuple(range(num_stages))
    processes = sorted(set(where))
    orders = {
        process: (
            stage_operation_order(
                schedule,
                num_stages=num_stages,
                num_microbatches=num_microbatches,
                stage=process,
                swap_odd_microbatches=swap_odd_microbatches,
            )
            if placement is None
            else placed_operation_order(
                schedule, num_stages=num_stages, num_microbatches=num_microbatches, placement=placement, process=process
            )
        )
        for process in processes
    }
    routes = [
        microbatch_route(num_stages, m, swap_odd_microbatches=swap_odd_microbatches) for m in range(num_microbatches)
    ]
    delivered: set[tuple[str, int, int]] = set()  # (direction, microbatch, receiving hop index)
    positions = dict.fromkeys(processes, 0)
    progress = True
    while progress:
        progress = False
        for process in processes:
            while positions[process] < len(orders[process]):
                operation = orders[process][positions[process]]
                route = routes[operation.microbatch]
                hop = route[operation.hop_index]
                key = (operation.direction, operation.microbatch, operation.hop_index)
                needs_input = not hop.runs_embedding if operation.direction == "forward" else not hop.runs_head
                if needs_input and key not in delivered:
                    break
                if operation.direction == "forward" and not hop.runs_head:
                    delivered.add(("forward", operation.microbatch, operation.hop_index + 1))
                if operation.direction == "backward" and operation.hop_index > 0 and not hop.runs_embedding:
                    delivered.add(("backward", operation.microbatch, operation.hop_index - 1))
                positions[process] += 1
                progress = True
    return all(positions[process] == len(orders[process]) for process in processes)


MessageKey = tuple[str, int, int]  # (direction, microbatch, hop index of the receiving hop)


def placed_operation_order(
    schedule: str, *, num_stages: int, num_microbatches: int, placement: tuple[int, ...], process: int
) -> tuple[StageOperation, ...]:
    """The operations of process `process` when stage t runs on process `placement[t]` (in-order
    routes; a process's stages are adjacent): the schedule of its position among the processes, each
    operation expanded into its stages' hops."""
    processes = sorted(set(placement), key=placement.index)  # in route order
    for candidate in processes:
        held = [stage for stage, holder in enumerate(placement) if holder == candidate]
        if held != list(range(held[0], held[-1] + 1)):
            raise ValueError(f"placement {placement}: process {candidate} holds stages {held}, which are not adjacent")
    node_order = stage_operation_order(
        schedule, num_stages=len(processes), num_microbatches=num_microbatches, stage=processes.index(process)
    )
    route = microbatch_route(num_stages, 0, swap_odd_microbatches=False)
    hops_here = [index for index, hop in enumerate(route) if placement[hop.stage] == process]
    operations: list[StageOperation] = []
    for operation in node_order:
        indices = hops_here if operation.direction == "forward" else hops_here[::-1]
        operations.extend(
            StageOperation(direction=operation.direction, microbatch=operation.microbatch, hop_index=index) for index in indices
        )
    return tuple(operations)


def pair_message_orders(
    schedule: str,
    *,
    num_stages: int,
    num_microbatches: int,
    swap_odd_microbatches: bool,
    placement: tuple[int, ...] | None = None,
) -> tuple[dict[tuple[int, int], list[MessageKey]], dict[tuple[int, int], list[MessageKey]]]:
    """For every (source, destination) pair of processes: the messages in the order the source sends
    them, and in the order the destination first needs them. `placement` (stage -> process): merged
    stages; None: every stage on its own process."""
    routes = [
        microbatch_route(num_stages, m, swap_odd_microbatches=swap_odd_microbatches) for m in range(num_microbatches)
    ]
    where = placement if placement is not None else tuple(range(num_stages))
    sent: dict[tuple[int, int], list[MessageKey]] = {}
    received: dict[tuple[int, int], list[MessageKey]] = {}
    for process in sorted(set(where)):
        if placement is None:
            order = stage_operation_order(
                schedule,
                num_stages=num_stages,
                num_microbatches=num_microbatches,
                stage=process,
                swap_odd_microbatches=swap_odd_microbatches,
            )
        else:
            order = placed_operation_order(
                schedule, num_stages=num_stages, num_microbatches=num_microbatches, placement=placement, process=process
            )
        for operation in order:
            route = routes[operation.microbatch]
            index, m = operation.hop_index, operation.microbatch
            hop = route[index]
            if operation.direction == "forward":
                if not hop.runs_embedding and where[route[index - 1].stage] != process:
                    received.setdefault((where[route[index - 1].stage], process), []).append(("forward", m, index))
                if not hop.runs_head and where[route[index + 1].stage] != process:
                    sent.setdefault((process, where[route[index + 1].stage]), []).append(("forward", m, index + 1))
            else:
                if not hop.runs_head and where[route[index + 1].stage] != process:
                    received.setdefault((where[route[index + 1].stage], process), []).append(("backward", m, index))
                if not hop.runs_embedding and where[route[index - 1].stage] != process:
                    sent.setdefault((process, where[route[index - 1].stage]), []).append(("backward", m, index - 1))
    return sent, received


def pair_orders_agree(schedule: str, *, num_stages: int, num_microbatches: int, swap_odd_microbatches: bool) -> bool:
    """Whether every stage needs its messages from each peer in the order the peer sends them.

    When they disagree (1F1B with CheckFree+'s swapped routes), `PipelineStage` still receives in
    the sender's order and holds early messages back, which NCCL (no tags) requires.
    """
    sent, received = pair_message_orders(
        schedule, num_stages=num_stages, num_microbatches=num_microbatches, swap_odd_microbatches=swap_odd_microbatches
    )
    return sent == received
