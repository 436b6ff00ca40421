"""The run's secret (real/run_secret.py) without training: the store's namespace, signed values, the
secret file, checkpoints bound by an HMAC, non-finite weights refused, endpoints on loopback only."""

from __future__ import annotations

import datetime
import hashlib
import json
import socket
import stat

import pytest
import torch
import torch.distributed as dist

from churnsim.calibration.errors import InputError
from churnsim.real.checkpoint import CheckpointCorruptError, SynchronousCheckpointEngine
from churnsim.real.checkpoint.manifest import _canonical
from churnsim.real.distributed import connect_store, serve_store
from churnsim.real.methods.checkpointing import check_finite_state
from churnsim.real.run_secret import (
    TOKEN_VARIABLE,
    checkpoint_key,
    new_token,
    read_secret_file,
    sign,
    store_namespace,
    token_from_environment,
    verify,
    write_secret_file,
)

RUN = "run-a"


def test_tokens_are_fresh_and_the_namespace_depends_on_them():
    first, second = new_token(), new_token()
    assert first != second and len(first) == 64
    assert store_namespace(first) != store_namespace(second)
    assert first not in store_namespace(first)  # the prefix does not reveal the secret


def test_a_signed_value_verifies_only_with_its_token_and_its_key():
    token = new_token()
    signed = sign(token, "generation-3/outcome", b"formed")
    assert verify(token, "generation-3/outcome", signed) == b"formed"
    assert verify(new_token(), "generation-3/outcome", signed) is None  # another run's
    assert verify(token, "generation-4/outcome", signed) is None  # replayed under another key
    assert verify(token, "generation-3/outcome", b"abandoned") is None  # unsigned
    forged = signed.replace(b"formed", b"abandn")
    assert verify(token, "generation-3/outcome", forged) is None


def test_the_secret_file_is_private_and_checked(tmp_path):
    path = tmp_path / "run.secret"
    token = new_token()
    write_secret_file(path, token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret_file(path) == token
    path.chmod(0o644)
    with pytest.raises(InputError, match="readable or writable by other users"):
        read_secret_file(path)
    path.chmod(0o600)
    path.write_text("not a token\n")
    with pytest.raises(InputError, match="not a churnsim run token"):
        read_secret_file(path)
    with pytest.raises(InputError, match="the run's secret is missing"):
        read_secret_file(tmp_path / "absent.secret")


def test_a_torchrun_rank_needs_the_token_in_its_environment(monkeypatch):
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    with pytest.raises(InputError, match=f"{TOKEN_VARIABLE} is not set"):
        token_from_environment()
    monkeypatch.setenv(TOKEN_VARIABLE, "guess")
    with pytest.raises(InputError, match="not a churnsim run token"):
        token_from_environment()
    token = new_token()
    monkeypatch.setenv(TOKEN_VARIABLE, token)
    assert token_from_environment() == token


def test_a_stranger_cannot_read_or_overwrite_the_run_s_keys():
    token = new_token()
    server = serve_store("127.0.0.1", 5.0)
    run = connect_store("127.0.0.1", server.port, token, 5.0)
    run.set("generation-0/outcome", sign(token, "generation-0/outcome", b"formed"))
    stranger = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=2))
    # The names the keys had before they lived under the run's namespace: nothing is there.
    assert not stranger.check(["generation-0/outcome"])
    stranger.set("generation-0/outcome", "abandoned")
    guessing = connect_store("127.0.0.1", server.port, new_token(), 5.0)  # a stranger with a token of its own
    assert not guessing.check(["generation-0/outcome"])
    guessing.set("generation-0/outcome", "abandoned")
    assert verify(token, "generation-0/outcome", bytes(run.get("generation-0/outcome"))) == b"formed"


def test_the_store_listens_on_loopback_only(external_address):
    address = external_address
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    server = serve_store("127.0.0.1", 5.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=2):
        pass  # reachable where it listens
    with pytest.raises(OSError):
        socket.create_connection((address, server.port), timeout=2).close()


def _state(scale: float = 1.0) -> dict:
    return {"module.weight": torch.full((4, 3), scale), "module.bias": torch.zeros(3), "step": 3}


def _forge(directory, engine_key: bytes | None, state: dict, iteration: int) -> None:
    """What a forger can do: write a checkpoint of the right run and stage with every checksum
    recomputed, by churnsim's own writer, with another key (or none)."""
    forger = SynchronousCheckpointEngine(directory, keep_last=5, run_id=RUN, stage=1, binding_key=engine_key)
    forger.save(state, iteration)
    forger.close()


@pytest.mark.parametrize("forger_key", [None, b"another run's key"], ids=["no-hmac", "wrong-hmac"])
def test_a_forged_checkpoint_with_recomputed_checksums_is_refused_loudly(tmp_path, forger_key):
    key = checkpoint_key(new_token())
    engine = SynchronousCheckpointEngine(tmp_path, keep_last=5, run_id=RUN, stage=1, binding_key=key)
    engine.save(_state(1.0), 2)
    _forge(tmp_path, forger_key, _state(666.0), 4)
    listed = engine.list_durable()
    assert [info.iteration for info in listed] == [2]  # the forged iteration 4 is not offered
    (skipped,) = engine.skipped()
    assert "binding_hmac" in skipped and "does not verify with this run's secret" in skipped
    assert torch.equal(engine.load(listed[0])["module.weight"], torch.full((4, 3), 1.0))
    engine.close()


def test_a_checkpoint_edited_after_its_hmac_was_made_is_refused(tmp_path):
    """Changing a signed manifest's fields (and recomputing its own checksum) breaks the HMAC."""
    key = checkpoint_key(new_token())
    engine = SynchronousCheckpointEngine(tmp_path, keep_last=5, run_id=RUN, stage=1, binding_key=key)
    engine.save(_state(), 2)
    (manifest_path,) = tmp_path.glob("*.manifest.json")
    fields = json.loads(manifest_path.read_text())
    fields["committed_unix_s"] += 1.0
    fields.pop("manifest_sha256")
    fields["manifest_sha256"] = hashlib.sha256(_canonical(fields)).hexdigest()
    manifest_path.write_text(json.dumps(fields))
    assert engine.list_durable() == [] and "binding_hmac" in engine.skipped()[0]
    engine.close()


def test_a_checkpoint_holding_nan_weights_is_not_loaded(tmp_path):
    state = _state()
    state["module.weight"][1, 2] = float("nan")
    with pytest.raises(CheckpointCorruptError, match="'module.weight' holds NaN or infinite values"):
        check_finite_state(state, "iter2.ckpt")
    state["module.weight"][1, 2] = float("inf")
    with pytest.raises(CheckpointCorruptError):
        check_finite_state(state, "iter2.ckpt")
    check_finite_state(_state(), "iter2.ckpt")  # finite: loads
    check_finite_state({"mask": torch.tensor([True]), "step": torch.tensor(3)}, "iter2.ckpt")  # not floating point


def test_the_checkpoint_key_stays_out_of_the_record_and_repr():
    from churnsim.real.model import MODEL_PRESETS
    from churnsim.real.trainer import TrainingConfig

    key = checkpoint_key(new_token())
    config = TrainingConfig(model=MODEL_PRESETS["tiny"], num_stages=2, num_microbatches=1, microbatch_size=1, num_iterations=1,
                            seed=1, checkpoint_key=key)  # fmt: skip
    assert "checkpoint_key" not in config.to_dict() and key.hex() not in repr(config) and str(key) not in repr(config)


@pytest.mark.parametrize("host", ["203.0.113.9", "no-such-host.invalid"])
def test_a_rendezvous_host_this_machine_cannot_listen_on_is_one_line_before_anything_is_written(tmp_path, host, assert_one_line_error):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "churnsim", "real", "run", "--preset", "cpu-tiny", "--method", "checkpoint",
         "--rendezvous-host", host, "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_one_line_error(result, "--rendezvous-host", host)
    assert not (tmp_path / "run").exists()
