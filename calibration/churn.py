"""Churn models of a scenario: which nodes fail, and when.

The pipeline is a grid of S stages × D data-parallel replicas; a node is one (stage, replica), and
every rate below is per node (per node-hour, or a node's lifetime), whatever D is: no rate is
multiplied by D. With D = 1 a node is a stage. Whether a lost node heals from a surviving replica or
loses its stage is `calibration/replica_rule.py`'s business; `pipeline.replicas_fail_together`
makes every failure take all D replicas of its stage at once.

A scenario's `churn` field is one of the models below, told apart by its `kind`:

- `none`: no failures.
- `stage_hourly`: every node fails with a fixed probability per node-hour (the CheckFree paper's
  unit, which it states per stage of a pipeline without data parallelism).
- `poisson`: every node fails at a constant rate per node-hour.
- `weibull`: every node lives a Weibull lifetime, renewed on replacement.
- `burst`: correlated bursts that take down several distinct nodes at once.
- `trace`: replay the add/remove events of a recorded spot-instance trace; its instances are nodes.
- `schedule`: replay a churnsim failure schedule (e.g. the failures.csv of a real run) by time.

`churnsim.calibration.failure_sampling.sample_failures` turns a model into the failure sample path of one replication.
This module only describes and validates; it imports neither numpy nor the simulator.
"""

import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Callable, Literal, Union

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from .base import StrictModel, describe_validation_error
from .errors import InputError

SECONDS_PER_HOUR = 3600.0

TRACE_DIRECTORY = Path(__file__).resolve().parent / "data" / "traces"
"""The trace files churnsim ships (provenance in `data/traces/SOURCES.md`)."""

TraceFormat = Literal["bamboo_csv", "parcae_jsonl", "instance_count", "instance_count_hours", "gcloud_count"]

# Sizes 1, 2, 3, 4, 5, 6 of simultaneous removals in the Bamboo p3 trace: 1 (0.5), 2 (0.16),
# 3 (0.19), 4 (0.09), 5-6 (0.06, split evenly here) (reference/simulators.md §5, preset aws-gpu-spot).
P3_TRACE_BURST_SIZE_PROBABILITIES: tuple[float, ...] = (0.5, 0.16, 0.19, 0.09, 0.03, 0.03)


def stage_hourly_probability_to_rate_per_s(probability_per_stage_hour: float) -> float:
    """Poisson rate (per second, per node) whose chance of at least one failure in an hour is `probability_per_stage_hour`.

    rate = −ln(1 − h) / 3600 s; e.g. h = 10 % ⇒ 0.105 failures per node-hour. The name keeps the
    paper's "stage": without data parallelism a node is a stage; with D replicas h is per node.
    """
    if not 0.0 <= probability_per_stage_hour < 1.0:
        raise InputError(
            f"probability_per_stage_hour = {probability_per_stage_hour}: must be in [0, 1); "
            "give a probability, e.g. 0.1 for 10 %/h"
        )
    return -math.log1p(-probability_per_stage_hour) / SECONDS_PER_HOUR


def stage_hourly_to_per_iteration_probability(probability_per_stage_hour: float, iteration_time_s: float) -> float:
    """Per-stage failure probability per iteration for an hourly per-stage probability h.

    The CheckFree paper's conversion (Blagoev, Ersoy, Chen, "All is Not Lost: LLM Recovery without
    Checkpoints", arXiv 2506.15461; its `simulate_training/*_config.json` values, see
    reference/checkfree.md §4.3): p_iter = 1 − (1 − h)^(T_iter / 3600 s). It assumes failures are
    independent across hours, which makes it exact for the Poisson model of `StageHourlyChurn`.
    """
    if not 0.0 <= probability_per_stage_hour < 1.0:
        raise InputError(
            f"probability_per_stage_hour = {probability_per_stage_hour}: must be in [0, 1); "
            "give a probability, e.g. 0.1 for 10 %/h"
        )
    if not (iteration_time_s > 0.0 and math.isfinite(iteration_time_s)):
        raise InputError(f"iteration_time_s = {iteration_time_s}: must be a positive number of seconds")
    return -math.expm1(iteration_time_s / SECONDS_PER_HOUR * math.log1p(-probability_per_stage_hour))


class NoChurn(StrictModel):
    """No failures: the reference run."""

    kind: Literal["none"]


class StageHourlyChurn(StrictModel):
    """Each node fails independently with probability h per node-hour (CheckFree's unit).

    Sampled as a Poisson process per node with rate −ln(1 − h) per hour, which gives exactly
    probability h of at least one failure in any hour. CheckFree states h per stage of a pipeline
    without data parallelism, where a node is a stage; with D replicas each of a stage's D nodes
    fails with probability h per hour (with `pipeline.replicas_fail_together`, the whole stage does).
    """

    kind: Literal["stage_hourly"]
    failure_probability_per_stage_hour: float = Field(ge=0.0, lt=1.0, allow_inf_nan=False)
    """Probability in [0, 1) that a given node fails at least once in an hour (0.1 = 10 %/h); a
    node is one replica of one stage, which is the stage itself without data parallelism."""

    @property
    def rate_per_stage_s(self) -> float:
        """Failures per second of one node (named for the stage of a pipeline without data parallelism)."""
        return stage_hourly_probability_to_rate_per_s(self.failure_probability_per_stage_hour)


class PoissonChurn(StrictModel):
    """Every node (one replica of one stage) fails at a constant rate (exponential lifetimes)."""

    kind: Literal["poisson"]
    failures_per_node_hour: float = Field(ge=0.0, allow_inf_nan=False)
    """Failure rate of one node per hour (AWS GPU spot ≈ 0.6, GCP ≈ 0.3); not multiplied by the data-parallel degree."""

    @property
    def rate_per_stage_s(self) -> float:
        """Failures per second of one node (named for the stage of a pipeline without data parallelism)."""
        return self.failures_per_node_hour / SECONDS_PER_HOUR


class WeibullChurn(StrictModel):
    """Each node lives a Weibull lifetime; its replacement draws a fresh one (renewal).

    The scale is derived so that the mean lifetime equals `mean_lifetime_s`. The replacement's
    lifetime starts at the moment the failed node fails: the join delay is ignored for the sample
    path, so that the path does not depend on the recovery method and every method sees the same
    failures (common random numbers). Shape < 1: infant mortality; 1: exponential; > 1: wear-out.
    """

    kind: Literal["weibull"]
    shape: float = Field(gt=0.0, allow_inf_nan=False)
    """Weibull shape k (1 = exponential lifetimes)."""
    mean_lifetime_s: float = Field(gt=0.0, allow_inf_nan=False)
    """Mean lifetime of one node in seconds."""

    @property
    def scale_s(self) -> float:
        """Weibull scale λ with λ·Γ(1 + 1/k) = mean lifetime."""
        return self.mean_lifetime_s / math.gamma(1.0 + 1.0 / self.shape)


class BurstChurn(StrictModel):
    """Correlated failures: bursts arrive as a Poisson process and each takes down distinct nodes.

    The number of nodes in a burst is i + 1 with probability `burst_size_probabilities[i]`, capped
    at the number of nodes (stages × data-parallel replicas); the nodes are chosen uniformly without
    repetition (whole stages, capped at the number of stages, when replicas fail together).
    """

    kind: Literal["burst"]
    bursts_per_hour: float = Field(ge=0.0, allow_inf_nan=False)
    """Rate of bursts for the whole grid of nodes, per hour."""
    burst_size_probabilities: tuple[float, ...] = P3_TRACE_BURST_SIZE_PROBABILITIES
    """Probabilities of bursts of 1, 2, … nodes; they must sum to 1. Default: the p3 spot trace."""

    @field_validator("burst_size_probabilities")
    @classmethod
    def _probabilities_form_a_distribution(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value:
            raise ValueError("is empty; give at least one probability, e.g. [1.0] for single-stage bursts")
        for index, probability in enumerate(value):
            if not (math.isfinite(probability) and 0.0 <= probability <= 1.0):
                raise ValueError(f"entry {index} (size {index + 1}) = {probability} is not in [0, 1]; use probabilities")
        total = math.fsum(value)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"the probabilities sum to {total:g}, not 1; rescale them so they sum to 1")
        return value

    @property
    def mean_burst_size(self) -> float:
        return math.fsum((index + 1) * probability for index, probability in enumerate(self.burst_size_probabilities))


class TraceChurn(StrictModel):
    """Replay the removals of a recorded spot-instance trace as node failures.

    Trace times (in the trace's own seconds) inside [window_start_s, window_end_s) are shifted so
    the window starts at simulated time 0 and multiplied by `time_scale`. Every removal inside is a
    preemption the simulator sees; it hits a node of the pipeline's grid with the grid-hosting
    share of the nodes alive (see `churnsim.calibration.failure_sampling`).
    """

    kind: Literal["trace"]
    path: str = Field(min_length=1)
    """Trace file; a relative path is looked up in the built-in trace directory first (e.g.
    `bamboo/p3-trace.csv`), then in the current directory."""
    format: TraceFormat
    """`bamboo_csv` (time_ms,add|remove,node), `parcae_jsonl`, `instance_count` (x_s,count steps),
    `instance_count_hours` (x in hours), `gcloud_count` (date, time, count)."""
    time_scale: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    """Multiplies trace times: 2 stretches the trace to half the churn rate, 0.5 doubles it."""
    window_start_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """Start of the replayed window, in trace seconds (before scaling), relative to the trace start."""
    window_end_s: float | None = Field(default=None, allow_inf_nan=False)
    """End of the window (exclusive), in trace seconds; None = through the trace's last record."""
    repeat: bool = False
    """Loop the window when the run outlasts it (each loop starts from the window's initial state)."""

    @field_validator("window_end_s")
    @classmethod
    def _window_end_after_start(cls, value: float | None, info: ValidationInfo) -> float | None:
        start = info.data.get("window_start_s")
        if value is not None and start is not None and value <= start:
            raise ValueError(f"must be greater than window_start_s = {start}; use a later end or omit it")
        return value

    def resolved_path(self) -> Path:
        """The trace file: built-in trace directory first, then the current directory."""
        return resolve_trace_path(self.path)


class ScheduleChurn(StrictModel):
    """Replay a failure schedule: the rows of a churnsim failure-schedule CSV, by their `time_s`.

    Each row is one node failure (its stage, and its replica when the file has that column) at
    that many seconds after the start of training, for the simulator and for real runs alike (a
    real run injects it at its first iteration boundary at or after that time). Every row needs a `time_s`: failure times are the one time base both share.
    """

    kind: Literal["schedule"]
    path: str = Field(min_length=1)
    """The failure-schedule CSV (`time_s,iteration,stage,kind`, optionally `,replica`), relative to the current directory."""


def resolve_trace_path(path: str | Path) -> Path:
    """Find a trace file: absolute as given; relative in the built-in directory, then the current one."""
    from .safe_files import check_path_text, resolve_inside

    check_path_text(path, what="churn.path")
    candidate = Path(path)
    if candidate.is_absolute():
        if candidate.is_file():
            return candidate
        raise InputError(f"churn.path = {str(path)!r}: no such file; check the path")
    # A relative path stays inside the folder it is resolved against (no '..' or link out of it).
    for base in (TRACE_DIRECTORY, Path.cwd()):
        found = resolve_inside(base, candidate, what="churn.path")
        if found is not None:
            return found
    available = ", ".join(sorted(str(p.relative_to(TRACE_DIRECTORY)) for p in builtin_trace_files()))
    raise InputError(
        f"churn.path = {str(path)!r}: not found in the built-in traces nor the current directory; "
        f"use a path to an existing file or one of: {available}"
    )


def builtin_trace_files() -> tuple[Path, ...]:
    """The replayable trace files churnsim ships."""
    patterns = ("bamboo/*.csv", "bamboo/*.txt", "parcae/*.jsonl")
    found = {p for pattern in patterns for p in TRACE_DIRECTORY.glob(pattern) if not p.name.startswith("LICENSE")}
    return tuple(sorted(found))


def _probability_scaled(probability: float, factor: float) -> float:
    return 1.0 - (1.0 - probability) ** factor  # the Poisson rate −ln(1 − h) × factor


@dataclass(frozen=True)
class RateField:
    """The field of a churn model that sets its failure rate, and how outputs name its values."""

    field: str
    scaled: Callable[[float, float], float]
    """The field's value with the rate scaled by a factor: a rate is multiplied, a mean lifetime or
    a time scale divided."""
    axis_label: str
    phrase: str
    """A value in words, `phrase.format(display_scale * value)`, e.g. `240 failures per node-hour`."""
    display_scale: float = 1.0

    @property
    def setting(self) -> str:
        """The scenario path of the field, as `--set` and a sweep's table column name it."""
        return f"churn.{self.field}"

    def words(self, value: float) -> str:
        return self.phrase.format(self.display_scale * value)


RATE_FIELD_OF_KIND: dict[str, RateField] = {
    "stage_hourly": RateField(
        "failure_probability_per_stage_hour", _probability_scaled, "failure probability per stage (%/h)", "{:.3g} %/h per stage", 100.0
    ),
    "poisson": RateField("failures_per_node_hour", operator.mul, "failures per node-hour", "{:g} failures per node-hour"),
    "weibull": RateField(
        "mean_lifetime_s", operator.truediv, "mean node lifetime (h; larger: fewer failures)", "a mean lifetime of {:.3g} h", 1 / SECONDS_PER_HOUR
    ),
    "burst": RateField("bursts_per_hour", operator.mul, "failure bursts per hour", "{:g} bursts per hour"),
    # A trace's window stays in the trace's own seconds.
    "trace": RateField("time_scale", operator.truediv, "trace time scale (larger: fewer preemptions)", "trace time scale {:g}"),
}
"""Per churn kind with a failure rate, the field that sets it."""


def rate_field_of_setting(setting: str) -> RateField | None:
    """The churn rate field a scenario path (`churn.failures_per_node_hour`, ...) sets, if it is one."""
    return next((rate for rate in RATE_FIELD_OF_KIND.values() if rate.setting == setting), None)


def own_rate(churn: object) -> tuple[RateField, float] | None:
    """The field that sets `churn`'s failure rate and its value; None without one (no churn, a fixed
    schedule of failure times)."""
    rate = RATE_FIELD_OF_KIND.get(getattr(churn, "kind", None))  # type: ignore[arg-type]
    return None if rate is None else (rate, float(getattr(churn, rate.field)))


def churn_with_rate_scaled(churn: object, factor: float) -> object | None:
    """`churn` failing `factor` times as often, its shape kept; None where there is no rate to scale
    (no failures, or a fixed schedule of failure times)."""
    if not (factor > 0.0 and math.isfinite(factor)):
        raise InputError(f"failure-rate factor {factor}: must be a positive number")
    own = own_rate(churn)
    if not isinstance(churn, StrictModel) or own is None:
        return None
    rate, value = own
    return churn.model_copy(update={rate.field: rate.scaled(value, factor)})


def rate_sweep(churn: object, factors: tuple[float, ...] = (0.5, 1.0, 2.0)) -> tuple[str, tuple[float, ...]] | None:
    """(`churn.FIELD`, values): the scenario field and values that sweep `churn`'s own failure rate
    at `factors` times itself, from no failures where the field is a rate (0 per hour); None without
    a rate (no churn, a fixed schedule)."""
    own = own_rate(churn)
    if own is None:
        return None
    rate, _ = own
    values = [float(getattr(churn_with_rate_scaled(churn, factor), rate.field)) for factor in factors]
    if rate.scaled is operator.mul:
        values.insert(0, 0.0)
    return rate.setting, tuple(dict.fromkeys(values))  # a rate of 0 scales to 0 at every factor


ChurnConfig = Annotated[
    Union[NoChurn, StageHourlyChurn, PoissonChurn, WeibullChurn, BurstChurn, TraceChurn, ScheduleChurn],
    Field(discriminator="kind"),
]
"""Any churn model; the `kind` field selects which."""

CHURN_KINDS: tuple[str, ...] = ("none", "stage_hourly", "poisson", "weibull", "burst", "trace", "schedule")


_CHURN_ADAPTER: TypeAdapter = TypeAdapter(ChurnConfig)


def parse_churn_config(data: object, source: str = "churn") -> ChurnConfig:
    """Build a churn model from plain data (e.g. a `--churn` JSON flag), raising a one-line `InputError`."""
    try:
        return _CHURN_ADAPTER.validate_python(data)
    except ValidationError as error:
        raise InputError(describe_validation_error(error, source)) from None
