"""The LLaMA-style model: stages cut from one whole model, same weights, clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from churnsim.calibration.errors import InputError
from churnsim.real.model import (
    MODEL_PRESETS,
    ModelConfig,
    StageModule,
    Transformer,
    count_parameters,
    model_preset,
    reference_parameter_name,
    training_flops_per_token,
)

TINY = MODEL_PRESETS["tiny"]


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_concatenated_stages_have_exactly_the_reference_weights(num_stages):
    reference = dict(Transformer(TINY, seed=11).named_parameters())
    seen = set()
    for stage in range(num_stages):
        for name, parameter in StageModule(TINY, stage, num_stages, seed=11).named_parameters():
            reference_name = reference_parameter_name(name, stage=stage, num_stages=num_stages, num_layers=TINY.num_layers)
            assert torch.equal(parameter, reference[reference_name]), reference_name
            seen.add(reference_name)
    assert seen == set(reference)


def test_stage_block_parameter_names_are_the_same_on_every_stage():
    names = [set(StageModule(TINY, stage, 4).part_parameters("blocks")) for stage in range(4)]
    assert all(stage_names == names[0] for stage_names in names)
    assert "blocks.0.attention.wq.weight" in names[0]


def test_first_stage_holds_embedding_and_last_stage_holds_norm_and_head():
    first, middle, last = (StageModule(TINY, stage, 4) for stage in (0, 1, 3))
    assert set(first.part_parameters("embedding")) == {"embedding.weight"}
    assert not first.part_parameters("head") and not middle.part_parameters("embedding")
    assert set(last.part_parameters("head")) == {"norm.weight", "lm_head.weight"}
    assert not any(name.endswith("bias") for name, _ in Transformer(TINY).named_parameters())


def test_stages_chained_by_hand_give_the_reference_loss():
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)
    stages = [StageModule(TINY, stage, 2, seed=4) for stage in range(2)]
    hidden = stages[1].run_blocks(stages[0].run_blocks(stages[0].embed(tokens)))
    torch.testing.assert_close(stages[1].head_loss(hidden, targets), Transformer(TINY, seed=4).loss(tokens, targets))


def test_initial_loss_is_near_uniform_over_the_vocabulary():
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=torch.Generator().manual_seed(1))
    loss = float(Transformer(TINY, seed=0).loss(tokens, tokens).detach())
    assert loss == pytest.approx(math.log(TINY.vocab_size), rel=0.02)


def test_attention_is_causal():
    model = Transformer(TINY, seed=2)
    tokens = torch.randint(0, TINY.vocab_size, (1, TINY.seq_len), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % TINY.vocab_size
    with torch.no_grad():
        hidden, hidden_changed = (model.blocks[0](model.embedding(t), model.rope_cos, model.rope_sin) for t in (tokens, changed))
    torch.testing.assert_close(hidden[:, :-1], hidden_changed[:, :-1])
    assert not torch.allclose(hidden[:, -1], hidden_changed[:, -1])


def test_reset_parameters_with_another_seed_gives_other_weights_with_same_statistics():
    stage = StageModule(TINY, 1, 2, seed=0)
    before = stage.blocks[0].attention.wq.weight.detach().clone()
    stage.reset_parameters(99)
    after = stage.blocks[0].attention.wq.weight
    assert not torch.equal(before, after)
    assert float(after.detach().std()) == pytest.approx(TINY.init_std, rel=0.1)
    assert torch.equal(stage.blocks[0].ffn_norm.weight, torch.ones(TINY.dim))


def test_training_flops_follow_six_n_plus_attention_term():
    model = Transformer(TINY)
    norm_gains = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    matmul_parameters = count_parameters(model) - model.embedding.weight.numel() - norm_gains
    expected = 6 * matmul_parameters + 12 * TINY.num_layers * TINY.dim * TINY.seq_len
    assert training_flops_per_token(TINY) == expected


def test_checkfree_presets_have_the_papers_shapes():
    assert [(c.dim, c.num_heads, c.num_layers, c.vocab_size) for c in (MODEL_PRESETS[n] for n in ("124M", "500M", "1.5B"))] == [
        (512, 8, 12, 32_000),
        (1024, 16, 24, 32_000),
        (2048, 16, 24, 32_000),
    ]
    assert model_preset("124M", vocab_size=256).vocab_size == 256
    assert TINY.hidden_dim == 4 * TINY.dim


def test_more_stages_than_layers_raises_input_error_naming_both():
    with pytest.raises(InputError, match=r"num_stages 5 .* num_layers 4"):
        StageModule(TINY, 0, 5)


def test_layers_not_divisible_by_stages_raises_input_error():
    with pytest.raises(InputError, match="not divisible"):
        StageModule(TINY, 0, 3)


def test_bad_model_shapes_and_unknown_presets_raise_input_error():
    with pytest.raises(InputError, match="num_heads"):
        ModelConfig(vocab_size=256, dim=60, num_heads=8, num_layers=2, seq_len=8)
    with pytest.raises(InputError, match="unknown model preset"):
        model_preset("7B")
