"""Setback uncertainty in simulated replications: wider intervals, same failures, reproducible draws."""

from __future__ import annotations

import pandas as pd
import pytest

from churnsim.calibration.presets import checkfree_500m_geo
from churnsim.sim.studies.replicate import ReplicationTask, run_replication, run_replications, runs_table, summary_table
from churnsim.sim.studies.outputs import scenario_notes

NUM_REPLICATIONS = 6


def checkfree_at_10pct(*, sample_setbacks: bool, seed: int = 0):
    scenario = checkfree_500m_geo(0.10)
    return scenario.model_copy(
        update={
            "methods": tuple(method for method in scenario.methods if method.name in ("redundant", "checkfree")),
            "replications": NUM_REPLICATIONS,
            "seed": seed,
            "convergence": scenario.convergence.model_copy(update={"sample_setbacks": sample_setbacks}),
            # The paper's emulator: a stage's replicas fail together, so every failure is a stage loss.
            "pipeline": scenario.pipeline.model_copy(update={"replicas_fail_together": True}),
        }
    )


def summary_and_runs(scenario) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs = runs_table(scenario, run_replications(scenario))
    return summary_table(runs).set_index("method"), runs


def test_setback_uncertainty_widens_the_time_to_target_and_speedup_intervals():
    with_uncertainty, runs = summary_and_runs(checkfree_at_10pct(sample_setbacks=True))
    at_the_means, fixed_runs = summary_and_runs(checkfree_at_10pct(sample_setbacks=False))

    def width(summary, low, high):
        return summary.at["checkfree", high] - summary.at["checkfree", low]

    assert width(with_uncertainty, "time_to_target_ci95_low_s", "time_to_target_ci95_high_s") > 2 * width(
        at_the_means, "time_to_target_ci95_low_s", "time_to_target_ci95_high_s"
    )
    assert width(with_uncertainty, "speedup_vs_redundant_ci95_low", "speedup_vs_redundant_ci95_high") > 2 * width(
        at_the_means, "speedup_vs_redundant_ci95_low", "speedup_vs_redundant_ci95_high"
    )
    # The runs table says what each run charged: a different draw per replication, or the mean.
    drawn = runs.loc[runs["method"] == "checkfree", "setback_interior_iterations"]
    assert drawn.nunique() == NUM_REPLICATIONS
    assert set(fixed_runs.loc[fixed_runs["method"] == "checkfree", "setback_interior_iterations"]) == {
        checkfree_500m_geo().convergence.setbacks["checkfree"].interior.mean_iterations
    }
    assert runs.loc[runs["method"] == "redundant", "setback_interior_iterations"].isna().all()
    assert set(runs["setback_source"]) == {"paper_fitted"} and set(with_uncertainty["setback_source"]) == {"paper_fitted"}
    # Methods without setbacks are untouched by the draws.
    assert with_uncertainty.at["redundant", "time_to_target_mean_s"] == at_the_means.at["redundant", "time_to_target_mean_s"]


def test_replications_with_drawn_setbacks_are_reproducible_and_keep_the_failure_path():
    scenario = checkfree_at_10pct(sample_setbacks=True)
    task = ReplicationTask(scenario=scenario, replication=2, methods=scenario.methods)
    first, second = run_replication(task), run_replication(task)
    assert [(r.wall_clock_s, r.progress_iterations, r.failures) for r in first] == [(r.wall_clock_s, r.progress_iterations, r.failures) for r in second]
    fixed = checkfree_at_10pct(sample_setbacks=False)
    (checkfree_drawn,) = [r for r in first if r.method == "checkfree"]
    (checkfree_fixed,) = [r for r in run_replication(ReplicationTask(scenario=fixed, replication=2, methods=fixed.methods)) if r.method == "checkfree"]
    assert checkfree_drawn.wall_clock_s != checkfree_fixed.wall_clock_s
    # Same failure path: the shorter run saw the first failures of the longer one.
    shorter, longer = sorted((checkfree_drawn, checkfree_fixed), key=lambda run: len(run.failures))
    assert [(f.time_s, f.stage) for f in shorter.failures] == [(f.time_s, f.stage) for f in longer.failures[: len(shorter.failures)]]
    # Another seed draws other setbacks.
    reseeded = checkfree_at_10pct(sample_setbacks=True, seed=1)
    other = run_replication(ReplicationTask(scenario=reseeded, replication=2, methods=reseeded.methods))
    assert [r.wall_clock_s for r in other] != [r.wall_clock_s for r in first]


def test_notes_name_the_setback_source_and_the_run_notes_the_values_charged():
    scenario = checkfree_at_10pct(sample_setbacks=True)
    (note, *_) = scenario_notes(scenario)
    assert "CheckFree paper's ablation" in note and "each replication draws" in note
    results = run_replication(ReplicationTask(scenario=scenario, replication=0, methods=scenario.methods))
    (checkfree,) = [r for r in results if r.method == "checkfree"]
    (charged,) = [n for n in checkfree.notes if n.startswith("convergence setbacks")]
    drawn = runs_table(scenario, results).set_index("method").at["checkfree", "setback_interior_iterations"]
    assert f"{drawn:.3g} (interior)" in charged and "CheckFree paper's ablation" in charged
    assert not any(n.startswith("convergence setbacks") for r in results if r.method == "redundant" for n in r.notes)


@pytest.mark.parametrize("field", ["sample_setbacks", "setback_source"])
def test_setback_fields_can_be_set_like_any_scenario_field(field):
    from churnsim.calibration.scenario_overrides import apply_settings

    value = {"sample_setbacks": False, "setback_source": "default"}[field]
    changed = apply_settings(checkfree_at_10pct(sample_setbacks=True), {f"convergence.{field}": value})
    assert getattr(changed.convergence, field) == value


def test_a_setback_that_grows_with_progress_is_noted_and_tabled_as_it_grows():
    """The convergence lab's setbacks are 0 early and grow past an offset: a run's note and its runs
    row give the growth, not only the constant part (which alone read "0 (interior), 0 (edge)")."""
    from churnsim.calibration.presets import preset

    scenario = preset("cpu-tiny", {"replications": 1, "convergence.setback_scale": 2.0}, methods=("checkfree",))
    interior = scenario.convergence.setbacks["checkfree"].interior
    assert interior.mean_iterations == 0 and interior.per_progress_iteration > 0  # the lab's shape, as shipped
    results = run_replication(ReplicationTask(scenario=scenario, replication=0, methods=scenario.methods))
    (charged,) = [n for n in results[0].notes if n.startswith("convergence setbacks")]
    row = runs_table(scenario, results).iloc[0]
    drawn_slope = row["setback_interior_per_progress_iteration"]
    assert row["setback_interior_iterations"] == 0
    # The replication's draw of the slope, scaled ×2, lies in twice the slope's interval.
    assert 2 * interior.per_progress_ci95_low <= drawn_slope <= 2 * interior.per_progress_ci95_high
    assert f"{drawn_slope:.3g} per iteration of progress past {interior.progress_offset_iterations:.0f} (interior)" in charged
    assert "in iterations per rebuilt stage" in charged
