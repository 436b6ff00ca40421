"""Byte-level data: deterministic batches, a held-out split, clear errors for bad corpora."""

from __future__ import annotations

import pytest
import torch

from churnsim.calibration.errors import InputError
from churnsim.real.data import TokenData, decode, default_corpus_files, encode, load_corpus, split_microbatches

TEXT = ("def add(a, b):\n    return a + b\n" * 200).encode()


def test_byte_tokenizer_round_trips_unicode():
    text = "λ = 'churn' → ok"
    tokens = encode(text)
    assert int(tokens.max()) < 256 and decode(tokens) == text


def test_default_corpus_is_the_sorted_standard_library_capped():
    files = default_corpus_files()
    assert files and all(path.suffix == ".py" for path in files)
    assert not any("site-packages" in path.parts for path in files)
    corpus = load_corpus(max_bytes=100_000)
    assert len(corpus) == 100_000
    assert corpus == load_corpus(max_bytes=100_000)


def test_training_batch_is_a_pure_function_of_seed_and_iteration():
    data = TokenData.from_bytes(TEXT, seq_len=16)
    first = data.train_batch(seed=1, iteration=5, num_sequences=4)
    again = data.train_batch(seed=1, iteration=5, num_sequences=4)
    other = data.train_batch(seed=1, iteration=6, num_sequences=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_targets_are_inputs_shifted_by_one_token():
    data = TokenData.from_bytes(bytes(range(200)), seq_len=8, held_out_fraction=0.1)
    inputs, targets = data.train_batch(seed=0, iteration=0, num_sequences=3)
    assert inputs.shape == targets.shape == (3, 8)
    torch.testing.assert_close(targets[:, :-1], inputs[:, 1:])


def test_held_out_split_is_the_tail_of_the_corpus_and_disjoint_from_training():
    data = TokenData.from_bytes(bytes(range(200)), seq_len=8, held_out_fraction=0.1)
    assert len(data.held_out) == 20 and len(data.train) == 180
    assert int(data.held_out.min()) >= 180
    inputs, _ = data.train_batch(seed=3, iteration=9, num_sequences=50)
    assert int(inputs.max()) < 180
    batches = data.held_out_batches(num_batches=2, num_sequences=2)
    assert len(batches) == 2 and all(int(b[0].min()) >= 180 for b in batches)


def test_corpus_from_a_file_or_a_directory(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first ")
    (tmp_path / "binary.bin").write_bytes(b"\x00\x01")
    assert load_corpus(tmp_path) == b"first second"
    assert load_corpus(tmp_path / "b.txt") == b"second"


def test_split_microbatches_cuts_the_batch_into_equal_parts():
    parts = split_microbatches(torch.arange(12).reshape(6, 2), 3)
    assert [p.shape for p in parts] == [(2, 2)] * 3
    with pytest.raises(InputError):
        split_microbatches(torch.zeros(5, 2), 2)


def test_missing_corpus_raises_input_error_naming_the_path(tmp_path):
    with pytest.raises(InputError, match="does-not-exist"):
        load_corpus(tmp_path / "does-not-exist")


def test_empty_corpus_raises_input_error(tmp_path):
    with pytest.raises(InputError, match="no text"):
        load_corpus(tmp_path)


def test_corpus_shorter_than_a_sequence_raises_input_error():
    with pytest.raises(InputError, match="seq_len"):
        TokenData.from_bytes(b"tiny", seq_len=64)
