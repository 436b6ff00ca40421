"""Flush throughput of the lazy async checkpoint engine against a plain write + fsync.

Writes the same state (float32 tensors, `--total-mib` in all) to the same disk four ways and reports
bytes per second and ratios measured in this one run (median of `--repeats`):

- plain:     one sequential write of every tensor's bytes into one file, then fsync (the disk's
             ceiling for this data, with no checksums, header or commit);
- sync:      SynchronousCheckpointEngine.save (checksums + temp/fsync/rename + manifest + latest);
- async:     LazyAsyncCheckpointEngine, pool >= state: time from save() until the checkpoint is
             committed at the local level (flush throughput), and training time blocked;
- async-bp:  the same with a pool of a quarter of the state (back-pressure: chunks wait for fsyncs).

Usage: python benchmarks/checkpoint_flush_throughput.py [--total-mib 256] [--repeats 3]
       [--directory DIR]   (default: a temporary directory in the system temp dir)
Writes benchmarks/results/checkpoint-flush-throughput.json and its dated report (`--no-report`: none).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIRECTORY, add_report_option, report_if_asked  # noqa: E402

from churnsim.real.checkpoint import LazyAsyncCheckpointEngine, SynchronousCheckpointEngine  # noqa: E402

RESULTS_FILE = RESULTS_DIRECTORY / "checkpoint-flush-throughput.json"


def make_state(total_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_tensors = 8
    numel = total_bytes // 4 // num_tensors
    return {f"tensor_{i}": torch.randn(numel, generator=generator) for i in range(num_tensors)}


def plain_write_s(state: dict[str, torch.Tensor], directory: Path) -> float:
    path = directory / "plain.bin"
    start_s = time.perf_counter()
    with open(path, "wb", buffering=0) as file:
        for tensor in state.values():
            file.write(memoryview(tensor.view(torch.uint8).numpy()))
        os.fsync(file.fileno())
    elapsed_s = time.perf_counter() - start_s
    path.unlink()
    return elapsed_s


def sync_save_s(state: dict[str, torch.Tensor], directory: Path) -> float:
    engine = SynchronousCheckpointEngine(directory / "sync", keep_last=1)
    start_s = time.perf_counter()
    engine.save(state, 1)
    elapsed_s = time.perf_counter() - start_s
    engine.close()
    shutil.rmtree(directory / "sync")
    return elapsed_s


def async_save(state: dict[str, torch.Tensor], directory: Path, pool_bytes: int) -> dict[str, float]:
    engine = LazyAsyncCheckpointEngine(directory / "local", directory / "remote",
                                       host_buffer_bytes=pool_bytes, keep_last=1)
    engine.save(state, 1)
    blocked_s = engine.wait_before_optimizer_step()
    engine.wait_until_durable()
    stats = engine.stats()
    engine.close()
    shutil.rmtree(directory / "local")
    shutil.rmtree(directory / "remote")
    return {
        "blocked_s": blocked_s,
        "local_commit_lag_s": stats.commit_lag_s_per_level["local"][0],
        "remote_commit_lag_s": stats.commit_lag_s_per_level["remote"][0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", type=Path, default=None)
    add_report_option(parser)
    args = parser.parse_args()
    total_bytes = args.total_mib * 1024 * 1024
    state = make_state(total_bytes, seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    directory = Path(tempfile.mkdtemp(prefix="churnsim-ckpt-bench-", dir=args.directory))
    try:
        plain = [plain_write_s(state, directory) for _ in range(args.repeats)]
        sync = [sync_save_s(state, directory) for _ in range(args.repeats)]
        full = [async_save(state, directory, nbytes + (1 << 20)) for _ in range(args.repeats)]
        backpressure = [async_save(state, directory, nbytes // 4) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    plain_s, sync_s = statistics.median(plain), statistics.median(sync)
    result = {
        "state_bytes": nbytes,
        "repeats": args.repeats,
        "plain_write_fsync_bytes_per_s": nbytes / plain_s,
        "sync_engine_bytes_per_s": nbytes / sync_s,
        "async_local_flush_bytes_per_s": nbytes / median(full, "local_commit_lag_s"),
        "async_remote_durable_bytes_per_s": nbytes / median(full, "remote_commit_lag_s"),
        "async_blocked_s": median(full, "blocked_s"),
        "async_backpressure_local_flush_bytes_per_s":
            nbytes / median(backpressure, "local_commit_lag_s"),
        "async_backpressure_blocked_s": median(backpressure, "blocked_s"),
        "sync_blocked_s": sync_s,
    }
    result["ratio_async_flush_to_plain"] = (
        result["async_local_flush_bytes_per_s"] / result["plain_write_fsync_bytes_per_s"])
    result["ratio_async_backpressure_flush_to_plain"] = (
        result["async_backpressure_local_flush_bytes_per_s"]
        / result["plain_write_fsync_bytes_per_s"])
    result["ratio_sync_engine_to_plain"] = (
        result["sync_engine_bytes_per_s"] / result["plain_write_fsync_bytes_per_s"])
    result["ratio_sync_blocked_to_async_blocked"] = sync_s / max(result["async_blocked_s"], 1e-9)
    for key, value in result.items():
        shown = f"{value / 1e9:.3f} GB/s" if key.endswith("bytes_per_s") else f"{value:.4g}"
        print(f"{key:45s} {shown}")
    print(json.dumps(result))
    RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_FILE.write_text(json.dumps(result, indent=2) + "\n")
    report_if_asked(args, "checkpoint-flush-throughput", RESULTS_FILE)


if __name__ == "__main__":
    main()
