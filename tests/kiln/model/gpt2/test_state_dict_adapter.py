"""Tests for kiln.model.gpt2.state_dict_adapter: config.json written and read back is the same model, a layout Kiln's
GPT computes differently is refused naming the key, and muP's multipliers fold into the query rows and ln_f."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.model.config import ModelConfig, model_dict
from kiln.model.gpt2.model import GPT
from kiln.model.gpt2.state_dict_adapter import hf_config, mup_fold, read_hf_config
from kiln.pretrained.config import PretrainedError

CFG = dict(vocab_size=320, block_size=64, n_layer=3, n_head=4, n_embd=64)


def test_config_json_reads_back_as_the_same_model() -> None:
    cfg = ModelConfig(**CFG)
    doc = hf_config(cfg, eot=7)
    assert doc["model_type"] == "gpt2" and doc["architectures"] == ["GPT2LMHeadModel"]
    assert (doc["n_positions"], doc["n_embd"], doc["bos_token_id"]) == (64, 64, 7)
    back = read_hf_config(Path("config.json"), {**doc, "n_inner": None})
    assert model_dict(back) == model_dict(cfg)


def test_what_kilns_gpt_computes_differently_is_refused_by_key() -> None:
    doc = hf_config(ModelConfig(**CFG), eot=0)
    with pytest.raises(PretrainedError, match=r"^x/config.json: n_inner=128 is not supported \(Kiln's GPT-2 MLP"):
        read_hf_config(Path("x/config.json"), {**doc, "n_inner": 128})
    with pytest.raises(PretrainedError, match=r"activation_function='relu' is not supported \(tanh GELU only\)"):
        read_hf_config(Path("x/config.json"), {**doc, "activation_function": "relu"})
    with pytest.raises(ValueError, match=r"Hugging Face GPT-2 needs biases"):
        hf_config(ModelConfig(**CFG, bias=False), eot=0)


def test_mup_fold_scales_the_query_rows_and_the_final_norm_only() -> None:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**CFG))
    state = model.state_dict()
    folded = mup_fold(state, model.config, 0.5, 3.0)
    for i in range(3):
        w, b = f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.attn.c_attn.bias"
        torch.testing.assert_close(folded[w][:64], state[w][:64] * 0.5)  # q rows of q | k | v
        torch.testing.assert_close(folded[w][64:], state[w][64:])  # k and v untouched
        torch.testing.assert_close(folded[b][:64], state[b][:64] * 0.5)
    torch.testing.assert_close(folded["transformer.ln_f.weight"], state["transformer.ln_f.weight"] * 3.0)
    torch.testing.assert_close(folded["transformer.ln_f.bias"], state["transformer.ln_f.bias"] * 3.0)
    assert folded["transformer.h.0.mlp.c_fc.weight"] is state["transformer.h.0.mlp.c_fc.weight"]
