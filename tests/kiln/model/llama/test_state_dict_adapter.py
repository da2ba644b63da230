"""Tests for kiln.model.llama.state_dict_adapter: config.json (Llama's, or Qwen3's with QK-norm) written and read back
is the same model, a layout Kiln's Llama computes differently is refused naming the key, and muP's multipliers fold
into the queries (or, with QK-norm, the query gain) and the final norm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.model.config import ModelConfig, model_dict
from kiln.model.llama.model import Llama
from kiln.model.llama.state_dict_adapter import hf_config, mup_fold, read_hf_config
from kiln.pretrained.config import PretrainedError

CFG = dict(family="llama", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
           intermediate_size=160, rope_theta=50000.0, tie_embeddings=False)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_config_json_reads_back_as_the_same_model(qk_norm) -> None:
    cfg = ModelConfig(**CFG, qk_norm=qk_norm)
    doc = hf_config(cfg, eot=3)
    assert doc["model_type"] == ("qwen3" if qk_norm else "llama")
    assert (doc["num_key_value_heads"], doc["intermediate_size"], doc["head_dim"]) == (2, 160, 16)
    assert doc["rope_theta"] == doc["rope_parameters"]["rope_theta"] == 50000.0
    back = read_hf_config(Path("config.json"), doc, qk_norm=qk_norm)
    assert model_dict(back) == model_dict(cfg)


def test_what_kilns_llama_computes_differently_is_refused_by_key() -> None:
    doc = hf_config(ModelConfig(**CFG), eot=0)
    with pytest.raises(PretrainedError, match=r"^m/config.json: attention_bias=True is not supported \(no attention"):
        read_hf_config(Path("m/config.json"), {**doc, "attention_bias": True})
    with pytest.raises(PretrainedError, match=r"head_dim=32 is not supported \(head_dim = hidden_size / num_atten"):
        read_hf_config(Path("m/config.json"), {**doc, "head_dim": 32})
    with pytest.raises(PretrainedError, match=r"rope type 'linear' is not supported"):
        read_hf_config(Path("m/config.json"), {**doc, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


@pytest.mark.parametrize("qk_norm", [False, True], ids=["q_proj", "q_norm"])
def test_mup_fold_scales_the_queries_and_the_final_norm(qk_norm) -> None:
    torch.manual_seed(0)
    model = Llama(ModelConfig(**CFG, qk_norm=qk_norm))
    state = model.state_dict()
    folded = mup_fold(state, model.config, 0.25, 2.0)
    query = "self_attn.q_norm.weight" if qk_norm else "self_attn.q_proj.weight"
    for i in range(2):
        name = f"model.layers.{i}.{query}"
        torch.testing.assert_close(folded[name], state[name] * 0.25)
        k = f"model.layers.{i}.self_attn.k_proj.weight"
        assert folded[k] is state[k]
    if qk_norm:  # the norm undoes a scaled projection, so the projection itself is left alone
        assert folded["model.layers.0.self_attn.q_proj.weight"] is state["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(folded["model.norm.weight"], state["model.norm.weight"] * 2.0)
