"""A compute cost model that scales: measured hop times as a function of a stage's layers and sizes.

Runs of one model and pipeline measure each stage's forward and backward time per microbatch; a
scenario of another depth, width, stage count, microbatch size or count needs them for its own
stages. The model (one per direction) is linear in five measured coefficients:

    work per hop = fixed_s + matmul_flops × seconds_per_matmul_flop + elements × seconds_per_element
                   + neighbours × seconds_per_neighbour
                   + shared_core_parameters × seconds_per_shared_core_parameter

- `matmul_flops`: 2 × tokens × (the stage's block parameters) + 4 × tokens × sequence × width per
  block (attention scores and their weighted sum) + 2 × tokens × vocab × width on the last stage
  (lm_head), forward (Kaplan et al., arXiv 2001.08361, counting the attention term);
- `elements`: tokens × width per block and once more for the embedding (first stage) and the
  final norm (last stage), plus tokens × vocab on the last stage (the loss over the logits): the
  element-wise work (norms, activations, softmax) that dominates small models on CPUs;
- `neighbours`: the stages next to this one (1 for an edge stage, 2 inside): a hop receives from
  one and sends to the other, and the Python and copies of each message are the stage process's
  work (the CPU work between spans is spread over the hops, calibration.cpu_sharing). Without it
  the fit put the calibrated setup's edge stages above and its interior stages below their
  recorded work, and a pipeline with more interior stages short (the calibrate-and-validate
  benchmark); the quick suite's 2-stage shape, with edge stages only, identifies it;
- `shared_core_parameters`: the stage's parameters when its run's stage processes outnumber the
  cores they share (0 otherwise): a hop then costs more work per parameter it holds, not per token
  it computes. On a machine of few cores, no-failure `cpu-tiny` runs of two layers a stage among more
  processes than cores ran above the model's hops fitted without the term, where two layers a stage
  with a core each (the quick suite's 2-stage shape) and twice the tokens among more processes
  (its microbatch-16 shape) were fitted within a few percent: the extra cost grows with the stage's
  weights, as a cache refilled after another process ran on the core would (a reading, not
  measured). The quick suite's double-depth shape, run only where the processes outnumber the
  cores, identifies it (the carry-by-shape benchmark);
- `fixed_s`: what a hop costs whatever its size (framework dispatch, Python).

Work is in core-seconds (calibration.cpu_sharing): what a hop takes with a core of its own. The
coefficients are fitted by non-negative least squares on relative errors, over every (run, stage)
median of every configuration measured; with a single configuration the five are not all
identifiable and the fit says so in `num_configurations`. The optimizer step is fitted the same way
against the stage's parameters (fixed + per parameter).

What a step takes beyond the iteration the simulator computes from these (the overhead) is fitted
against stages × microbatches, the hops of one direction in an iteration (`iteration_overhead_s` +
`overhead_per_stage_microbatch_s` per hop): on 2 cores it is Python and messaging the spans do not
show, and the time a woken process waits for a core. In held-out no-failure runs of the
calibrate-and-validate benchmark, with each run's own measured hops in the simulator, the step's
excess over the simulated iteration grew about linearly with stages × microbatches once the stage
processes outnumbered the cores, where a per-microbatch term alone gives 6 stages the overhead of
4. Each setup's overhead is measured against its own measured hops, so a shape run made in a faster
or slower minute does not put its speed into the overhead (`fit_compute_cost_model` in
calibration.fit_timing). Approximation: one line for every pipeline; the 2-stage shape, whose
processes each have a core, lies under it, and GPipe above it.
"""

import hashlib
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from .base import StrictModel
from .errors import InputError
from .scenario import ExplicitCompute, ModelSpec, PipelineSpec, Scenario, stage_layer_counts


StageFeatures = tuple[float, float, float, float]
"""(matmul FLOPs, elements, neighbours, shared-core parameters) of one stage's hop (module docstring)."""


class HopCost(StrictModel):
    """Work of one hop of one microbatch on one stage (module docstring)."""

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

    forward: HopCost
    backward: HopCost
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

    def optimizer_step_s(self, parameters: float) -> float:
        return self.optimizer_fixed_s + self.optimizer_seconds_per_parameter * parameters

    def compute_for(self, model: ModelSpec, pipeline: PipelineSpec) -> ExplicitCompute:
        """Per-stage compute of a scenario's model and pipeline: edge stages' embedding and head work
        inside their block times (as a run measures it); the slowest stage's optimizer step plus the
        per-iteration overhead, charged once per iteration where the optimizer step sits."""
        features = stage_features(model, pipeline, self.shared_cores)
        largest_stage_parameters = max(stage_parameters(model, pipeline))
        overhead_s = (
            self.iteration_overhead_s
            + self.overhead_per_microbatch_s * pipeline.num_microbatches
            + self.overhead_per_stage_microbatch_s * pipeline.num_stages * pipeline.num_microbatches
        )
        return ExplicitCompute(
            block_forward_s=tuple(self.forward.work_s(stage) for stage in features),
            block_backward_s=tuple(self.backward.work_s(stage) for stage in features),
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


def setup_description(model: ModelSpec, pipeline: PipelineSpec) -> str:
    """A setup in short, for tables and notes (it leaves out fields `setup_key` compares)."""
    return (
        f"{pipeline.num_stages} stages × {pipeline.num_microbatches} microbatches of {pipeline.microbatch_size}, "
        f"{pipeline.schedule}, {model.num_layers} layers d{model.hidden_size}"
    )


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


def stage_features(model: ModelSpec, pipeline: PipelineSpec, shared_cores: int | None) -> tuple[StageFeatures, ...]:
    """Per stage: the features of one microbatch's forward hop (module docstring), on a machine whose
    stage processes share `shared_cores` cores (None: a device each)."""
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


def fit_hop_cost(features: Sequence[StageFeatures], work_s: Sequence[float]) -> tuple[HopCost, float]:
    """Non-negative least squares of work on (1, the stage features), each row weighted by
    1 / its work so that small and large hops count alike; returns the cost and the median
    |relative residual|."""
    from scipy.optimize import nnls

    work = np.asarray(work_s, dtype=float)
    if work.size == 0 or np.any(~np.isfinite(work)) or np.any(work <= 0):
        raise InputError("hop cost fit: needs at least one finite, positive per-stage work median")
    design = np.column_stack([np.ones(work.size), np.asarray(features, dtype=float)])
    # Columns are scaled to unit size first: FLOPs (~1e8) and 1 differ by orders of magnitude.
    scale = np.maximum(np.abs(design).max(axis=0), 1e-300)
    weighted = design / scale / work[:, None]
    coefficients, _ = nnls(weighted, np.ones(work.size))
    coefficients = coefficients / scale
    predicted = design @ coefficients
    residual = float(np.median(np.abs(predicted - work) / work))
    cost = HopCost(
        fixed_s=float(coefficients[0]),
        seconds_per_matmul_flop=float(coefficients[1]),
        seconds_per_element=float(coefficients[2]),
        seconds_per_neighbour=float(coefficients[3]),
        seconds_per_shared_core_parameter=float(coefficients[4]),
    )
    return cost, residual


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
