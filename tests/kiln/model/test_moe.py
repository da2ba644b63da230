"""Tests for the mixture-of-experts family (kiln.model.moe): a transformers Qwen3-MoE imports with its logits and
Kiln's releases load back in transformers with Kiln's; mismatched experts and unsupported routing are refused by
name; the balance loss, the z-loss, capacity drops and aux-free biases are what the papers define, checked by hand.

Run: python -m pytest tests/kiln/model/test_moe.py -q
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfmodels import corpus, hf_logits, save_tiny
from kiln.model.config import ModelConfig, model_dict
from kiln.model.families import build_model
from kiln.model.moe import SparseMLP, end_step, load_measures, sparse_layers, tensor_count
from kiln.pretrained.config import PretrainedError
from kiln.pretrained.source import load_pretrained

TINY = dict(family="moe", vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_experts=4,
            n_experts_per_token=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("hf") / "qwen3-moe", "qwen3_moe", "qwen2")


def test_a_transformers_qwen3_moe_imports_with_its_logits(hf_moe) -> None:
    state, cfg, tok, record = load_pretrained(hf_moe, corpus(40, seed=3))
    assert (cfg.family, cfg.n_experts, cfg.n_experts_per_token, cfg.moe_intermediate_size) == ("moe", 4, 2, 16)
    assert cfg.qk_norm and cfg.norm_topk_prob and state["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    model = build_model(cfg)
    model.load_state_dict(state)
    ids = torch.randint(0, record["imported_vocab"], (2, 24), generator=torch.Generator().manual_seed(0))
    want = hf_logits(hf_moe, ids)
    got = model.eval()(ids)
    keep = [i for i in range(want.shape[-1]) if i not in set(tok.added.values())]
    torch.testing.assert_close(got[..., keep], want[..., keep], atol=1e-5, rtol=1e-5)


def test_kilns_moe_release_loads_in_transformers_with_kilns_logits(tmp_path, tiny_tokenizer) -> None:
    import transformers

    from kiln.model.config import padded_vocab
    from kiln.release.bundle import load_release, verify_release, write_release
    from kiln.train.checkpoint import save_checkpoint

    enc, tok_path = tiny_tokenizer
    cfg = ModelConfig(**{**TINY, "vocab_size": padded_vocab(enc.n_vocab), "tie_embeddings": False})
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for layer in sparse_layers(m):
            layer.gate.weight.mul_(20)  # a decided router: which experts run shows in the logits
    m.eval()
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": m.state_dict()},
                    {"model": model_dict(cfg), "task": "pretrain"}, extra_files={"tokenizer.json": tok_path})
    write_release(tmp_path / "run", tmp_path / "release", card="# test\n")
    bundle = tmp_path / "release"
    verify_release(bundle)
    written = load_file(str(bundle / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in written  # the published per-expert names
    assert not any(k.endswith(("gate_up_proj", "expert_bias")) for k in written)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundle).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts_per_tok == 2
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = m(idx), hf(idx).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    released, _ = load_release(bundle)
    with torch.no_grad():
        assert torch.equal(released(idx), want)


def test_mismatched_experts_and_unsupported_routing_are_refused_by_name(hf_moe, tmp_path) -> None:
    import shutil

    def variant(name: str, config: dict | None = None, drop: str = "") -> object:
        folder = tmp_path / name
        shutil.copytree(hf_moe, folder)
        if config:
            doc = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**doc, **config}))
        if drop:
            tensors = load_file(str(folder / "model.safetensors"))
            save_file({k: v for k, v in tensors.items() if drop not in k}, str(folder / "model.safetensors"))
        return folder

    with pytest.raises(PretrainedError, match=r"model.layers.0.mlp.experts.\*: the weights hold experts .* \(3 "
                                              r"experts\) but config.json says num_experts=4"):
        load_pretrained(variant("three", drop="mlp.experts.3."))
    with pytest.raises(PretrainedError, match=r"model.layers.0.mlp.experts.\*: .* \(4 experts\) but config.json says "
                                              r"num_experts=8"):
        load_pretrained(variant("eight", {"num_local_experts": 8, "num_experts": 8}))
    with pytest.raises(PretrainedError, match=r"mlp_only_layers=\[0\] is not supported \(no dense blocks"):
        load_pretrained(variant("dense-first", {"mlp_only_layers": [0]}))
    with pytest.raises(PretrainedError, match=r"decoder_sparse_step=2 is not supported"):
        load_pretrained(variant("every-other", {"decoder_sparse_step": 2}))
    with pytest.raises(PretrainedError, match=r"num_experts=0: a qwen3_moe model needs routed experts"):
        load_pretrained(variant("none", {"num_local_experts": 0, "num_experts": 0}))

    from kiln.release.hf import hf_config, to_hf_state_dict

    with pytest.raises(ValueError, match=r"n_shared_experts=1: Qwen3-MoE's layout has no shared experts"):
        hf_config(ModelConfig(**TINY, n_shared_experts=1), eot=0)
    cfg = ModelConfig(**TINY, router_balance="aux_free")
    state = build_model(cfg).state_dict()
    assert to_hf_state_dict(state, cfg)  # a zero bias is no bias
    state["model.layers.1.mlp.expert_bias"][2] = 0.01
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.expert_bias: router_balance aux_free left a routing "
                                         r"bias that Qwen3-MoE's layout has no place for"):
        to_hf_state_dict(state, cfg)


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


def test_load_measures_and_parameter_counts() -> None:
    assert load_measures(torch.tensor([[5.0, 5, 5, 5]])) == pytest.approx(
        {"moe/load_max_over_mean": 1.0, "moe/load_max_over_mean_worst": 1.0, "moe/load_entropy": 1.0})
    skewed = load_measures(torch.tensor([[20.0, 0, 0, 0], [10.0, 10, 0, 0]]))
    assert skewed["moe/load_max_over_mean"] == pytest.approx(3.0) and skewed["moe/load_max_over_mean_worst"] == 4.0
    assert skewed["moe/load_entropy"] == pytest.approx(0.25)  # (0 + log 2 / log 4) / 2
    cfg = ModelConfig(**TINY)
    model = build_model(cfg)
    counts = tensor_count(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] - counts["active"] == 2 * 2 * 3 * 32 * 16  # 2 layers x 2 unchosen experts
    assert model.active_params(non_embedding=False) == counts["active"]
    with pytest.raises(ValueError, match=r"model.n_experts_per_token \(5\) must be between 1 and model.n_experts"):
        ModelConfig(**{**TINY, "n_experts_per_token": 5})
    with pytest.raises(ValueError, match=r"model.router_balance: 'sinkhorn' is not one of aux_loss, aux_free, none"):
        ModelConfig(**TINY, router_balance="sinkhorn")
    with pytest.raises(ValueError, match=r"model.n_experts applies to the moe family only"):
        ModelConfig(family="llama", n_experts=4)


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
