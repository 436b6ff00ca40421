"""A short fixed workload that measures how fast this machine computes right now.

`churnsim calibrate` stores its time in the calibration file (`SpeedReference`); `churnsim validate`
on the same machine times it again. The ratio separates the machine's drift (other load on shared
cores, clock frequency) from the model's error: a held-out run 10 % slower than predicted while the
probe also runs 10 % slower is the machine, not the compute model.

The workload is what a stage's hop does, in small: a matmul of a fixed 256 × 256 fp32 block followed
by elementwise work (a SiLU gate and a scaled add), in one thread as the suite's stage processes
run. Each pass repeats it a fixed number of times; the median pass over `num_repeats` passes is the
probe's time (the median, not the mean: one pass interrupted by another process would move a mean).
"""

from __future__ import annotations

import statistics
import time
from typing import Literal

from churnsim.calibration.calibration_file import SpeedReference
from churnsim.calibration.errors import InputError
from churnsim.calibration.run_record import utc_now

PROBE_WORKLOAD = "matmul-silu-256-fp32-1thread-v1"
"""Stored with each measurement; a reference of another workload (a later version) is not compared."""
PROBE_MATRIX_SIZE = 256
PROBE_STEPS_PER_PASS = 80
"""Matmul and elementwise steps per pass: a few tens of milliseconds on one CPU core."""
DEFAULT_NUM_REPEATS = 31
WARMUP_PASSES = 2
"""Passes timed but not kept: the first ones pay for allocation and cache warm-up."""


def _one_pass(torch, state, weight, steps: int, device: str) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        product = state @ weight
        # Scaled so the values stay bounded over the steps (no overflow slows the floating point).
        state = 0.5 * state + 0.05 * torch.nn.functional.silu(product)
    if device == "cuda":
        torch.cuda.synchronize()
    else:
        float(state[0, 0])  # the result is read, so nothing can be skipped
    return time.perf_counter() - started


def measure_speed_reference(*, device: Literal["cpu", "cuda"] = "cpu", num_repeats: int = DEFAULT_NUM_REPEATS) -> SpeedReference:
    """Time the probe workload `num_repeats` times on `device` (one thread on a CPU): a few seconds."""
    import torch

    if num_repeats < 1:
        raise InputError(f"speed probe: num_repeats {num_repeats} must be >= 1")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("speed probe on cuda: CUDA is not available on this machine; use the cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        size = PROBE_MATRIX_SIZE
        weight = (torch.randn(size, size, generator=generator) / size**0.5).to(device)
        state = torch.randn(size, size, generator=generator).to(device)
        with torch.no_grad():
            seconds = [_one_pass(torch, state, weight, PROBE_STEPS_PER_PASS, device) for _ in range(WARMUP_PASSES + num_repeats)]
    finally:
        torch.set_num_threads(threads)
    kept = sorted(seconds[WARMUP_PASSES:])
    quartiles = statistics.quantiles(kept, n=4) if len(kept) >= 2 else [kept[0], kept[0], kept[0]]
    return SpeedReference(
        workload=PROBE_WORKLOAD if device == "cpu" else f"{PROBE_WORKLOAD}-cuda",
        probe_s=statistics.median(kept),
        interquartile_range_s=max(0.0, quartiles[2] - quartiles[0]),
        num_repeats=num_repeats,
        device=device,
        measured_utc=utc_now(),
    )
