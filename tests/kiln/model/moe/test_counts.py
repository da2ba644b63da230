"""Tests for kiln.model.moe.counts: total and active parameters equal the built model's, and FLOPs per token count
the k chosen experts and the router, not all E."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.llama.counts import flops_per_token as dense_flops
from kiln.model.moe.counts import active_layer_params, flops_per_token, layer_params, tensor_count

TINY = dict(family="moe", vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_experts=4,
            n_experts_per_token=2, moe_intermediate_size=16)


def test_total_and_active_parameters_match_the_built_model() -> None:
    cfg = ModelConfig(**TINY)
    model = build_model(cfg)
    counts = tensor_count(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == 2 * 2 * 3 * 32 * 16  # 2 layers x 2 unchosen experts
    assert model.active_params(non_embedding=False) == counts["active"]
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert layer_params(cfg) == block
    assert layer_params(cfg) - active_layer_params(cfg) == 2 * 3 * 32 * 16


def test_flops_per_token_count_the_chosen_experts_and_the_router() -> None:
    cfg = ModelConfig(**TINY, n_shared_experts=1)
    # per block: k + shared experts' SwiGLU (3 x C x width each) and the router (C x E); attention as llama's
    mlp = 3 * 32 * (2 + 1) * 16 + 32 * 4
    assert flops_per_token(cfg, 32) == dense_flops(cfg, 32, mlp=mlp)
    more = ModelConfig(**{**TINY, "n_experts": 8})  # more experts, the same k: FLOPs grow by the router only
    assert flops_per_token(more, 32) - flops_per_token(ModelConfig(**TINY), 32) == 6 * 2 * 32 * 4
