"""The convergence model: a baseline loss curve plus per-method setbacks (DESIGN.md section 3).

Loss is a function of *effective progress*, counted in iterations of the no-failure run. A rollback
subtracts the iterations it loses exactly; a CheckFree-style rebuild subtracts a setback, the number
of baseline iterations the rebuilt model needs to get back to the loss it had before the failure.
The headline question "when do I reach loss L?" becomes "when does effective progress reach
`baseline.progress_for_loss(L)`?".

The baseline is a shifted power law, L(i) = floor + scale · (i + offset)^(−exponent), the usual
empirical form of LLM loss against steps (Kaplan et al., arXiv 2001.08361, fit per run here).

Iterations of what batch? A curve counts iterations of one global batch. When the spec names it
(`baseline_tokens_per_iteration`) and a scenario trains another (more microbatches, a larger
microbatch, more data-parallel replicas), `at_batch` carries the curve and the setbacks to the
scenario's batch with the empirical model of large-batch training (McCandlish et al., "An Empirical
Model of Large-Batch Training", arXiv 1812.06162): the steps to reach a loss are S(B) = S_min ·
(1 + B_noise / B), so one iteration at batch B is worth (1 + B_noise / B_ref) / (1 + B_noise / B)
iterations at the curve's batch B_ref: nearly B / B_ref well below the critical batch B_noise, and
no more than 1 + B_noise / B_ref far above it. Approximation: B_noise grows as the loss falls (Kaplan
et al. 2020, B_crit(L) = B* / L^(1/α_B)); one value is taken for the whole run, the presets' at
their target loss (`critical_batch_tokens_at_loss`).

What model size? When the spec names the size of the model whose curve it is (`baseline_parameters`)
and a scenario trains another, `at_model_size` moves the curve's floor by the parameter term of
Hoffmann et al.'s parametric fit, L(N, D) = E + A / N^α + B / D^β ("Training Compute-Optimal Large
Language Models", arXiv 2203.15556, approach 3: A = 406.4, α = 0.34, N counting every parameter):
L(N₁, D) − L(N₀, D) = A·(N₁^−α − N₀^−α) for every D, so the curve shifts by that much at every
iteration. Approximation: the fit is of MassiveText with its tokenizer, on 70M–16B parameters
trained near compute-optimally; a larger model is taken to learn as fast per token as the fit says,
and its setbacks stay as many iterations.
"""

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from .base import StrictModel
from .errors import InputError
from .methods import METHOD_CONFIGS, METHOD_NAMES
from .stage_positions import StagePosition

SetbackSource = Literal["measured", "paper_fitted", "default"]


# Hoffmann et al. 2022 (arXiv 2203.15556), approach 3: the parameter term A / N^α of their loss fit.
CHINCHILLA_PARAMETER_COEFFICIENT = 406.4
CHINCHILLA_PARAMETER_EXPONENT = 0.34
FIT_PARAMETER_RANGE = (70e6, 16e9)
"""The model sizes the fit was made on ("from 70 million to over 16 billion parameters")."""


def parameter_loss_term(num_parameters: float) -> float:
    """The loss, in nats per token, that a model of `num_parameters` keeps for lack of size (A / N^α)."""
    return CHINCHILLA_PARAMETER_COEFFICIENT * num_parameters ** (-CHINCHILLA_PARAMETER_EXPONENT)


class PowerLawLossCurve(StrictModel):
    """L(i) = floor_loss + scale · (i + offset_iterations)^(−exponent), i = effective iterations."""

    kind: Literal["power_law"] = "power_law"
    floor_loss: float = Field(ge=0, allow_inf_nan=False)
    """The loss the curve falls towards and never reaches (nats per token); a target at or below it
    is never reached."""
    scale: float = Field(gt=0, allow_inf_nan=False)
    """How far above the floor the curve lies: the factor of (i + offset_iterations)^(−exponent), in
    nats per token."""
    exponent: float = Field(gt=0, allow_inf_nan=False)
    """How fast the loss falls towards the floor: the power of (i + offset_iterations)^(−exponent);
    larger falls faster."""
    offset_iterations: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Shifts the curve along the iterations so that it is finite at the start: the loss at i = 0 is
    floor_loss + scale · offset_iterations^(−exponent)."""
    r_squared: float | None = None
    """Goodness of fit when the curve was fitted to measured losses."""

    def loss(self, progress_iterations: float) -> float:
        return self.floor_loss + self.scale * (max(progress_iterations, 0.0) + self.offset_iterations) ** (-self.exponent)

    def in_iterations_worth(self, worth: float) -> "PowerLawLossCurve":
        """The same curve against iterations that are each worth `worth` of this curve's:
        floor + scale · (worth · i + offset)^(−exponent) = floor + scale · worth^(−exponent) · (i + offset / worth)^(−exponent)."""
        return self.model_copy(update={"scale": self.scale * worth ** (-self.exponent), "offset_iterations": self.offset_iterations / worth})

    def with_floor_moved(self, change: float) -> "PowerLawLossCurve":
        """The same curve shifted by `change` at every iteration (its floor moved)."""
        floor = self.floor_loss + change
        if floor < 0:
            raise InputError(f"the loss curve's floor {self.floor_loss:.4g} moved by {change:.4g} falls below 0; check convergence.baseline")
        return self.model_copy(update={"floor_loss": floor})

    def progress_for_loss(self, target_loss: float) -> float:
        """Effective iterations at which the baseline first reaches `target_loss`."""
        if target_loss <= self.floor_loss:
            raise InputError(
                f"target loss {target_loss} is at or below the loss floor {self.floor_loss:.4g} of the "
                "convergence model: it is never reached; choose a higher target.loss"
            )
        try:
            progress = ((target_loss - self.floor_loss) / self.scale) ** (-1.0 / self.exponent) - self.offset_iterations
        except OverflowError:
            progress = math.inf
        if not math.isfinite(progress):
            raise InputError(
                f"target loss {target_loss} is reached after more iterations than a number can hold (loss curve floor "
                f"{self.floor_loss:.4g}, scale {self.scale:.4g}, exponent {self.exponent:.4g}); check convergence.baseline or raise target.loss"
            )
        return max(progress, 0.0)


class SetbackSpec(StrictModel):
    """Baseline iterations lost per rebuild of one stage, for one method and stage position."""

    mean_iterations: float = Field(ge=0)
    """Baseline iterations one rebuild of the stage costs (the constant part, when it also grows with
    progress)."""
    ci95_low_iterations: float | None = Field(None, ge=0)
    """Lower end of the 95 % interval of mean_iterations. With ci95_high_iterations, each replication
    draws its setback from the interval (calibration/setback_uncertainty.py); None: no interval,
    the mean is used as it is."""
    ci95_high_iterations: float | None = Field(None, ge=0)
    """Upper end of the 95 % interval of mean_iterations (given with ci95_low_iterations, or neither)."""
    num_samples: int = Field(0, ge=0)
    """Rebuilds the setback was fitted from; 0 for a documented default. A calibration's setback is
    carried to another model only when it has enough of them (`calibration.apply`)."""
    per_progress_iteration: float = Field(0.0, ge=0)
    """A setback that grows with training progress, as the convergence lab measures it: a rebuild at
    progress p costs mean_iterations + per_progress_iteration × max(0, p − progress_offset_iterations)."""
    per_progress_ci95_low: float | None = Field(None, ge=0)
    """Lower end of the 95 % interval of per_progress_iteration; a replication's draw moves it and
    the mean's together (calibration/setback_uncertainty.py). None: no interval."""
    per_progress_ci95_high: float | None = Field(None, ge=0)
    """Upper end of the 95 % interval of per_progress_iteration (given with per_progress_ci95_low,
    or neither)."""
    progress_offset_iterations: float = Field(0.0, ge=0)
    """Progress below which a rebuild costs only `mean_iterations` (early in training a rebuilt stage
    re-learns within the lab's window)."""

    @model_validator(mode="after")
    def _intervals_hold_their_values(self) -> "SetbackSpec":
        # A reversed or one-sided interval would otherwise be dropped without a word by the draws
        # (calibration/setback_uncertainty.py uses an interval only when both ends bracket the value).
        for value_name, low_name, high_name in (
            ("mean_iterations", "ci95_low_iterations", "ci95_high_iterations"),
            ("per_progress_iteration", "per_progress_ci95_low", "per_progress_ci95_high"),
        ):
            value, low, high = getattr(self, value_name), getattr(self, low_name), getattr(self, high_name)
            if (low is None) != (high is None):
                raise ValueError(f"give both {low_name} and {high_name}, or neither")
            bounded = low is not None and all(math.isfinite(number) for number in (value, low, high))  # the rest: FiniteNumbersModel
            if bounded and not low <= value <= high:
                raise ValueError(f"{value_name} {value:g} lies outside its interval [{low_name} {low:g}, {high_name} {high:g}]; give an interval that contains it")
        return self

    def in_iterations_worth(self, worth: float) -> "SetbackSpec":
        """The same setback counted in iterations that are each worth `worth` of this one's."""
        update: dict[str, float] = {"mean_iterations": self.mean_iterations / worth, "progress_offset_iterations": self.progress_offset_iterations / worth}
        for bound in ("ci95_low_iterations", "ci95_high_iterations"):
            value = getattr(self, bound)
            if value is not None:
                update[bound] = value / worth
        # setback(p) / worth with p = worth · i: the growth per iteration of progress stays as it is.
        return self.model_copy(update=update)

    def at_progress(self, progress_iterations: float) -> float:
        """Baseline iterations one rebuild at this much training progress costs."""
        return self.mean_iterations + self.per_progress_iteration * max(0.0, progress_iterations - self.progress_offset_iterations)

    def description(self, scale: float = 1.0) -> str:
        """In words, as iterations per rebuilt stage (× `scale`): "12", or for a setback that grows with
        training progress "0.406 per iteration of progress past 197" (after its constant part, if any)."""
        constant = f"{self.mean_iterations * scale:.3g}"
        if self.per_progress_iteration <= 0:
            return constant
        growing = f"{self.per_progress_iteration * scale:.3g} per iteration of progress past {self.progress_offset_iterations:.0f}"
        return growing if self.mean_iterations == 0 else f"{constant} + {growing}"


class MethodSetbacks(StrictModel):
    interior: SetbackSpec
    """The setback of a rebuilt stage that is neither the first nor the last."""
    edge: SetbackSpec
    """The setback of a rebuilt first or last stage."""

    def in_iterations_worth(self, worth: float) -> "MethodSetbacks":
        return MethodSetbacks(interior=self.interior.in_iterations_worth(worth), edge=self.edge.in_iterations_worth(worth))

    def for_position(self, position: StagePosition) -> SetbackSpec:
        return self.interior if position == "interior" else self.edge


def _setbacks(interior: float, edge: float) -> MethodSetbacks:
    return MethodSetbacks(interior=SetbackSpec(mean_iterations=interior), edge=SetbackSpec(mean_iterations=edge))


def default_setbacks() -> dict[str, MethodSetbacks]:
    """The documented, uncalibrated setbacks of every registered method that uses setbacks (its
    `default_setback_iterations` trait; calibration/methods.py says where the numbers come from)."""
    return {
        name: _setbacks(*config_class.default_setback_iterations)
        for name, config_class in METHOD_CONFIGS.items()
        if config_class.default_setback_iterations is not None
    }


class ConvergenceSpec(StrictModel):
    baseline: PowerLawLossCurve
    """Loss against effective iterations of a run without failures."""
    setbacks: dict[str, MethodSetbacks] = Field(default_factory=default_setbacks)
    """Per method name, the baseline iterations a rebuild of one stage costs, at interior and edge
    stages; the methods that rebuild a lost stage instead of rolling back (CheckFree, CheckFree+
    and their ablations) use them. Left out: the documented defaults of each (calibration/methods.py)."""
    setback_scale: float = Field(1.0, gt=0)
    """Multiplies every setback: how a calibration measured on one model is carried to another."""
    calibrated: bool = False
    """True when the setbacks were measured (a calibration): exactly when `setback_source` is "measured"."""
    setback_source: SetbackSource | None = None
    """Where the setbacks come from: "measured" (a calibration of real runs), "paper_fitted" (fitted to
    the CheckFree paper's ablation, calibration/paper_setbacks.py) or "default" (the documented
    defaults of calibration/methods.py). Left out, it follows `calibrated` ("measured" or "default").
    Every output names it."""
    source: str = "uncalibrated default setbacks (calibration/methods.py)"
    """Where the setbacks come from, in words (a calibration, the convergence lab); outputs quote it
    for measured setbacks."""
    sample_setbacks: bool = True
    """Each replication draws its setbacks from their intervals (calibration/setback_uncertainty.py), so
    that intervals of time to target include what is not known about them; False uses the means."""
    baseline_tokens_per_iteration: float | None = Field(None, gt=0)
    """The global batch, in tokens per iteration, whose iterations `baseline` and the setbacks count.
    A scenario that trains another batch carries them to its own (`at_batch`, module docstring) and
    names its own batch here. None: iterations count alike whatever the batch (the old behaviour)."""
    critical_batch_tokens: float | None = Field(None, gt=0)
    """B_noise of the empirical model of large-batch training, in tokens (module docstring); given
    exactly when `baseline_tokens_per_iteration` is."""
    batch_carried_from_tokens_per_iteration: float | None = Field(None, gt=0)
    """Set by `at_batch`: the batch the curve was given for, before it was carried to this one (the
    outputs say so); None when it was not carried."""
    baseline_parameters: float | None = Field(None, gt=0)
    """The size, in parameters, of the model whose training `baseline` is. A scenario of another size
    carries the curve to its own (`at_model_size`, module docstring) and names its own size here.
    None: the curve holds as it is whatever the model."""
    model_carried_from_parameters: float | None = Field(None, gt=0)
    """Set by `at_model_size`: the size the curve was given for, before it was carried to this one
    (the outputs say so); None when it was not carried."""
    stale_reload_costs_progress: bool = True
    """A stage reloaded from an older checkpoint while the others keep going (checkpoint with
    rollback "stage", CheckFree's edge checkpoints) costs the run Δ/S iterations of progress, the
    simulator's stand-in for the damage a stale stage does to convergence (sim/model/methods/
    checkpointing.py). False drops it, as a wall-clock replay of a real run must: the real run does
    not repeat those iterations, it only trains on with a stale stage (sim/checks/validate.py)."""
    restart_from_scratch_costs_progress: bool = True
    """A rebuild that leaves no trained weight anywhere (every stage lost at random init,
    `calibration.rebuild_plan.leaves_no_trained_weights`) costs all the progress made: training
    starts again from iteration 0. False drops it, as a wall-clock replay of a real run must: the
    real run trains on from the random weights for its fixed number of iterations (sim/checks/validate.py)."""

    @model_validator(mode="before")
    @classmethod
    def _source_follows_calibrated(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        source, calibrated = data.get("setback_source"), data.get("calibrated")
        if source is None:
            return {**data, "setback_source": "measured" if calibrated else "default"}
        if calibrated is None:
            return {**data, "calibrated": source == "measured"}
        if bool(calibrated) != (source == "measured"):
            raise ValueError(
                f"calibrated = {calibrated} contradicts setback_source = {source!r}: calibrated is true exactly "
                "for measured setbacks; drop one of the two fields"
            )
        return data

    @model_validator(mode="after")
    def _known_methods(self) -> "ConvergenceSpec":
        unknown = sorted(set(self.setbacks) - set(METHOD_NAMES))
        if unknown:
            raise ValueError(f"setbacks name unknown methods {unknown}; use method names from {list(METHOD_NAMES)}")
        if (self.baseline_tokens_per_iteration is None) != (self.critical_batch_tokens is None):
            raise ValueError(
                "convergence.baseline_tokens_per_iteration and convergence.critical_batch_tokens go together: "
                "give both (the curve's batch and B_noise, in tokens) or neither"
            )
        return self

    def iteration_worth(self, tokens_per_iteration: float) -> float:
        """How many iterations of the curve's batch one iteration of `tokens_per_iteration` is worth
        (module docstring); 1 when the spec names no batch."""
        reference, critical = self.baseline_tokens_per_iteration, self.critical_batch_tokens
        if reference is None or critical is None or tokens_per_iteration == reference:
            return 1.0
        return iteration_worth(tokens_per_iteration, reference_tokens=reference, critical_tokens=critical)

    def at_batch(self, tokens_per_iteration: float) -> "ConvergenceSpec":
        """This spec with the curve and the setbacks counted in iterations of `tokens_per_iteration`
        (itself when it names no batch or that one)."""
        if self.baseline_tokens_per_iteration is None or tokens_per_iteration == self.baseline_tokens_per_iteration:
            return self
        worth = self.iteration_worth(tokens_per_iteration)
        given = self.batch_carried_from_tokens_per_iteration or self.baseline_tokens_per_iteration
        return self.model_copy(
            update={
                "baseline": self.baseline.in_iterations_worth(worth),
                "setbacks": {method: setbacks.in_iterations_worth(worth) for method, setbacks in self.setbacks.items()},
                "baseline_tokens_per_iteration": float(tokens_per_iteration),
                "batch_carried_from_tokens_per_iteration": None if tokens_per_iteration == given else given,
            }
        )

    def at_model_size(self, num_parameters: float) -> "ConvergenceSpec":
        """This spec with the curve moved to a model of `num_parameters` (itself when it names no
        size or that one); the setbacks stay as many iterations."""
        if self.baseline_parameters is None or num_parameters == self.baseline_parameters:
            return self
        change = parameter_loss_term(num_parameters) - parameter_loss_term(self.baseline_parameters)
        given = self.model_carried_from_parameters or self.baseline_parameters
        return self.model_copy(
            update={
                "baseline": self.baseline.with_floor_moved(change),
                "baseline_parameters": float(num_parameters),
                "model_carried_from_parameters": None if num_parameters == given else given,
            }
        )

    def model_size_note(self, target_loss: float | None = None) -> str | None:
        """In words, how the curve was carried to this model size, and what that does to the
        iterations to `target_loss` when it is given; None when it was not carried."""
        given, size = self.model_carried_from_parameters, self.baseline_parameters
        if given is None or size is None:
            return None
        change = parameter_loss_term(size) - parameter_loss_term(given)
        note = (
            f"the loss curve is given for a model of {_parameters(given)} parameters and carried to this scenario's {_parameters(size)} "
            f"by the parameter term of Hoffmann et al.'s loss fit (arXiv 2203.15556, {CHINCHILLA_PARAMETER_COEFFICIENT} / N^{CHINCHILLA_PARAMETER_EXPONENT}): "
            f"every loss on it moves by {change:+.3f}"
        )
        if target_loss is not None and target_loss > self.baseline.floor_loss:
            original = self.baseline.with_floor_moved(-change)
            if target_loss > original.floor_loss:
                ratio = self.baseline.progress_for_loss(target_loss) / max(original.progress_for_loss(target_loss), 1e-12)
                note += f", so the target loss {target_loss:g} takes {ratio:.2f}× the iterations"
        outside = [_parameters(count) for count in (given, size) if not FIT_PARAMETER_RANGE[0] <= count <= FIT_PARAMETER_RANGE[1]]
        if outside:
            note += f" ({' and '.join(outside)} outside the fit's {_parameters(FIT_PARAMETER_RANGE[0])}–{_parameters(FIT_PARAMETER_RANGE[1])}: extrapolated)"
        return note

    def batch_note(self) -> str | None:
        """In words, how the curve was carried to this batch; None when it was not."""
        given, tokens, critical = self.batch_carried_from_tokens_per_iteration, self.baseline_tokens_per_iteration, self.critical_batch_tokens
        if given is None or tokens is None or critical is None:
            return None
        worth = iteration_worth(tokens, reference_tokens=given, critical_tokens=critical)
        change = f"{worth:.2f}× fewer" if worth >= 1 else f"{1 / worth:.2f}× more"
        return (
            f"the loss curve is given for {given:,.0f} tokens per iteration and carried to this scenario's {tokens:,.0f} by the "
            f"large-batch model (McCandlish et al., arXiv 1812.06162; B_noise {critical:,.0f} tokens): one iteration is worth "
            f"{worth:.2f} of the curve's, so the target takes {change} iterations"
        )

    def setback_for(self, method: str, position: StagePosition) -> SetbackSpec | None:
        """The setback of this method and position, unscaled; None for methods without setbacks."""
        setbacks = self.setbacks.get(method)
        return None if setbacks is None else setbacks.for_position(position)

    def setback_grows_with_progress(self, method: str, position: StagePosition) -> bool:
        """Whether `setback_iterations` of this method and position depends on training progress."""
        spec = self.setback_for(method, position)
        return spec is not None and spec.per_progress_iteration > 0

    def setback_description(self, method: str, position: StagePosition) -> str:
        """`SetbackSpec.description` of this method and position, scaled; "0" for methods without setbacks."""
        spec = self.setback_for(method, position)
        return "0" if spec is None else spec.description(self.setback_scale)

    def setback_per_progress_iteration(self, method: str, position: StagePosition) -> float:
        """How many baseline iterations a rebuild's setback grows by per iteration of training
        progress past its offset (scaled); 0 for a constant setback or a method without setbacks."""
        spec = self.setback_for(method, position)
        return 0.0 if spec is None else spec.per_progress_iteration * self.setback_scale

    def setback_iterations(self, method: str, position: StagePosition, progress_iterations: float = 0.0) -> float:
        """Mean setback in baseline iterations for one rebuild at `progress_iterations` of training
        progress; 0 for methods that lose no progress this way."""
        spec = self.setback_for(method, position)
        return 0.0 if spec is None else spec.at_progress(progress_iterations) * self.setback_scale


def iteration_worth(tokens_per_iteration: float, *, reference_tokens: float, critical_tokens: float) -> float:
    """Iterations at `reference_tokens` per iteration that one at `tokens_per_iteration` is worth:
    S(B_ref) / S(B) with S(B) = S_min · (1 + B_noise / B) (McCandlish et al.; module docstring)."""
    return (1.0 + critical_tokens / reference_tokens) / (1.0 + critical_tokens / tokens_per_iteration)


CRITICAL_BATCH_TOKENS_AT_LOSS_ONE = 2e8
"""B* of Kaplan et al. 2020 (arXiv 2001.08361, eq. 1.4 and §5.1): B_crit(L) ≈ B* / L^(1/α_B) tokens."""
CRITICAL_BATCH_LOSS_EXPONENT = 0.21
"""α_B of the same fit (WebText2, loss in nats per token)."""


def critical_batch_tokens_at_loss(loss: float) -> float:
    """Kaplan et al.'s critical batch at `loss` (nats per token), in tokens: an order of magnitude for
    B_noise where none was measured (their fit is for WebText2 and their tokenizer)."""
    return CRITICAL_BATCH_TOKENS_AT_LOSS_ONE / loss ** (1.0 / CRITICAL_BATCH_LOSS_EXPONENT)


def iterations_for_target(curve: PowerLawLossCurve, target_loss: float) -> int:
    """Whole iterations of baseline progress needed to reach `target_loss`."""
    return max(1, math.ceil(curve.progress_for_loss(target_loss) - 1e-9))


def _parameters(count: float) -> str:
    """A parameter count in words: 468M, 1.74B."""
    return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"
