"""Calibration of data parallelism: the all-reduce and the heal fitted from data-parallel run records,
and applied only to scenarios with D > 1."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from churnsim.calibration.apply import apply_calibration
from churnsim.calibration.builtin import builtin_calibration_path
from churnsim.calibration.calibration_file import LinkProfile, load_calibration
from churnsim.calibration.fit_timing import fit_allreduce, fit_replica_heal
from churnsim.calibration.methods import method_from_name
from churnsim.calibration.presets import preset
from churnsim.calibration.run_record import RealRunSettings, RunManifest, make_run_record
from churnsim.calibration.scenario import ModelSpec, PipelineSpec
from churnsim.sim.model.run import simulate_run

LATENCY_S = 2e-4
BANDWIDTH_BYTES_PER_S = 5e8
HEAL_LATENCY_S = 1e-3
HEAL_BANDWIDTH_BYTES_PER_S = 2e8
NOISE_SIGMA = 0.03  # lognormal shape of span durations


def _record(degree: int, gradient_bytes: tuple[int, ...], heal_bytes: tuple[int, ...] = (), *, seed: int = 0, num_iterations: int = 30):
    """A real-run record of `len(gradient_bytes)` stages × `degree` replicas whose `allreduce` spans take
    the ring all-reduce's time (2(D-1) latencies + 2(D-1)/D of the bytes over the bandwidth) and whose
    `recovery.heal` spans take latency + bytes / bandwidth, each with a little noise."""
    rng = np.random.default_rng([seed, degree])
    num_stages = len(gradient_bytes)
    spans, metrics, wall_s = [], [], 0.0
    for step in range(num_iterations):
        for stage, size in enumerate(gradient_bytes):
            for replica in range(degree):
                seconds = 2 * (degree - 1) * LATENCY_S + 2 * (degree - 1) / degree * size / BANDWIDTH_BYTES_PER_S
                seconds *= np.exp(NOISE_SIGMA * rng.standard_normal())
                spans.append(dict(rank=replica * num_stages + stage, stage=stage, iteration=step, kind="allreduce", microbatch=None,
                                  start_s=wall_s, end_s=wall_s + seconds, replica=replica, bytes=size))
        wall_s += 0.1
        metrics.append(dict(step=step, iteration=step, wall_time_s=wall_s, train_loss=3.0, eval_loss=float("nan")))
    for index, size in enumerate(heal_bytes):
        seconds = (HEAL_LATENCY_S + size / HEAL_BANDWIDTH_BYTES_PER_S) * np.exp(NOISE_SIGMA * rng.standard_normal())
        spans.append(dict(rank=0, stage=0, iteration=10 + index, kind="recovery.heal", microbatch=None, start_s=1.0, end_s=1.0 + seconds,
                          replica=1, bytes=size))
    settings = RealRunSettings(
        model=ModelSpec(name="tiny", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, sequence_length=16),
        pipeline=PipelineSpec(num_stages=num_stages, microbatch_size=2, num_microbatches=2, data_parallel_degree=degree),
        method=method_from_name("checkpoint"),
        num_iterations=num_iterations,
        learning_rate=1e-3,
        eval_every_iterations=50,
    )
    manifest = RunManifest(run_id=f"dp-{degree}-{seed}", source="real", method="checkpoint", seed=seed, real_settings=settings)
    return make_run_record(manifest, metrics, pd.DataFrame(spans), [])  # a frame keeps the optional replica and bytes columns


def test_allreduce_latency_and_bandwidth_are_recovered_from_spans_of_several_degrees_and_sizes():
    records = [_record(2, (100_000, 1_000_000, 8_000_000)), _record(4, (50_000, 2_000_000))]
    fitted = fit_allreduce(records)
    assert fitted is not None
    assert fitted.latency_s == pytest.approx(LATENCY_S, rel=0.1)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(BANDWIDTH_BYTES_PER_S, rel=0.05)
    assert fitted.num_points == 30 * 2 * 3 + 30 * 4 * 2 - 3 * (2 * 3 + 4 * 2)  # every span past the 3 warm-up iterations


def test_heal_latency_and_bandwidth_are_recovered_from_heal_spans():
    fitted = fit_replica_heal([_record(2, (1_000,), heal_bytes=(200_000, 1_000_000, 5_000_000, 20_000_000))])
    assert fitted is not None
    assert fitted.latency_s == pytest.approx(HEAL_LATENCY_S, rel=0.15)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(HEAL_BANDWIDTH_BYTES_PER_S, rel=0.05)


def test_one_size_gives_the_bandwidth_through_the_origin_and_no_latency():
    size = 1_000_000
    fitted = fit_allreduce([_record(2, (size,))])
    assert fitted is not None and fitted.latency_s == 0.0
    expected_s = 2 * LATENCY_S + size / BANDWIDTH_BYTES_PER_S  # D = 2: 2(D-1)/D = 1
    assert size / fitted.bandwidth_bytes_per_s == pytest.approx(expected_s, rel=0.03)


def test_runs_without_data_parallelism_or_heals_give_none():
    assert fit_allreduce([_record(1, (1_000_000,))]) is None
    assert fit_replica_heal([_record(2, (1_000_000,))]) is None


def _healthy_iteration_s(scenario) -> float:
    return simulate_run(scenario, scenario.methods[0], ()).healthy_iteration_time_s


def test_a_measured_allreduce_changes_the_prediction_of_a_data_parallel_scenario_only():
    old = load_calibration(str(builtin_calibration_path("cpu-tiny")))
    assert old.allreduce is None and old.replica_heal is None  # a calibration made before they existed still loads
    measured = old.model_copy(update={"allreduce": LinkProfile(latency_s=5e-3, bandwidth_bytes_per_s=1e7)})
    single = preset("cpu-tiny", {"target.loss": None, "target.iterations": 50}, methods=("checkpoint",))
    data_parallel = preset("cpu-tiny", {"pipeline.data_parallel_degree": 2, "target.loss": None, "target.iterations": 50}, methods=("checkpoint",))

    single_old, single_new = (apply_calibration(single, calibration, mode="full") for calibration in (old, measured))
    assert single_new.network == single_old.network
    assert _healthy_iteration_s(single_new) == _healthy_iteration_s(single_old)

    parallel_old, parallel_new = (apply_calibration(data_parallel, calibration, mode="full") for calibration in (old, measured))
    assert parallel_old.network.allreduce_latency_s == data_parallel.network.allreduce_latency_s  # kept without a measurement
    assert (parallel_new.network.allreduce_latency_s, parallel_new.network.allreduce_bandwidth_bytes_per_s) == (5e-3, 1e7)
    assert _healthy_iteration_s(parallel_new) > _healthy_iteration_s(parallel_old)


def test_the_calibration_summary_shows_the_all_reduce_and_heal_only_where_measured(capsys):
    from churnsim.calibration_report import print_calibration

    old = load_calibration(str(builtin_calibration_path("cpu-tiny")))
    print_calibration(old)
    assert "all-reduce" not in capsys.readouterr().out
    print_calibration(old.model_copy(update={"allreduce": LinkProfile(latency_s=0.0, bandwidth_bytes_per_s=8e7, num_points=12),
                                             "replica_heal": LinkProfile(latency_s=0.0, bandwidth_bytes_per_s=3e8, num_points=2)}))  # fmt: skip
    shown = capsys.readouterr().out
    assert "data-parallel all-reduce: latency 0, bandwidth 80 MB/s (12 spans)" in shown and "bandwidth 300 MB/s (2 heals)" in shown
