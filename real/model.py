"""A LLaMA-style decoder cut into pipeline stages, and the whole-model reference it must equal.

Architecture (as in the CheckFree reference model, simplellm): pre-norm blocks with RMSNorm,
multi-head causal attention with rotary position embeddings (RoPE, theta 10,000), a SwiGLU feed
forward with hidden size 4·d, no biases, weights initialised N(0, 0.02), RMSNorm gains 1, and an
untied lm_head. The loss is computed in fp32.

Stage s of S holds blocks [s·L/S, (s+1)·L/S); stage 0 also holds the token embedding, stage S-1 the
final norm and the lm_head. Block parameter names are stage-independent (`blocks.0.attention.wq.weight`
on every stage), so two stages' block state dicts line up key by key: CheckFree averages them.

Every parameter is initialised from its own generator, seeded from (seed, part, global layer index),
so a stage's weights do not depend on how the model is cut: `Transformer(config, seed)` has exactly
the weights of `StageModule(config, s, S, seed)` concatenated over s, for every S.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from churnsim.calibration.errors import InputError

# Seed-stream codes: each part of the model draws from its own generator.
_EMBEDDING_STREAM = 0
_BLOCK_STREAM = 1
_HEAD_STREAM = 2


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the model; every stage of a run uses the same config."""

    vocab_size: int
    """Number of token ids (256 for the byte-level tokenizer)."""
    dim: int
    """Model width d."""
    num_heads: int
    """Attention heads; dim must be divisible by num_heads."""
    num_layers: int
    """Transformer blocks L in the whole model."""
    seq_len: int
    """Tokens per sequence (the RoPE tables are built for this length)."""
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden size; None means 4·dim (the CheckFree reference's choice)."""
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_heads", "num_layers", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise InputError(f"model {name} must be >= 1, got {value}")
        if self.dim % self.num_heads != 0 or (self.dim // self.num_heads) % 2 != 0:
            raise InputError(
                f"model dim {self.dim} must be divisible by num_heads {self.num_heads} into an even head "
                "size (RoPE rotates pairs): change dim or num_heads"
            )

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim if self.ffn_hidden_dim is not None else 4 * self.dim

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


MODEL_PRESETS: dict[str, ModelConfig] = {
    # For tests and CPU smoke runs: seconds per iteration on one core.
    "tiny": ModelConfig(vocab_size=256, dim=64, num_heads=4, num_layers=4, seq_len=64),
    # The CheckFree paper's presets (reference sheet section 5); listed, not exercised on CPU.
    "124M": ModelConfig(vocab_size=32_000, dim=512, num_heads=8, num_layers=12, seq_len=512),
    "500M": ModelConfig(vocab_size=32_000, dim=1024, num_heads=16, num_layers=24, seq_len=1024),
    "1.5B": ModelConfig(vocab_size=32_000, dim=2048, num_heads=16, num_layers=24, seq_len=4096),
}


def model_preset(name: str, **overrides: object) -> ModelConfig:
    """A named model config, optionally with fields replaced (e.g. `vocab_size=256`)."""
    if name not in MODEL_PRESETS:
        raise InputError(f"unknown model preset {name!r}: use one of {', '.join(MODEL_PRESETS)}")
    return dataclasses.replace(MODEL_PRESETS[name], **overrides)  # type: ignore[arg-type]


def check_stage_split(num_layers: int, num_stages: int) -> None:
    """Every stage must hold the same number of blocks so that neighbours' blocks can be averaged."""
    if num_stages < 1 or num_stages > num_layers:
        raise InputError(
            f"num_stages {num_stages} must be between 1 and num_layers {num_layers}: "
            "reduce num_stages or increase num_layers"
        )
    if num_layers % num_stages != 0:
        raise InputError(
            f"num_layers {num_layers} is not divisible by num_stages {num_stages}: "
            "choose num_layers as a multiple of num_stages"
        )


def derive_seed(seed: int, *path: int) -> int:
    """An independent 63-bit seed for the stream named by `path` (numpy SeedSequence hashing)."""
    state = np.random.SeedSequence([seed, *path]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def training_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs per token ≈ 6N + 12·L·d·T (PaLM, Chowdhery et al. 2022, appendix B).

    N counts the matmul parameters (blocks and lm_head; the embedding is a lookup). The attention
    term ignores the causal mask, as PaLM does; an approximation within a few per cent for T ≪ 6d.
    """
    per_block = 4 * config.dim * config.dim + 3 * config.dim * config.hidden_dim
    num_matmul_parameters = config.num_layers * per_block + config.dim * config.vocab_size
    return 6.0 * num_matmul_parameters + 12.0 * config.num_layers * config.dim * config.seq_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, head_dim/2) (Su et al. 2021, RoFormer)."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), frequencies)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (B, H, T, hd) by the position's angles."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, H, T, hd/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]  # (T, hd/2)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape  # (B, T, d)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, dim // self.num_heads).transpose(1, 2)  # (B, H, T, hd)

        q = apply_rope(heads(self.wq(x)), cos, sin)
        k = apply_rope(heads(self.wk(x)), cos, sin)
        v = heads(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(batch, length, dim))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def _init_module(module: nn.Module, seed: int, stream: int, index: int, std: float) -> None:
    """Norm gains 1, everything else N(0, std), from a generator owned by this (stream, index)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, stream, index))
    with torch.no_grad():
        for submodule in module.modules():  # fixed registration order: the draws are reproducible
            for parameter in submodule.parameters(recurse=False):
                if isinstance(submodule, RMSNorm):
                    parameter.fill_(1.0)
                else:
                    values = torch.empty(parameter.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
                    parameter.copy_(values)


class _ModelParts(nn.Module):
    """What StageModule and Transformer share: RoPE buffers and the part-wise initialisation."""

    def _setup_rope(self, config: ModelConfig) -> None:
        cos, sin = rope_tables(config.head_dim, config.seq_len, config.rope_theta)
        # Not persistent: state dicts hold only weights, so neighbours' state dicts align.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


class StageModule(_ModelParts):
    """Stage `stage` of `num_stages`: its blocks, plus the embedding (first) or norm + lm_head (last)."""

    def __init__(self, config: ModelConfig, stage: int, num_stages: int, *, seed: int = 0) -> None:
        super().__init__()
        check_stage_split(config.num_layers, num_stages)
        if not 0 <= stage < num_stages:
            raise InputError(f"stage {stage} is outside 0..{num_stages - 1}")
        self.config = config
        self.stage = stage
        self.num_stages = num_stages
        self.layers_per_stage = config.num_layers // num_stages
        self.first_layer = stage * self.layers_per_stage
        self.embedding = nn.Embedding(config.vocab_size, config.dim) if stage == 0 else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(self.layers_per_stage))
        self.is_last = stage == num_stages - 1
        self.norm = RMSNorm(config.dim, config.norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False) if self.is_last else None
        self._setup_rope(config)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Fresh weights from `seed`; equal to the reference model's for the same seed."""
        std = self.config.init_std
        if self.embedding is not None:
            _init_module(self.embedding, seed, _EMBEDDING_STREAM, 0, std)
        for offset, block in enumerate(self.blocks):
            _init_module(block, seed, _BLOCK_STREAM, self.first_layer + offset, std)
        if self.norm is not None and self.lm_head is not None:
            _init_module(_Head(self.norm, self.lm_head), seed, _HEAD_STREAM, 0, std)

    def part_parameters(self, part: str) -> dict[str, nn.Parameter]:
        """Named parameters of one part: `blocks`, `embedding` or `head` (final norm + lm_head)."""
        prefixes = {"blocks": ("blocks.",), "embedding": ("embedding.",), "head": ("norm.", "lm_head.")}
        if part not in prefixes:
            raise ValueError(f"unknown part {part!r}")
        return {name: p for name, p in self.named_parameters() if name.startswith(prefixes[part])}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) int64 → (B, T, d)."""
        assert self.embedding is not None, "only stage 0 embeds"
        return self.embedding(tokens)

    def run_blocks(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, d) → (B, T, d) through this stage's blocks."""
        for block in self.blocks:
            hidden = block(hidden, self.rope_cos, self.rope_sin)
        return hidden

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of (B, T, d) hidden states against (B, T) targets, in fp32."""
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the head"
        logits = self.lm_head(self.norm(hidden)).float()  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Head(nn.Module):
    """Groups norm + lm_head so both parts draw from one generator, in one fixed order."""

    def __init__(self, norm: RMSNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head


class Transformer(_ModelParts):
    """The whole model in one process: the single-process reference for the pipeline."""

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._setup_rope(config)
        std = config.init_std
        _init_module(self.embedding, seed, _EMBEDDING_STREAM, 0, std)
        for index, block in enumerate(self.blocks):
            _init_module(block, seed, _BLOCK_STREAM, index, std)
        _init_module(_Head(self.norm, self.lm_head), seed, _HEAD_STREAM, 0, std)

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        num_stages: int = 1,
        stage_order: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy; `stage_order` runs the blocks of each of `num_stages` chunks in that order
        (CheckFree+'s swapped order for odd microbatches)."""
        check_stage_split(self.config.num_layers, num_stages)
        per_stage = self.config.num_layers // num_stages
        order = stage_order if stage_order is not None else tuple(range(num_stages))
        hidden = self.embedding(tokens)  # (B, T, d)
        for stage in order:
            for block in self.blocks[stage * per_stage : (stage + 1) * per_stage]:
                hidden = block(hidden, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(hidden)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_parameter_name(name: str, *, stage: int, num_stages: int, num_layers: int) -> str:
    """The Transformer parameter name of a StageModule parameter (`blocks.0.x` of stage 1 → `blocks.3.x`)."""
    if not name.startswith("blocks."):
        return name
    _, local, rest = name.split(".", 2)
    return f"blocks.{stage * (num_layers // num_stages) + int(local)}.{rest}"


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = [
    "MODEL_PRESETS",
    "ModelConfig",
    "StageModule",
    "Transformer",
    "check_stage_split",
    "count_parameters",
    "derive_seed",
    "model_preset",
    "reference_parameter_name",
    "training_flops_per_token",
]
