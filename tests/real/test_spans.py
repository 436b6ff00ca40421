"""SpanRecorder: host timing on CPU, CUDA-event timing of compute and waits on CUDA.

No GPU runs here: the CUDA path is exercised with a stand-in for torch.cuda.Event on a simulated
device timeline (a queue of work that completes in order), which is what the recorder relies on:
events complete in stream order and `elapsed_time` gives milliseconds between two of them. Whether
real CUDA events behave so is for benchmarks/gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import time

import pytest
import torch

from churnsim.real.spans import EVENT_TIMED_SPAN_KINDS, SpanRecorder


class DeviceTimeline:
    """One stream: work is queued with `launch(seconds)`; `run_until_idle` completes it in order."""

    def __init__(self) -> None:
        self.device_s = 0.0  # the device's own clock
        self.queue: list[tuple[str, object]] = []  # ("work", seconds) or ("event", event)
        self.device_synchronizations = 0

    def launch(self, seconds: float) -> None:
        self.queue.append(("work", seconds))

    def run_until(self, event: "FakeEvent | None") -> None:
        while self.queue:
            what, item = self.queue.pop(0)
            if what == "work":
                self.device_s += item  # type: ignore[operator]
            else:
                item.completed_at_s = self.device_s  # type: ignore[union-attr]
                if item is event:
                    return

    def synchronize_device(self) -> None:
        self.device_synchronizations += 1
        self.run_until(None)


class FakeEvent:
    def __init__(self, timeline: DeviceTimeline) -> None:
        self.timeline = timeline
        self.completed_at_s: float | None = None
        self.synchronized = 0

    def record(self) -> None:
        self.timeline.queue.append(("event", self))

    def query(self) -> bool:
        return self.completed_at_s is not None

    def synchronize(self) -> None:
        self.synchronized += 1
        if self.completed_at_s is None:
            self.timeline.run_until(self)

    def elapsed_time(self, end_event: "FakeEvent") -> float:
        assert self.completed_at_s is not None and end_event.completed_at_s is not None, "elapsed_time of an incomplete event"
        return (end_event.completed_at_s - self.completed_at_s) * 1000.0


def recorder_on(timeline: DeviceTimeline) -> SpanRecorder:
    return SpanRecorder(rank=1, stage=1, device=torch.device("cuda", 0), make_event=lambda: FakeEvent(timeline),
                        synchronize_device=timeline.synchronize_device)


def test_on_cpu_spans_are_host_times_and_rows_are_there_at_once():
    spans = SpanRecorder(rank=0, stage=0)
    spans.step = 3
    with spans.span("forward", microbatch=1):
        time.sleep(0.02)
    assert len(spans._rows) == 1  # no deferral on CPU
    (row,) = spans.rows
    assert row["kind"] == "forward" and row["iteration"] == 3 and row["microbatch"] == 1
    assert row["end_s"] - row["start_s"] >= 0.02
    assert row["end_s"] <= spans.now_s()


def test_on_cuda_a_compute_span_times_its_own_kernels_not_the_work_queued_before_it():
    timeline = DeviceTimeline()
    spans = recorder_on(timeline)
    spans.restart_clock()  # anchors the device clock at the origin
    anchor_s = spans._anchor.seconds
    spans.step = 5
    timeline.launch(0.5)  # earlier work on the stream (a copy, an NCCL receive the stream waits for)
    with spans.span("forward", microbatch=2):
        timeline.launch(0.25)  # the forward's kernels
    with spans.span("backward", microbatch=2):
        timeline.launch(0.75)
    # Nothing waited for the device: the spans are pending until their events complete.
    assert spans._rows == [] and timeline.device_synchronizations == 0
    end_of_iteration_s = spans.now_s()  # the trainer's end of an iteration: waits for one event
    assert timeline.device_synchronizations == 0
    forward, backward = spans._rows
    assert forward["kind"] == "forward" and forward["iteration"] == 5 and forward["microbatch"] == 2
    assert forward["start_s"] == pytest.approx(anchor_s + 0.5)
    assert forward["end_s"] - forward["start_s"] == pytest.approx(0.25)
    assert backward["start_s"] == pytest.approx(forward["end_s"])
    assert backward["end_s"] - backward["start_s"] == pytest.approx(0.75)
    assert end_of_iteration_s >= anchor_s


def test_on_cuda_reading_the_rows_waits_for_spans_still_on_the_device():
    timeline = DeviceTimeline()
    spans = recorder_on(timeline)
    spans.restart_clock()
    with spans.span("receive"):
        timeline.launch(0.125)
    with spans.span("optimizer"):
        timeline.launch(0.0625)
    rows = spans.rows  # what the journal and the results read
    assert [row["kind"] for row in rows] == ["receive", "optimizer"]
    assert [row["end_s"] - row["start_s"] for row in rows] == pytest.approx([0.125, 0.0625])
    assert timeline.device_synchronizations == 0


def test_on_cuda_host_work_keeps_wall_clock_times_with_the_device_synchronised():
    timeline = DeviceTimeline()
    spans = recorder_on(timeline)
    spans.restart_clock()
    assert "recovery.transfer" not in EVENT_TIMED_SPAN_KINDS
    with spans.span("recovery.transfer"):
        timeline.launch(10.0)  # device seconds do not set a host span's length
        time.sleep(0.02)
    (row,) = spans.rows
    assert timeline.device_synchronizations == 2  # at both ends
    assert 0.02 <= row["end_s"] - row["start_s"] < 10.0


def test_on_cuda_spans_recorded_before_the_clock_restarts_keep_their_anchor():
    timeline = DeviceTimeline()
    spans = recorder_on(timeline)
    with spans.span("forward"):  # before the run's barrier: anchors on first use
        timeline.launch(0.25)
    spans.restart_clock()
    (row,) = spans._rows  # resolved before the origin moved
    assert row["end_s"] - row["start_s"] == pytest.approx(0.25)


def test_on_cuda_a_span_left_by_an_error_keeps_host_times_and_waits_for_no_event():
    timeline = DeviceTimeline()
    spans = recorder_on(timeline)
    spans.restart_clock()
    with pytest.raises(ConnectionError):
        with spans.span("receive"):
            timeline.launch(1000.0)  # a receive from a peer that died: the device never gets past it
            time.sleep(0.01)
            raise ConnectionError("peer gone")
    (row,) = spans._rows  # recorded at once, without waiting for the device
    assert row["kind"] == "receive" and 0.01 <= row["end_s"] - row["start_s"] < 1000.0
    assert timeline.device_s == 0.0 and timeline.device_synchronizations == 0
