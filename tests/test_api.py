"""The Python API builds the scenario the command line builds from the same methods and settings."""

from __future__ import annotations

from churnsim import api
from churnsim.jobs import ScenarioChoice


def test_the_api_and_the_command_line_configure_a_calibrated_preset_alike():
    settings = {"pipeline.num_stages": 6, "model.num_layers": 6}
    from_api = api._configured("cpu-tiny", methods=["checkpoint", "checkfree"], replications=2, settings=settings)
    # What `churnsim simulate --preset cpu-tiny --method checkpoint --method checkfree --replications 2 --set ...` runs.
    from_cli = ScenarioChoice("cpu-tiny", methods=("checkpoint", "checkfree"), settings=settings, replications=2).build()
    assert from_api == from_cli
    # The calibration's compute model for six stages, not the calibrated setup's four per-stage times.
    assert from_api.pipeline.num_stages == 6 and len(from_api.compute.block_forward_s) == 6
    assert [method.name for method in from_api.methods] == ["checkpoint", "checkfree"] and from_api.replications == 2


def test_the_api_runs_a_calibrated_preset_at_three_stages_without_checkfree_plus():
    result = api.simulate("cpu-tiny", methods=["checkpoint", "checkfree"], replications=2, settings={"pipeline.num_stages": 3, "model.num_layers": 6})
    assert sorted(result.summary["method"]) == ["checkfree", "checkpoint"]
    assert (result.summary["time_to_target_mean_s"] > 0).all()


def test_the_api_whatif_takes_settings_as_the_command_line_does():
    result = api.whatif(
        "checkfree-500m-geo-10pct", failure_rates=[0.1], methods=["none", "checkpoint"], replications=2, interval_study=False,
        settings={"pipeline.num_microbatches": 8},
    )
    assert any("carried to this scenario's 524,288" in note for note in result.notes)
    assert set(result.summary["method"]) == {"none", "checkpoint"}
