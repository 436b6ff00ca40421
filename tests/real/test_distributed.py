"""Backend choice: NCCL only when every rank on a host has a GPU of its own."""

from __future__ import annotations

import pytest

from churnsim.calibration.errors import InputError
from churnsim.real.distributed import backend_for


@pytest.mark.parametrize(
    ("device", "ranks_on_host", "gpus_on_host", "backend"),
    [
        ("cpu", 4, 0, "gloo"),
        ("cpu", 1, 8, "gloo"),
        ("cuda", 4, 8, "nccl"),
        ("cuda", 8, 8, "nccl"),
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), seen on a one-GPU H200.
        ("cuda", 4, 1, "gloo"),
        ("cuda", 9, 8, "gloo"),
    ],
)
def test_backend_follows_device_and_gpus_per_rank(device, ranks_on_host, gpus_on_host, backend):
    assert backend_for(device, ranks_on_host=ranks_on_host, gpus_on_host=gpus_on_host) == backend


def test_unknown_device_is_refused_with_the_choices():
    with pytest.raises(InputError, match="use one of cpu, cuda"):
        backend_for("tpu")
