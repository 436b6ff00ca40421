"""Trace parsers: every shipped trace gives the statistics its README states; bad lines are named."""

from __future__ import annotations

import pytest

from churnsim.calibration.errors import InputError
from churnsim.calibration.traces import TraceEvent, load_trace, summarize_trace

P2_1E = "bamboo/aws-spot-instances-p2-xlarge-us-east-1e-2020-11-23-1700-to-2020-11-24-0700.csv"
P2_HOURS = "bamboo/aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv"
BUILTIN = [
    ("bamboo/p3-trace.csv", "bamboo_csv"),
    ("bamboo/gcloud-v100x1-east1c.txt", "gcloud_count"),
    ("parcae/gpt-1.5b_trace_hh_55_65.jsonl", "parcae_jsonl"),
    ("parcae/gpt-1.5b_trace_hl_15_25.jsonl", "parcae_jsonl"),
    ("bamboo/aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200.csv", "instance_count"),
    ("bamboo/aws-spot-instances-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530.csv", "instance_count"),
    (P2_1E, "instance_count"),
    (P2_HOURS, "instance_count_hours"),
]


def test_p3_trace_matches_its_published_statistics():
    trace = load_trace("bamboo/p3-trace.csv", "bamboo_csv")
    summary = summarize_trace(trace)
    assert summary.num_additions + summary.num_preemptions == 344  # one row per node event
    assert summary.num_preemptions == 167
    assert summary.max_nodes_alive == 32
    assert summary.max_removals_at_once == 6
    assert trace.end_s == 40920.0  # last row: 40920000,remove,node172
    assert summary.duration_h == pytest.approx(11.4, abs=0.05)
    assert summary.node_hours == pytest.approx(273, abs=0.5)
    assert summary.mean_nodes_alive == pytest.approx(24.0, abs=0.05)
    assert summary.preemptions_per_node_hour == pytest.approx(0.61, abs=0.005)
    assert summary.num_preemptions / summary.num_removal_events == pytest.approx(2.11, abs=0.005)
    assert trace.events[0] == TraceEvent(time_s=0.0, kind="add", count=trace.events[0].count)


def test_gcloud_trace_matches_its_published_statistics():
    summary = summarize_trace(load_trace("bamboo/gcloud-v100x1-east1c.txt", "gcloud_count"))
    # The README's "518 count decreases" are VMs lost: the sum of the decreases, over 55 decrease steps.
    assert summary.num_preemptions == 518
    assert summary.num_removal_events == 55
    assert summary.duration_h == pytest.approx(22.4, abs=0.05)
    assert summary.mean_nodes_alive == pytest.approx(76.0, abs=0.05)
    assert summary.preemptions_per_node_hour == pytest.approx(0.30, abs=0.005)
    assert summary.max_nodes_alive == 80


@pytest.mark.parametrize(
    ("name", "initial_nodes", "num_added_later", "num_removed"),
    [("parcae/gpt-1.5b_trace_hh_55_65.jsonl", 32, 16, 19), ("parcae/gpt-1.5b_trace_hl_15_25.jsonl", 27, 7, 11)],
)
def test_parcae_windows_match_their_published_counts(name, initial_nodes, num_added_later, num_removed):
    trace = load_trace(name, "parcae_jsonl")
    summary = summarize_trace(trace)
    assert trace.events[0] == TraceEvent(time_s=0.0, kind="add", count=initial_nodes)
    assert summary.num_additions - initial_nodes == num_added_later
    assert summary.num_preemptions == num_removed
    assert trace.end_s == 3600.0  # 60 lines of 60-s intervals


def test_instance_count_steps_become_exact_events():
    trace = load_trace(P2_1E, "instance_count")
    assert [(event.time_s, event.kind, event.count) for event in trace.events] == [
        (0.0, "add", 10),
        (41093.0, "remove", 1),
        (41885.0, "add", 1),
        (55744.0, "remove", 1),
        (55746.0, "add", 1),
        (68250.0, "remove", 1),
        (68252.0, "add", 1),
    ]
    assert trace.end_s == 68252.0


def test_instance_count_hours_format_converts_hours_to_seconds():
    trace = load_trace(P2_HOURS, "instance_count_hours")
    assert trace.end_s == pytest.approx(88.695 * 3600.0)
    # Rows 2-3 of the file: "0.030,0" then "0.030,9"
    assert trace.events[0] == TraceEvent(time_s=pytest.approx(0.030 * 3600.0), kind="add", count=9)


@pytest.mark.parametrize(("name", "format"), BUILTIN)
def test_builtin_traces_are_time_ordered_and_never_go_negative(name, format):
    trace = load_trace(name, format)
    times = [event.time_s for event in trace.events]
    assert times == sorted(times)
    assert min(trace.alive_after_each_event()) >= 0
    assert all(event.count > 0 for event in trace.events)
    assert trace.end_s >= times[-1]


def test_bamboo_parser_accepts_crlf_and_merges_simultaneous_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"0,add,a\r\n0,add,b\r\n0,add,c\r\n60000,remove,a\r\n60000,remove,c\r\n120000,add,d\r\n")
    trace = load_trace(path, "bamboo_csv")
    assert trace.events == (
        TraceEvent(time_s=0.0, kind="add", count=3),
        TraceEvent(time_s=60.0, kind="remove", count=2),
        TraceEvent(time_s=120.0, kind="add", count=1),
    )
    assert trace.alive_at(60.0) == 3 and trace.alive_at(60.001) == 1


def test_gcloud_parser_keeps_first_of_each_run_and_clamps_backward_steps(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text(
        "2021-12-10, 13:00:00, 5\n"
        "2021-12-10, 13:01:00, 5\n"  # repeat: dropped
        "2021-12-10, 13:02:00, 3\n"
        "2021-12-10, 13:01:30, 4\n"  # kept, but earlier than the previous kept sample: clamped to 120 s
        "2021-12-10, 13:05:00, 4\n"
    )
    trace = load_trace(path, "gcloud_count")
    assert trace.events == (
        TraceEvent(time_s=0.0, kind="add", count=5),
        TraceEvent(time_s=120.0, kind="remove", count=2),
        TraceEvent(time_s=120.0, kind="add", count=1),
    )
    assert trace.end_s == 120.0  # the last kept sample, as the trace README measures the span


@pytest.mark.parametrize(
    ("format", "text", "line", "complaint"),
    [
        ("bamboo_csv", "0,add,a\n60000,explode,a\n", 2, "neither 'add' nor 'remove'"),
        ("bamboo_csv", "0,add,a\n60000,remove\n", 2, "expected 3 fields"),
        ("bamboo_csv", "0,add,a\nsoon,remove,a\n", 2, "not a number"),
        ("bamboo_csv", "0,add,a\n60000,remove,b\n", 2, "not alive"),
        ("bamboo_csv", "0,add,a\n0,add,a\n", 2, "already alive"),
        ("bamboo_csv", "60000,add,a\n0,add,b\n", 2, "sort the file"),
        ("parcae_jsonl", '[0, "add", {"nodes": ["a"]}]\n{oops\n', 2, "not valid JSON"),
        ("parcae_jsonl", '[0, "add", {"nodes": ["a"]}]\n[60000, "remove", {"nodes": ["b"]}]\n', 2, "not alive"),
        ("parcae_jsonl", '[0, "grow", {"nodes": ["a"]}]\n', 1, "'no-op'"),
        ("instance_count", "0,4\n10,-1\n", 2, "negative"),
        ("instance_count", "0,4\n10\n", 2, "expected 2 fields"),
        ("instance_count", "0,4\n10,2.5\n", 2, "whole number"),
        ("gcloud_count", "2021-12-10, 13:00:00, 5\n2021-12-10, 25:00:00, 4\n", 2, "HH:MM:SS"),
    ],
)
def test_malformed_lines_raise_input_error_naming_file_and_line(tmp_path, format, text, line, complaint):
    path = tmp_path / "bad.trace"
    path.write_text(text)
    with pytest.raises(InputError) as raised:
        load_trace(path, format)
    message = str(raised.value)
    assert str(path) in message
    assert f"line {line}:" in message
    assert complaint in message


def test_empty_trace_is_rejected(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("\n\n")
    with pytest.raises(InputError, match="no records"):
        load_trace(path, "bamboo_csv")


def test_unknown_format_names_the_allowed_ones():
    with pytest.raises(InputError, match="bamboo_csv"):
        load_trace("bamboo/p3-trace.csv", "csv")
