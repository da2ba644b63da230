"""Tests for kiln.model.moe.balance: aux_free's biases move toward balance and steer the choice only; the load
measures by hand."""

from __future__ import annotations

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.moe.balance import end_step, load_measures
from kiln.model.moe.model import sparse_layers


TINY = dict(family="moe", vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_experts=4,
            n_experts_per_token=2, moe_intermediate_size=16)


def test_aux_free_biases_move_toward_balance_and_steer_the_choice_only() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, router_balance="aux_free", router_bias_rate=0.1)).train()
    layer = sparse_layers(model)[0]
    with torch.no_grad():
        layer.gate.weight[1] += 0.5  # expert 1 favoured
    model(torch.randint(0, 128, (2, 16)))
    load = layer.load.clone()
    out = end_step(sparse_layers(model))
    assert torch.equal(out["load"][0], load) and float(layer.load.sum()) == 0  # counts handed over, then reset
    assert torch.equal(layer.expert_bias, 0.1 * torch.sign(load.mean() - load))  # busy experts down, idle up
    assert "model.layers.0.mlp.expert_bias" in model.state_dict()  # checkpointed with the model

    # the bias changes which experts are chosen, not the chosen ones' weights
    h = torch.randn(5, 32)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))
        _, idx, w = layer.route(h)
        probs = layer.gate(h).softmax(-1)
    assert (idx == 3).any(-1).all()
    picked = probs.gather(-1, idx)
    torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True))


def test_load_measures() -> None:
    assert load_measures(torch.tensor([[5.0, 5, 5, 5]])) == pytest.approx(
        {"moe/load_max_over_mean": 1.0, "moe/load_max_over_mean_worst": 1.0, "moe/load_entropy": 1.0})
    skewed = load_measures(torch.tensor([[20.0, 0, 0, 0], [10.0, 10, 0, 0]]))
    assert skewed["moe/load_max_over_mean"] == pytest.approx(3.0) and skewed["moe/load_max_over_mean_worst"] == 4.0
    assert skewed["moe/load_entropy"] == pytest.approx(0.25)  # (0 + log 2 / log 4) / 2
