"""A calibration's measured steady extra of a method, charged to the method's runs.

Kept apart from sim/model/calibrated.py (which reads run records, and so pandas) because every simulated
run of a calibrated scenario passes through it (sim/model/run.py), and a run imports neither pandas nor
scipy.
"""

from __future__ import annotations

from churnsim.calibration.methods import MethodConfig
from churnsim.calibration.scenario import ExplicitCompute, Scenario
from churnsim.calibration.statistics import solve_increasing

from .iteration import simulate_iteration
from .methods import build_policy
from .pipeline_state import build_pipeline_state


def with_measured_method_extra(scenario: Scenario, method: MethodConfig) -> Scenario:
    """The scenario as `method` runs it: where a calibration measured the method's steady extra
    (`ExplicitCompute.method_iteration_extra_s`: redundant forwards, CheckFree+ swaps, lazy
    snapshot copies), its healthy iteration lasts the plain iteration plus that extra. The returned
    compute carries no extras, so applying this twice changes nothing.

    The iteration model predicts a method's extra from compute alone (a redundant forward in
    pipeline bubbles is free), which processes sharing few cores do not see; the difference is
    charged once per iteration, where the optimizer step sits, solved with the iteration model
    (`solve_increasing`). Subtracted instead, with 4 stages sharing 2 cores, every stage's charge cost
    about twice its length and redundant computation's runs were predicted slow.

    On another setup the measured extra scales as the iteration model's own extra of the method
    does from the calibrated setup (`method_model_extra_s`) to this one (`structural_extra_s`):
    more stages or microbatches, more redundant forwards. Carried unchanged, it left redundant
    computation's runs of 6 stages and of 6 microbatches predicted faster than their no-failure
    twins (the calibrate-and-validate benchmark). Without a
    reference (a calibration made before it existed, or a method the model gives no extra: a lazy
    snapshot's copies) the extra is carried unscaled."""
    compute = scenario.compute
    if not isinstance(compute, ExplicitCompute) or not (compute.method_iteration_extra_s or compute.method_model_extra_s):
        return scenario
    extra_s = dict(compute.method_iteration_extra_s).get(method.name)
    reference_s = dict(compute.method_model_extra_s).get(method.name)
    plain_compute = compute.model_copy(update={"method_iteration_extra_s": (), "method_model_extra_s": ()})
    scenario = scenario.model_copy(update={"compute": plain_compute})
    if extra_s is None:
        return scenario
    return _with_method_extra_charged(scenario, method, extra_s, reference_s)


def _with_method_extra_charged(scenario: Scenario, method: MethodConfig, extra_s: float, reference_s: float | None) -> Scenario:
    compute = scenario.compute
    assert isinstance(compute, ExplicitCompute)
    # Every run of one setup asks the same: solve it once. A healthy iteration follows from these
    # alone (sim/model/methods/base.py, `_shared_states`), all hashable.
    key = (scenario.model, scenario.pipeline, compute, scenario.network, method, extra_s, reference_s)
    optimizer_step_s = _CHARGED_OPTIMIZER_STEP_S.get(key)
    if optimizer_step_s is None:
        optimizer_step_s = _charged_optimizer_step_s(scenario, method, extra_s, reference_s)
        if len(_CHARGED_OPTIMIZER_STEP_S) >= _CHARGED_CACHE_SIZE:
            _CHARGED_OPTIMIZER_STEP_S.clear()
        _CHARGED_OPTIMIZER_STEP_S[key] = optimizer_step_s
    return scenario.model_copy(update={"compute": compute.model_copy(update={"optimizer_step_s": optimizer_step_s})})


_CHARGED_OPTIMIZER_STEP_S: dict[tuple, float] = {}
_CHARGED_CACHE_SIZE = 256


def _charged_optimizer_step_s(scenario: Scenario, method: MethodConfig, extra_s: float, reference_s: float | None) -> float:
    """The optimizer step that makes the method's healthy iteration the plain one plus the extra,
    scaled to the scenario's setup."""
    compute = scenario.compute
    assert isinstance(compute, ExplicitCompute)

    def method_iteration_s(optimizer_step_s: float) -> float:
        charged = scenario.model_copy(update={"compute": compute.model_copy(update={"optimizer_step_s": optimizer_step_s})})
        return _healthy_iteration_s(charged, method)

    plain_s = _plain_iteration_s(scenario)
    scale = 1.0
    if reference_s is not None and reference_s > MINIMUM_STRUCTURAL_EXTRA_S:
        scale = max(structural_extra_s(scenario, method, plain_s=plain_s), 0.0) / reference_s
    target_s = plain_s + extra_s * scale
    return solve_increasing(target_s, method_iteration_s, 0.0, max(target_s, compute.optimizer_step_s))


def structural_extra_s(scenario: Scenario, method: MethodConfig, *, plain_s: float | None = None) -> float:
    """How much longer the iteration model makes a healthy iteration of `method` than the plain
    pipeline's (`plain_s`, when the caller already has it), from the scenario's compute alone."""
    return _healthy_iteration_s(scenario, method) - (_plain_iteration_s(scenario) if plain_s is None else plain_s)


def _plain_iteration_s(scenario: Scenario) -> float:
    return simulate_iteration(build_pipeline_state(scenario)).time_s


def _healthy_iteration_s(scenario: Scenario, method: MethodConfig) -> float:
    return simulate_iteration(build_policy(method, scenario).healthy_state()).time_s


MINIMUM_STRUCTURAL_EXTRA_S = 1e-6
"""A structural extra at or under this (a microsecond) is none: a ratio to it would only scale noise."""
