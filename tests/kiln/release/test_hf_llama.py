"""Tests for the llama family's release: transformers loads the bundle as LlamaForCausalLM (Qwen3ForCausalLM with
QK-norm) with no Kiln code and gives Kiln's logits; the bundle reloads into Kiln; a tied head is not written twice.

Run: python -m pytest tests/kiln/release/test_hf_llama.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kiln.model.config import ModelConfig, model_dict, padded_vocab
from kiln.model.families import build_model
from kiln.release.bundle import load_release, verify_release, write_release
from kiln.release.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from kiln.train.checkpoint import load_for_inference, save_checkpoint

SHAPES = {
    "llama-gqa-tied": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, rope_theta=500000.0),
    "llama-untied": dict(n_layer=2, n_head=4, n_kv_head=1, n_embd=32, intermediate_size=96, tie_embeddings=False),
    "qwen3-qk-norm": dict(n_layer=1, n_head=2, n_embd=32, qk_norm=True, norm_eps=1e-6),
}


def _release(tmp_path: Path, tiny_tokenizer, cfg: ModelConfig) -> tuple[Path, torch.nn.Module]:
    enc, tok_path = tiny_tokenizer
    torch.manual_seed(0)
    m = build_model(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from 1, so a misread weight shows in the logits
    m.eval()
    save_checkpoint(tmp_path / "run" / "checkpoints", 5, {"model": m.state_dict()}, {"model": model_dict(cfg), "task": "pretrain"},
                    extra_files={"tokenizer.json": tok_path})
    write_release(tmp_path / "run", tmp_path / "release", card="# test\n")
    return tmp_path / "release", m


@pytest.mark.parametrize("name", list(SHAPES))
def test_transformers_loads_the_llama_bundle_with_kilns_logits(tmp_path, tiny_tokenizer, name) -> None:
    import transformers

    enc, _ = tiny_tokenizer
    cfg = ModelConfig(family="llama", vocab_size=padded_vocab(enc.n_vocab), block_size=32, **SHAPES[name])
    bundle, kiln_model = _release(tmp_path, tiny_tokenizer, cfg)
    verify_release(bundle)
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundle).eval()
    want_class = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    assert type(hf).__name__ == want_class
    assert (hf.config.num_key_value_heads, hf.config.intermediate_size) == (cfg.n_kv_head, cfg.intermediate_size)
    idx = torch.randint(0, enc.n_vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = kiln_model(idx), hf(idx).logits  # (B, T, vocab)
    assert got.shape == want.shape == (2, 32, cfg.vocab_size)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    tied = hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert tied == cfg.tie_embeddings
    written = load_file(str(bundle / "model.safetensors"))
    assert ("lm_head.weight" in written) == (not cfg.tie_embeddings)  # an untied head is its own matrix
    assert set(written) | {"lm_head.weight"} == set(kiln_model.state_dict()) | {"lm_head.weight"}

    released, _ = load_release(bundle)  # and back into Kiln, both ways
    loaded, _, meta = load_for_inference(tmp_path / "run")
    assert meta["model"] == model_dict(cfg)
    with torch.no_grad():
        assert torch.equal(released(idx), want) and torch.equal(loaded(idx), want)


def test_llama_state_dict_round_trip_and_config_fields() -> None:
    cfg = ModelConfig(family="llama", vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)
    state = build_model(cfg).state_dict()
    back = from_hf_state_dict(to_hf_state_dict(state, cfg), cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    conf = hf_config(cfg, eot=7)
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["tie_word_embeddings"] is True
    assert (conf["head_dim"], conf["num_key_value_heads"], conf["intermediate_size"]) == (8, 2, 64)
    assert conf["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
