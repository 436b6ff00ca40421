"""`churnsim reproduce checkfree`: the CheckFree paper's published claims against churnsim's presets.

Paper: Blagoev, Ersoy, Chen, "All is Not Lost: LLM Recovery without Checkpoints", arXiv 2506.15461,
with its code (gensyn-ai/CheckFree) and blog. Each claim is tagged by where it is published: A = the
arXiv abstract, B = the Gensyn blog, C = the authors' code (the ablation's perplexities: its
plot_perplexity.py).

churnsim's side: the `checkfree-{124m,500m,1.5b}-geo-*` presets at 5, 10, 16 and 33 %/h per stage,
with checkpointing, redundant computation, CheckFree and CheckFree+, in two layouts
(`pipeline.embedding_placement`): the authors' (a separate never-failing (de)embedding node, the
`-embedding-node` presets; the verdicts use it, it is the paper's setup) and churnsim's default
(the embedding with the first and last stages). As in the paper, a failure takes every data-parallel
replica of its stage (`pipeline.replicas_fail_together`): the `checkfree-emulator-*` presets show
the emulator's layout with its replicas failing together and on their own. A speed-up is the paired ratio of times to target
(mean over replications, common random numbers). "The paper's methods" are CheckFree and CheckFree+:
a claim about them is met when the better of the two meets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from churnsim.calibration.paper_setbacks import PAPER_PERPLEXITY_AFTER_10K, PAPER_SETBACKS, PaperSetting, ProgressModel
from churnsim.calibration.presets import (
    CHECKFREE_FAILURE_RATES,
    CHECKFREE_PAPER,
    checkfree_124m_geo,
    checkfree_1_5b_geo,
    checkfree_500m_geo,
    with_calibrated_setbacks,
)
from churnsim.calibration.scenario import Scenario

from ..studies.replicate import replication_tasks
from .reproduce_claims import Claim, Reproduction, format_ratio
from ..studies.sweep import SweepTask, run_sweep

SIZES = {"124m": checkfree_124m_geo, "500m": checkfree_500m_geo, "1.5b": checkfree_1_5b_geo}
LAYOUTS = ("separate_node", "edge_stages")
"""The authors' layout first: the verdicts use it."""
LAYOUT_WORDS = {"separate_node": "separate embedding node (authors')", "edge_stages": "embedding with edge stages (churnsim default)"}
METHODS = ("checkpoint", "redundant", "checkfree", "checkfree_plus")
PAPER_METHODS = ("checkfree", "checkfree_plus")
LOW_RATES = (0.05, 0.10)
"""[A v1]: "5–10 %" per stage-hour."""
HIGH_RATES = (0.16, 0.33)
"""The paper's frequent-fault settings (the authors' code's grid: 5/10/16/33 %)."""
MORE_THAN_12_PERCENT = 1.12
UP_TO_VS_CHECKPOINT = 1.6
UP_TO_VS_REDUNDANT = 1.2


@dataclass(frozen=True, kw_only=True)
class CheckFreePlan:
    replications: int = 5
    sizes: tuple[str, ...] = tuple(SIZES)
    rates: tuple[float, ...] = CHECKFREE_FAILURE_RATES
    layouts: tuple[str, ...] = LAYOUTS


QUICK_PLAN = CheckFreePlan(replications=2, layouts=("separate_node",))


def scenario_for(size: str, rate: float, layout: str, replications: int) -> Scenario:
    """The preset of `size` at `rate` in `layout` (with its setbacks, as `churnsim presets` builds it)."""
    scenario = with_calibrated_setbacks(SIZES[size](rate, layout))
    methods = tuple(scenario.method_config(name) for name in METHODS)
    return scenario.model_copy(update={"replications": replications, "methods": methods})


def tasks_for(plan: CheckFreePlan) -> list[SweepTask]:
    tasks = []
    for layout in plan.layouts:
        for size in plan.sizes:
            for rate in plan.rates:
                scenario = Scenario.model_validate(scenario_for(size, rate, layout, plan.replications).model_dump())
                for task in replication_tasks(scenario):
                    tasks.append(SweepTask(task=task, settings={"model": size, "layout": layout}, keep_trajectories=False))
    return tasks


def speedup_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (layout, model, rate, method of the paper): its speed-ups over both baselines."""
    rows = []
    for _, row in summary[summary["method"].isin(PAPER_METHODS)].iterrows():
        rows.append(
            {
                "layout": row["layout"],
                "model": row["model"],
                "failure_probability_per_stage_hour": row["failure_probability_per_stage_hour"],
                "method": row["method"],
                "fraction_reached": row["fraction_reached"],
                "speedup_vs_checkpoint": row["speedup_vs_checkpoint_mean"],
                "speedup_vs_checkpoint_ci95_low": row["speedup_vs_checkpoint_ci95_low"],
                "speedup_vs_checkpoint_ci95_high": row["speedup_vs_checkpoint_ci95_high"],
                "speedup_vs_redundant": row["speedup_vs_redundant_mean"],
                "speedup_vs_redundant_ci95_low": row["speedup_vs_redundant_ci95_low"],
                "speedup_vs_redundant_ci95_high": row["speedup_vs_redundant_ci95_high"],
                "scenario": row["scenario"],
            }
        )
    return pd.DataFrame(rows)


def _best(speedups: pd.DataFrame, layout: str, rates: Sequence[float], baseline: str) -> pd.DataFrame:
    """Per (model, rate) in `layout`: the better paper method's speed-up over `baseline` (NaN if neither reached)."""
    column = f"speedup_vs_{baseline}"
    chosen = speedups[(speedups["layout"] == layout) & speedups["failure_probability_per_stage_hour"].isin(rates)]
    rows = []
    for (model, rate), group in chosen.groupby(["model", "failure_probability_per_stage_hour"], sort=False):
        values = group.set_index("method")[column]
        finite = values[np.isfinite(values)]
        best_method = finite.idxmax() if len(finite) else None
        rows.append({"model": model, "rate": rate, "method": best_method, "speedup": finite.max() if len(finite) else math.nan})
    return pd.DataFrame(rows, columns=["model", "rate", "method", "speedup"])


def _where(row) -> str:
    method = {"checkfree": "CheckFree", "checkfree_plus": "CheckFree+"}.get(row["method"], "—")
    return f"{row['model'].upper()}, {100 * row['rate']:g} %/h, {method}"


def _floor_claim(claim_id: str, baseline: str, words: str, best: pd.DataFrame, source: str, why: str, preset: str) -> Claim:
    reached = best.dropna(subset=["speedup"])
    if reached.empty:
        value, text = None, "— (no setting where both reached the target)"
    else:
        worst, top = reached.loc[reached["speedup"].idxmin()], reached.loc[reached["speedup"].idxmax()]
        value = float(worst["speedup"])
        missing = len(best) - len(reached)
        met = int((reached["speedup"] >= MORE_THAN_12_PERCENT).sum())
        text = (
            f"{met} of {len(reached)} settings ≥ 1.12×; lowest {format_ratio(worst['speedup'])} ({_where(worst)}), "
            f"highest {format_ratio(top['speedup'])} ({_where(top)})"
            + (f"; {missing} setting(s) without a speed-up (a method never reached the target)" if missing else "")
        )
    return Claim(
        id=claim_id, claim=f"the paper's methods converge over 12 % faster than {words}", source=source,
        setting="124M, 500M, 1.5B at 5 and 10 %/h per stage", paper_value=MORE_THAN_12_PERCENT, paper_text="> 1.12×",
        churnsim_value=value, churnsim_text=text, comparison="at_least", preset=preset, why=why,
    )


def _up_to_claim(claim_id: str, baseline: str, words: str, paper: float, best: pd.DataFrame, source: str, why: str, preset: str) -> Claim:
    reached = best.dropna(subset=["speedup"])
    if reached.empty:
        value, text = None, "—"
    else:
        top = reached.loc[reached["speedup"].idxmax()]
        value, text = float(top["speedup"]), f"{format_ratio(top['speedup'])} ({_where(top)})"
    return Claim(
        id=claim_id, claim=f"up to {paper:g}× faster than {words} when faults are frequent", source=source,
        setting="124M, 500M, 1.5B at 16 and 33 %/h per stage (largest speed-up)", paper_value=paper, paper_text=f"up to {paper:g}×",
        churnsim_value=value, churnsim_text=text, comparison="speedup", preset=preset, why=why,
    )


def perplexity_round_trip(num_paths: int = 2000) -> dict[str, float]:
    """Perplexity after 10k iterations (500M, 16 %/h) that churnsim's stored setbacks give, per ablation arm:
    exp of the mean loss over the fit's failure paths (calibration/paper_setbacks.py, the simulator's rule)."""
    curve = checkfree_500m_geo(0.16).convergence.baseline
    setting = PaperSetting()
    model = ProgressModel(iterations=setting.iterations, rebuilds_per_iteration=setting.rebuilds_per_iteration, num_paths=num_paths)
    return {arm: math.exp(float(np.mean(model.final_losses(curve, PAPER_SETBACKS[arm][0])))) for arm in PAPER_PERPLEXITY_AFTER_10K}


def reproduce_checkfree(
    plan: CheckFreePlan = CheckFreePlan(), *, workers: int | None = None, on_task_done: Callable[[], None] | None = None
) -> Reproduction:
    """Every claim of the CheckFree paper with churnsim's number and a verdict."""
    result = run_sweep(tasks_for(plan), workers=workers, on_task_done=on_task_done)
    speedups = speedup_table(result.summary)
    verdict_layout = plan.layouts[0]
    presets = "checkfree-{124m,500m,1.5b}" + ("-embedding-node" if verdict_layout == "separate_node" else "") + "-geo-{5,10,16,33}pct"
    low_checkpoint = _best(speedups, verdict_layout, LOW_RATES, "checkpoint")
    low_redundant = _best(speedups, verdict_layout, LOW_RATES, "redundant")
    high_checkpoint = _best(speedups, verdict_layout, HIGH_RATES, "checkpoint")
    high_redundant = _best(speedups, verdict_layout, HIGH_RATES, "redundant")
    perplexity = perplexity_round_trip()
    redundant_why = (
        "churnsim's redundant computation runs the successor's forward in pipeline bubbles, which on this latency-bound "
        "geo testbed are large, so it costs almost nothing per iteration and recovers without any setback; CheckFree "
        "pays a convergence setback per rebuild (fitted to the paper's ablation) and its edge stages reload checkpoints. "
        "The paper's redundant baseline was emulated with half-size microbatches and no extra FLOPs "
        "(the authors' development code, github.com/NikolayBlagoev/PipelineRecovery), and its wall-clock model is not "
        "in the paper."
    )
    checkpoint_why = (
        "In churnsim a checkpoint rollback (every 20 iterations, the paper's replay default: ≈ 10 iterations lost per "
        "failure, plus writes over a 500 Mb/s WAN) and a CheckFree rebuild (a setback of 12 iterations fitted to the "
        "paper's own ablation, 25 at an edge, plus edge-stage checkpoints) cost about the same, and both wait for the "
        "replacement to join; at 5–10 %/h they end within a few per cent of each other, CheckFree ahead. The paper's "
        "wall-clock model is not published (hours to target, checkpoint frequency and GPU type are not confirmed from "
        "the paper text)."
    )
    claims = [
        _floor_claim("C1", "checkpoint", "checkpointing", low_checkpoint, "[A] arXiv 2506.15461 v1 abstract", checkpoint_why, presets),
        _floor_claim("C2", "redundant", "redundant computation", low_redundant, "[A] arXiv 2506.15461 v1 abstract", redundant_why, presets),
        _up_to_claim(
            "C3", "checkpoint", "checkpointing", UP_TO_VS_CHECKPOINT, high_checkpoint,
            "[C] gensyn-ai/CheckFree README (f716b3f); [B] gensyn.ai/articles/checkfree",
            "With a checkpoint every 20 iterations a rollback loses ≈ 10 iterations, about a CheckFree rebuild's fitted "
            "setback (12; 25 at an edge), so more faults do not widen the gap much. The 1.6× is a README figure whose "
            "checkpoint frequency is not confirmed from the paper text; the authors' replay also rolls back to the last "
            "100-iteration save under a flag, where a rollback costs ≈ 50 iterations.", presets,
        ),
        _up_to_claim(
            "C4", "redundant", "redundant computation", UP_TO_VS_REDUNDANT, high_redundant, "[B] gensyn.ai/articles/checkfree",
            redundant_why, presets,
        ),
    ]
    words = {"weighted": "gradient-weighted average (CheckFree)", "copy": "copy of a neighbour (ablation)", "random": "random re-initialisation (ablation)"}
    for index, (arm, paper) in enumerate(PAPER_PERPLEXITY_AFTER_10K.items(), start=5):
        claims.append(
            Claim(
                id=f"C{index}", claim=f"validation perplexity after 10k iterations, {words[arm]}",
                source="[C] CheckFree v1 plot_perplexity.py (the paper's ablation)", setting="500M, 16 %/h per stage",
                paper_value=paper, paper_text=f"{paper:.2f}", churnsim_value=perplexity[arm], churnsim_text=f"{perplexity[arm]:.2f}",
                comparison="input", preset="checkfree-500m-geo-16pct",
                why=(
                    "churnsim's setbacks are fitted to these three perplexities (calibration/paper_setbacks.py); the row "
                    "is the fit's round trip, exp of the mean loss after 10k iterations over its failure paths."
                ),
            )
        )
    layout_table = _layout_table(speedups)
    setup = (
        f"Presets {presets} (calibration/presets.py): the paper's model sizes, its emulated geo testbed's sites and links, "
        "every data-parallel replica of a stage failing with it as in the paper (pipeline.replicas_fail_together), "
        "checkpoints every 20 iterations to storage behind a 500 Mb/s WAN link, setbacks fitted to the paper's ablation.",
        f"{plan.replications} replications per setting, common random numbers across methods; speed-ups are paired "
        "ratios of times to target, averaged.",
        "Verdicts use the authors' layout, a separate (de)embedding node that never fails (pipeline.embedding_placement = "
        "'separate_node'); " + ("the speed-up table also shows churnsim's default layout." if len(plan.layouts) > 1 else "--quick runs it alone."),
    )
    notes = (
        "The paper's throughput and wall-clock model are not published (Blagoev et al., arXiv 2506.15461: hours to "
        "target, checkpoint frequency, redundant overhead and GPU type are not given in the paper text), so the speed-up "
        "claims are checked against churnsim's own wall-clock model of the authors' testbed.",
    )
    return Reproduction(
        paper="checkfree",
        title="CheckFree / CheckFree+ (arXiv 2506.15461): recovery without checkpoints",
        citation=CHECKFREE_PAPER,
        claims=tuple(claims),
        tables={"speedups": speedups, "speedups_by_layout": layout_table},
        setup=setup,
        notes=notes,
    )


def _layout_table(speedups: pd.DataFrame) -> pd.DataFrame:
    """Speed-ups of CheckFree and CheckFree+ side by side per layout (the README's comparison)."""
    if speedups.empty:
        return speedups
    # unstack (not pivot_table) keeps the rows where no speed-up exists (a method never reached the target).
    table = speedups.set_index(["model", "failure_probability_per_stage_hour", "method", "layout"])[
        ["speedup_vs_checkpoint", "speedup_vs_redundant"]
    ].unstack("layout")
    table.columns = [f"{value}_{layout}" for value, layout in table.columns]
    table = table.reset_index()
    order = {size: index for index, size in enumerate(SIZES)}
    return table.sort_values(["model", "failure_probability_per_stage_hour", "method"], key=lambda column: column.map(order) if column.name == "model" else column).reset_index(drop=True)


__all__ = ["CheckFreePlan", "QUICK_PLAN", "perplexity_round_trip", "reproduce_checkfree", "scenario_for", "tasks_for"]
