"""The validator replays a real data-parallel run: its failures name replicas, its D and
`while_replica_missing` come from the record, and the prediction heals a lost replica and sends a
lost stage to the method (its `handled_as` is the method's own recovery, here a rollback)."""

from __future__ import annotations

import math

import pytest

from churnsim.calibration.builtin import load_builtin_calibration
from churnsim.calibration.fit_timing import fit_allreduce, fit_replica_heal
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.run_record import read_run_record
from churnsim.real.launch import launch_local
from churnsim.real.model import MODEL_PRESETS
from churnsim.real.trainer import TrainingConfig
from churnsim.sim.checks.validate import validate_record

# (step, stage, replica): a replica of stage 1 lost (healed from its survivor), then both replicas of stage 0 (a stage loss).
FAILURES = ((3, 1, 1), (6, 0, 0), (6, 0, 1))


@pytest.fixture(scope="module")
def data_parallel_record(tmp_path_factory):
    config = TrainingConfig(
        model=MODEL_PRESETS["tiny"], num_stages=2, data_parallel_degree=2, num_microbatches=2, microbatch_size=2, num_iterations=10,
        seed=3, method=method_from_name("checkpoint", interval_iterations=2), failures=FAILURES, corpus_max_bytes=200_000, timeout_s=120,
        num_threads=1,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("dp") / "run"
    launch_local(config, run_dir=directory)
    return read_run_record(directory)


def test_a_real_2x2_run_is_predicted_with_a_finite_error_and_both_a_heal_and_a_stage_loss(data_parallel_record):
    record = data_parallel_record
    pipeline = record.manifest.real_settings.pipeline
    assert (pipeline.num_stages, pipeline.data_parallel_degree, pipeline.while_replica_missing) == (2, 2, "wait")
    assert sorted((failure.stage, failure.replica) for failure in record.failures.failures) == [(0, 0), (0, 1), (1, 1)]
    builtin = load_builtin_calibration("cpu-tiny")[0]
    # The built-in calibration's machine taken as this one, with the all-reduce and heal fitted from the run itself.
    calibration = builtin.model_copy(
        update={
            "provenance": builtin.provenance.model_copy(update={"hardware": dict(record.manifest.hardware)}),
            "allreduce": fit_allreduce([record]),
            "replica_heal": fit_replica_heal([record]),
        }
    )
    assert calibration.allreduce is not None and calibration.replica_heal is not None
    validation = validate_record(record, calibration)
    wall = validation.rows.set_index("quantity").loc["total_wall_clock_s"]
    assert wall["measured"] > 0 and math.isfinite(wall["relative_error"])
    assert not any("measured no data-parallel all-reduce" in note for note in validation.notes)
    without = validate_record(record, calibration.model_copy(update={"allreduce": None}))
    assert any("measured no data-parallel all-reduce" in note for note in without.notes)
    handled = validation.predicted_handled_as
    # Stage 1's lost replica heals; of stage 0's two nodes lost at one boundary, the first starts a
    # heal that the second abandons: the stage is lost and goes to the method (checkpoint: a rollback).
    assert len(handled) == 3 and handled[0] == "replica_heal" and handled[-1] == "rollback"
