"""No pickle from disk or network in real/: what ranks exchange and store is JSON plus raw tensors."""

from __future__ import annotations

import dataclasses
import math
import pickle
import re
from pathlib import Path

import pytest
import torch

from churnsim.real.methods import RecoveryOutcome
from churnsim.real.safe_codec import SafeCodecError, decode, encode, register_dataclass
from churnsim.real.trainer import RankResult

REAL = Path(__file__).resolve().parents[2] / "real"


def test_values_ranks_exchange_round_trip_exactly():
    value = {
        "rank": RankResult(rank=1, stage=1, iteration_rows=[{"step": 0, "train_loss": math.nan, "eval_loss": None}]),
        "outcome": RecoveryOutcome(failed_stages=frozenset({1, 2}), rebuilt_from={1: "replica"}, notes=("a",)),
        ("1f1b", True): {"gradients": {"w": torch.randn(3, 4), "h": torch.randn(2).to(torch.bfloat16)}, "kinds": {"forward"}},
        "empty": torch.empty(0, 5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "dtype": torch.float16,
        "path": Path("/tmp/x"),
        "$odd key": [1, 2.5, "s", None, True, (1, (2,))],
        "inf": -math.inf,
    }
    decoded = decode(encode(value))
    assert decoded.keys() == value.keys()
    assert decoded["outcome"] == value["outcome"]
    assert decoded["rank"].iteration_rows[0]["eval_loss"] is None and math.isnan(decoded["rank"].iteration_rows[0]["train_loss"])
    gradients = decoded[("1f1b", True)]["gradients"]
    assert torch.equal(gradients["w"], value[("1f1b", True)]["gradients"]["w"])
    assert gradients["h"].dtype == torch.bfloat16 and torch.equal(gradients["h"], value[("1f1b", True)]["gradients"]["h"])
    assert decoded[("1f1b", True)]["kinds"] == {"forward"}
    assert decoded["empty"].shape == (0, 5) and torch.equal(decoded["strided"], value["strided"])
    assert decoded["dtype"] is torch.float16 and decoded["path"] == Path("/tmp/x")
    assert decoded["$odd key"] == value["$odd key"] and decoded["inf"] == -math.inf


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_bytes_are_refused_without_running_them(tmp_path):
    marker = tmp_path / "code-ran"
    with pytest.raises(SafeCodecError, match="bad magic"):
        decode(pickle.dumps(_Exploit(marker)))
    assert not marker.exists()


@pytest.mark.parametrize(
    "tree",
    [
        b'{"value":{"$dataclass":"os.system","fields":{}},"tensors":[]}',
        b'{"value":{"$dataclass":"subprocess.Popen","fields":{"args":"touch x"}},"tensors":[]}',
        b'{"value":{"$dtype":"load"},"tensors":[]}',
        b'{"value":{"$tensor":0},"tensors":[]}',
        b'{"value":1,"tensors":[{"dtype":"float32","shape":[1000000000],"nbytes":4000000000}]}',
        b'{"value":{"$unknown":1},"tensors":[]}',
    ],
)
def test_a_crafted_message_can_only_describe_data(tree):
    message = b"CHSIMWR1" + len(tree).to_bytes(8, "little") + tree
    with pytest.raises(SafeCodecError):
        decode(message)


def test_values_that_would_need_pickle_are_refused_when_sent():
    @dataclasses.dataclass
    class NotAllowed:
        x: int

    with pytest.raises(SafeCodecError, match="not on the allow-list"):
        encode(NotAllowed(1))
    with pytest.raises(SafeCodecError, match="function"):
        encode({"f": print})
    register_dataclass(NotAllowed)
    assert decode(encode(NotAllowed(1))) == NotAllowed(1)


def test_real_reads_no_pickle_from_disk_or_network():
    """Static guard over real/: no pickle, no torch.load without weights_only=True, no *_object collectives."""
    forbidden = [
        (re.compile(r"^\s*(import pickle|from pickle|import cPickle|import dill|import cloudpickle)", re.M), "pickle import"),
        (re.compile(r"pickle\.loads?\("), "pickle.load"),
        (re.compile(r"torch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only=True"),
        (re.compile(r"dist\.(all_gather_object|gather_object|broadcast_object_list|scatter_object_list|recv_object_list|send_object_list)\("), "pickling collective"),
        (re.compile(r"numpy\.load\([^)]*allow_pickle=True|np\.load\([^)]*allow_pickle=True"), "numpy pickle"),
    ]
    problems = []
    for path in sorted(REAL.rglob("*.py")):
        text = path.read_text()
        for pattern, what in forbidden:
            for match in pattern.finditer(text):
                problems.append(f"{path.relative_to(REAL.parent)}:{text[: match.start()].count(chr(10)) + 1}: {what}")
    assert problems == []
