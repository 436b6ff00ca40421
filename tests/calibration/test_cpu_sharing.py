"""Span work in core-seconds: fair sharing of a run's cores among the compute spans open at once."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.cpu_sharing import core_seconds, cores_of_hardware, with_core_seconds, work_outside_spans


def test_spans_that_fit_on_the_cores_keep_their_wall_time():
    starts, ends = np.array([0.0, 0.5, 2.0]), np.array([1.0, 1.5, 3.0])
    assert core_seconds(starts, ends, cores=2) == pytest.approx([1.0, 1.0, 1.0])


def test_four_spans_on_two_cores_each_get_half_a_core():
    starts, ends = np.zeros(4), np.ones(4)
    assert core_seconds(starts, ends, cores=2) == pytest.approx([0.5] * 4)


def test_a_span_is_slowed_only_while_others_crowd_the_cores():
    # One core; the long span shares it with a second span during [1, 2): it does 1 + 0.5 + 1 = 2.5.
    starts, ends = np.array([0.0, 1.0]), np.array([3.0, 2.0])
    assert core_seconds(starts, ends, cores=1) == pytest.approx([2.5, 0.5])


def test_only_compute_spans_are_deflated_and_counted():
    spans = pd.DataFrame(
        dict(
            rank=[0, 1, 2],
            kind=["forward", "backward", "receive"],
            start_s=[0.0, 0.0, 0.0],
            end_s=[1.0, 1.0, 1.0],
        )
    )
    work = with_core_seconds(spans, cores=1)["work_s"].tolist()
    assert work == pytest.approx([0.5, 0.5, 1.0])  # waiting for a message is not work and takes no core
    assert with_core_seconds(spans, cores=None)["work_s"].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_cores_come_from_the_record_s_hardware_for_cpu_runs_only():
    assert cores_of_hardware({"cpu_count": "2"}, "cpu") == 2
    assert cores_of_hardware({"cpu_count": "2"}, "cuda") is None
    assert cores_of_hardware({}, "cpu") is None
    assert cores_of_hardware({"cpu_count": "many"}, "cpu") is None


def _spans(rows):
    return pd.DataFrame(rows, columns=["rank", "iteration", "kind", "start_s", "end_s"])


def test_a_waiting_process_leaves_the_core_to_the_others():
    spans = _spans([(0, 0, "forward", 0.0, 2.0), (1, 0, "receive", 0.0, 2.0), (1, 0, "forward", 2.0, 3.0)])
    assert with_core_seconds(spans, cores=1)["work_s"].tolist() == pytest.approx([2.0, 2.0, 1.0])


def test_a_process_between_its_spans_competes_for_the_cores():
    # Rank 1 computes nothing it records during [0, 2) but is not waiting either: its Python work
    # halves rank 0's core.
    spans = _spans([(0, 0, "forward", 0.0, 2.0), (1, 0, "send", 0.0, 0.1), (1, 0, "forward", 2.0, 3.0)])
    assert with_core_seconds(spans, cores=1)["work_s"].tolist()[0] == pytest.approx(1.0)


def test_work_outside_spans_is_a_step_s_busy_time_less_its_compute_and_waits():
    spans = _spans(
        [
            (0, 0, "forward", 0.0, 1.0),
            (0, 0, "receive", 1.5, 2.0),
            (0, 0, "forward", 2.0, 3.0),
            (0, 1, "forward", 4.0, 5.0),  # the step lasts until the next one begins
        ]
    )
    outside = work_outside_spans(spans, cores=1).set_index("iteration")["work_s"]
    assert outside[0] == pytest.approx(4.0 - 0.5 - 2.0)
    assert outside[1] == pytest.approx(0.0)
