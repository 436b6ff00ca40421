"""Checks every command makes before any work: sizes that would exhaust memory or time, and input files.

A scenario can be valid field by field and still be impossible to simulate: 10^12 microbatches per
iteration, 10^9 failures per hour, 10^8 replications. Each such size is refused with one line that
names the field, what the run would cost, and the limit. The costs are estimates from this
simulator's own data structures: per stage-microbatch of an iteration (per pipeline state, cached
after the first) and per failure of a run (its events, records and recovery), each a time and a
memory size (the constants below). They are orders of magnitude, not promises; the limits sit where
a run would take minutes and hundreds of MB.

Trace and schedule files named by the churn model are parsed here too (they are cached, so the
simulation does not parse them again), so a broken file is reported before any progress line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:
    from .scenario import Scenario

MAX_STAGES = 4096
MAX_STAGE_MICROBATCHES_PER_ITERATION = 65_536
"""Stages × microbatches of one iteration, simulated per microbatch once per pipeline state."""
MAX_REPLICATIONS = 100_000
TOO_MANY_REPLICATIONS = f"more than the limit of {MAX_REPLICATIONS:,}; intervals narrow as 1/sqrt(replications), a few hundred are plenty"
MAX_LOCAL_WORKERS = 1024
"""Local worker processes a command may start (`--workers`)."""
MAX_EXPECTED_FAILURES_PER_RUN = 200_000
"""Failures the churn model is expected to produce within `target.max_wall_clock_s`."""

SECONDS_PER_STAGE_MICROBATCH = 1.8e-3
BYTES_PER_STAGE_MICROBATCH = 1.2 * 1024
SECONDS_PER_FAILURE = 0.8e-3
BYTES_PER_FAILURE = 1.4 * 1024


def _cost(seconds: float, nbytes: float) -> str:
    if seconds < 3600:
        duration = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
    elif seconds < 3600 * 24 * 365:
        duration = f"{seconds / 3600:.0f} h"
    else:
        duration = f"{seconds / (3600 * 24 * 365):.1e} years"
    size = f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"
    return f"≈ {duration} and {size}"


def expected_failures_per_run(scenario: "Scenario") -> float:
    """Mean number of stage failures the churn model produces within `target.max_wall_clock_s`.

    Parses a trace or schedule file the churn model names (an InputError names a broken one).
    """
    from .failure_sampling import mean_stage_failure_rate_per_s

    num_stages = scenario.pipeline.num_stages
    rate_per_stage_s = mean_stage_failure_rate_per_s(scenario.churn, num_stages=num_stages)
    return rate_per_stage_s * num_stages * scenario.target.max_wall_clock_s


def check_workers(workers: int | None) -> None:
    """Refuse a `--workers` count no machine runs as local processes."""
    if workers is not None and not 1 <= workers <= MAX_LOCAL_WORKERS:
        raise InputError(f"--workers {workers}: must be between 1 and {MAX_LOCAL_WORKERS} local processes")


def check_scenario_size(scenario: "Scenario", *, source: str) -> None:
    """Refuse (InputError, one line naming `source` and the field) a scenario too large to simulate."""
    stages = scenario.pipeline.num_stages
    if stages > MAX_STAGES:
        raise InputError(f"{source}: pipeline.num_stages = {stages}: more than the limit of {MAX_STAGES} stages; use fewer stages")
    microbatches = scenario.pipeline.num_microbatches
    stage_microbatches = stages * microbatches
    if stage_microbatches > MAX_STAGE_MICROBATCHES_PER_ITERATION:
        cost = _cost(stage_microbatches * SECONDS_PER_STAGE_MICROBATCH, stage_microbatches * BYTES_PER_STAGE_MICROBATCH)
        raise InputError(
            f"{source}: pipeline.num_microbatches = {microbatches} with {stages} stages: simulating one iteration "
            f"would take {cost}; the limit is {MAX_STAGE_MICROBATCHES_PER_ITERATION:,} stages × microbatches: "
            "use fewer microbatches (the iteration time scales with them)"
        )
    if scenario.replications > MAX_REPLICATIONS:
        raise InputError(f"{source}: replications = {scenario.replications}: {TOO_MANY_REPLICATIONS}")
    failures = expected_failures_per_run(scenario)
    if failures > MAX_EXPECTED_FAILURES_PER_RUN:
        hours = scenario.target.max_wall_clock_s / 3600.0
        cost = _cost(failures * SECONDS_PER_FAILURE, failures * BYTES_PER_FAILURE)
        raise InputError(
            f"{source}: churn ({scenario.churn.kind}) is expected to fail {failures:.3g} stages within "
            f"target.max_wall_clock_s ({hours:.0f} h), {cost} per run; the limit is "
            f"{MAX_EXPECTED_FAILURES_PER_RUN:,}: lower the failure rate or target.max_wall_clock_s"
        )

