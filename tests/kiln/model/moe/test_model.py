"""Tests for kiln.model.moe.model: the balance loss and the z-loss reach the router as the papers define them, checked
by hand; capacity drops and counts slots; shared experts see every token; activation checkpointing counts once."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.families import build_model
from kiln.model.moe.model import SparseMLP, sparse_layers


TINY = dict(family="moe", vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_experts=4,
            n_experts_per_token=2, moe_intermediate_size=16)


def router_grad(layer: SparseMLP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad()
    out = layer(x)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()  # a fixed downstream loss
    return out.detach(), layer.gate.weight.grad.clone()


def test_the_balance_and_z_losses_reach_the_router_as_the_papers_define_them() -> None:
    """E * sum_i f_i P_i (Switch Transformer eq. 4) and mean logsumexp^2 (ST-MoE eq. 5), added as gradients only."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    plain = SparseMLP(ModelConfig(**TINY, router_aux_loss_coef=0.0)).train()
    lossy = SparseMLP(ModelConfig(**TINY, router_aux_loss_coef=0.3, router_z_loss_coef=0.2)).train()
    lossy.load_state_dict(plain.state_dict())
    out0, g0 = router_grad(plain, x)
    out1, g1 = router_grad(lossy, x)
    assert torch.equal(out0, out1)  # the forward value is untouched

    gate = lossy.gate.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, 32) @ gate.t()  # (12, 4)
    idx = logits.softmax(-1).topk(2, dim=-1).indices
    f = torch.bincount(idx.flatten(), minlength=4).float() / idx.numel()  # fraction of slots per expert
    balance = 4 * (f * logits.softmax(-1).mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    (0.3 * balance + 0.2 * z).backward()
    torch.testing.assert_close(g1 - g0, gate.grad, atol=1e-6, rtol=1e-5)
    assert lossy.last_losses == pytest.approx({"moe/balance_loss": float(balance.detach()), "moe/z_loss": float(z.detach())})
    assert float(balance.detach()) >= 1.0 - 1e-6  # 1 at perfect balance, more otherwise


def test_capacity_drops_slots_past_an_experts_share_and_counts_them() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, capacity_factor=0.5)
    layer = SparseMLP(cfg).train()
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0] = 1.0  # expert 0 wanted by most tokens
    x = torch.randn(1, 16, 32).abs()
    out = layer(x)
    idx = layer.route(x.reshape(-1, 32))[1]
    counts = torch.bincount(idx.flatten(), minlength=4)
    cap = math.ceil(0.5 * 32 / 4)
    assert int(layer.dropped) == int((counts - cap).clamp_min(0).sum()) > 0
    assert torch.equal(layer.load, counts.float())  # the load counts what was asked for, before capacity

    dropless = SparseMLP(ModelConfig(**TINY)).train()
    dropless.load_state_dict(layer.state_dict())
    full = dropless(x)
    assert int(dropless.dropped) == 0 and not torch.allclose(full, out)
    # a token whose every slot fit gets the dropless output
    keep = layer.keep_mask(idx).all(-1)
    torch.testing.assert_close(out.view(-1, 32)[keep], full.view(-1, 32)[keep])


def test_the_shared_experts_see_every_token() -> None:
    torch.manual_seed(0)
    layer = SparseMLP(ModelConfig(**TINY, n_shared_experts=2)).eval()
    x = torch.randn(1, 4, 32)
    routed = layer(x) - layer.shared_experts(x)
    with torch.no_grad():
        layer.shared_experts.down_proj.weight.zero_()
    torch.testing.assert_close(layer(x), routed)
    assert layer.shared_experts.gate_proj.weight.shape == (32, 32)  # 2 experts of width 16


def test_activation_checkpointing_recomputes_without_counting_twice_and_with_the_same_gradients() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY, router_z_loss_coef=0.01)
    x = torch.randint(0, 128, (2, 16))
    grads, loads = [], []
    for recompute in (False, True):
        torch.manual_seed(1)
        model = build_model(cfg).train()
        model.checkpoint_blocks = recompute
        model(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        loads.append(torch.stack([m.load for m in sparse_layers(model)]))
    assert torch.equal(loads[0], loads[1]) and float(loads[0].sum()) == 2 * 2 * 16 * 2
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_routing_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"model.n_experts_per_token \(5\) must be between 1 and model.n_experts"):
        ModelConfig(**{**TINY, "n_experts_per_token": 5})
    with pytest.raises(ValueError, match=r"model.router_balance: 'sinkhorn' is not one of aux_loss, aux_free, none"):
        ModelConfig(**TINY, router_balance="sinkhorn")
    with pytest.raises(ValueError, match=r"model.n_experts applies to the moe family only"):
        ModelConfig(family="llama", n_experts=4)
    assert ModelConfig(**TINY).qk_norm is True  # Qwen3-MoE's QK-norm, always
