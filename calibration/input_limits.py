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

import os
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
    """Mean number of node failures (stage failures when D = 1) the churn model produces within
    `target.max_wall_clock_s`: every node of the S × D grid fails at the model's per-node rate.

    Parses a trace or schedule file the churn model names (an InputError names a broken one).
    """
    from .failure_sampling import mean_node_failure_rate_per_s

    pipeline = scenario.pipeline
    num_nodes = pipeline.num_nodes
    rate_per_node_s = mean_node_failure_rate_per_s(
        scenario.churn,
        num_stages=pipeline.num_stages,
        data_parallel_degree=pipeline.data_parallel_degree,
        replicas_fail_together=pipeline.replicas_fail_together,
    )
    return rate_per_node_s * num_nodes * scenario.target.max_wall_clock_s


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
            f"{source}: churn ({scenario.churn.kind}) is expected to fail {failures:.3g} "
            f"{'nodes' if scenario.pipeline.data_parallel_degree > 1 else 'stages'} within "
            f"target.max_wall_clock_s ({hours:.0f} h), {cost} per run; the limit is "
            f"{MAX_EXPECTED_FAILURES_PER_RUN:,}: lower the failure rate or target.max_wall_clock_s"
        )



# -- work of a whole command: what-if, sweep, recommendation ------------------------------------------

MAX_WORK_CORE_HOURS = 1.0
"""Default limit on a command's estimated work, in core-hours (`--max-work` raises it): the default
what-if is estimated at a few core-seconds, so this refuses only what would run for hours."""
SECONDS_PER_RUN = 0.02
"""One simulated run (one method, one replication, one failure path) besides its failures: the
closed-form evaluation, its tables and the pool's transfer; an order of magnitude, as above."""
BYTES_PER_RUN = 8 * 1024
"""What one run keeps until the command ends: its task, its row of the runs table (≈ 60 columns as
Python objects) and its share of the trajectories."""
MEMORY_FRACTION_LIMIT = 0.5
"""A command's estimated memory may take at most this share of the machine's physical memory."""


def physical_memory_bytes() -> float:
    """The machine's physical memory (8 GiB where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * 2**30


def seconds_per_run(scenario: "Scenario") -> float:
    """Estimated core-seconds of one run of `scenario` (one method, one replication): SECONDS_PER_RUN.

    A constant: the failures expected before the deadline (`expected_failures_per_run`) overstate a
    run that reaches its target long before it by orders of magnitude, and a run's own length is not
    known before it is simulated. `check_scenario_size` bounds the failures of one run separately."""
    return SECONDS_PER_RUN


def check_max_work(max_work_core_hours: float | None) -> float:
    """The `--max-work` limit in core-hours (the default when not given); InputError for a bad value."""
    if max_work_core_hours is None:
        return MAX_WORK_CORE_HOURS
    if not (max_work_core_hours > 0 and max_work_core_hours < float("inf")):
        raise InputError(f"--max-work {max_work_core_hours}: must be a positive number of core-hours, e.g. 4")
    return float(max_work_core_hours)


def check_work(
    runs: float, seconds_each: float, *, what: str, max_work_core_hours: float | None = None, flag: str = "--max-work"
) -> None:
    """Refuse (one line, before any work) `runs` simulated runs of `seconds_each` core-seconds when their
    estimated work exceeds `--max-work` core-hours or their memory half the machine's.

    `what` says how the runs come about ("5 rates × 100,000 replications × 9 methods").
    """
    limit_hours = check_max_work(max_work_core_hours)
    seconds = runs * seconds_each
    nbytes = runs * BYTES_PER_RUN
    memory_limit = physical_memory_bytes() * MEMORY_FRACTION_LIMIT
    if nbytes > memory_limit:
        raise InputError(
            f"{what} = {runs:,.0f} simulated runs, estimated at {_cost(seconds, nbytes)}: the memory is more than half of this "
            f"machine's {physical_memory_bytes() / 2**30:.0f} GiB; use fewer replications, rates, methods or grid points"
        )
    if seconds > limit_hours * 3600.0:
        raise InputError(
            f"{what} = {runs:,.0f} simulated runs, estimated at {seconds / 3600.0:,.2g} core-hours ({_cost(seconds, nbytes)}), "
            f"more than the limit of {limit_hours:g} core-hours: use fewer replications, rates, methods or grid points, "
            f"or raise the limit with {flag} HOURS"
        )
