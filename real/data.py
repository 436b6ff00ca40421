"""Byte-level training data from text already on the machine; no downloads.

The default corpus is the Python standard library's own `.py` sources (every machine that runs
churnsim has them), read in sorted path order and capped, so two machines with the same Python
version build the same corpus. `--corpus PATH` takes any text file or directory instead.

Tokens are bytes (vocab 256). The last `held_out_fraction` of the corpus is the held-out split for
eval loss. The training batch of iteration i is a pure function of (seed, i): a rollback to
iteration i replays exactly the same data.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from churnsim.calibration.errors import InputError
from churnsim.calibration.scenario import CORPUS_MAX_BYTES

BYTE_VOCAB_SIZE = 256
# Directories skipped in the standard library: installed third-party packages differ between
# machines, and some distributions ship the test suite separately.
_SKIPPED_STDLIB_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
_DATA_STREAM = 7


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of `text` as int64 token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: torch.Tensor) -> str:
    return bytes(int(t) for t in tokens.flatten()).decode("utf-8", errors="replace")


def default_corpus_files() -> list[Path]:
    """The standard library's `.py` files, sorted by their path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_STDLIB_DIRECTORIES)
        files.extend(Path(directory) / name for name in sorted(names) if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())


def load_corpus(path: str | Path | None = None, *, max_bytes: int = CORPUS_MAX_BYTES) -> bytes:
    """The corpus bytes: `path` (a text file or a directory of them) or the default stdlib corpus.

    Files are concatenated in sorted order until `max_bytes`; files holding NUL bytes (binary) are
    skipped.
    """
    if max_bytes < 1:
        raise InputError(f"corpus max_bytes must be >= 1, got {max_bytes}")
    if path is None:
        files, source = default_corpus_files(), "the Python standard library"
    else:
        corpus_path = Path(path)
        if not corpus_path.exists():
            raise InputError(f"corpus path {str(corpus_path)!r} does not exist: pass an existing text file or directory")
        files, source = _files_under(corpus_path), repr(str(corpus_path))
    chunks: list[bytes] = []
    total = 0
    for file in files:
        try:
            data = file.read_bytes()
        except OSError:
            continue
        if not data or b"\x00" in data:
            continue
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise InputError(f"corpus {source} holds no text: pass a non-empty text file or directory with --corpus")
    return b"".join(chunks)


@dataclass(frozen=True, kw_only=True)
class TokenData:
    """Train and held-out token streams and the sequence length batches are cut to."""

    train: torch.Tensor  # (N_train,) uint8
    held_out: torch.Tensor  # (N_held_out,) uint8
    seq_len: int

    @classmethod
    def from_bytes(cls, data: bytes, *, seq_len: int, held_out_fraction: float = 0.05, source: str = "corpus") -> TokenData:
        if not 0.0 < held_out_fraction < 1.0:
            raise InputError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        num_held_out = int(len(tokens) * held_out_fraction)
        train, held_out = tokens[: len(tokens) - num_held_out], tokens[len(tokens) - num_held_out :]
        for split, part in (("training", train), ("held-out", held_out)):
            if len(part) < seq_len + 1:
                raise InputError(
                    f"{source}: the {split} split has {len(part)} bytes, fewer than seq_len + 1 = {seq_len + 1}: "
                    "use a larger corpus or a shorter seq_len"
                )
        return cls(train=train, held_out=held_out, seq_len=seq_len)

    @classmethod
    def load(
        cls,
        path: str | Path | None,
        *,
        seq_len: int,
        held_out_fraction: float = 0.05,
        max_bytes: int = CORPUS_MAX_BYTES,
    ) -> TokenData:
        source = f"corpus {str(path)!r}" if path is not None else "the standard-library corpus"
        return cls.from_bytes(
            load_corpus(path, max_bytes=max_bytes), seq_len=seq_len, held_out_fraction=held_out_fraction, source=source
        )

    def _windows(self, stream: torch.Tensor, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.as_tensor(starts, dtype=torch.int64)[:, None] + torch.arange(self.seq_len + 1)
        windows = stream[offsets].to(torch.int64)  # (N, T + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def train_batch(self, *, seed: int, iteration: int, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (num_sequences, T): random windows that depend only on (seed, iteration)."""
        generator = np.random.default_rng(np.random.SeedSequence([seed, _DATA_STREAM, iteration]))
        starts = generator.integers(0, len(self.train) - self.seq_len, size=num_sequences)
        return self._windows(self.train, starts)

    def held_out_batches(self, *, num_batches: int, num_sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fixed held-out batches: evenly spaced windows over the held-out split, the same every call."""
        total = num_batches * num_sequences
        starts = np.linspace(0, len(self.held_out) - self.seq_len - 1, num=total).astype(np.int64)
        inputs, targets = self._windows(self.held_out, starts)
        return [
            (inputs[b * num_sequences : (b + 1) * num_sequences], targets[b * num_sequences : (b + 1) * num_sequences])
            for b in range(num_batches)
        ]


def split_microbatches(tensor: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split a (M·B, T) batch into M microbatches of B sequences."""
    if tensor.shape[0] % num_microbatches != 0:
        raise InputError(f"batch of {tensor.shape[0]} sequences does not split into {num_microbatches} microbatches")
    return list(tensor.chunk(num_microbatches))
