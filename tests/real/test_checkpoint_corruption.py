"""Damaged, foreign and planted checkpoints: every case is found, with the engine's own error, and never loads wrong.

Each case damages the newest of three checkpoints of one run and stage (or the directory around
them) and then checks the two promises of the loader: a listed checkpoint either loads bit for bit
what was saved or raises CheckpointCorruptError naming the file, and recovery still reaches the
newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import struct
import time
from pathlib import Path

import pytest
import torch

from churnsim.real.checkpoint import CheckpointCorruptError, LazyAsyncCheckpointEngine, SynchronousCheckpointEngine
from churnsim.real.checkpoint.format import read_header
from churnsim.real.checkpoint.manifest import _canonical

RUN = "run-a"


def make_state(iteration: int) -> dict:
    generator = torch.Generator().manual_seed(iteration)
    return {
        "layer.weight": torch.randn(32, 24, generator=generator),
        "layer.bias_bf16": torch.randn(24, generator=generator).to(torch.bfloat16),
        "optimizer.step": torch.tensor(float(iteration)),
        "mask": torch.rand(9, generator=generator) > 0.5,
        "optimizer.param_groups": [{"lr": 1e-3 * iteration, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None}],
        "iteration": iteration,
    }


def assert_state_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
        else:
            assert loaded[key] == value, key


def sync_engine(directory: Path, *, run_id: str = RUN, stage: int = 1) -> SynchronousCheckpointEngine:
    return SynchronousCheckpointEngine(directory, keep_last=5, run_id=run_id, stage=stage)


@pytest.fixture()
def store(tmp_path) -> Path:
    """Checkpoints of iterations 1, 2, 3 of run-a, stage 1 in tmp_path/store."""
    engine = sync_engine(tmp_path / "store")
    for iteration in (1, 2, 3):
        engine.save(make_state(iteration), iteration)
    engine.close()
    return tmp_path / "store"


def files(store: Path, iteration: int) -> tuple[Path, Path]:
    (manifest,) = store.glob(f"iter{iteration:010d}-*.manifest.json")
    return manifest, manifest.with_name(manifest.name.replace(".manifest.json", ".ckpt"))


def flip(path: Path, offset: int, mask: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def flip_digit_of(manifest: Path, field: str) -> None:
    """Change one digit of a number in the manifest (still valid JSON, still a number)."""
    text = manifest.read_text()
    start = text.index(f'"{field}": ') + len(field) + 4
    flip(manifest, start + 2, mask=0x01)  # '0' <-> '1', '2' <-> '3', ...


def tensor_offset(data_file: Path, key: str) -> int:
    header, _ = read_header(data_file)
    return header["tensors"][key]["offset"] + header["tensors"][key]["nbytes"] // 2


def rewrite_manifest(manifest: Path, **changes) -> None:
    """A consistent forgery: fields changed and the manifest's own checksum recomputed."""
    fields = json.loads(manifest.read_text())
    fields.update(changes)
    fields.pop("manifest_sha256")
    fields["manifest_sha256"] = hashlib.sha256(_canonical(fields)).hexdigest()
    manifest.write_text(json.dumps(fields))


def forge(data_file: Path, manifest: Path, edit=None, metadata: bytes | None = None) -> None:
    """A consistent forgery: the data file rebuilt (header room to spare, `edit(header)` applied last,
    `metadata` bytes with their right checksum) and the manifest made to agree with it."""
    raw = data_file.read_bytes()
    (length,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + length])
    pieces = [raw[e["offset"] : e["offset"] + e["nbytes"]] for e in header["tensors"].values()]
    meta = header["metadata"]
    metadata = raw[meta["offset"] : meta["offset"] + meta["nbytes"]] if metadata is None else metadata
    room = 8192
    offset = 16 + room
    for entry, piece in zip(header["tensors"].values(), pieces):
        entry["offset"] = offset
        offset += len(piece)
    meta.update(offset=offset, nbytes=len(metadata), sha256=hashlib.sha256(metadata).hexdigest())
    if edit is not None:
        edit(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    prefix = raw[:8] + struct.pack("<Q", room) + body.ljust(room, b" ")
    data_file.write_bytes(prefix + b"".join(pieces) + metadata)
    rewrite_manifest(manifest, header_sha256=hashlib.sha256(prefix).hexdigest(), data_file_nbytes=data_file.stat().st_size)


def _rename_to_sequence(paths: tuple[Path, Path], sequence: int) -> None:
    """A consistent forgery of a newer save: manifest and data file renamed, the manifest rewritten."""
    manifest, data_file = paths
    stem = f"iter{3:010d}-{sequence:020d}"
    data_file.rename(data_file.with_name(stem + ".ckpt"))
    new_manifest = manifest.rename(manifest.with_name(stem + ".manifest.json"))
    rewrite_manifest(new_manifest, sequence=sequence, data_file=stem + ".ckpt")


def _swap(a: Path, b: Path) -> None:
    temporary = a.with_name("swap.tmp-name")
    a.rename(temporary)
    b.rename(a)
    temporary.rename(b)


# Each case damages the store and names the iterations whose checkpoints must no longer load.
CASES = {
    "data file truncated": lambda s: files(s, 3)[1].write_bytes(files(s, 3)[1].read_bytes()[:-700]),
    "data file truncated to nothing": lambda s: files(s, 3)[1].write_bytes(b""),
    "data file truncated and re-padded to its size": lambda s: files(s, 3)[1].write_bytes(
        files(s, 3)[1].read_bytes()[:2000].ljust(files(s, 3)[1].stat().st_size, b"\0")),
    "bit flip in tensor data": lambda s: flip(files(s, 3)[1], tensor_offset(files(s, 3)[1], "layer.weight")),
    "bit flip in a bf16 tensor": lambda s: flip(files(s, 3)[1], tensor_offset(files(s, 3)[1], "layer.bias_bf16")),
    "bit flip in the magic": lambda s: flip(files(s, 3)[1], 2),
    "bit flip in the header length": lambda s: flip(files(s, 3)[1], 9),
    "bit flip in the JSON header": lambda s: flip(files(s, 3)[1], 40),
    "bit flip in the metadata": lambda s: flip(files(s, 3)[1], files(s, 3)[1].stat().st_size - 5),
    "bit flip in the manifest's JSON": lambda s: flip(files(s, 3)[0], files(s, 3)[0].read_text().index("data_file_nbytes") + 20),
    "bit flip in the manifest's data size": lambda s: flip_digit_of(files(s, 3)[0], "data_file_nbytes"),
    "bit flip in the manifest's header checksum": lambda s: flip(
        files(s, 3)[0], files(s, 3)[0].read_text().index('"header_sha256": ') + 20, mask=0x01),
    "bit flip in the manifest's timestamp": lambda s: flip_digit_of(files(s, 3)[0], "committed_unix_s"),
    "manifest truncated": lambda s: files(s, 3)[0].write_bytes(files(s, 3)[0].read_bytes()[:100]),
    "garbage manifest": lambda s: files(s, 3)[0].write_bytes(random.Random(1).randbytes(300)),
    "manifest of the wrong shape": lambda s: files(s, 3)[0].write_text("[1, 2, 3]"),
    "manifest deleted": lambda s: files(s, 3)[0].unlink(),
    "data file deleted": lambda s: files(s, 3)[1].unlink(),
    "data files of two checkpoints swapped": lambda s: _swap(files(s, 3)[1], files(s, 2)[1]),
    "manifests of two checkpoints swapped": lambda s: _swap(files(s, 3)[0], files(s, 2)[0]),
    "manifest bound to another stage": lambda s: rewrite_manifest(files(s, 3)[0], stage=2),
    "manifest bound to another run": lambda s: rewrite_manifest(files(s, 3)[0], run_id="run-b"),
    "manifest with a sequence in the future": lambda s: _rename_to_sequence(files(s, 3), 10**19),
    "forged header naming a function as dtype": lambda s: forge(
        *reversed(files(s, 3)), lambda h: h["tensors"]["layer.weight"].update(dtype="load")),
    "forged header with a tensor past the end": lambda s: forge(
        *reversed(files(s, 3)), lambda h: h["tensors"]["mask"].update(offset=10**12)),
    "forged header with a huge tensor": lambda s: forge(
        *reversed(files(s, 3)), lambda h: h["tensors"]["mask"].update(shape=[10**7, 10**6], nbytes=10**13)),
    "forged header declaring pickled metadata": lambda s: forge(
        *reversed(files(s, 3)), lambda h: h["metadata"].update(encoding="pickle")),
    "forged metadata that is not JSON": lambda s: forge(*reversed(files(s, 3)), metadata=b"\x80\x04K\x01."),
    "forged metadata with an unknown tag": lambda s: forge(*reversed(files(s, 3)), metadata=b'{"x":{"$dataclass":"os.system","fields":{}}}'),
    "forged header of an older format version": lambda s: forge(
        *reversed(files(s, 3)), lambda h: h.update(format_version=1)),
}
# Which checkpoints each case leaves unloadable (default: the newest, 3).
UNLOADABLE = {"data files of two checkpoints swapped": {2, 3}, "manifests of two checkpoints swapped": {2, 3}}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_corruption_is_refused_with_the_engines_error_and_recovery_reaches_the_newest_intact(store, case):
    CASES[case](store)
    engine = sync_engine(store)
    unloadable = UNLOADABLE.get(case, {3})
    loaded = set()
    for info in engine.list_durable():
        try:
            state = engine.load(info)
        except CheckpointCorruptError as error:
            assert str(info.data_path.parent) in str(error)  # the error names the file
            continue
        assert_state_equal(state, make_state(info.iteration))  # never a wrong state
        loaded.add(info.iteration)
    assert loaded == {1, 2, 3} - unloadable
    newest_intact = max(loaded)
    # What recovery does: the newest listed checkpoint that loads.
    for info in reversed(engine.list_durable()):
        try:
            assert_state_equal(engine.load(info), make_state(info.iteration))
            break
        except CheckpointCorruptError:
            continue
    assert info.iteration == newest_intact
    # Whatever the listing skipped is reported, one line per file.
    if not any(i.iteration == 3 for i in engine.list_durable()):
        assert any(str(store) in line for line in engine.skipped())
    engine.close()


@pytest.mark.parametrize("seed", range(6))
def test_any_bit_flip_anywhere_is_either_refused_or_harmless(store, seed):
    """40 random bit flips per seed over data file and manifest: each is detected or changes nothing loaded."""
    manifest, data_file = files(store, 3)
    rng = random.Random(seed)
    originals = {path: path.read_bytes() for path in (manifest, data_file)}
    engine = sync_engine(store)
    for _ in range(40):
        path = rng.choice([manifest, data_file])
        flip(path, rng.randrange(len(originals[path])))
        infos = [info for info in engine.list_durable() if info.iteration == 3]
        for info in infos:
            try:
                assert_state_equal(engine.load(info), make_state(3))  # harmless: e.g. a flip in padding
            except CheckpointCorruptError:
                pass
        path.write_bytes(originals[path])
    engine.close()


def test_a_lost_latest_pointer_hides_nothing(store):
    (store / "latest").unlink()
    engine = sync_engine(store)
    assert [info.iteration for info in engine.list_durable()] == [1, 2, 3]
    assert engine.latest_durable().iteration == 3
    (store / "latest").write_text("garbage {")
    assert engine.latest_durable().iteration == 3
    engine.close()


def test_a_broken_oldest_manifest_does_not_block_recovery(store):
    manifest, _ = files(store, 1)
    manifest.write_text("{not json")
    engine = sync_engine(store)
    assert [info.iteration for info in engine.list_durable()] == [2, 3]
    assert_state_equal(engine.load(engine.latest_durable()), make_state(3))
    (line,) = engine.skipped()
    assert manifest.name in line and "not valid JSON" in line
    engine.save(make_state(4), 4)  # and saving (with its purge) goes on
    assert engine.latest_durable().iteration == 4
    engine.close()


def test_swapped_stage_directories_are_refused_not_loaded(tmp_path):
    """Stage 2's checkpoints where stage 1's should be: nothing is listed, a direct load is refused with one line."""
    for stage in (1, 2):
        engine = sync_engine(tmp_path / f"stage-{stage}", stage=stage)
        engine.save(make_state(10 * stage), 5)
        engine.close()
    (tmp_path / "stage-1").rename(tmp_path / "tmp")
    (tmp_path / "stage-2").rename(tmp_path / "stage-1")
    stage_1 = sync_engine(tmp_path / "stage-1", stage=1)
    assert stage_1.list_durable() == [] and stage_1.latest_durable() is None
    assert any("another run or stage" in line for line in stage_1.skipped())
    planted = sync_engine(tmp_path / "stage-1", stage=2).latest_durable()
    with pytest.raises(CheckpointCorruptError, match=r"'stage' = 'run-a', 2 .* stage 1") as raised:
        stage_1.load(planted)
    assert "\n" not in str(raised.value)
    stage_1.close()


def test_a_planted_checkpoint_of_another_run_is_never_chosen_by_its_sequence(tmp_path):
    own = sync_engine(tmp_path / "store")
    own.save(make_state(1), 1)
    own.close()
    intruder = sync_engine(tmp_path / "store", run_id="another-run")
    intruder._last_sequence = time.time_ns() + 3600 * 10**9  # an hour ahead: newest by far
    intruder.save(make_state(99), 99)
    intruder.close()
    engine = sync_engine(tmp_path / "store")
    assert engine.latest_durable().iteration == 1
    with pytest.raises(CheckpointCorruptError, match="another run or stage"):
        engine.load(sync_engine(tmp_path / "store", run_id="another-run").latest_durable())
    engine.save(make_state(2), 2)  # the own run's purge never deletes the other run's files
    assert len(list((tmp_path / "store").glob("*.ckpt"))) == 3
    engine.close()


def test_a_checkpoint_outside_the_engines_levels_is_refused(tmp_path):
    other = sync_engine(tmp_path / "elsewhere")
    other.save(make_state(1), 1)
    engine = sync_engine(tmp_path / "store")
    with pytest.raises(CheckpointCorruptError, match="not in level"):
        engine.load(other.latest_durable())


class _Exploit:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant_pickle_checkpoint(store: Path, marker: Path, *, version: int) -> None:
    """A checkpoint whose metadata is a pickle that would create `marker`, with every checksum right
    (version 1: the old format, which stored pickled metadata; version 2: pickle bytes where JSON belongs)."""
    manifest, data_file = files(store, 3)
    payload = pickle.dumps({"iteration": _Exploit(marker)})

    def edit(header: dict) -> None:
        if version == 1:  # the old header: no binding, pickle encoding
            for name in ("run_id", "stage"):
                header.pop(name)
            header.update(format_version=1)
            header["metadata"]["encoding"] = "pickle"

    forge(data_file, manifest, edit, metadata=payload)


@pytest.mark.parametrize("version", [1, 2])
def test_a_crafted_pickle_in_the_metadata_cannot_run_code_and_is_refused(store, tmp_path, version):
    marker = tmp_path / "code-ran"
    assert pickle.loads(pickle.dumps(_Exploit(marker))) is None and marker.exists()  # the payload works...
    marker.unlink()
    _plant_pickle_checkpoint(store, marker, version=version)
    engine = sync_engine(store)
    infos = [info for info in engine.list_durable() if info.iteration == 3]
    if infos:  # version 2 passes the cheap checks (its checksums are right); loading refuses it
        with pytest.raises(CheckpointCorruptError, match="metadata: not valid JSON"):
            engine.load(infos[0])
    else:  # version 1 is refused by the header check already
        assert any("format_version' = 1" in line for line in engine.skipped())
    assert engine.latest_durable().iteration in (2, 3)
    assert not marker.exists()  # ...and was never unpickled
    engine.close()


def test_the_async_engine_refuses_a_corrupted_remote_copy_and_falls_back(tmp_path):
    engine = LazyAsyncCheckpointEngine(tmp_path / "local", tmp_path / "remote", host_buffer_bytes=1 << 16, run_id=RUN, stage=1)
    for iteration in (1, 2):
        engine.save(make_state(iteration), iteration)
        engine.wait_until_durable()
    engine.lose_node_local_levels()
    _, data_file = files(tmp_path / "remote", 2)
    flip(data_file, tensor_offset(data_file, "layer.weight"))
    remote = engine.list_durable(surviving_node_loss=True)
    assert [info.iteration for info in remote] == [1, 2]
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch for tensor 'layer.weight'"):
        engine.load(remote[-1])
    assert_state_equal(engine.load(remote[0]), make_state(1))
    engine.close()


def test_surviving_node_loss_reads_only_levels_that_survive(tmp_path):
    engine = LazyAsyncCheckpointEngine(tmp_path / "local", tmp_path / "remote", host_buffer_bytes=1 << 16,
                                       throttle_remote_bytes_per_s=1.0)  # nothing reaches remote
    engine.save(make_state(1), 1)
    engine.wait_before_optimizer_step()
    while engine.latest_durable("local") is None:
        time.sleep(0.01)
    assert engine.latest_durable().level == "local"
    assert engine.latest_durable(surviving_node_loss=True) is None
    assert engine.list_durable(surviving_node_loss=True) == []
    engine.lose_node_local_levels()  # stops the (throttled) remote copy
    engine.close()
