"""The recovery methods' names, parameters and traits: one rule book for sim/, real/, calibration
fits and figures (DESIGN.md section 2).

Each method is a strict config model with a `name` tag. Its fields are the knobs a scenario file
sets (`{"name": "checkpoint", "interval_iterations": 50}`, the rest from the defaults below); its
ClassVars are its *traits*, what the method is (family, storage tiers, checkpoint interval field,
rollback, minimum stages, default setbacks, display label, headline or ablation, speed-up
baseline). Every consumer outside the method packages reads the traits instead of branching on a
method's name.

`METHOD_CONFIGS` is the registry, and it is open: `register_method_config(cls)` adds a method, and
`MethodConfig` (the type of `Scenario.methods`) validates a config by looking its `name` up there,
so a new method needs no edit to this module. sim/ and real/ each keep one class per name
(`sim.model.methods.POLICIES`, `real.methods.METHODS`); a test checks that the three registries agree.
"""

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, SerializeAsAny
from pydantic_core import PydanticCustomError

from .base import StrictModel, validate_model
from .errors import InputError
from .pipeline_schedule import MINIMUM_STAGES_FOR_SWAP
from .rebuild_plan import (
    RebuildPlan,
    checkfree_plus_stage_plan,
    checkfree_stage_plan,
    copy_stage_plan,
    random_stage_plan,
    uniform_stage_plan,
    uses_edge_checkpoints,
)

GradientWeighting = Literal["squared_l2", "l2", "uniform"]
MethodFamily = Literal["reference", "checkpoint", "redundant", "rebuild"]


class MethodConfigBase(StrictModel):
    """Base of every method config: the `name` tag, and the traits (ClassVars) a subclass sets."""

    name: str

    family: ClassVar[MethodFamily]
    """`reference`: failures are ignored (the no-failure curve); `checkpoint`: a lost stage reloads
    stored state and progress rolls back; `redundant`: a neighbour holds a live replica; `rebuild`:
    a lost stage is rebuilt from live stages at a convergence setback."""
    label: ClassVar[str]
    """Display name in tables and figures."""
    headline: ClassVar[bool] = False
    """Compared in the headline results (the loss-vs-wall-clock figure keeps these and the reference)."""
    ablation: ClassVar[bool] = False
    """An ablation of another method: available everywhere, left out of the crowded headline figures."""
    speedup_baseline: ClassVar[bool] = False
    """summary.csv reports every method's paired speed-up over this one (`speedup_vs_<name>_*`)."""
    ignores_failures: ClassVar[bool] = False
    """Failures are recorded and otherwise ignored: the run follows the no-failure loss curve."""
    tier_fields: ClassVar[tuple[str, ...]] = ()
    """Fields holding the storage tiers the method writes to (a tier name, or a tuple of names in order)."""
    checkpoint_interval_field: ClassVar[str | None] = None
    """Field holding the method's checkpoint interval in iterations (what an interval sweep or flag sets)."""
    supports_rollback: ClassVar[bool] = False
    """Has a `rollback` field: `all` stages or only the lost `stage` return to the checkpoint."""
    blocking_checkpoint: ClassVar[bool] = False
    """Every checkpoint blocks training for its whole write: its `save` spans measure the write latency
    and its stalls are Young's and Daly's δ."""
    plain_iteration: ClassVar[bool] = True
    """The healthy iteration is the plain in-order pipeline with no extra work (no redundant forwards,
    swaps or snapshot copies), so stage timings and the optimizer step alone predict it."""
    swaps_odd_microbatches: ClassVar[bool] = False
    """True when odd microbatches visit the first two and the last two stages in swapped order (CheckFree+)."""
    minimum_stages: ClassVar[int] = 1
    """Fewest pipeline stages the method works with."""
    uses_setbacks: ClassVar[bool] = False
    """Recoveries cost a convergence setback (`ConvergenceSpec.setbacks[name]`), which may be uncalibrated."""
    default_setback_iterations: ClassVar[tuple[float, float] | None] = None
    """Uncalibrated (interior, edge) setback in baseline iterations per rebuilt stage; set iff `uses_setbacks`."""
    on_stage_loss: ClassVar[str]
    """What the method does when a stage loses every data-parallel replica (with D = 1, on every
    loss): one sentence for the docs and the run outputs."""
    lost_optimizer_shard: ClassVar[Literal["checkpoint", "reinitialise"]] = "reinitialise"
    """Under ZeRO-1 (`checkpoint_sharding = "data_parallel"`) a healed replica's optimizer shard is on
    no survivor: `checkpoint` reloads it from the latest checkpoint, `reinitialise` starts it from
    zero at a setback (calibration/replica_rule.py)."""

    @classmethod
    def on_replica_loss(cls) -> str:
        """What the method does when a node is lost and its stage keeps a replica: one sentence."""
        if cls.ignores_failures:
            return "Ignored: the reference run never fails."
        shard = {
            "checkpoint": "reloads its ZeRO-1 optimizer shard from the latest checkpoint",
            "reinitialise": "starts its ZeRO-1 optimizer shard from zero",
        }[cls.lost_optimizer_shard]
        return (
            "The replacement copies the stage's weights and optimizer state from a surviving replica "
            f"(bit-exact); under ZeRO-1 it {shard}."
        )

    @property
    def tiers_used(self) -> tuple[str, ...]:
        """Names of the storage tiers this config writes to (from `tier_fields`), in order."""
        tiers: list[str] = []
        for field in self.tier_fields:
            value = getattr(self, field)
            if isinstance(value, str):
                tiers.append(value)
            elif value is not None:
                tiers.extend(value)
        return tuple(tiers)

    @classmethod
    def method_name(cls) -> str | None:
        """The `name` tag of a concrete method config; None for an abstract base."""
        default = cls.model_fields["name"].default
        return default if isinstance(default, str) else None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = cls.method_name()
        if name is None:
            return
        # The rule book must be complete and consistent: a mistake here is a programming error.
        problems = [f"trait {trait!r} is not set" for trait in ("family", "label", "on_stage_loss") if not hasattr(cls, trait)]
        problems += [f"tier field {field!r} is not a field" for field in cls.tier_fields if field not in cls.model_fields]
        if cls.checkpoint_interval_field is not None and cls.checkpoint_interval_field not in cls.model_fields:
            problems.append(f"checkpoint_interval_field {cls.checkpoint_interval_field!r} is not a field")
        if cls.supports_rollback != ("rollback" in cls.model_fields):
            problems.append("supports_rollback must be True exactly when the config has a 'rollback' field")
        if cls.uses_setbacks != (cls.default_setback_iterations is not None):
            problems.append("default_setback_iterations must be given exactly when uses_setbacks is True")
        if cls.headline and cls.ablation:
            problems.append("a method is either headline or an ablation, not both")
        if problems:
            raise TypeError(f"method config {cls.__name__} ({name!r}): " + "; ".join(problems))


class NoneConfig(MethodConfigBase):
    """Failures are ignored: the no-failure reference curve."""

    name: Literal["none"] = "none"

    family = "reference"
    label = "no failures"
    ignores_failures = True
    on_stage_loss = "Ignored: the reference run never fails."


class CheckpointConfig(MethodConfigBase):
    """Synchronous checkpointing: training blocks while every stage writes its state."""

    name: Literal["checkpoint"] = "checkpoint"

    family = "checkpoint"
    label = "checkpoint (sync)"
    headline = True
    speedup_baseline = True
    tier_fields = ("tier",)
    checkpoint_interval_field = "interval_iterations"
    supports_rollback = True
    blocking_checkpoint = True
    lost_optimizer_shard = "checkpoint"
    on_stage_loss = (
        "Every stage (`rollback = all`) or the lost stage (`stage`) reloads the latest complete "
        "checkpoint and the iterations since are trained again."
    )

    interval_iterations: int = Field(50, ge=1)
    """Iterations between checkpoints (K)."""
    tier: str = "remote"
    """Name of the storage tier written to; must survive node loss to be useful."""
    rollback: Literal["all", "stage"] = "all"
    """`all`: every stage returns to the last complete checkpoint (the CheckFree paper's baseline);
    `stage`: only the failed stage loads its stale state."""


class AsyncCheckpointConfig(MethodConfigBase):
    """Lazy asynchronous multi-level checkpointing (DataStates-LLM, HPDC'24)."""

    name: Literal["async_checkpoint"] = "async_checkpoint"

    family = "checkpoint"
    label = "lazy async checkpoint"
    headline = True
    tier_fields = ("levels",)
    checkpoint_interval_field = "interval_iterations"
    supports_rollback = True
    plain_iteration = False  # snapshot copies overlap the next iteration's forward/backward
    lost_optimizer_shard = "checkpoint"
    on_stage_loss = (
        "Every stage (`rollback = all`) or the lost stage (`stage`) reloads the newest snapshot "
        "durable on a level that survived, and the iterations since are trained again."
    )

    interval_iterations: int = Field(10, ge=1)
    """Iterations between snapshots (K)."""
    host_buffer_bytes: int | None = Field(None, gt=0)
    """Host buffer per stage; None means twice the stage's checkpoint size."""
    levels: tuple[str, ...] = ("local_disk", "remote")
    """Storage tiers the host buffer is flushed through, in order."""
    keep_per_level: int = Field(2, ge=1)
    """Snapshots each storage level keeps before it deletes the oldest; real runs keep two more, so
    that the snapshot all stages roll back to is still there. The simulator restores the newest
    durable snapshot and does not model the space they take."""
    rollback: Literal["all", "stage"] = "all"
    """`all`: every stage returns to the newest snapshot durable on a tier that survives node loss;
    `stage`: only the failed stage loads its stale state."""


class RedundantConfig(MethodConfigBase):
    """Bamboo-style redundant computation: stage s holds and runs a replica of stage s+1."""

    name: Literal["redundant"] = "redundant"

    family = "redundant"
    label = "redundant (Bamboo)"
    headline = True
    speedup_baseline = True
    tier_fields = ("fallback_tier",)
    checkpoint_interval_field = "fallback_interval_iterations"
    plain_iteration = False  # redundant forwards of the next stage
    on_stage_loss = (
        "The previous stage's live copy of the lost stage takes over until the replacement joins; "
        "two adjacent stages lost together fall back to the latest checkpoint."
    )

    fallback_interval_iterations: int = Field(100, ge=1)
    """Checkpoint interval of the fallback used when two adjacent stages are lost together."""
    fallback_tier: str = "remote"
    """Storage tier of the fallback's checkpoints; must survive node loss to be useful."""


# Uncalibrated default setbacks (`default_setback_iterations`, iterations of baseline progress lost
# per rebuilt stage). They are NOT measurements: they order the ablations the way the CheckFree paper
# reports perplexity after 10k iterations at 500M, 16 %/h (weighted 22.60 < copy 29.24 < random
# 121.03, arXiv 2506.15461), and they are small enough that CheckFree still converges at 16 %/h, as
# the paper reports (12 stages failing at 16 %/h lose a stage about every 22 iterations of 80 s
# there). Every output built on them says so; `churnsim calibrate` replaces them with setbacks
# measured on real runs.
class _NeighbourRebuildConfig(MethodConfigBase):
    """Shared knobs and traits of the methods that rebuild a lost stage from live stages."""

    family = "rebuild"
    uses_setbacks = True

    lr_scale: float = Field(1.1, gt=0)
    """Learning-rate multiplier of a rebuilt stage (the CheckFree paper: 1.1)."""


class CheckFreeConfig(_NeighbourRebuildConfig):
    """CheckFree: rebuild a lost interior stage as a gradient-weighted average of its neighbours."""

    name: Literal["checkfree"] = "checkfree"

    label = "CheckFree"
    headline = True
    on_stage_loss = (
        "An interior stage is rebuilt from its neighbours in its own replica pipeline (gradient-weighted "
        "average) at a convergence setback; an edge stage follows `edge_fallback`."
    )
    default_setback_iterations = (2.0, 6.0)

    weighting: GradientWeighting = "squared_l2"
    """Weights of the two neighbours in the average that rebuilds a lost interior stage, from the L2
    norm of each one's last gradient: `squared_l2` ω = ‖g‖² (the CheckFree paper), `l2` ω = ‖g‖,
    `uniform` ω = 1. Real runs only: in the simulator a rebuild costs its setback."""
    edge_fallback: Literal["checkpoint", "copy", "random"] = "checkpoint"
    """What a lost first/last stage starts from (calibration/rebuild_plan.py has the whole rule).
    `checkpoint`: stages 0 and S-1 save their state every `edge_checkpoint_interval_iterations` to
    `edge_checkpoint_tier` and a lost edge reloads its own latest save (stage-local rollback, stale
    by the iterations since; the other stages keep going). `copy`: the neighbour's blocks are copied
    but the embedding (or final norm and lm_head) restarts from random init, so the loss jumps back
    towards chance. `random`: fresh init, also for interior stages with a lost neighbour."""
    edge_checkpoint_interval_iterations: int = Field(50, ge=1)
    """Iterations between edge-stage saves under `edge_fallback = "checkpoint"`."""
    edge_checkpoint_tier: str = "remote"
    """Storage tier of the edge-stage saves; one that dies with its node loses the save with the edge."""
    edge_stages_reliable: bool = False
    """True mirrors the CheckFree paper's setup, where the nodes holding the embedding and the head
    never fail: failures of stages 0 and S-1 are recorded as ignored and leave their state intact
    (both wings read `reliable_stages`), and no edge checkpoints are written."""

    @property
    def tiers_used(self) -> tuple[str, ...]:
        # Only when edge checkpoints are written: `copy`/`random` fallbacks need no storage.
        return (self.edge_checkpoint_tier,) if uses_edge_checkpoints(self) else ()

    def plan_stage(self, stage: int, lost: frozenset[int], num_stages: int) -> "RebuildPlan":
        """What lost `stage` starts from when the stages `lost` went together (calibration/rebuild_plan.py)."""
        return checkfree_stage_plan(self, stage, lost, num_stages)


class CheckFreePlusConfig(_NeighbourRebuildConfig):
    """CheckFree+: out-of-order pipelining so that edge stages are rebuilt by copying their swap partner."""

    name: Literal["checkfree_plus"] = "checkfree_plus"

    label = "CheckFree+"
    headline = True
    on_stage_loss = (
        "As CheckFree for interior stages; an edge stage copies its swap partner and restores the "
        "embedding or head from the replica the partner holds."
    )
    plain_iteration = False  # odd microbatches take the swapped route
    swaps_odd_microbatches = True
    minimum_stages = MINIMUM_STAGES_FOR_SWAP
    default_setback_iterations = (2.0, 4.0)

    weighting: GradientWeighting = "squared_l2"
    """Weights of the two neighbours in the average that rebuilds a lost interior stage, from the L2
    norm of each one's last gradient: `squared_l2` ω = ‖g‖² (the CheckFree paper), `l2` ω = ‖g‖,
    `uniform` ω = 1. Real runs only: in the simulator a rebuild costs its setback."""
    replica_refresh_iterations: int = Field(100, ge=1)
    """Iterations between refreshes of the (de)embedding replicas on the neighbouring stages."""

    def plan_stage(self, stage: int, lost: frozenset[int], num_stages: int) -> "RebuildPlan":
        """What lost `stage` starts from when the stages `lost` went together (calibration/rebuild_plan.py)."""
        return checkfree_plus_stage_plan(self, stage, lost, num_stages)


class CopyConfig(_NeighbourRebuildConfig):
    """Ablation: copy the previous stage (the next one for stage 0)."""

    name: Literal["copy"] = "copy"

    label = "copy (ablation)"
    ablation = True
    on_stage_loss = "Copies the nearest surviving stage's blocks, at a convergence setback."
    default_setback_iterations = (6.0, 6.0)

    def plan_stage(self, stage: int, lost: frozenset[int], num_stages: int) -> "RebuildPlan":
        """What lost `stage` starts from when the stages `lost` went together (calibration/rebuild_plan.py)."""
        return copy_stage_plan(self, stage, lost, num_stages)


class UniformConfig(_NeighbourRebuildConfig):
    """Ablation: 0.5/0.5 average of the two neighbours."""

    name: Literal["uniform"] = "uniform"

    label = "uniform average (ablation)"
    ablation = True
    on_stage_loss = "An interior stage is the plain average of its neighbours; otherwise a copy, at a setback."
    default_setback_iterations = (3.0, 6.0)

    def plan_stage(self, stage: int, lost: frozenset[int], num_stages: int) -> "RebuildPlan":
        """What lost `stage` starts from when the stages `lost` went together (calibration/rebuild_plan.py)."""
        return uniform_stage_plan(self, stage, lost, num_stages)


class RandomConfig(_NeighbourRebuildConfig):
    """Ablation: a fresh random initialisation."""

    name: Literal["random"] = "random"

    label = "random init (ablation)"
    ablation = True
    on_stage_loss = "Starts the stage again from random initialisation, at a convergence setback."
    default_setback_iterations = (40.0, 40.0)

    def plan_stage(self, stage: int, lost: frozenset[int], num_stages: int) -> "RebuildPlan":
        """What lost `stage` starts from when the stages `lost` went together (calibration/rebuild_plan.py)."""
        return random_stage_plan(self, stage, lost, num_stages)


METHOD_CONFIGS: dict[str, type[MethodConfigBase]] = {}
"""Registry of the method configs by name, in the order figures and tables list them."""

METHOD_NAMES = METHOD_CONFIGS.keys()
"""The registered method names: a live view of `METHOD_CONFIGS`, so it lists later registrations too."""


def register_method_config(config_class: type[MethodConfigBase]) -> type[MethodConfigBase]:
    """Add a concrete method config under its `name` tag (usable as a class decorator).

    From then on scenario files and `method_from_name` accept the name. Registering a second class
    under a registered name is an error; remove the first with `METHOD_CONFIGS.pop(name)`.
    """
    name = config_class.method_name() if issubclass(config_class, MethodConfigBase) else None
    if name is None:
        raise TypeError(f"{config_class!r} is not a concrete MethodConfigBase subclass with a Literal 'name' default")
    registered = METHOD_CONFIGS.get(name)
    if registered is not None and registered is not config_class:
        raise ValueError(f"method {name!r} is already registered as {registered.__name__}")
    METHOD_CONFIGS[name] = config_class
    return config_class


for _config_class in (
    NoneConfig,
    CheckpointConfig,
    AsyncCheckpointConfig,
    RedundantConfig,
    CheckFreeConfig,
    CheckFreePlusConfig,
    CopyConfig,
    UniformConfig,
    RandomConfig,
):
    register_method_config(_config_class)


def validate_method_config(data: Any) -> Any:
    """Build the registered config class that `data["name"]` names (a discriminated union that grows
    with the registry); errors keep their field path, e.g. `methods.0.interval_iterations`."""
    if isinstance(data, MethodConfigBase) or not isinstance(data, Mapping):
        return data  # a built config passes; anything else fails the base type's check
    if "name" not in data:
        raise PydanticCustomError("union_tag_not_found", "Unable to extract tag using discriminator 'name'")
    config_class = METHOD_CONFIGS.get(data["name"]) if isinstance(data["name"], str) else None
    if config_class is None:
        raise PydanticCustomError(
            "union_tag_invalid",
            "Input tag '{tag}' found using 'name' does not match any of the expected tags: {expected_tags}",
            {"tag": str(data["name"]), "expected_tags": ", ".join(repr(name) for name in METHOD_CONFIGS)},
        )
    return config_class.model_validate(data)


MethodConfig = Annotated[SerializeAsAny[MethodConfigBase], BeforeValidator(validate_method_config)]
"""A method config of any registered method, validated by its `name` and serialised with all its fields."""


def method_traits(name: str) -> type[MethodConfigBase]:
    """The config class of a registered method: its traits are class attributes (`.family`, `.label`, ...)."""
    config_class = METHOD_CONFIGS.get(name)
    if config_class is None:
        raise InputError(f"unknown method {name!r}: use one of {', '.join(METHOD_CONFIGS)}")
    return config_class


def method_names_where(**traits: object) -> tuple[str, ...]:
    """Registered method names whose traits equal the given values, e.g. `method_names_where(headline=True)`."""
    for trait in traits:
        if trait not in MethodConfigBase.__class_vars__:
            raise AttributeError(f"{trait!r} is not a method trait; use one of {sorted(MethodConfigBase.__class_vars__)}")
    return tuple(
        name for name, config_class in METHOD_CONFIGS.items() if all(getattr(config_class, trait) == value for trait, value in traits.items())
    )


def speedup_baselines() -> tuple[str, ...]:
    """Methods every other method's speed-up is reported against (the `speedup_baseline` trait)."""
    return method_names_where(speedup_baseline=True)


def reference_method() -> str:
    """The registered method that ignores failures: the no-failure reference curve."""
    names = method_names_where(ignores_failures=True)
    if len(names) != 1:
        raise RuntimeError(f"expected exactly one registered reference method (ignores_failures), found {names}")
    return names[0]


def method_from_name(name: str, **parameters: object) -> MethodConfig:
    """A method config with default parameters, e.g. `method_from_name("checkpoint", interval_iterations=20)`."""
    return validate_model(method_traits(name), {"name": name, **parameters}, f"method {name}")
