"""The CUDA code paths, measured on a machine with a GPU (CI has none; this is a manual check).

What it runs, each part independent so one failure does not hide the others:

1. pinned:    the lazy async engine's host pool on CUDA is page-locked memory.
2. overlap:   the lazy async engine snapshots a GPU state (`--state-mib`) on its own copy stream
              while the training stream runs matrix products. Reported as ratios measured in this
              one run (median of `--repeats`):
              - copy_s:          save() until the snapshot is in host memory, with nothing else running;
              - compute_s:       the matrix products alone;
              - together_s:      save(), the same products, then wait_before_optimizer_step();
              - overlap:         (compute_s + copy_s - together_s) / min(compute_s, copy_s),
                                 1 = the copy hid completely behind compute, 0 = none of it did;
              - blocked_s:       training time blocked by the save (save() call + the wait);
              - sync_blocked_s:  the synchronous engine's save of the same state (GPU -> disk).
              The checkpoint, loaded back, must equal the GPU state bit for bit.
3. messages:  a one-rank NCCL process group (the backend a multi-GPU host uses) runs the
              Communicator's collectives; NCCL refuses two ranks on one GPU, so point-to-point
              NCCL needs a host with two GPUs.
4. real runs: `churnsim real run` per method with training.device=cuda: several stage processes
              share the one GPU, so they talk over gloo with host staging (distributed.py).

Usage: python benchmarks/cuda_paths.py [--state-mib 512] [--repeats 3] [--skip-runs]
Writes one JSON line per part to stdout (and --out FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_report_option, report_if_asked  # noqa: E402

from churnsim.real.checkpoint import LazyAsyncCheckpointEngine, SynchronousCheckpointEngine  # noqa: E402

RESULTS: list[dict] = []


def report(part: str, **values: object) -> None:
    row = {"part": part, **values}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def gpu_state(total_bytes: int, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    num_tensors = 16
    numel = total_bytes // 4 // num_tensors
    return {f"weight_{i}": torch.randn(numel, generator=generator, device=device) for i in range(num_tensors)}


def matrix_products(a: torch.Tensor, count: int) -> None:
    for _ in range(count):
        a = (a @ a).clamp_(-1, 1)


def seconds(function, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    start_s = time.perf_counter()
    function()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start_s


def part_pinned(device: torch.device, directory: Path) -> None:
    engine = LazyAsyncCheckpointEngine(directory / "p-local", directory / "p-remote",
                                       host_buffer_bytes=1 << 24, device=device)
    try:
        report("pinned", host_pool_pinned=bool(engine.host_pool.buffer.is_pinned()))
    finally:
        engine.close()


def part_overlap(device: torch.device, directory: Path, state_mib: int, repeats: int) -> None:
    state = gpu_state(state_mib << 20, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    operand = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) / 90
    matrix_products(operand, 3)  # warm-up
    engine = LazyAsyncCheckpointEngine(directory / "local", directory / "remote",
                                       host_buffer_bytes=nbytes + (1 << 22), device=device, keep_last=1)
    rows = []
    try:
        iteration = 0
        # Size the compute to about the copy's length, so that the overlap is visible either way.
        iteration += 1
        copy_probe_s = seconds(lambda: (engine.save(state, iteration), engine.wait_before_optimizer_step()), device)
        engine.wait_until_durable()
        one_product_s = seconds(lambda: matrix_products(operand, 10), device) / 10
        num_products = max(1, round(copy_probe_s / one_product_s))
        for _ in range(repeats):
            iteration += 1
            copy_s = seconds(lambda: (engine.save(state, iteration), engine.wait_before_optimizer_step()), device)
            engine.wait_until_durable()
            compute_s = seconds(lambda: matrix_products(operand, num_products), device)
            iteration += 1
            blocked: list[float] = []

            def together() -> None:
                start_s = time.perf_counter()
                engine.save(state, iteration)
                blocked.append(time.perf_counter() - start_s)
                matrix_products(operand, num_products)
                blocked.append(engine.wait_before_optimizer_step())

            together_s = seconds(together, device)
            engine.wait_until_durable()
            rows.append({
                "copy_s": copy_s, "compute_s": compute_s, "together_s": together_s,
                "blocked_s": sum(blocked),
                "overlap": (compute_s + copy_s - together_s) / min(compute_s, copy_s),
            })
        latest = engine.latest_durable()
        assert latest is not None
        loaded = engine.load(latest)
        identical = all(torch.equal(loaded[key], tensor.cpu()) for key, tensor in state.items())
        stats = engine.stats()
    finally:
        engine.close()
    sync_engine = SynchronousCheckpointEngine(directory / "sync", keep_last=1)
    try:
        sync_blocked = [seconds(lambda i=i: sync_engine.save(state, i), device) for i in range(1, repeats + 1)]
        sync_identical = all(torch.equal(sync_engine.load(sync_engine.latest_durable())[key], tensor.cpu())
                             for key, tensor in state.items())
    finally:
        sync_engine.close()
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    report("overlap", state_bytes=nbytes, repeats=repeats, num_products=num_products,
           device_to_host_bytes_per_s=nbytes / median["copy_s"], **median,
           spread_overlap=[min(r["overlap"] for r in rows), max(r["overlap"] for r in rows)],
           sync_blocked_s=statistics.median(sync_blocked),
           ratio_sync_blocked_to_async_blocked=statistics.median(sync_blocked) / max(median["blocked_s"], 1e-9),
           local_commit_lag_s=statistics.median(stats.commit_lag_s_per_level["local"]),
           loaded_equals_gpu_state=identical, sync_loaded_equals_gpu_state=sync_identical)


def part_messages(device: torch.device) -> None:
    from churnsim.real.distributed import destroy_process_group, find_free_port, init_process_group

    communicator = init_process_group(rank=0, world_size=1, device="cuda", timeout_s=60,
                                      master_addr="127.0.0.1", master_port=find_free_port())
    try:
        import torch.distributed as dist

        total = communicator.all_reduce_sum(torch.ones(4, device=device))
        gathered = communicator.all_gather_objects({"rank": 0, "values": [1.5, 2.5]})
        report("messages", backend=dist.get_backend(), wire_device=str(communicator.wire_device),
               nccl_version=".".join(map(str, torch.cuda.nccl.version())),
               all_reduce_ok=bool(torch.equal(total.cpu(), torch.ones(4))),
               all_gather_ok=gathered == [{"rank": 0, "values": [1.5, 2.5]}])
    finally:
        destroy_process_group()


def part_real_runs(directory: Path, methods: list[str], iterations: int) -> None:
    for method in methods:
        out = directory / f"run-{method}"
        command = [sys.executable, "-m", "churnsim.cli", "real", "run", "--preset", "cpu-tiny",
                   "--method", method, "--out", str(out), "--set", "training.device=cuda",
                   "--set", f"target.iterations={iterations}", "--set", "target.loss=null"]
        start_s = time.perf_counter()
        finished = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=directory)
        wall_s = time.perf_counter() - start_s
        summary = {}
        for path in out.rglob("*.json"):
            if path.name in ("summary.json", "result.json", "run.json"):
                try:
                    summary[path.name] = json.loads(path.read_text())
                except ValueError:
                    pass
        report("real_run", method=method, exit_code=finished.returncode, wall_s=round(wall_s, 2),
               stdout_tail=finished.stdout[-1500:], stderr_tail=finished.stderr[-1500:],
               files=sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())[:40])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--methods", nargs="*",
                        default=["none", "checkpoint", "async_checkpoint", "redundant", "checkfree", "checkfree_plus"])
    parser.add_argument("--skip-runs", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines of the parts (and, unless --no-report, their dated report)")
    add_report_option(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_paths: no CUDA device here; run this on a machine with a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    report("environment", torch=torch.__version__, gpu=torch.cuda.get_device_name(device),
           gpus=torch.cuda.device_count(), cpus=os.cpu_count())
    directory = Path(tempfile.mkdtemp(prefix="churnsim-cuda-"))
    parts = [("pinned", lambda: part_pinned(device, directory)),
             ("overlap", lambda: part_overlap(device, directory, args.state_mib, args.repeats)),
             ("messages", lambda: part_messages(device))]
    if not args.skip_runs:
        parts.append(("real_runs", lambda: part_real_runs(directory, args.methods, args.iterations)))
    try:
        for name, function in parts:
            try:
                function()
            except Exception as error:  # a manual check: show every part's failure, go on
                report(name, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()[-3000:])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if args.out is not None:
            args.out.write_text("\n".join(json.dumps(row) for row in RESULTS) + "\n")
            report_if_asked(args, "cuda-paths", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
