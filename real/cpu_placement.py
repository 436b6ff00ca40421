"""Stage processes on physical cores of their own, when asked and when the machine has enough.

Stage processes run short bursts that alternate with waits for their neighbours, and the OS wakes
each burst where it likes: beside the process that woke it, or on the other hyperthread of a busy
core. Pinning gives every stage the core of its own that the simulator assumes, and takes the
placement out of the list of things that differ between two runs.

Measured, it is not what makes identical runs differ: on a quiet VM without hyperthreads, pinned
no-failure runs of `cpu-tiny` spread as much as unpinned ones, and a pinned validation round missed
as far as an unpinned one (the identical-runs-spread and calibrate-and-validate benchmark reports).
Hence opt-in: `TrainingConfig.pin_stages_to_cores`, which `launch_local` sets when the environment
has `CHURNSIM_PIN_STAGES=1` (like `OMP_PROC_BIND`, it describes the machine, not the experiment,
and it reaches every command that runs real stages: `real run`, `calibrate`, the benchmarks). Two
pinned runs at once on one machine would share the same cores.

Stage s of S, with T torch threads each, gets T physical cores, one logical CPU on each, counted
from the end of the process's allowed CPUs (CPU 0 often takes most interrupts; the launcher stays
unpinned). With fewer physical cores than S × T nothing is pinned: the stages share the cores, as
calibration/cpu_sharing.py models it. Every run record says how its stages were placed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PIN_VARIABLE = "CHURNSIM_PIN_STAGES"
_TOPOLOGY_ROOT = Path("/sys/devices/system/cpu")


def pinning_requested() -> bool:
    return os.environ.get(PIN_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def physical_cores(cpus: Iterable[int], topology_root: Path = _TOPOLOGY_ROOT) -> list[list[int]]:
    """The logical CPUs grouped by physical core (package, core id), cores in order of their lowest
    CPU; a CPU whose topology the kernel does not expose counts as a core of its own."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        topology = topology_root / f"cpu{cpu}" / "topology"
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("no topology", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values(), key=min)


def stage_cpus(stage: int, num_stages: int, threads_per_stage: int, cores: list[list[int]]) -> tuple[int, ...] | None:
    """The logical CPUs stage `stage` is pinned to (module docstring), None when `cores` are too few."""
    needed = num_stages * threads_per_stage
    if len(cores) < needed:
        return None
    chosen = cores[len(cores) - needed :]
    return tuple(core[0] for core in chosen[stage * threads_per_stage : (stage + 1) * threads_per_stage])


def _allowed_physical_cores() -> list[list[int]] | None:
    """This process's allowed CPUs by physical core; None where the platform has no CPU affinity."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return physical_cores(os.sched_getaffinity(0))


def placement_plan(num_stages: int, threads_per_stage: int, pin: bool) -> str:
    """What `pin_stage_process` does for every stage of such a run here, in words (for run records)."""
    if not pin:
        return "the OS places stage processes (not pinned)"
    cores = _allowed_physical_cores()
    if cores is None:
        return "the OS places stage processes (no CPU affinity on this platform)"
    plans = [stage_cpus(stage, num_stages, threads_per_stage, cores) for stage in range(num_stages)]
    if plans[0] is None:
        return f"the OS places stage processes ({len(cores)} physical cores < {num_stages} stages × {threads_per_stage} thread(s))"
    return "pinned: " + ", ".join(f"stage {stage} → CPU {'+'.join(map(str, cpus or ()))}" for stage, cpus in enumerate(plans))


def pin_stage_process(stage: int, num_stages: int, threads_per_stage: int, pin: bool) -> tuple[int, ...] | None:
    """Pin this process to its stage's CPUs when `pin` and the machine allows; returns them."""
    cores = _allowed_physical_cores() if pin else None
    cpus = stage_cpus(stage, num_stages, threads_per_stage, cores) if cores is not None else None
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus
