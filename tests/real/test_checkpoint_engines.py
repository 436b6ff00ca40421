"""Specifications of the synchronous and lazy asynchronous checkpoint engines (CPU)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from churnsim.real.checkpoint import (
    CheckpointCorruptError,
    CheckpointEngineFailed,
    HostPool,
    LazyAsyncCheckpointEngine,
    SynchronousCheckpointEngine,
)
from churnsim.real.checkpoint.format import read_header
from churnsim.real.checkpoint.host_pool import PoolStopped


def make_state(seed: int, scale: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(64 * scale, 48, generator=generator),
        "layer.bias_bf16": torch.randn(48, generator=generator).to(torch.bfloat16),
        "optimizer.exp_avg": torch.randn(64 * scale, 48, generator=generator),
        "optimizer.step": torch.tensor(float(seed)),
        "token_ids": torch.randint(0, 256, (33,), generator=generator),
        "mask": torch.rand(17, generator=generator) > 0.5,
        "empty": torch.empty(0, 5),
        "transposed": torch.randn(12, 20, generator=generator).t(),  # not contiguous
        "iteration": seed,
        "lr": 3e-4 * seed,
        "rng_state": generator.get_state(),
    }


def clone_state(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def assert_states_bitwise_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
            assert torch.equal(
                loaded[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)
            ), key
        else:
            assert loaded[key] == value, key


def tensor_payloads(path: Path) -> dict[str, bytes]:
    header, _ = read_header(path)
    data = path.read_bytes()
    return {
        key: data[entry["offset"] : entry["offset"] + entry["nbytes"]]
        for key, entry in header["tensors"].items()
    }


def async_engine(tmp_path: Path, **options) -> LazyAsyncCheckpointEngine:
    options.setdefault("host_buffer_bytes", 1 << 20)
    return LazyAsyncCheckpointEngine(tmp_path / "local", tmp_path / "remote", device="cpu", **options)


def mutate_in_place(state: dict) -> None:
    """What an optimizer step does: every saved tensor changes in place."""
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.numel():
            if value.dtype == torch.bool:
                value.logical_not_()
            else:
                value.add_(1)


def test_async_files_hold_exactly_what_a_sync_save_holds_despite_in_place_updates(tmp_path):
    state = make_state(seed=1, scale=4)
    sync_engine = SynchronousCheckpointEngine(tmp_path / "sync", keep_last=10)
    # A small pool and small chunks so tensors are split and the ring wraps.
    engine = async_engine(tmp_path, host_buffer_bytes=40_000, chunk_bytes=8192, keep_last=10)
    with engine:
        for iteration in range(1, 4):
            expected = clone_state(state)
            expected["iteration"] = state["iteration"] = iteration
            sync_engine.save(state, iteration)
            engine.save(state, iteration)
            engine.wait_before_optimizer_step()
            mutate_in_place(state)
            engine.wait_until_durable()
            sync_info = sync_engine.latest_durable()
            for level in ("local", "remote"):
                info = engine.latest_durable(level)
                assert info.iteration == iteration
                assert tensor_payloads(info.data_path) == tensor_payloads(sync_info.data_path)
                assert info.data_path.read_bytes() == sync_info.data_path.read_bytes()
                assert_states_bitwise_equal(engine.load(info), expected)


def test_optimizer_hook_waits_so_the_checkpoint_holds_pre_step_weights(tmp_path):
    model = torch.nn.Linear(300, 200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with async_engine(tmp_path, host_buffer_bytes=64 * 1024) as engine:
        engine.register_optimizer_hook(optimizer)
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model(torch.randn(8, 300)).square().sum().backward()
        engine.save(dict(model.state_dict()), 7)
        optimizer.step()  # the hook blocks until the snapshot is in host memory
        engine.wait_until_durable()
        loaded = engine.load(engine.latest_durable())
    assert not torch.equal(model.weight.detach(), expected["weight"])
    assert_states_bitwise_equal(loaded, expected)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("crashing_rename", [".ckpt", ".manifest.json", "latest"])
def test_latest_still_loads_after_a_crash_between_write_and_rename(
    tmp_path, monkeypatch, kind, crashing_rename
):
    make_engine = {
        "sync": lambda: SynchronousCheckpointEngine(tmp_path / "remote"),
        "async": lambda: async_engine(tmp_path),
    }[kind]
    engine = make_engine()
    first = make_state(seed=1)
    engine.save(first, 1)
    engine.wait_before_optimizer_step()
    engine.wait_until_durable()

    real_replace = os.replace

    def crashing_replace(source, target, *args, **kwargs):
        if str(target).endswith(crashing_rename):
            raise OSError(f"injected crash before renaming to {target}")
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", crashing_replace)
    if kind == "sync":
        with pytest.raises(OSError, match="injected crash"):
            engine.save(make_state(seed=2), 2)
    else:
        engine.save(make_state(seed=2), 2)
        with pytest.raises(CheckpointEngineFailed, match="injected crash"):
            engine.wait_before_optimizer_step()
            engine.wait_until_durable()
        with pytest.raises(CheckpointEngineFailed):
            engine.save(make_state(seed=3), 3)  # a failed engine refuses new saves
    monkeypatch.setattr(os, "replace", real_replace)

    # A crash before `latest` moved leaves checkpoint 2 committed (its manifest is durable): it is
    # found by scanning the manifests, `latest` being only a hint.
    expected_iteration, expected = (2, make_state(seed=2)) if crashing_rename == "latest" else (1, first)
    info = engine.latest_durable()
    assert info.iteration == expected_iteration
    assert_states_bitwise_equal(engine.load(info), expected)
    engine.close()
    # A replacement engine on the same directories cleans leftovers and finds the same checkpoint.
    replacement = make_engine()
    assert not list(tmp_path.rglob("*.tmp"))
    assert replacement.latest_durable().iteration == expected_iteration
    replacement.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_checksum_mismatch_on_load_names_the_file_and_tensor(tmp_path, kind):
    engine = (SynchronousCheckpointEngine(tmp_path / "store") if kind == "sync"
              else async_engine(tmp_path))
    engine.save(make_state(seed=4), 4)
    engine.wait_until_durable()
    info = engine.latest_durable()
    header, _ = read_header(info.data_path)
    offset = header["tensors"]["optimizer.exp_avg"]["offset"] + 5
    with open(info.data_path, "r+b") as file:
        file.seek(offset)
        original = file.read(1)
        file.seek(offset)
        file.write(bytes([original[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="optimizer.exp_avg") as raised:
        engine.load(info)
    assert str(info.data_path) in str(raised.value)
    engine.close()


def test_a_pool_smaller_than_one_tensor_still_saves_it(tmp_path):
    big = {"embedding": torch.randn(400, 256)}  # 400 KiB through a 64 KiB pool
    with async_engine(tmp_path, host_buffer_bytes=64 * 1024) as engine:
        engine.save(big, 1)
        engine.wait_before_optimizer_step()
        engine.wait_until_durable()
        assert engine.host_pool.peak_used_bytes <= engine.host_pool.capacity_bytes
        assert_states_bitwise_equal(engine.load(engine.latest_durable("remote")), big)


def test_a_throttled_flush_makes_wait_before_optimizer_step_block_longer(tmp_path):
    state = {"weights": torch.randn(512 * 1024)}  # 2 MiB
    pool_bytes = 256 * 1024
    rate_bytes_per_s = 8e6

    def blocked_s(directory: Path, throttle: float | None) -> float:
        engine = async_engine(directory, host_buffer_bytes=pool_bytes, chunk_bytes=64 * 1024,
                              throttle_local_bytes_per_s=throttle)
        with engine:
            engine.save(state, 1)
            blocked = engine.wait_before_optimizer_step()
            assert engine.stats().blocked_s_per_save[0] >= blocked
        return blocked

    fast = blocked_s(tmp_path / "fast", None)
    slow = blocked_s(tmp_path / "slow", rate_bytes_per_s)
    # Bytes beyond the pool must be flushed before the copy finishes: ≈ 0.23 s at 8 MB/s.
    must_flush_s = (4 * 512 * 1024 - pool_bytes) / rate_bytes_per_s
    assert slow >= 0.8 * must_flush_s
    assert slow > fast + 0.5 * must_flush_s


def test_after_node_loss_the_restore_comes_from_remote(tmp_path):
    engine = async_engine(tmp_path, throttle_remote_bytes_per_s=100_000)
    first = make_state(seed=1)
    engine.save(first, 1)
    engine.wait_until_durable()
    assert engine.latest_durable().level == "local"  # the fastest level wins a tie
    engine.save(make_state(seed=2), 2)
    engine.wait_before_optimizer_step()
    deadline = time.monotonic() + 10
    while engine.latest_durable("local").iteration != 2:  # local is quick, remote ~1 s behind
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.latest_durable().iteration == 2

    engine.lose_node_local_levels()

    info = engine.latest_durable()
    assert (info.level, info.iteration) == ("remote", 1)
    assert engine.latest_durable("local") is None
    assert not any((tmp_path / "local").iterdir())
    assert not list((tmp_path / "remote").glob("*.tmp"))
    assert_states_bitwise_equal(engine.load(info), first)
    # The replacement keeps checkpointing with the same engine.
    engine.save(make_state(seed=3), 3)
    engine.close()
    assert engine.latest_durable("remote").iteration == 3


def test_a_save_in_flight_at_the_boundary_where_its_node_died_is_lost_even_if_it_lands(tmp_path):
    engine = async_engine(tmp_path, throttle_remote_bytes_per_s=100_000)  # each remote copy ~0.3 s
    engine.save(make_state(seed=1), 1)
    engine.wait_until_durable()
    engine.mark_boundary()  # iteration 1 was durable before this boundary
    engine.save(make_state(seed=2), 2)
    engine.mark_boundary()  # the node dies here, with iteration 2 in flight...
    engine.wait_until_durable()  # ...which lands on remote before the loss is noticed
    assert engine.latest_durable("remote").iteration == 2

    engine.lose_node_local_levels()

    assert [info.iteration for info in engine.list_durable(surviving_node_loss=True)] == [1]
    assert not list((tmp_path / "remote").glob("iter0000000002-*"))  # neither manifest nor data
    engine.save(make_state(seed=3), 3)
    engine.close()
    assert engine.latest_durable("remote").iteration == 3


def test_a_replacement_engine_on_a_fresh_node_restores_from_remote(tmp_path):
    with async_engine(tmp_path) as engine:
        engine.save(make_state(seed=5), 5)
    replacement = LazyAsyncCheckpointEngine(
        tmp_path / "new-node-local", tmp_path / "remote", host_buffer_bytes=1 << 16
    )
    info = replacement.latest_durable()
    assert (info.level, info.iteration) == ("remote", 5)
    assert_states_bitwise_equal(replacement.load(info), make_state(seed=5))
    replacement.close()


def test_close_drains_every_pending_save_to_remote(tmp_path):
    engine = async_engine(tmp_path, throttle_remote_bytes_per_s=2_000_000, keep_last=5)
    for iteration in range(1, 4):
        engine.save(make_state(seed=iteration), iteration)
        engine.wait_before_optimizer_step()
    engine.close()
    assert [info.iteration for info in engine.list_durable("remote")] == [1, 2, 3]
    assert engine.stats().num_committed_per_level == {"local": 3, "remote": 3}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_keep_last_purges_older_checkpoints_at_every_level(tmp_path, kind):
    engine = (SynchronousCheckpointEngine(tmp_path / "store", keep_last=2) if kind == "sync"
              else async_engine(tmp_path, keep_last=2))
    for iteration in range(1, 6):
        engine.save(make_state(seed=iteration), iteration)
        engine.wait_before_optimizer_step()
        engine.wait_until_durable()
    for level in engine.level_names:
        infos = engine.list_durable(level)
        assert [info.iteration for info in infos] == [4, 5]
        directory = infos[0].data_path.parent
        assert sorted(p.suffix for p in directory.iterdir()) == ["", ".ckpt", ".ckpt", ".json",
                                                                  ".json"]
    engine.close()


def test_a_resave_of_an_older_iteration_after_rollback_becomes_latest(tmp_path):
    engine = SynchronousCheckpointEngine(tmp_path / "store", keep_last=3)
    for iteration in (10, 20, 15):  # rollback to 10, training reaches 15 again
        engine.save(make_state(seed=iteration), iteration)
    assert engine.latest_durable().iteration == 15
    assert [info.iteration for info in engine.list_durable()] == [10, 20, 15]


def test_spans_and_counters_describe_the_work(tmp_path):
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def record(kind: str, start_s: float, end_s: float) -> None:
        with lock:
            spans.append((kind, start_s, end_s))

    with async_engine(tmp_path, record_span=record) as engine:
        engine.save(make_state(seed=1), 1)
        engine.wait_before_optimizer_step()
        engine.wait_until_durable()
        engine.load(engine.latest_durable())
        stats = engine.stats()
    kinds = sorted(kind for kind, _, _ in spans)
    assert kinds.count("flush") == 2 and kinds.count("snapshot") == 1 and "load" in kinds
    assert all(end >= start for _, start, end in spans)
    file_nbytes = engine.latest_durable("remote").file_nbytes
    assert stats.bytes_written_per_level["remote"] == file_nbytes
    assert 0 < stats.bytes_written_per_level["local"] <= file_nbytes
    assert stats.num_saves == 1 and stats.total_blocked_s == sum(stats.blocked_s_per_save)


def test_host_pool_allocates_fifo_and_blocks_until_the_oldest_region_is_released():
    pool = HostPool(1024, pin_memory=False)
    first = pool.allocate(512, lambda: False)
    second = pool.allocate(256, lambda: False)
    third = pool.allocate(256, lambda: False)
    assert (first.start, second.start, third.start) == (0, 512, 768)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pool.allocate(300, lambda: False)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # full: waits for a release
    pool.release(first)
    waiter.join(timeout=5)
    assert got[0].start == 0  # wrapped to the freed front of the ring
    with pytest.raises(PoolStopped):
        pool.allocate(1024, lambda: True)
    with pytest.raises(AssertionError):
        pool.release(third)  # out of FIFO order


def test_metadata_manifest_and_latest_are_plain_json(tmp_path):
    engine = SynchronousCheckpointEngine(tmp_path / "store")
    engine.save(make_state(seed=2), 2)
    info = engine.latest_durable()
    manifest = json.loads(info.manifest_path.read_text())
    latest = json.loads((tmp_path / "store" / "latest").read_text())
    assert latest["manifest"] == info.manifest_path.name
    assert manifest["data_file_nbytes"] == info.data_path.stat().st_size
    header, _ = read_header(info.data_path)
    assert header["tensors"]["layer.bias_bf16"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096, 1 << 20])
def test_chunk_plan_covers_every_payload_byte_exactly_once(chunk_bytes):
    from churnsim.real.checkpoint.format import plan_layout
    from churnsim.real.checkpoint.snapshot import plan_chunks

    tensors = {"a": torch.zeros(5, dtype=torch.float32), "b": torch.zeros(0), "c": torch.zeros(3, 7, dtype=torch.float64), "d": torch.zeros(1, dtype=torch.int8)}
    layout = plan_layout(12, tensors, metadata_nbytes=10)
    covered = {}  # file offset → what lands there
    for chunk in plan_chunks(layout, chunk_bytes):
        assert 0 < chunk.nbytes <= chunk_bytes
        for key, tensor_offset, chunk_start, nbytes in chunk.pieces:
            for i in range(nbytes):
                position = chunk.file_offset + chunk_start + i
                assert position not in covered
                covered[position] = (key, tensor_offset + i)
        for start, end in chunk.gaps:
            for position in range(chunk.file_offset + start, chunk.file_offset + end):
                assert position not in covered
                covered[position] = ("padding", None)
    for entry in layout.tensors:
        for i in range(entry.nbytes):
            assert covered[entry.offset + i] == (entry.key, i)


def test_cached_layout_equals_a_fresh_plan_across_digit_boundaries():
    from churnsim.real.checkpoint.format import _plan_layout_uncached, plan_layout

    tensors = {"w": torch.zeros(4, 4), "step": torch.zeros(())}
    signature = tuple((key, t.dtype, tuple(t.shape)) for key, t in tensors.items())
    for iteration in (9, 10, 99, 100, 12345, 12346):
        assert plan_layout(iteration, tensors, 33) == _plan_layout_uncached(iteration, signature, 33)


def test_cleanup_leaves_a_live_writers_temp_file_and_removes_a_dead_ones(tmp_path):
    """A redundant host may be writing a lost stage's checkpoint while the replacement opens the level."""
    import os
    import subprocess
    import sys

    from churnsim.real.checkpoint.levels import LevelDirectory

    level = LevelDirectory(tmp_path, name="local", survives_node_loss=False, keep_last=2, run_id="run", stage=0)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(finished.stdout)  # exited: its pid is free (reuse within this test is vanishingly unlikely)
    live = tmp_path / f"iter0000000010-1.ckpt.{os.getppid()}.tmp"
    dead = tmp_path / f"iter0000000010-2.ckpt.{dead_pid}.tmp"
    for path in (live, dead):
        path.write_bytes(b"partial")
    level.remove_temporary_files()
    assert live.exists() and not dead.exists()
