"""Tests for kiln.model.llama.counts: a block's parameters equal the built model's (with and without QK-norm, with
grouped-query attention), and FLOPs per token by hand."""

from __future__ import annotations

import pytest

from kiln.model.config import ModelConfig
from kiln.model.llama.counts import flops_per_token, layer_params, saved_per_token
from kiln.model.llama.model import Llama

CFG = dict(family="llama", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
           intermediate_size=160)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_blocks_parameters_match_the_built_model(qk_norm) -> None:
    cfg = ModelConfig(**CFG, qk_norm=qk_norm)
    block = Llama(cfg).model.layers[0]
    assert layer_params(cfg) == sum(p.numel() for p in block.parameters())
    # by hand: q, o 64 x 64; k, v 64 x 32 (2 of 4 heads); gate, up, down 64 x 160; two norms; QK-norm 2 x 16
    assert layer_params(cfg) == 2 * 4096 + 2 * 2048 + 3 * 10240 + 128 + (32 if qk_norm else 0)


def test_flops_per_token_by_hand() -> None:
    cfg = ModelConfig(**CFG)
    n = 2 * (2 * 4096 + 2 * 2048 + 3 * 10240) + 256 * 64  # matmul weights of the blocks and the head
    assert flops_per_token(cfg, 64) == 6 * n + 12 * 2 * 64 * 64
    # a mixture of experts passes its own MLP width
    assert flops_per_token(cfg, 64, mlp=0) == 6 * (n - 2 * 3 * 10240) + 12 * 2 * 64 * 64


def test_saved_activations_grow_with_qk_norm() -> None:
    plain, normed = saved_per_token(ModelConfig(**CFG)), saved_per_token(ModelConfig(**CFG, qk_norm=True))
    assert plain == (9 * 64 + 2 * 32 + 4 * 160, 128)
    assert normed[0] - plain[0] == 3 * (64 + 32) and normed[1] == plain[1]
