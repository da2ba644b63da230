"""Tests for kiln.model.moe.state_dict_adapter: a transformers Qwen3-MoE imports with its logits, Kiln's releases load
back in transformers with Kiln's, and mismatched experts or unsupported routing are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfmodels import corpus, hf_logits, save_tiny
from kiln.model.config import ModelConfig, model_dict
from kiln.model.families import build_model
from kiln.model.moe.model import sparse_layers
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
