"""The pipelined run equals a single-process reference; the operation orders cannot deadlock."""

from __future__ import annotations

import math

import pytest
import torch

from churnsim.calibration.errors import InputError
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.pipeline_schedule import swapped_block_order
from churnsim.real.distributed import Communicator
from churnsim.real.launch import launch_local, run_distributed
from churnsim.real.model import MODEL_PRESETS, StageModule, Transformer, reference_parameter_name
from churnsim.real.pipeline import PipelineStage, message_flow_completes, pair_orders_agree
from churnsim.real.spans import SpanRecorder
from churnsim.real.trainer import TrainingConfig

CONFIG = MODEL_PRESETS["tiny"]
NUM_STAGES = 4
NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 2
SEED = 5
CASES = (("gpipe", False), ("1f1b", False), ("gpipe", True), ("1f1b", True))


def _microbatches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(123)
    tokens = torch.randint(0, CONFIG.vocab_size, (NUM_MICROBATCHES, MICROBATCH_SIZE, CONFIG.seq_len + 1), generator=generator)
    return [t[:, :-1] for t in tokens], [t[:, 1:] for t in tokens]


def _one_iteration_per_case(communicator: Communicator) -> dict:
    """Worker: one pipelined iteration per (schedule, swap) case; returns loss and gradients."""
    torch.set_num_threads(1)
    stage, last = communicator.rank, NUM_STAGES - 1
    inputs, targets = _microbatches()
    results = {}
    for schedule, swap in CASES:
        module = StageModule(CONFIG, stage, NUM_STAGES, seed=SEED)
        spans = SpanRecorder(rank=stage, stage=stage)
        hops_seen: list[tuple[int, int]] = []
        pipeline = PipelineStage(
            module=module,
            communicator=communicator,
            spans=spans,
            schedule=schedule,
            num_microbatches=NUM_MICROBATCHES,
            microbatch_size=MICROBATCH_SIZE,
            swap_odd_microbatches=swap,
            after_forward_hop=lambda *, microbatch, hop_index, **_: hops_seen.append((microbatch, hop_index)),
        )
        loss = pipeline.run_iteration(0, inputs=inputs if stage == 0 else None, targets=targets if stage == last else None)
        results[(schedule, swap)] = {
            "loss": loss,
            "gradients": {name: p.grad.clone() for name, p in module.named_parameters()},
            "span_kinds": {row["kind"] for row in spans.rows},
            "hops_seen": hops_seen,
            "forward_operations": [(o.microbatch, o.hop_index) for o in pipeline.operations if o.direction == "forward"],
        }
    return results


@pytest.fixture(scope="module")
def pipelined() -> list[dict]:
    return run_distributed(_one_iteration_per_case, NUM_STAGES, timeout_s=60)


def _reference(swap: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = Transformer(CONFIG, seed=SEED)
    inputs, targets = _microbatches()
    total = torch.zeros(())
    for m, (x, y) in enumerate(zip(inputs, targets)):
        order = swapped_block_order(NUM_STAGES) if swap and m % 2 == 1 else None
        total = total + model.loss(x, y, num_stages=NUM_STAGES, stage_order=order) / NUM_MICROBATCHES
    total.backward()
    return float(total.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("schedule", "swap"), CASES)
def test_pipelined_loss_and_gradients_equal_single_process_reference(pipelined, schedule, swap):
    expected_loss, expected_gradients = _reference(swap)
    case = (schedule, swap)
    assert pipelined[-1][case]["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert all(rank_result[case]["loss"] is None for rank_result in pipelined[:-1])
    checked = set()
    for stage, rank_result in enumerate(pipelined):
        for name, gradient in rank_result[case]["gradients"].items():
            reference_name = reference_parameter_name(name, stage=stage, num_stages=NUM_STAGES, num_layers=CONFIG.num_layers)
            torch.testing.assert_close(gradient, expected_gradients[reference_name], msg=f"{case} {reference_name}")
            checked.add(reference_name)
    assert checked == set(expected_gradients)


def test_swapped_routes_change_the_loss(pipelined):
    # Guards the test above against a reference that ignores the swap.
    assert pipelined[-1][("gpipe", True)]["loss"] != pytest.approx(pipelined[-1][("gpipe", False)]["loss"], rel=1e-9)


def test_every_stage_records_forward_backward_send_and_receive_spans(pipelined):
    for rank_result in pipelined:
        assert {"forward", "backward", "send", "receive"} <= rank_result[("1f1b", False)]["span_kinds"]


def test_after_forward_hop_hook_sees_every_forward_hop_in_operation_order(pipelined):
    for rank_result in pipelined:
        for case in CASES:
            assert rank_result[case]["hops_seen"] == rank_result[case]["forward_operations"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("swap", [False, True])
def test_operation_orders_never_deadlock_with_nonblocking_sends(schedule, swap):
    for num_stages in range(4 if swap else 1, 9):
        for num_microbatches in range(1, 10):
            assert message_flow_completes(
                schedule, num_stages=num_stages, num_microbatches=num_microbatches, swap_odd_microbatches=swap
            ), (schedule, num_stages, num_microbatches, swap)


def test_in_order_routes_send_and_receive_in_the_same_order_per_pair():
    # NCCL matches messages by issue order; the swapped 1F1B case is handled by receiving in sender order.
    for schedule in ("gpipe", "1f1b"):
        for num_stages in range(1, 7):
            for num_microbatches in range(1, 7):
                assert pair_orders_agree(
                    schedule, num_stages=num_stages, num_microbatches=num_microbatches, swap_odd_microbatches=False
                )
    assert not pair_orders_agree("1f1b", num_stages=4, num_microbatches=4, swap_odd_microbatches=True)


def test_launch_local_writes_a_readable_run_record(tmp_path):
    from churnsim.calibration.run_record import METRICS_COLUMNS, read_run_record  # pandas: not in the workers

    config = TrainingConfig(
        model=CONFIG,
        num_stages=2,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=4,
        seed=3,
        schedule="gpipe",
        method=method_from_name("none"),
        failures=((2, 1),),
        eval_interval_iterations=2,
        corpus_max_bytes=200_000,
        timeout_s=60,
    )
    result = launch_local(config, run_dir=tmp_path / "run")
    record = read_run_record(tmp_path / "run")
    assert list(record.metrics.columns) == list(METRICS_COLUMNS)
    assert record.metrics["step"].tolist() == [0, 1, 2, 3]
    assert all(math.isfinite(loss) for loss in record.metrics["train_loss"])
    assert record.metrics["eval_loss"].notna().tolist() == [False, True, False, True]
    assert record.metrics["wall_time_s"].is_monotonic_increasing
    assert [(f.iteration, f.stage) for f in record.failures.failures] == [(2, 1)]
    assert set(record.spans["stage"]) == {0, 1}
    assert result.recoveries[0]["rebuilt_from"] == {1: "kept (failure ignored)"}


def test_training_config_round_trips_through_a_plain_dict():
    config = TrainingConfig(
        model=CONFIG,
        num_stages=4,
        num_microbatches=2,
        microbatch_size=2,
        num_iterations=3,
        seed=1,
        method=method_from_name("checkfree", lr_scale=1.2),
        failures=((1, 2),),
    )
    assert TrainingConfig.from_dict(config.to_dict()) == config


def test_training_config_rejects_impossible_runs():
    common = dict(model=CONFIG, num_microbatches=2, microbatch_size=2, num_iterations=3, seed=1)
    with pytest.raises(InputError, match=r"num_stages 8 .* num_layers 4"):
        TrainingConfig(num_stages=8, **common)
    with pytest.raises(InputError, match="stage 4"):
        TrainingConfig(num_stages=4, failures=((1, 4),), **common)
    with pytest.raises(InputError, match="unknown training config keys"):
        TrainingConfig.from_dict({**TrainingConfig(num_stages=2, **common).to_dict(), "colour": "red"})


def test_a_span_stamps_the_process_cpu_clock_and_a_hand_timed_one_does_not():
    import time

    spans = SpanRecorder(rank=0, stage=0)
    with spans.span("forward"):
        finish = time.perf_counter() + 0.05
        while time.perf_counter() < finish:  # computes: uses CPU for as long as it has a core
            pass
    with spans.span("receive"):
        time.sleep(0.05)  # waits: uses (almost) no CPU
    spans.add("recovery.join", 0, None, 0.0, 1.0)
    computing, waiting, by_hand = spans.rows
    computing_cpu_s = computing["cpu_end_s"] - computing["cpu_start_s"]
    waiting_cpu_s = waiting["cpu_end_s"] - waiting["cpu_start_s"]
    # The clock counts every thread of this process, so the bounds leave room for other threads.
    assert waiting_cpu_s < 0.5 * (waiting["end_s"] - waiting["start_s"])
    assert computing_cpu_s > 3 * waiting_cpu_s
    assert waiting["cpu_start_s"] >= computing["cpu_end_s"]  # one clock, running on
    assert math.isnan(by_hand["cpu_start_s"]) and math.isnan(by_hand["cpu_end_s"])
