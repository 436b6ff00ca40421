"""A compute cost model that scales: a stage's hop work from the model's shapes and the machine's speeds.

Runs of one model and pipeline measure each stage's forward and backward time per microbatch; a
scenario of another depth, width, sequence length, stage count, microbatch size or count needs them
for its own stages. The model (`PhysicalHopCost`, one per direction) counts what a hop does and
charges it at the machine's speeds:

    work per hop = (fixed_s + operations × seconds_per_operation + matmul_flops × seconds_per_matmul_flop
                    + elementwise_bytes × seconds_per_byte + messages × seconds_per_message)
                   × (1 + slowdown_per_extra_process_per_core × max(0, processes per core − 1))

- `matmul_flops`: 2 × tokens × (the stage's block matmul parameters) + 4 × tokens × sequence × width
  per block (attention's scores and their weighted sum: the sequence term) + 2 × tokens × vocab ×
  width on the last stage (lm_head), forward (Kaplan et al., arXiv 2001.08361); a backward hop does
  twice a forward's (the gradients of the input and of the weights);
- `elementwise_bytes`: the bytes the element-wise operations read and write (RMSNorm, RoPE, SwiGLU's
  activation and product, residual adds, the attention's softmax over sequence × heads scores per
  token, the embedding's lookup, the loss over the logits), at `model.activation_bytes_per_element`
  (`block_elements_per_token`; counted from the trainer's LLaMA-style block, real/model.py);
  backward twice the forward's (each operation's gradient reads its input and output gradient);
- `operations`: the framework operations a hop dispatches (`OPERATIONS_PER_BLOCK` per block, and the
  embedding's and head's), each with a fixed cost whatever its size (dispatch, Python, allocation);
  backward twice (each has a gradient node and kernel);
- `messages`: the stages next to this one (1 for an edge stage, 2 inside): a hop receives from one
  and sends to the other, and each message costs the stage process a fixed amount of its work;
- `fixed_s`: what a hop costs whatever it holds (the trainer's Python around it).

So each coefficient is a speed of the machine (seconds per FLOP, per byte, per operation, per
message), and a wider or longer model is charged by what it computes, not by what the calibration
happened to run. Work is in core-seconds (calibration.cpu_sharing): what a hop takes with a core of
its own.

Shared cores: the simulator shares cores among the stage processes itself (sim.model.iteration);
what sharing costs beyond that, a process's cache and branch state refilled after another ran on
its core, grows with how many processes share a core, not with a shape. It is charged as one
dimensionless slowdown per process beyond one per core (`processes_per_core`), multiplying all the
hop's work, fitted with the speeds. Where the processes never outnumbered the cores it is 0
(nothing measured it). Approximation: the slowdown is one number for every shape and direction,
and the optimizer step is not slowed by it. Calibrations made before this model (`HopCost`, which charged a fitted
per-parameter cost on shared cores) still load and predict as they did; `churnsim calibrate`
writes the physical model.

The coefficients are fitted by non-negative least squares on relative errors over every (run,
stage) median of every configuration measured (the slowdown by a bounded search around them,
`fit_physical_hop_costs`); only a suite that varies width, depth, sequence length and stage count
tells FLOPs from bytes from operations (at one width both grow alike with tokens and layers, and
only the edge stages' embedding and head tell them apart), so the fit keeps the widths and sequence
lengths it measured and a carry outside them says it is extrapolated (`outside_fitted_shapes`);
`num_configurations` says how many shapes the fit saw.
The optimizer step is fitted against the stage's parameters (fixed + per parameter).

What a step takes beyond the iteration the simulator computes from these (the overhead) is fitted
against stages × microbatches, the hops of one direction in an iteration (`iteration_overhead_s` +
`overhead_per_stage_microbatch_s` per hop): on few cores it is Python and messaging the spans do
not show, and the time a woken process waits for a core. Each setup's overhead is measured against
its own measured hops, so a shape run made in a faster or slower minute does not put its speed into
the overhead (`fit_compute_cost_model` in calibration.fit_timing). Approximation: one line for
every pipeline.
"""

import hashlib
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
from pydantic import Field, model_validator

from .base import StrictModel
from .errors import InputError
from .scenario import ExplicitCompute, ModelSpec, PipelineSpec, Scenario, stage_layer_counts


StageFeatures = tuple[float, float, float, float]
"""(matmul FLOPs, elements, neighbours, shared-core parameters) of one stage's hop under the model
calibrations made before the physical one (`HopCost`, `legacy_stage_features`)."""

Direction = Literal["forward", "backward"]

OPERATIONS_PER_BLOCK = 55
"""Framework operations one block's forward dispatches (real/model.py): two RMSNorms of 6, the
q, k, v and o projections, RoPE on q and k (12 each), the head views and copies (6), the fused
attention, two residual adds, and SwiGLU's three projections, activation and product."""
OPERATIONS_EMBEDDING = 2
"""The token embedding's lookup and its copy into the stage's activations."""
OPERATIONS_HEAD = 11
"""The final RMSNorm (6), the lm_head, and the loss over the logits in fp32 (4)."""
BACKWARD_WORK_RATIO = 2.0
"""A backward hop's FLOPs, element-wise bytes and operations over its forward's: every matmul has
an input and a weight gradient, and every element-wise operation's gradient reads its input and the
output's gradient."""


def block_elements_per_token(model: ModelSpec) -> float:
    """Elements one block's element-wise operations read and write per token, forward: RMSNorm 7 d
    each (square, mean, scale, gain), RoPE on q and k 8 d each, the attention's q, k, v reads and
    output write 4 d, the heads' copy back 2 d, two residual adds 3 d each, SwiGLU's activation and
    product 5 × ffn width, and the softmax over the scores, 4 × sequence × heads (written, read,
    normalised, read): attention's element-wise sequence term."""
    width, ffn = float(model.hidden_size), float(model.ffn_width)
    return 42.0 * width + 5.0 * ffn + 4.0 * model.sequence_length * model.num_heads


class HopFeatures(NamedTuple):
    """What one hop of one microbatch on one stage does (module docstring)."""

    operations: float
    matmul_flops: float
    elementwise_bytes: float
    messages: float


class PhysicalHopCost(StrictModel):
    """Work of one hop at the machine's speeds (module docstring): each coefficient is a time per unit
    of what the hop does."""

    fixed_s: float = Field(ge=0)
    """Per hop, whatever it holds."""
    seconds_per_operation: float = Field(ge=0)
    """Per framework operation dispatched (its fixed cost, whatever its size)."""
    seconds_per_matmul_flop: float = Field(ge=0)
    """Inverse of the matmul throughput."""
    seconds_per_byte: float = Field(ge=0)
    """Inverse of the element-wise operations' memory throughput."""
    seconds_per_message: float = Field(ge=0)
    """Per activation or gradient received or sent (the stage process's side of it)."""

    def work_s(self, features: HopFeatures) -> float:
        return (
            self.fixed_s
            + features.operations * self.seconds_per_operation
            + features.matmul_flops * self.seconds_per_matmul_flop
            + features.elementwise_bytes * self.seconds_per_byte
            + features.messages * self.seconds_per_message
        )


class HopCost(StrictModel):
    """Work of one hop under the model calibrations made before `PhysicalHopCost` (kept so that their
    files load and predict as they did): fixed + per matmul FLOP + per element + per neighbour + per
    stage parameter when the processes outnumber the cores, the last fitted to the shapes run."""

    fixed_s: float = Field(ge=0)
    seconds_per_matmul_flop: float = Field(ge=0)
    seconds_per_element: float = Field(ge=0)
    seconds_per_neighbour: float = Field(0.0, ge=0)
    """Calibrations made before it was measured have none (0)."""
    seconds_per_shared_core_parameter: float = Field(0.0, ge=0)
    """Calibrations made before the term existed have none (0), and so does any fit whose runs never
    had more stage processes than cores."""

    def work_s(self, features: StageFeatures) -> float:
        matmul_flops, elements, neighbours, shared_core_parameters = features
        return (
            self.fixed_s
            + matmul_flops * self.seconds_per_matmul_flop
            + elements * self.seconds_per_element
            + neighbours * self.seconds_per_neighbour
            + shared_core_parameters * self.seconds_per_shared_core_parameter
        )


class ComputeCostModel(StrictModel):
    """Compute of any model and pipeline of the calibrated machine (module docstring)."""

    forward: PhysicalHopCost | HopCost
    backward: PhysicalHopCost | HopCost
    """Both physical (what `churnsim calibrate` writes) or both of the earlier model (older files)."""
    slowdown_per_extra_process_per_core: float = Field(0.0, ge=0)
    """A physical model's shared-core cost: every hop's work × (1 + this × (processes per core − 1))
    where the stage processes outnumber the cores (module docstring); 0 without shared cores, where
    no run had more processes than cores, and in files of the earlier model."""
    optimizer_fixed_s: float = Field(ge=0)
    optimizer_seconds_per_parameter: float = Field(ge=0)
    iteration_overhead_s: float = Field(ge=0)
    """Per iteration, outside the recorded spans (the trainer's loop, logging, loss bookkeeping)."""
    overhead_per_stage_microbatch_s: float = Field(0.0, ge=0)
    """Per iteration and (stage, microbatch) pair: the time a step takes beyond the simulated
    iteration grows with the hops it makes (module docstring)."""
    overhead_per_microbatch_s: float = Field(0.0, ge=0)
    """Per iteration and microbatch: how older calibrations scaled the overhead; newer ones fit
    `overhead_per_stage_microbatch_s` instead and leave this 0."""
    shared_cores: int | None = Field(None, ge=1)
    """The CPU cores the stage processes shared (local CPU runs); None for one device per stage."""
    num_configurations: int = Field(ge=1)
    """Distinct (model, pipeline) shapes the coefficients were fitted on."""
    fitted_setups: tuple[str, ...] = ()
    """Their `setup_fingerprint`s, so that a validation can tell a setup the fit measured from one it
    carries the coefficients to; calibrations made before this field existed list none."""
    hop_relative_residual: float = Field(ge=0)
    """Median |relative residual| of the hop fit over the (run, stage, direction) medians."""
    fitted_hidden_sizes: tuple[int, ...] = ()
    """The widths of the setups the fit measured: FLOPs grow with the width squared and bytes with the
    width, so only runs of more than one width tell the two speeds apart, and a width outside them
    is extrapolated (`outside_fitted_shapes`). Empty in calibrations made before it was kept."""
    fitted_sequence_lengths: tuple[int, ...] = ()
    """The sequence lengths of the setups the fit measured (attention's terms grow with it)."""

    @model_validator(mode="after")
    def _one_kind_of_hop_cost(self) -> "ComputeCostModel":
        if isinstance(self.forward, PhysicalHopCost) != isinstance(self.backward, PhysicalHopCost):
            raise ValueError("forward and backward hop costs are of different models; re-run churnsim calibrate")
        return self

    @property
    def physical(self) -> bool:
        """Whether this is the physical model (module docstring), not the earlier per-shape fit."""
        return isinstance(self.forward, PhysicalHopCost)

    def outside_fitted_shapes(self, model: ModelSpec) -> str | None:
        """How a model's width or sequence length lies outside those the fit measured, in words; None
        when inside (or not recorded)."""
        outside = []
        for label, value, fitted in (
            ("hidden size", model.hidden_size, self.fitted_hidden_sizes),
            ("sequence length", model.sequence_length, self.fitted_sequence_lengths),
        ):
            if fitted and not min(fitted) <= value <= max(fitted):
                measured = f"{min(fitted)}" if min(fitted) == max(fitted) else f"{min(fitted)}–{max(fitted)}"
                outside.append(f"{label} {value} outside the measured {measured}")
        return " and ".join(outside) or None

    def optimizer_step_s(self, parameters: float) -> float:
        return self.optimizer_fixed_s + self.optimizer_seconds_per_parameter * parameters

    def hop_work_s(self, model: ModelSpec, pipeline: PipelineSpec) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per stage, the work of one microbatch's forward and of its backward hop, in core-seconds."""
        if not self.physical:
            legacy = legacy_stage_features(model, pipeline, self.shared_cores)
            return tuple(self.forward.work_s(stage) for stage in legacy), tuple(self.backward.work_s(stage) for stage in legacy)  # type: ignore[arg-type]
        slowdown = shared_core_slowdown(self.slowdown_per_extra_process_per_core, processes_per_core(pipeline, self.shared_cores))
        return tuple(
            tuple(slowdown * hop.work_s(stage) for stage in hop_features(model, pipeline, direction))  # type: ignore[arg-type]
            for hop, direction in ((self.forward, "forward"), (self.backward, "backward"))
        )  # type: ignore[return-value]

    def compute_for(self, model: ModelSpec, pipeline: PipelineSpec) -> ExplicitCompute:
        """Per-stage compute of a scenario's model and pipeline: edge stages' embedding and head work
        inside their block times (as a run measures it); the slowest stage's optimizer step plus the
        per-iteration overhead, charged once per iteration where the optimizer step sits."""
        forward_s, backward_s = self.hop_work_s(model, pipeline)
        largest_stage_parameters = max(stage_parameters(model, pipeline))
        overhead_s = (
            self.iteration_overhead_s
            + self.overhead_per_microbatch_s * pipeline.num_microbatches
            + self.overhead_per_stage_microbatch_s * pipeline.num_stages * pipeline.num_microbatches
        )
        return ExplicitCompute(
            block_forward_s=forward_s,
            block_backward_s=backward_s,
            optimizer_step_s=self.optimizer_step_s(largest_stage_parameters) + overhead_s,
            shared_cores=self.shared_cores,
        )


def setup_key(model: ModelSpec, pipeline: PipelineSpec) -> str:
    """What determines a setup's compute: its model (but not its display name) and pipeline."""
    return model.model_copy(update={"name": ""}).model_dump_json() + pipeline.model_dump_json()


def setup_fingerprint(model: ModelSpec, pipeline: PipelineSpec) -> str:
    """A short digest of `setup_key`, for a calibration file to name the setups it was fitted on."""
    return hashlib.sha256(setup_key(model, pipeline).encode()).hexdigest()[:16]


def compute_carry_note(scenario: Scenario) -> str | None:
    """One line saying that the scenario's compute was carried from another setup by a calibration's
    compute model (`ExplicitCompute.carried_from`), and how far such carries missed; None otherwise."""
    compute = scenario.compute
    if not isinstance(compute, ExplicitCompute) or not compute.carried_from:
        return None
    return (
        f"compute of {setup_description(scenario.model, scenario.pipeline)} is carried by the compute model from "
        f"{compute.carried_from}, not measured on it: a compute model carried from another shape predicts less "
        "accurately than one measured on the setup (most where the stage processes outnumber the cores; see the "
        "calibrate-and-validate benchmark report, carry_by_setup); `churnsim calibrate --quick --set ...` on this setup "
        "measures it"
    )


SHORT_SETUP_FIELDS: dict[str, frozenset[str]] = {
    "model": frozenset({"num_layers", "hidden_size", "sequence_length"}),
    "pipeline": frozenset({"num_stages", "num_microbatches", "microbatch_size", "schedule"}),
}
"""The fields `setup_description` always shows."""


def setup_differences(model: ModelSpec, pipeline: PipelineSpec, calibrated_model: ModelSpec, calibrated_pipeline: PipelineSpec) -> tuple[tuple[str, object, object], ...]:
    """Every field (`model.<field>`, `pipeline.<field>`) in which a setup differs from a calibrated
    one, with its value and the calibrated value; the model's display name is not compared."""
    differences = []
    for part, spec, calibrated in (("model", model, calibrated_model), ("pipeline", pipeline, calibrated_pipeline)):
        values, calibrated_values = spec.model_dump(exclude={"name"}), calibrated.model_dump(exclude={"name"})
        for field, value in values.items():
            if value != calibrated_values.get(field):
                differences.append((f"{part}.{field}", value, calibrated_values.get(field)))
    return tuple(differences)


def setup_description(model: ModelSpec, pipeline: PipelineSpec, calibrated: tuple[ModelSpec, PipelineSpec] | None = None) -> str:
    """A setup in short, for tables and notes: its stages, microbatches, schedule, layers, width and
    sequence length; with `calibrated` (the calibrated model and pipeline), also every other field in
    which it differs from them, so that no two setups a calibration tells apart read the same."""
    short = (
        f"{pipeline.num_stages} stages × {pipeline.num_microbatches} microbatches of {pipeline.microbatch_size}, "
        f"{pipeline.schedule}, {model.num_layers} layers d{model.hidden_size} seq {model.sequence_length}"
    )
    if calibrated is None:
        return short
    others = [
        f"{name.split('.', 1)[1]} {value}"
        for name, value, _ in setup_differences(model, pipeline, *calibrated)
        if name.split(".", 1)[1] not in SHORT_SETUP_FIELDS[name.split(".", 1)[0]]
    ]
    return short + (f" ({', '.join(others)})" if others else "")


def stage_parameters(model: ModelSpec, pipeline: PipelineSpec) -> tuple[int, ...]:
    layers = stage_layer_counts(model, pipeline)
    last = len(layers) - 1
    return tuple(
        count * model.parameters_per_layer
        + (model.embedding_parameters if stage == 0 else 0)
        + (model.head_parameters if stage == last else 0)
        for stage, count in enumerate(layers)
    )


def processes_outnumber_cores(num_stages: int, shared_cores: int | None) -> bool:
    """Whether a run's stage processes (one per stage) share fewer cores than they are (None: a
    device each)."""
    return shared_cores is not None and num_stages > shared_cores


def processes_per_core(pipeline: PipelineSpec, shared_cores: int | None) -> float:
    """Stage processes (one per node: stages × data-parallel replicas) per core they share; 0 with a
    device each (None)."""
    if shared_cores is None:
        return 0.0
    return pipeline.num_nodes / shared_cores


def shared_core_slowdown(slowdown_per_extra_process_per_core: float, per_core: float) -> float:
    """The factor on a hop's work of `per_core` processes per core (module docstring): 1 up to one a core."""
    return 1.0 + slowdown_per_extra_process_per_core * max(0.0, per_core - 1.0)


def hop_features(model: ModelSpec, pipeline: PipelineSpec, direction: Direction = "forward") -> tuple[HopFeatures, ...]:
    """Per stage: what one microbatch's hop in `direction` does (module docstring)."""
    tokens = float(pipeline.microbatch_size * model.sequence_length)
    width, vocab, sequence = float(model.hidden_size), float(model.vocab_size), float(model.sequence_length)
    matmul_parameters_per_block = 4 * width**2 + 3 * width * model.ffn_width
    ratio = BACKWARD_WORK_RATIO if direction == "backward" else 1.0
    layers = stage_layer_counts(model, pipeline)
    last = len(layers) - 1
    features = []
    for stage, count in enumerate(layers):
        matmul_flops = count * tokens * (2 * matmul_parameters_per_block + 4 * sequence * width)
        elements = count * tokens * block_elements_per_token(model)
        operations = count * OPERATIONS_PER_BLOCK
        if stage == 0:
            elements += 2 * tokens * width
            operations += OPERATIONS_EMBEDDING
        if stage == last:
            matmul_flops += 2 * tokens * vocab * width
            # The final RMSNorm, and the loss reading, normalising and reading again the fp32 logits.
            elements += tokens * (7 * width + 4 * vocab)
            operations += OPERATIONS_HEAD
        messages = float((stage > 0) + (stage < last))
        features.append(
            HopFeatures(
                operations=ratio * operations,
                matmul_flops=ratio * matmul_flops,
                elementwise_bytes=ratio * elements * model.activation_bytes_per_element,
                messages=messages,
            )
        )
    return tuple(features)


def legacy_stage_features(model: ModelSpec, pipeline: PipelineSpec, shared_cores: int | None) -> tuple[StageFeatures, ...]:
    """Per stage: the features of one microbatch's hop under the earlier model (`HopCost`), on a
    machine whose stage processes share `shared_cores` cores (None: a device each)."""
    parameters = stage_parameters(model, pipeline)
    sharing = processes_outnumber_cores(pipeline.num_stages, shared_cores)
    tokens = float(pipeline.microbatch_size * model.sequence_length)
    width, vocab = float(model.hidden_size), float(model.vocab_size)
    layers = stage_layer_counts(model, pipeline)
    last = len(layers) - 1
    features = []
    for stage, count in enumerate(layers):
        matmul_flops = 2 * tokens * count * model.parameters_per_layer + 4 * tokens * model.sequence_length * width * count
        elements = tokens * width * count
        if stage == 0:
            elements += tokens * width
        if stage == last:
            matmul_flops += 2 * tokens * vocab * width
            elements += tokens * width + tokens * vocab
        neighbours = (stage > 0) + (stage < last)
        features.append((matmul_flops, elements, float(neighbours), float(parameters[stage]) if sharing else 0.0))
    return tuple(features)


MAX_SLOWDOWN_PER_EXTRA_PROCESS_PER_CORE = 4.0
"""Upper end of the fit's search: contention that made each process beyond one per core cost more
than four times a hop's work would be a machine to calibrate with fewer processes, not a slowdown."""


class PhysicalFit(NamedTuple):
    forward: PhysicalHopCost
    backward: PhysicalHopCost
    slowdown_per_extra_process_per_core: float
    forward_relative_residual: float
    backward_relative_residual: float


def _relative_nnls(design: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative coefficients of work on the design's columns, each row weighted by 1 / its work
    (small and large hops count alike); and the sum of squared relative residuals."""
    from scipy.optimize import nnls

    # Columns scaled to unit size first: FLOPs (~1e9) and 1 differ by orders of magnitude.
    scale = np.maximum(np.abs(design).max(axis=0), 1e-300)
    weighted = design / scale / work[:, None]
    coefficients, norm = nnls(weighted, np.ones(work.size))
    return coefficients / scale, float(norm) ** 2


def fit_physical_hop_costs(
    forward_features: Sequence[HopFeatures],
    forward_work_s: Sequence[float],
    backward_features: Sequence[HopFeatures],
    backward_work_s: Sequence[float],
    per_core: Sequence[float],
) -> PhysicalFit:
    """The physical hop costs of both directions and the shared-core slowdown they share (module
    docstring), from per-(setup, stage) work medians; `per_core`: each row's processes per core
    (`processes_per_core`, the same rows in both directions).

    For a given slowdown the speeds are a non-negative least-squares fit on relative errors; the
    slowdown is the one of least summed squared relative error, searched on a grid from 0 to
    `MAX_SLOWDOWN_PER_EXTRA_PROCESS_PER_CORE` and refined between the grid points around the best.
    0 where no row had more processes than cores (nothing measures it)."""
    from scipy.optimize import minimize_scalar

    directions = []
    for features, work_s in ((forward_features, forward_work_s), (backward_features, backward_work_s)):
        work = np.asarray(work_s, dtype=float)
        if work.size == 0 or np.any(~np.isfinite(work)) or np.any(work <= 0):
            raise InputError("hop cost fit: needs at least one finite, positive per-stage work median")
        design = np.column_stack([np.ones(work.size), np.asarray(features, dtype=float)])
        if design.shape[0] != work.size:
            raise InputError(f"hop cost fit: {design.shape[0]} feature rows for {work.size} work medians")
        directions.append((design, work))
    excess = np.maximum(np.asarray(per_core, dtype=float) - 1.0, 0.0)
    if any(design.shape[0] != excess.size for design, _ in directions):
        raise InputError("hop cost fit: the processes per core must give one value per (setup, stage) row")

    def squared_error(slowdown: float) -> float:
        factor = (1.0 + slowdown * excess)[:, None]
        return sum(_relative_nnls(design * factor, work)[1] for design, work in directions)

    slowdown = 0.0
    if np.any(excess > 0):
        grid = np.concatenate([[0.0], np.geomspace(1e-3, MAX_SLOWDOWN_PER_EXTRA_PROCESS_PER_CORE, 60)])
        errors = [squared_error(value) for value in grid]
        best = int(np.argmin(errors))
        low, high = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
        refined = minimize_scalar(squared_error, bounds=(low, high), method="bounded", options={"xatol": 1e-6 * max(high, 1e-3)})
        slowdown = float(refined.x) if refined.fun <= errors[best] else float(grid[best])
    factor = (1.0 + slowdown * excess)[:, None]
    costs, residuals = [], []
    for design, work in directions:
        coefficients, _ = _relative_nnls(design * factor, work)
        predicted = (design * factor) @ coefficients
        residuals.append(float(np.median(np.abs(predicted - work) / work)))
        costs.append(
            PhysicalHopCost(
                fixed_s=float(coefficients[0]),
                seconds_per_operation=float(coefficients[1]),
                seconds_per_matmul_flop=float(coefficients[2]),
                seconds_per_byte=float(coefficients[3]),
                seconds_per_message=float(coefficients[4]),
            )
        )
    return PhysicalFit(costs[0], costs[1], slowdown, residuals[0], residuals[1])


def fit_linear_non_negative(regressor: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) >= 0 of values on one regressor: relative errors when every value is
    positive, absolute errors when some is zero or less (a relative error to zero is unbounded: one
    zero would pull the whole line to it); the median and slope 0 when the regressor takes a single
    value (nothing to tell them apart)."""
    from scipy.optimize import nnls

    x = np.asarray(regressor, dtype=float)
    y = np.asarray(values, dtype=float)
    if y.size == 0:
        raise InputError("linear fit: no values")
    if np.unique(x).size < 2:
        return max(0.0, float(np.median(y))), 0.0
    scale = float(np.abs(x).max())
    design = np.column_stack([np.ones(y.size), x / scale])
    if np.all(y > 0):
        (intercept, slope), _ = nnls(design / y[:, None], np.ones(y.size))
    else:
        (intercept, slope), _ = nnls(design, np.maximum(y, 0.0))
    return float(intercept), float(slope / scale)
