"""Stage processes pinned to physical cores of their own (real/cpu_placement.py).

- Logical CPUs are grouped by physical core from the kernel's topology files; a CPU without them
  counts as a core of its own.
- Stage s of S with T threads gets T physical cores, one CPU each, from the end of the allowed
  CPUs; with fewer physical cores than S × T nothing is pinned.
- Stage processes of a local launch pin themselves to exactly those CPUs, and a run record says
  how its stages were placed, with CHURNSIM_PIN_STAGES=1 and without.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from churnsim.calibration.run_record import read_run_record
from churnsim.cli import main
from churnsim.real.cpu_placement import PIN_VARIABLE, physical_cores, pin_stage_process, placement_plan, stage_cpus
from churnsim.real.launch import run_distributed

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def _fake_topology(root: Path, core_of_cpu: dict[int, tuple[int, int]]) -> Path:
    for cpu, (package, core) in core_of_cpu.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_hyperthreads_of_one_core_are_grouped_and_cores_of_two_packages_are_told_apart(tmp_path):
    # 2 packages × 2 cores × 2 hyperthreads, siblings numbered n and n + 4 as Linux usually does.
    root = _fake_topology(tmp_path, {cpu: (cpu % 4 // 2, cpu % 2) for cpu in range(8)})
    assert physical_cores(range(8), root) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert physical_cores([5, 1, 2], root) == [[1, 5], [2]]


def test_a_cpu_without_topology_files_is_a_core_of_its_own(tmp_path):
    root = _fake_topology(tmp_path, {0: (0, 0), 1: (0, 0)})
    assert physical_cores([0, 1, 2, 3], root) == [[0, 1], [2], [3]]


def test_stages_get_disjoint_cores_from_the_end_and_nothing_when_cores_are_too_few():
    cores = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_cpus(stage, 2, 1, cores) for stage in range(2)] == [(2,), (3,)]
    assert [stage_cpus(stage, 2, 2, cores) for stage in range(2)] == [(0, 1), (2, 3)]
    assert [stage_cpus(stage, 4, 1, cores) for stage in range(4)] == [(0,), (1,), (2,), (3,)]
    # 8 logical CPUs, but 3 stages × 2 threads need 6 physical cores: hyperthreads are not cores.
    assert stage_cpus(0, 3, 2, cores) is None


def test_without_the_flag_nothing_is_pinned():
    assert pin_stage_process(0, 1, 1, pin=False) is None
    assert placement_plan(4, 1, pin=False) == "the OS places stage processes (not pinned)"


def _pin_and_report(communicator) -> list[int]:
    pin_stage_process(communicator.rank, communicator.world_size, 1, pin=True)
    return sorted(os.sched_getaffinity(0))


@needs_affinity
def test_each_stage_process_runs_on_the_cpus_of_its_stage():
    allowed = sorted(os.sched_getaffinity(0))
    affinities = run_distributed(_pin_and_report, 2, timeout_s=30.0)
    cores = physical_cores(allowed)
    for stage, affinity in enumerate(affinities):
        expected = stage_cpus(stage, 2, 1, cores)
        assert affinity == (list(expected) if expected is not None else allowed)
    assert sorted(os.sched_getaffinity(0)) == allowed  # the launcher itself stays unpinned


@needs_affinity
@pytest.mark.parametrize("pin", [True, False])
def test_the_run_record_says_how_stages_were_placed(tmp_path, monkeypatch, pin):
    if pin:
        monkeypatch.setenv(PIN_VARIABLE, "1")
    else:
        monkeypatch.delenv(PIN_VARIABLE, raising=False)
    out = tmp_path / "run"
    arguments = [
        "real", "run", "--preset", "cpu-tiny", "--method", "none", "--out", str(out),
        "--set", "pipeline.num_stages=2", "--set", 'churn={"kind":"none"}', "--set", "target.loss=null", "--set", "target.iterations=3",
    ]  # fmt: skip
    assert main(arguments) in (None, 0)
    placement = read_run_record(out).manifest.hardware["stage_placement"]
    assert placement == placement_plan(2, 1, pin)
    assert placement.startswith("pinned: stage 0 → CPU") or not pin or "physical cores <" in placement
