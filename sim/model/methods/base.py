"""The one abstract recovery policy of the simulator: a few hooks the run model calls.

A policy never loops over time itself. The run model (`sim/model/run.py`) calls:

- `healthy_state()`: the pipeline state of a failure-free iteration under this method (redundant
  forwards, CheckFree+ swapped routes);
- `on_start(context)`: once, before training (start background workers);
- `iterations_until_boundary(context)`: executed iterations until the method's next periodic work
  (a checkpoint, a replica refresh), or None; at 0 the run calls
- `at_boundary(context)`: a generator doing that work (stalls through `context.wait`, background transfers);
- `on_failures(context, failures)`: a generator that recovers from a batch of failures. It may be
  interrupted by further failures, in which case it is called again with the new ones: a policy
  keeps the recovery in progress in its own state and merges (it must leave that state consistent
  at every `yield`, and apply rollbacks and setbacks so that a repeated call does not count twice).

`context` is the run's `RunContext` (sim/model/run_context.py): the state and services a policy may use,
never the trainer itself. Generators spend simulated time only through `context.wait(...)`, which
books it to a badput category.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import TYPE_CHECKING, ClassVar, Generator

from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.rebuild_plan import reliable_stages
from churnsim.calibration.scenario import Scenario

from ..pipeline_state import PipelineState
from ..pipeline_state import build_pipeline_state

if TYPE_CHECKING:
    from churnsim.calibration.failure_sampling import FailureEvent
    from ..run_context import RunContext


_RECENT_SETUPS = 16
_states_of_recent_setups: OrderedDict[tuple, dict[tuple[int, ...] | None, PipelineState]] = OrderedDict()


def _shared_states(scenario: Scenario, swap_odd_microbatches: bool, redundant_forward: bool) -> dict[tuple[int, ...] | None, PipelineState]:
    """The pipeline states (per node placement) of one setup, shared by every policy of it in this
    process: the runs of a sweep build each placement once, not once per run (a redundant run meets
    dozens of degraded placements). A state follows from the model, pipeline, compute and network
    alone (`build_pipeline_state`), which key the cache by value; states are frozen, so sharing them
    is safe."""
    key = (scenario.model, scenario.pipeline, scenario.compute, scenario.network, swap_odd_microbatches, redundant_forward)
    states = _states_of_recent_setups.get(key)
    if states is None:
        states = _states_of_recent_setups[key] = {}
        if len(_states_of_recent_setups) > _RECENT_SETUPS:
            _states_of_recent_setups.popitem(last=False)
    else:
        _states_of_recent_setups.move_to_end(key)
    return states


class RecoveryPolicy(ABC):
    """One recovery method in the simulator; subclasses set `name` to a `METHOD_NAMES` entry."""

    name: ClassVar[str]
    swap_odd_microbatches: ClassVar[bool] = False
    redundant_forward: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, scenario: Scenario) -> None:
        self.config = config
        self.scenario = scenario
        self.num_stages = scenario.pipeline.num_stages
        self.reliable_stages = reliable_stages(config, self.num_stages)
        """Stages whose failures are recorded as ignored (CheckFree's `edge_stages_reliable`)."""
        self._states = _shared_states(scenario, self.swap_odd_microbatches, self.redundant_forward)

    def healthy_state(self, node_of_stage: tuple[int, ...] | None = None) -> PipelineState:
        # Memoised: building a state (link matrices, validation) is costly and a degraded placement
        # recurs often; returning the same object also makes the iteration-model lookup an identity hit.
        state = self._states.get(node_of_stage)
        if state is None:
            state = build_pipeline_state(
                self.scenario,
                swap_odd_microbatches=self.swap_odd_microbatches,
                redundant_forward=self.redundant_forward,
                node_of_stage=node_of_stage,
            )
            self._states[node_of_stage] = state
        return state

    def on_start(self, context: "RunContext") -> None:
        """Called once before training starts."""

    def iterations_until_boundary(self, context: "RunContext") -> int | None:
        return None

    def at_boundary(self, context: "RunContext") -> Generator:
        return
        yield  # a generator that does nothing

    @abstractmethod
    def on_failures(self, context: "RunContext", failures: tuple["FailureEvent", ...]) -> Generator:
        """Recover from `failures` (stages whose nodes were just lost)."""


# ---------------------------------------------------------------- sizes shared by the policies
def stage_checkpoint_bytes(scenario: Scenario, stage: int) -> float:
    """Weights + optimizer state of one stage (`checkpoint_bytes_per_parameter` per parameter), all
    its data-parallel shards together; a stage's blocks follow `pipeline.layers_per_stage`."""
    return scenario.stage_parameters(stage) * scenario.model.checkpoint_bytes_per_parameter


def checkpoint_writers_per_stage(scenario: Scenario) -> int:
    """Nodes that write (and read) parts of one stage's checkpoint: its data-parallel replicas under
    `pipeline.checkpoint_sharding = "data_parallel"`, else one."""
    pipeline = scenario.pipeline
    return pipeline.data_parallel_degree if pipeline.checkpoint_sharding == "data_parallel" else 1


def checkpoint_part_bytes(scenario: Scenario, stage: int) -> float:
    """What one node of `stage` writes, copies to its host buffer or reads: the stage's checkpoint,
    or its 1/DP shard when checkpoints are sharded across the data-parallel replicas."""
    writers = checkpoint_writers_per_stage(scenario)
    whole = stage_checkpoint_bytes(scenario, stage)
    return whole if writers == 1 else whole / writers


def tier_flow_bytes(scenario: Scenario, stage: int, tier_name: str) -> float:
    """Bytes of `stage`'s checkpoint on the simulator's link to tier `tier_name` (one link per stage,
    or one for all on a `shared` tier). On a per-node link: one node's part (the replicas write their
    shards at the same time over links of their own, so one shard on one link takes as long); on a
    shared link: the whole stage, since every replica's shard crosses that one link."""
    if scenario.tier(tier_name).shared:
        return stage_checkpoint_bytes(scenario, stage)
    return checkpoint_part_bytes(scenario, stage)


def serialization_s(scenario: Scenario, stage: int, tier_name: str) -> float:
    """Seconds a node of `stage` spends serializing its part before writing it to `tier_name`
    (`serialization_bytes_per_s` of the tier, on the node's own CPU); 0 for raw writes."""
    rate = scenario.tier(tier_name).serialization_bytes_per_s
    return 0.0 if rate is None else checkpoint_part_bytes(scenario, stage) / rate


def stage_weight_bytes(scenario: Scenario, stage: int) -> float:
    """Weights of one stage, embedding or head included."""
    return scenario.stage_parameters(stage) * scenario.model.weight_bytes_per_parameter


def block_weight_bytes(scenario: Scenario, stage: int = 0) -> float:
    """Weights of one stage's transformer blocks (what a neighbour contributes to a rebuild; the
    rebuild methods need equal stages, so any stage's count serves)."""
    return scenario.stage_layers(stage) * scenario.model.parameters_per_layer * scenario.model.weight_bytes_per_parameter


def embedding_weight_bytes(scenario: Scenario) -> float:
    return scenario.model.embedding_parameters * scenario.model.weight_bytes_per_parameter


def head_weight_bytes(scenario: Scenario) -> float:
    return scenario.model.head_parameters * scenario.model.weight_bytes_per_parameter
