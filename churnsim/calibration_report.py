"""How `churnsim calibrate` and `churnsim validate` show their results: a calibration's summary,
the convergence lab's measured setbacks, and the validation's tables (on stdout)."""

from __future__ import annotations

import math


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def print_calibration(calibration) -> None:
    """The short human-readable summary of a calibration file."""
    from rich.console import Console
    from rich.table import Table

    from churnsim.calibration.compute_cost import PhysicalHopCost
    from churnsim.calibration.speed_uncertainty import run_speed_log_sd, speed_interval_factors

    out = Console()
    timings = Table("stage", "forward/microbatch [IQR]", "backward/microbatch [IQR]", "samples", title=f"calibration {calibration.name!r}: stage timings")
    for timing in calibration.stage_timings:
        timings.add_row(
            str(timing.stage),
            f"{_seconds(timing.block_forward.median_s)} [{_seconds(timing.block_forward.interquartile_range_s)}]",
            f"{_seconds(timing.block_backward.median_s)} [{_seconds(timing.block_backward.interquartile_range_s)}]",
            str(timing.block_forward.num_samples),
        )
    out.print(timings)
    link = calibration.link
    evaluation = calibration.evaluation
    lines = [
        f"optimizer step {_seconds(calibration.optimizer_step.median_s)}, per-iteration overhead {_seconds(calibration.iteration_overhead_s)}, "
        f"warm-up extra {_seconds(calibration.warmup_extra_s)}, evaluation {_seconds(evaluation.median_s) if evaluation else 'not measured'}, "
        f"checkpoint write fixed cost {_seconds(calibration.checkpoint_write_latency_s)}",
        "steady extra per iteration over plain methods: "
        + (", ".join(f"{method} {_seconds(value) if value >= 0 else '−' + _seconds(-value)}" for method, value in sorted(calibration.method_iteration_extra_s.items())) or "none measured"),
        f"link: latency {_seconds(link.latency_s)}, bandwidth {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s (r² {link.r_squared:.3f}, {link.num_points} sizes)"
        if link.r_squared is not None
        else f"link: latency {_seconds(link.latency_s)}, bandwidth {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s",
    ]
    for label, fitted, what in (("data-parallel all-reduce", calibration.allreduce, "spans"), ("replica heal copy (not applied)", calibration.replica_heal, "heals")):
        if fitted is not None:
            lines.append(f"{label}: latency {_seconds(fitted.latency_s)}, bandwidth {fitted.bandwidth_bytes_per_s / 1e6:.0f} MB/s ({fitted.num_points} {what})")
    lines += [
        f"tier {tier.name}: write {tier.write_bandwidth_bytes_per_s / 1e6:.0f} MB/s, read {tier.read_bandwidth_bytes_per_s / 1e6:.0f} MB/s"
        for tier in calibration.storage
    ]
    if calibration.machine_step_s is not None:
        speeds = sorted(calibration.run_speed_factors.values())
        spread = f"; its runs' hops took {speeds[0]:.2f}–{speeds[-1]:.2f}× their pooled median ({len(speeds)} runs)" if speeds else ""
        log_sd = run_speed_log_sd(speeds)
        if log_sd > 0:
            low, high = speed_interval_factors(log_sd)
            spread += f", so a run's compute is predicted within ×{low:.3f}–{high:.3f} (95 %)"
        lines.append(f"machine speed while calibrating: median no-failure step {_seconds(calibration.machine_step_s)}{spread}")
    compute = calibration.compute_model

    def _hop_cost_text(hop) -> str:
        if isinstance(hop, PhysicalHopCost):
            return (
                f"{_seconds(hop.fixed_s)} + {_seconds(hop.seconds_per_operation)} per operation + {hop.seconds_per_matmul_flop * 1e9:.3g} s/GFLOP"
                f" + {hop.seconds_per_byte * 1e9:.3g} s/GB element-wise + {_seconds(hop.seconds_per_message)} per message"
            )
        shared = hop.seconds_per_shared_core_parameter
        return (
            f"{_seconds(hop.fixed_s)} + {hop.seconds_per_matmul_flop * 1e9:.3g} s/GFLOP + {_seconds(hop.seconds_per_neighbour)} per neighbouring stage"
            + (f" + {_seconds(shared * 1e6)} per million stage parameters on shared cores" if shared > 0 else "")
        )

    if compute is not None:
        cores = f"{compute.shared_cores} shared cores" if compute.shared_cores else "a device per stage"
        lines.append(
            f"compute model ({compute.num_configurations} setups, {cores}, median residual {100 * compute.hop_relative_residual:.1f} %): "
            f"forward hop {_hop_cost_text(compute.forward)}, backward hop {_hop_cost_text(compute.backward)}; "
            + (
                f"× (1 + {compute.slowdown_per_extra_process_per_core:.3g} per stage process beyond one per core); "
                if compute.slowdown_per_extra_process_per_core > 0
                else ""
            )
            + f"overhead of other setups {_seconds(compute.iteration_overhead_s)} + {_seconds(compute.overhead_per_stage_microbatch_s)} per stage × microbatch"
            # Calibrations made before the stages × microbatches fit scaled it per microbatch.
            + (f" + {_seconds(compute.overhead_per_microbatch_s)} per microbatch" if compute.overhead_per_microbatch_s else "")
        )
    for line in lines:
        out.print(line)
    recovery = Table(
        "method", "join", "transfer", "load", "rebuild", "restart", "n",
        title="recovery component times (soft failures; median of n events; restart: the step's time no span records)",
    )
    recovery.columns[0].min_width = max((len(method) for method in calibration.recovery), default=0)  # names whole on 80 columns
    for method, times in sorted(calibration.recovery.items()):
        recovery.add_row(
            method, *(_seconds(value) for value in (times.join_s, times.transfer_s, times.load_s, times.rebuild_s, times.unrecorded_s)), str(times.num_samples)
        )
    out.print(recovery)
    if calibration.hard_failure_recovery:
        hard = Table(
            "method", "join", "process start", "rendezvous", "transfer", "load", "rebuild", "restart", "n",
            title="hard-failure recovery times (median of n events; process start: the join less the configured join delay)",
        )
        for method, times in sorted(calibration.hard_failure_recovery.items()):
            parts = (times.join_s, times.process_start_s, times.rendezvous_s, times.transfer_s, times.load_s, times.rebuild_s, times.unrecorded_s)
            hard.add_row(method, *(_seconds(value) for value in parts), str(times.num_samples))
        out.print(hard)
    costs = calibration.hard_failure_costs
    if costs is not None:
        restart = Table("part", "fitted", "n", "r²", title=f"a hard failure's restart under torchrun's agent ({costs.num_recoveries} recoveries)")
        for name, seconds in (("detection", costs.detection), ("agents' restart", costs.agent_restart), ("process start", costs.process_start),
                              ("rendezvous", costs.rendezvous)):  # fmt: skip
            restart.add_row(name, _seconds(seconds.median_s), str(seconds.num_points), "")
        for name, transfer in (("survivors' reload", costs.survivor_reload), ("state transfer", costs.state_transfer)):
            if transfer is None:
                continue
            bandwidth = f" + bytes / {transfer.bandwidth_bytes_per_s / 1e6:.3g} MB/s" if transfer.bandwidth_bytes_per_s else ""
            r_squared = f"{transfer.r_squared:.3f}" if transfer.r_squared is not None else "n/a"
            restart.add_row(name, _seconds(transfer.latency_s) + bandwidth, str(transfer.num_points), r_squared)
        out.print(restart)
        for note in costs.notes:
            out.print(f"  note: {note}")
    convergence = calibration.convergence
    curve = convergence.baseline
    setbacks = Table("method", "position", "setback iterations [95 % CI]", "samples", title="convergence setbacks (measured where samples > 0)")
    for method, spec in sorted(convergence.setbacks.items()):
        for position in ("interior", "edge"):
            value = spec.for_position(position)
            interval = (
                f" [{value.ci95_low_iterations:.1f}, {value.ci95_high_iterations:.1f}]"
                if value.ci95_low_iterations is not None and value.ci95_high_iterations is not None
                else ""
            )
            setbacks.add_row(method, position, f"{value.mean_iterations:.1f}{interval}", str(value.num_samples) if value.num_samples else "0 (default)")
    out.print(setbacks)
    r_squared = "n/a" if curve.r_squared is None else f"{curve.r_squared:.3f}"
    from churnsim.calibration.fit_convergence import MAXIMUM_CURVE_EXPONENT, exponent_at_bound

    at_bound = (
        f" (the exponent at its bound {MAXIMUM_CURVE_EXPONENT}: these runs do not tell a steeper curve with a higher floor "
        "from this one)"
        if exponent_at_bound(curve)
        else ""
    )
    out.print(
        f"baseline loss = {curve.floor_loss:.3f} + {curve.scale:.3g}·(i + {curve.offset_iterations:.3g})^−{curve.exponent:.3f}, r² {r_squared}"
        + at_bound
    )
    provenance = calibration.provenance
    out.print(
        f"provenance: created {provenance.created_utc}, git {provenance.git_revision}, "
        f"hardware {', '.join(f'{key}={value}' for key, value in sorted(provenance.hardware.items()))}"
    )
    out.print(f"fitted on runs: {', '.join(provenance.fit_run_ids)}")
    reference = calibration.speed_reference
    if reference is None:
        out.print("speed reference: none (validate cannot tell the machine's drift since calibrating from the model's error)")
    else:
        out.print(
            f"speed reference: the probe took {1000 * reference.probe_s:.1f} ms (median of {reference.num_repeats} passes, "
            f"interquartile range {1000 * reference.interquartile_range_s:.1f} ms) at {reference.measured_utc}"
        )


def print_lab_setbacks(rows) -> None:
    """The convergence lab's measured setbacks (its widest window) and the methods it tells apart."""
    from rich.console import Console
    from rich.table import Table

    from churnsim.calibration.fit_setbacks import methods_told_apart, setback_summary

    summary = setback_summary(rows)
    kept = summary[summary["window_iterations"] == summary["window_iterations"].max()]
    table = Table("method", "position", "rebuilds", "setback iterations [95 % CI]", "per iteration of progress [95 % CI]", title="measured setbacks")
    for row in kept.itertuples(index=False):
        table.add_row(
            row.method, row.position, str(row.num_rebuilds),
            f"{row.mean_setback_iterations:.1f} [{row.ci95_low_iterations:.1f}, {row.ci95_high_iterations:.1f}]",
            f"{row.setback_per_iteration_of_progress:.3f} [{row.slope_ci95_low:.3f}, {row.slope_ci95_high:.3f}]",
        )  # fmt: skip
    Console().print(table)
    for position in ("interior", "edge"):
        pairs = methods_told_apart(rows, position)
        apart = pairs[pairs["told_apart"]] if not pairs.empty else pairs
        told = ", ".join(f"{r.method} vs {r.other} ({r.mean_difference_iterations:+.1f})" for r in apart.itertuples()) or "none"
        Console().print(f"{position}: pairs told apart (paired 95 % interval excludes 0): {told}")


def print_validation(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from churnsim.sim.checks.validate import interval_coverage, machine_speed, median_absolute_error, steady_step_carry

    out = Console(width=max(Console().width, 120))
    out.print(f"fitted on (not validated): {', '.join(report.fit_run_ids) or 'none recorded'}")
    out.print(f"validated (held out): {', '.join(report.validated_run_ids)}")
    table = Table(
        "run", "method", "quantity", "measured", "predicted", "error", "load-normalised error", "machine slowdown since calibrating",
        title="predicted against measured (absolute error; load-normalised: compute rescaled by the run's own steady step)",
    )

    def percent(value: float) -> str:
        return f"{100 * value:+.1f} %" if math.isfinite(value) else "—"

    for row in report.table.itertuples(index=False):
        slowdown = getattr(row, "machine_slowdown_at_validation", math.nan)
        table.add_row(
            row.run_id, row.method, row.quantity, f"{row.measured:.4g}", f"{row.predicted:.4g}", percent(row.relative_error),
            percent(row.load_normalised_relative_error), f"{slowdown:.2f}×" if math.isfinite(slowdown) else "not measured",
        )  # fmt: skip
    out.print(table)
    summary = Table("method", "runs", "median |error| of total wall-clock", "its 95 % interval", "load-normalised", title="wall-clock error per method")
    for row in median_absolute_error(report.table).itertuples(index=False):
        normalised = row.median_load_normalised_absolute_relative_error
        summary.add_row(
            row.method,
            str(row.num_runs),
            f"{100 * row.median_absolute_relative_error:.1f} %",
            f"{100 * row.median_absolute_relative_error_ci95_low:.1f}–{100 * row.median_absolute_relative_error_ci95_high:.1f} %",
            f"{100 * normalised:.1f} %" if math.isfinite(normalised) else "—",
        )
    out.print(summary)
    speed = machine_speed(report.table)
    if speed is not None:
        if speed.num_runs == 1:
            measured = f"the real run's steady step was {speed.median_factor:.2f}× the calibration's prediction"
        else:
            measured = (
                f"the {speed.num_runs} real runs' steady steps were {speed.lowest_factor:.2f}–{speed.highest_factor:.2f}× the calibration's "
                f"prediction (median {speed.median_factor:.2f}×, a single run {100 * speed.scatter:.1f} % from it in the median)"
            )
        out.print(
            f"machine speed: {measured}; the absolute errors include this, the load-normalised ones rescale each run's compute by its own factor"
        )
        if math.isfinite(speed.log_standard_deviation):
            out.print(
                f"their speeds spread by {speed.log_standard_deviation:.3f} (standard deviation of the log factor): a scenario with "
                f"--set compute.run_speed_log_sd={speed.log_standard_deviation:.3f} draws speeds that spread as these runs' did"
            )
    on_calibrated_setup = report.table["calibrated_setup"].astype(bool)
    carry = steady_step_carry(report.table, on_calibrated_setup, report.table["setup"].where(~on_calibrated_setup))
    if carry:
        out.print(
            "the compute model's carry, with the machine's speed cancelled (each setup's median steady step over its prediction, "
            "over that of the calibrated setup's runs here): " + "; ".join(f"{setup}: {ratio:.3f}×" for setup, ratio in carry.items())
        )
    coverage = interval_coverage(report.table)
    if coverage is not None:
        runs_possessive = "run's" if coverage.num_runs == 1 else "runs'"
        out.print(
            f"{coverage.num_inside} of {coverage.num_runs} real {runs_possessive} total wall-clock fell inside the prediction's 95 % interval of the "
            f"calibrated machine's run-to-run speed ({coverage.num_slower} slower, {coverage.num_faster} faster): columns "
            "predicted_ci95_low/high; a machine that drifted further since calibrating lies outside"
        )
