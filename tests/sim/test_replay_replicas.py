"""A run record's failures replay on the nodes they struck: the replica travels with the stage."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from churnsim.calibration.failure_sampling import FailureEvent
from churnsim.calibration.failures import FailureSchedule, ScheduledFailure
from churnsim.sim.model.calibrated import replay_failures


def test_replayed_failures_keep_their_replica():
    metrics = pd.DataFrame({"step": [0, 1, 2, 3], "wall_time_s": [1.0, 2.0, 3.0, 4.0]})
    failures = FailureSchedule(
        failures=(
            ScheduledFailure(time_s=2.5, iteration=2, stage=1, kind="failure", replica=1),
            ScheduledFailure(iteration=3, stage=0, kind="failure"),
        )
    )
    record = SimpleNamespace(metrics=metrics, failures=failures)
    assert replay_failures(record) == (
        FailureEvent(time_s=2.5, stage=1, replica=1, kind="failure"),
        FailureEvent(time_s=3.0, stage=0, replica=0, kind="failure"),
    )
