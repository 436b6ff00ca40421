"""Synthetic real-run records of the built-in `cpu-tiny` calibration's machine, built in code (no torch):
for the validator's tests of failure modes and setups."""

from __future__ import annotations

import math

from churnsim.calibration.builtin import load_builtin_calibration
from churnsim.calibration.failures import ScheduledFailure
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.run_record import RealRunSettings, RunManifest, make_run_record
from churnsim.calibration.scenario import ModelSpec, PipelineSpec, Scenario

CALIBRATION = load_builtin_calibration("cpu-tiny")[0]
STEADY_S = 0.075
JOIN_DELAY_S = 0.05
PROCESS_START_S = 0.012
RENDEZVOUS_S = 0.011
SOFT_JOIN_S = 0.001
TRANSFER_S = 0.002
FAILURES = ((10, 1), (25, 2))
NUM_STEPS = 40


def real_record(
    run_id: str, *, hard: bool, say_mode: bool = True, failures=FAILURES, process_start_s: float = PROCESS_START_S,
    model: ModelSpec | None = None, pipeline: PipelineSpec | None = None, scenario: Scenario | None = None,
):
    """A checkfree run (of the calibrated setup unless `model` or `pipeline` say otherwise): steady
    steps of STEADY_S, and per failure its recovery spans (hard: the replacement's join from the
    kill, then every rank's rendezvous; soft: the reset in place) and a transfer, the step lasting
    that much longer."""
    model = model or CALIBRATION.model
    pipeline = pipeline or CALIBRATION.pipeline
    num_stages = pipeline.num_stages
    failed = dict(failures)
    spans, metrics, failure_rows, wall_s = [], [], [], 0.0
    for step in range(NUM_STEPS):
        start = wall_s
        if step in failed:
            stage = failed[step]
            failure_rows.append(ScheduledFailure(time_s=wall_s, iteration=step, stage=stage, kind="stage_failure"))
            join_s = JOIN_DELAY_S + process_start_s if hard else SOFT_JOIN_S
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="recovery.join", microbatch=None, start_s=start, end_s=start + join_s))
            start += join_s
            if hard:
                for rank in range(num_stages):
                    spans.append(dict(rank=rank, stage=rank, iteration=step, kind="recovery.rendezvous", microbatch=None, start_s=start, end_s=start + RENDEZVOUS_S))
                start += RENDEZVOUS_S
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="recovery.transfer", microbatch=None, start_s=start, end_s=start + TRANSFER_S))
            start += TRANSFER_S
        for stage in range(num_stages):
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="forward", microbatch=0, start_s=start, end_s=start + 0.01))
            spans.append(dict(rank=stage, stage=stage, iteration=step, kind="backward", microbatch=0, start_s=start + 0.01, end_s=start + 0.03))
        wall_s = start + STEADY_S
        loss = 5.0 / math.sqrt(step + 1)
        metrics.append(dict(step=step, iteration=step, wall_time_s=wall_s, train_loss=loss, eval_loss=loss if step == NUM_STEPS - 1 else math.nan))
    settings = RealRunSettings(
        model=model, pipeline=pipeline, method=method_from_name("checkfree"), num_iterations=NUM_STEPS,
        learning_rate=1e-3, eval_every_iterations=NUM_STEPS, device="cpu",
        failure_mode=("hard" if hard else "soft") if say_mode else None, join_delay_s=JOIN_DELAY_S if hard and say_mode else None,
    )  # fmt: skip
    manifest = RunManifest(run_id=run_id, source="real", method="checkfree", seed=0, real_settings=settings, scenario=scenario)
    return make_run_record(manifest, metrics, spans, failure_rows)


