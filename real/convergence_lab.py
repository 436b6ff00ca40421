"""The convergence lab: how much baseline progress a rebuild costs, measured on the real model.

Why one process: a rebuild's cost in convergence depends on the weights and the data, not on where
the stages run (a pipelined run's loss and gradients equal a single-process reference,
tests/real/test_pipeline.py). The lab trains the S `StageModule`s of a real run in one process with
what real/trainer.py does per stage (AdamW, per-stage gradient clipping, the same data order, the
same re-initialisation of a lost stage) and rebuilds a lost stage with the contract's plan
(`plan_rebuild`) and the real runs' combination (`combine_blocks`). So a failure can be *forked*
from the no-failure run's exact state: every rebuild is paired with the no-failure run of the same
seed, on the same batches, and costs one process instead of S.

Protocol, per seed:
1. The baseline trains `num_iterations` without failures (a second one with CheckFree+'s swapped
   odd microbatches, the reference of `checkfree_plus`), keeping its state at every failure
   iteration f and its held-out loss at f + W and on a grid (for the loss curve).
2. A fork, per (f, stage, method): from the state at f, the stage is lost (fresh init), rebuilt by
   the method's plan, trained W iterations on the baseline's batches, and evaluated.
3. Setback of the fork = P(L_baseline(f + W)) − P(L_fork(f + W)), P = the equivalent progress of a
   held-out loss on the power law fitted to the baseline's held-out curve. Both sides go through the
   same fitted P, so a misfit of the curve cancels to first order.

Held-out losses come from fixed held-out batches, the same for every evaluation. A setback can come
out negative (a rebuild that helps, or noise); the raw values are kept.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from churnsim.calibration.stage_positions import stage_position
from churnsim.calibration.fit_setbacks import LAB_FAILURE_POINTS, LAB_ITERATIONS, LAB_WINDOW_ITERATIONS, lab_failure_span
from churnsim.calibration.methods import MethodConfig, method_from_name
from churnsim.calibration.pipeline_schedule import microbatch_route
from churnsim.calibration.rebuild_plan import RebuildPlan, plan_rebuild
from churnsim.calibration.scenario import CORPUS_MAX_BYTES

from .data import TokenData
from .methods.rebuild import combine_blocks, flatten_parameters, load_flat_parameters
from .model import ModelConfig, StageModule, derive_seed
from .trainer import _FAILURE_INIT_STREAM

SETBACK_COLUMNS = (
    "seed", "method", "stage", "position", "failure_iteration", "window_iterations", "rebuilt_from",
    "baseline_loss", "rebuilt_loss", "setback_iterations",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class LabSettings:
    model: ModelConfig
    num_stages: int
    num_microbatches: int
    microbatch_size: int
    num_iterations: int
    """Length of the baseline runs; failures strike in [first_failure_iteration, num_iterations − W]."""
    failure_iterations: tuple[int, ...]
    window_iterations: int
    """W: iterations trained after a rebuild before its loss is compared (the setback the calibration keeps)."""
    early_windows: tuple[int, ...] = ()
    """Shorter windows also compared, to see how a setback develops (rows with their own window)."""
    methods: tuple[MethodConfig, ...]
    learning_rate: float = 1e-3
    max_gradient_norm: float = 1.0
    num_eval_batches: int = 4
    eval_every_iterations: int = 20
    corpus_max_bytes: int = CORPUS_MAX_BYTES
    device: str = "cpu"
    """Where the stages train: "cpu", "cuda" or "cuda:N" (`measure_setbacks` spreads seeds over the GPUs)."""

    def __post_init__(self) -> None:
        last = max(self.failure_iterations, default=0) + self.window_iterations
        if last > self.num_iterations:
            raise ValueError(f"failure at {max(self.failure_iterations)} + window {self.window_iterations} > {self.num_iterations} iterations")


@dataclass
class _State:
    """Everything a fork starts from: weights, optimizers, last gradient norms, CheckFree+ replicas."""

    modules: list[dict[str, torch.Tensor]]
    optimizers: list[dict[str, Any]]
    lr_scales: list[float]
    gradient_norms: list[float]
    replicas: dict[str, torch.Tensor] = field(default_factory=dict)


class LabPipeline:
    """The S stages of a real run in one process; routes as the real pipeline's (CheckFree+ swaps)."""

    def __init__(self, settings: LabSettings, *, seed: int, swap_odd_microbatches: bool) -> None:
        self.settings = settings
        self.seed = seed
        self.swap = swap_odd_microbatches
        num_stages = settings.num_stages
        self.device = torch.device(settings.device)
        self.stages = [StageModule(settings.model, stage, num_stages, seed=seed).to(self.device) for stage in range(num_stages)]
        self.lr_scales = [1.0] * num_stages
        self.optimizers = [self._optimizer(stage) for stage in range(num_stages)]
        self.gradient_norms = [1.0] * num_stages
        self.replicas: dict[str, torch.Tensor] = {}

    def _optimizer(self, stage: int) -> torch.optim.Optimizer:
        lr = self.settings.learning_rate * self.lr_scales[stage]
        return torch.optim.AdamW(self.stages[stage].parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)

    def _forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor, swapped: bool) -> torch.Tensor:
        route = microbatch_route(self.settings.num_stages, 1 if swapped else 0, swap_odd_microbatches=swapped)
        hidden = None
        for hop in route:
            module = self.stages[hop.stage]
            if hop.runs_embedding:
                hidden = module.embed(tokens)
            if hop.runs_blocks:
                hidden = module.run_blocks(hidden)
            if hop.runs_head:
                return module.head_loss(hidden, targets)
        raise AssertionError("a route ends at the head")

    def train_step(self, data: TokenData, iteration: int) -> float:
        """One iteration on the batch of `iteration` (the batch a real run of this seed sees)."""
        settings = self.settings
        tokens, targets = data.train_batch(seed=self.seed, iteration=iteration, num_sequences=settings.num_microbatches * settings.microbatch_size)
        # Microbatches are equal slices, so the mean loss over them is the mean over the batch; with
        # swaps the odd microbatches take the swapped route (grouped: same gradients, fewer passes).
        groups = [(slice(None), False)]
        if self.swap:
            size = settings.microbatch_size
            even = [m for m in range(settings.num_microbatches) if m % 2 == 0]
            odd = [m for m in range(settings.num_microbatches) if m % 2 == 1]
            rows = lambda ms: torch.cat([torch.arange(m * size, (m + 1) * size) for m in ms])  # noqa: E731
            groups = [(rows(even), False), (rows(odd), True)] if odd else [(rows(even), False)]
        total = 0.0
        for rows_index, swapped in groups:
            part_tokens, part_targets = tokens[rows_index].to(self.device), targets[rows_index].to(self.device)
            weight = part_tokens.shape[0] / tokens.shape[0]
            loss = self._forward_loss(part_tokens, part_targets, swapped) * weight
            loss.backward()
            total += float(loss.detach())
        for stage, module in enumerate(self.stages):
            blocks = [p.grad for p in module.part_parameters("blocks").values() if p.grad is not None]
            if blocks:  # as NeighbourRebuildMethod.before_optimizer_step: block gradients before clipping
                self.gradient_norms[stage] = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in blocks])))
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], settings.max_gradient_norm)
            self.optimizers[stage].step()
            self.optimizers[stage].zero_grad(set_to_none=True)
        return total

    @torch.no_grad()
    def held_out_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return sum(float(self._forward_loss(tokens, targets, False)) for tokens, targets in batches) / len(batches)

    def refresh_replicas(self) -> None:
        """CheckFree+: the (de)embedding replicas held by stages 1 and S-2 (a snapshot, not trained)."""
        self.replicas = {
            part: flatten_parameters(self.stages[owner].part_parameters(part)).clone()
            for part, owner in (("embedding", 0), ("head", self.settings.num_stages - 1))
        }

    def snapshot(self) -> _State:
        return _State(
            modules=[copy.deepcopy(module.state_dict()) for module in self.stages],
            optimizers=[copy.deepcopy(optimizer.state_dict()) for optimizer in self.optimizers],
            lr_scales=list(self.lr_scales),
            gradient_norms=list(self.gradient_norms),
            replicas={part: value.clone() for part, value in self.replicas.items()},
        )

    def restore(self, state: _State) -> None:
        for module, weights in zip(self.stages, state.modules):
            module.load_state_dict(weights)
        self.lr_scales = list(state.lr_scales)
        self.optimizers = [self._optimizer(stage) for stage in range(self.settings.num_stages)]
        for optimizer, saved in zip(self.optimizers, state.optimizers):
            optimizer.load_state_dict(saved)
        self.gradient_norms = list(state.gradient_norms)
        self.replicas = {part: value.clone() for part, value in state.replicas.items()}

    def lose_and_rebuild(self, method: MethodConfig, stage: int, failure_iteration: int) -> RebuildPlan:
        """Stage `stage` is lost before `failure_iteration`; rebuild it as the method's plan says."""
        (plan,) = plan_rebuild(method, {stage}, self.settings.num_stages).values()
        module = self.stages[stage]
        module.reset_parameters(derive_seed(self.seed, _FAILURE_INIT_STREAM, stage, failure_iteration))
        if plan.blocks_from == "sources":
            received = {
                source: (flatten_parameters(self.stages[source].part_parameters("blocks")), self.gradient_norms[source])
                for source in plan.sources
            }
            combined, _ = combine_blocks(plan, received, getattr(method, "weighting", "uniform"))
            load_flat_parameters(module.part_parameters("blocks"), combined)
        elif plan.blocks_from == "edge_checkpoint":
            raise ValueError("the lab measures setbacks: use an edge fallback other than checkpoint")
        if plan.edge_part == "replica":
            part = "embedding" if stage == 0 else "head"
            load_flat_parameters(module.part_parameters(part), self.replicas[part])
        self.gradient_norms[stage] = 1.0
        if plan.fresh_optimizer:
            self.lr_scales[stage] = getattr(method, "lr_scale", 1.0)
            self.optimizers[stage] = self._optimizer(stage)
        return plan


def _failure_stages(num_stages: int) -> tuple[int, int]:
    return (0, 1) if num_stages < 3 else (1, 0)  # an interior and an edge stage, in turn


def lab_data(settings: LabSettings) -> tuple[TokenData, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A lab process's corpus and its fixed held-out batches, on the lab's device."""
    data = TokenData.load(None, seq_len=settings.model.seq_len, held_out_fraction=0.05, max_bytes=settings.corpus_max_bytes)
    num_sequences = settings.microbatch_size * settings.num_microbatches
    batches = data.held_out_batches(num_batches=settings.num_eval_batches, num_sequences=num_sequences)
    return data, [(tokens.to(settings.device), targets.to(settings.device)) for tokens, targets in batches]


def run_seed(settings: LabSettings, seed: int, *, on_fork_done=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rebuild rows, baseline held-out curve rows) of one seed (module docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    data, eval_batches = lab_data(settings)
    window = settings.window_iterations
    failure_set = set(settings.failure_iterations)
    windows = tuple(sorted({*settings.early_windows, window}))
    check_set = {f + w for f in settings.failure_iterations for w in windows}
    rows, curve = [], []
    for swapped in (False, True):
        methods = [m for m in settings.methods if m.swaps_odd_microbatches == swapped]
        if not methods:
            continue
        pipeline = LabPipeline(settings, seed=seed, swap_odd_microbatches=swapped)
        refresh = next((getattr(m, "replica_refresh_iterations", None) for m in methods if getattr(m, "replica_refresh_iterations", None)), None)
        states: dict[int, _State] = {}
        baseline_at: dict[int, float] = {}
        for iteration in range(settings.num_iterations):
            if iteration in failure_set:
                states[iteration] = pipeline.snapshot()
            pipeline.train_step(data, iteration)
            if refresh is not None and iteration % refresh == 0:
                pipeline.refresh_replicas()
            done = iteration + 1
            if done in check_set or done % settings.eval_every_iterations == 0:
                baseline_at[done] = pipeline.held_out_loss(eval_batches)
                curve.append({"seed": seed, "swapped": swapped, "iteration": done, "held_out_loss": baseline_at[done]})
        for index, failure in enumerate(settings.failure_iterations):
            for stage in _failure_stages(settings.num_stages):
                stage = stage if index % 2 == 0 else settings.num_stages - 1 - stage  # both edges and several interiors
                for method in methods:
                    pipeline.restore(states[failure])
                    plan = pipeline.lose_and_rebuild(method, stage, failure)
                    for iteration in range(failure, failure + window):
                        pipeline.train_step(data, iteration)
                        if refresh is not None and iteration % refresh == 0:
                            pipeline.refresh_replicas()
                        trained = iteration + 1 - failure
                        if trained in windows:
                            rows.append(
                                {
                                    "seed": seed, "method": method.name, "stage": stage,
                                    "position": stage_position(stage, settings.num_stages), "failure_iteration": failure,
                                    "window_iterations": trained, "rebuilt_from": plan.description,
                                    "baseline_loss": baseline_at[iteration + 1], "rebuilt_loss": pipeline.held_out_loss(eval_batches),
                                    "swapped": swapped,
                                }
                            )  # fmt: skip
                    if on_fork_done is not None:
                        on_fork_done()
    return pd.DataFrame(rows), pd.DataFrame(curve)


def add_setbacks(rows: pd.DataFrame, curve: pd.DataFrame) -> tuple[pd.DataFrame, dict[bool, Any]]:
    """Setback per rebuild, through the power law fitted to each baseline's held-out curve."""
    from churnsim.calibration.fit_convergence import equivalent_progress, fit_baseline_curve

    curves = {}
    rows = rows.copy()
    rows["setback_iterations"] = math.nan
    for swapped, points in curve.groupby("swapped"):
        metrics = [
            frame.rename(columns={"held_out_loss": "train_loss"})[["iteration", "train_loss"]] for _, frame in points.groupby("seed")
        ]
        fitted = fit_baseline_curve(metrics)
        curves[bool(swapped)] = fitted
        mine = rows["swapped"] == swapped
        rows.loc[mine, "setback_iterations"] = [
            equivalent_progress(fitted, baseline) - equivalent_progress(fitted, rebuilt)
            for baseline, rebuilt in zip(rows.loc[mine, "baseline_loss"], rows.loc[mine, "rebuilt_loss"])
        ]
    return rows, curves


def lab_settings(
    model: ModelConfig,
    *,
    num_stages: int,
    num_microbatches: int,
    microbatch_size: int,
    learning_rate: float = 1e-3,
    num_iterations: int = LAB_ITERATIONS,
    num_failure_points: int = LAB_FAILURE_POINTS,
    window_iterations: int = LAB_WINDOW_ITERATIONS,
    device: str = "cpu",
    corpus_max_bytes: int = CORPUS_MAX_BYTES,
) -> LabSettings:
    """The lab for one model and pipeline (e.g. a calibration's): every method with the
    `uses_setbacks` trait, failures spread evenly over the run from 10 % of it, so the data show how a
    setback depends on training progress."""
    from churnsim.calibration.methods import method_names_where, method_traits

    first, last = lab_failure_span(num_iterations, window_iterations)
    if last <= first:
        raise ValueError(f"num_iterations {num_iterations} leaves no room for failures before a {window_iterations}-iteration window")
    step = (last - first) / max(num_failure_points - 1, 1)
    methods = []
    for name in method_names_where(uses_setbacks=True):
        # CheckFree's setbacks are those of its neighbour rebuilds: its edge fallback copies (a
        # checkpoint reload is a stale-stage rollback, which the simulator charges exactly).
        parameters = {"edge_fallback": "copy"} if "edge_fallback" in method_traits(name).model_fields else {}
        config = method_from_name(name, **parameters)
        if num_stages >= config.minimum_stages:
            methods.append(config)
    return LabSettings(
        model=model,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        microbatch_size=microbatch_size,
        num_iterations=num_iterations,
        failure_iterations=tuple(round(first + index * step) for index in range(num_failure_points)),
        window_iterations=window_iterations,
        early_windows=(5, 10),
        methods=tuple(methods),
        learning_rate=learning_rate,
        device=device,
        corpus_max_bytes=corpus_max_bytes,
    )


def cpu_tiny_lab_settings(**overrides: Any) -> LabSettings:
    """The lab on the cpu-tiny model: 4 layers, d 64, 4 stages, 4 × 8 sequences, lr 1e-3."""
    model = ModelConfig(vocab_size=256, dim=64, num_heads=4, num_layers=4, seq_len=64)
    return lab_settings(model, num_stages=4, num_microbatches=4, microbatch_size=8, **overrides)


def _run_seed_task(arguments: tuple[LabSettings, int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    settings, seed = arguments
    return run_seed(settings, seed)


def settings_for_worker(settings: LabSettings, index: int) -> LabSettings:
    """The settings of the `index`-th lab process: on CUDA, the host's GPUs in turn. Processes that
    share one GPU take turns on it (three lab processes of a 12-layer model on one H100 took 104 ms
    per step each)."""
    if settings.device != "cuda" or torch.cuda.device_count() < 2:
        return settings
    return dataclasses.replace(settings, device=f"cuda:{index % torch.cuda.device_count()}")


def measure_setbacks(
    settings: LabSettings, seeds: tuple[int, ...], *, workers: int = 2, on_seed_done=None
) -> tuple[pd.DataFrame, pd.DataFrame, dict[bool, Any]]:
    """(per-rebuild rows with setbacks, baseline curve rows, fitted curves), one process per seed.

    `on_seed_done(seed, rows, curve)` sees each seed's raw tables as soon as it finishes, so a long
    lab can keep what it measured if it is stopped."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    tasks = {seed: (settings_for_worker(settings, index), seed) for index, seed in enumerate(seeds)}
    by_seed: dict[int, tuple[pd.DataFrame, pd.DataFrame]] = {}

    def finished(seed: int, result: tuple[pd.DataFrame, pd.DataFrame]) -> None:
        by_seed[seed] = result
        if on_seed_done is not None:
            on_seed_done(seed, *result)

    if workers <= 1 or len(seeds) <= 1:
        for seed, task in tasks.items():
            finished(seed, _run_seed_task(task))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(seeds)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(_run_seed_task, task): seed for seed, task in tasks.items()}
            for future in as_completed(futures):
                finished(futures[future], future.result())
    results = [by_seed[seed] for seed in seeds]  # in seed order, whatever order they finished in
    rows = pd.concat([rows for rows, _ in results], ignore_index=True)
    curve = pd.concat([curve for _, curve in results], ignore_index=True)
    rows, curves = add_setbacks(rows, curve)
    return rows, curve, curves
