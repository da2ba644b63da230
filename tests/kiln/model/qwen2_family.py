"""A demonstration family, Qwen2: Llama with biases on the query, key and value projections. It is the whole of
what a new architecture needs (with one line in kiln.model.families.FAMILY_MODULES), and lives in the tests only."""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from kiln.model import llama
from kiln.model.config import ModelConfig
from kiln.model.llama.counts import layer_params as llama_layer_params
from kiln.model.llama.model import Llama
from kiln.model.llama.state_dict_adapter import hf_config as llama_hf_config
from kiln.model.llama.state_dict_adapter import read_hf_config


class Qwen2(Llama):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for block in self.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(block.self_attn, name)
                new = nn.Linear(old.in_features, old.out_features, bias=True)
                new.weight = old.weight  # Llama's seeded initial weights, zero biases
                nn.init.zeros_(new.bias)
                setattr(block.self_attn, name, new)


def layer_params(cfg: ModelConfig) -> int:
    return llama_layer_params(cfg) + cfg.n_embd + 2 * cfg.n_kv_head * cfg.head_dim  # + the q, k and v biases


def hf_config(cfg: ModelConfig, eot: int) -> dict:
    out = {k: v for k, v in llama_hf_config(cfg, eot).items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp")}
    return {**out, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": cfg.n_layer}


BASE = llama.FAMILY
FAMILY = replace(
    BASE, name="qwen2", model=Qwen2, counts=replace(BASE.counts, layer_params=layer_params),
    adapter=replace(BASE.adapter, style="Qwen2-style", hf_config=hf_config,
                    readers={"qwen2": lambda path, doc: replace(read_hf_config(path, doc), family="qwen2")}),
)
