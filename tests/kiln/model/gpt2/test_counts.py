"""Tests for kiln.model.gpt2.counts: the planner's parameter count equals the built model's, by hand for one config,
and PaLM's FLOPs per token."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt2.counts import flops_per_token
from kiln.model.gpt2.model import GPT
from kiln.plan.memory import count_params


def make(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32),
        dict(vocab_size=320, block_size=64, n_layer=3, n_head=4, n_embd=64),
        dict(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False),
    ],
    ids=["w32", "w64", "nobias"],
)
def test_num_params_matches_planner_formula(cfg) -> None:
    m = make(**cfg)
    total, non_embedding = count_params(m.config)
    assert m.num_params(non_embedding=False) == total == sum(p.numel() for p in m.parameters())
    V, P, C = cfg["vocab_size"], cfg["block_size"], cfg["n_embd"]
    assert non_embedding == total - (V + P) * C
    # the model's non_embedding count (nanoGPT's convention) leaves out only the position table
    assert m.num_params(non_embedding=True) == total - P * C


def test_hand_count_for_one_small_config() -> None:
    # L=2, C=32, V=300, P=32: per layer 12*C^2 + 13*C = 12704; + ln_f 64; + (V + P) * C = 10624
    m = make()
    assert m.num_params(non_embedding=False) == 2 * 12704 + 64 + 10624 == 36096


def test_flops_per_token() -> None:
    cfg = ModelConfig(vocab_size=300, block_size=32, n_layer=2, n_head=2, n_embd=32)
    n = 12 * 2 * 32**2 + 300 * 32
    assert flops_per_token(cfg, 32) == 6 * n + 12 * 2 * 32 * 32
