"""The mixture of experts as Hugging Face writes it: Qwen3MoeForCausalLM's config.json both ways and its per-expert
weight names (Kiln holds each block's experts as two 3-D weights)."""

from __future__ import annotations

from typing import Any

import torch

from kiln.model.config import ModelConfig


def hf_config(cfg: ModelConfig, eot: int) -> dict:
    """config.json of Qwen3MoeForCausalLM: every block sparse, no shared experts, softmax top-k routing."""
    if cfg.n_shared_experts:
        raise ValueError(f"model.n_shared_experts={cfg.n_shared_experts}: Qwen3-MoE's layout has no shared experts; "
                         "a model trained with them cannot be released in it")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer,
        "num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.n_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "torch_dtype": "float32", "dtype": "float32",
    }


def read_hf_config(path, doc: dict) -> ModelConfig:
    """A qwen3_moe config.json as ModelConfig; a layout Kiln's model computes differently is refused by name."""
    from kiln.pretrained.config import PretrainedError, require, rope_theta

    n_embd, n_head = doc["hidden_size"], doc["num_attention_heads"]
    require(path, doc, "hidden_act", lambda v: v == "silu", "SwiGLU experts with SiLU")
    require(path, doc, "attention_bias", lambda v: v is False, "no attention biases")
    require(path, doc, "head_dim", lambda v: v == n_embd // n_head, "head_dim = hidden_size / num_attention_heads")
    require(path, doc, "use_sliding_window", lambda v: v is False, "full attention")
    require(path, doc, "decoder_sparse_step", lambda v: v == 1, "every block sparse (decoder_sparse_step 1)")
    require(path, doc, "mlp_only_layers", lambda v: v == [], "no dense blocks among the sparse ones")
    n_experts = doc.get("num_experts") or doc.get("num_local_experts") or 0  # transformers 5 writes the latter
    if n_experts < 1:
        raise PretrainedError(f"{path}: num_experts={n_experts!r}: a qwen3_moe model needs routed experts; a dense "
                              "model is imported as qwen3")
    return ModelConfig(
        family="moe", vocab_size=doc["vocab_size"], block_size=doc["max_position_embeddings"],
        n_layer=doc["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=doc.get("num_key_value_heads") or n_head, intermediate_size=doc["intermediate_size"],
        rope_theta=rope_theta(path, doc), norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(doc.get("tie_word_embeddings", False)), bias=False,
        n_experts=n_experts, n_experts_per_token=doc["num_experts_per_tok"],
        moe_intermediate_size=doc["moe_intermediate_size"], norm_topk_prob=bool(doc.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(doc.get("router_aux_loss_coef", 0.001)),
    )


def to_hf_experts(state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Kiln's 3-D expert weights -> Qwen3-MoE's per-expert names; an aux_free routing bias that is not zero cannot be
    expressed there (transformers would choose other experts) and is refused."""
    out: dict[str, Any] = {}
    i = cfg.moe_intermediate_size
    for name, t in state.items():
        if name.endswith(".mlp.expert_bias"):
            if bool((t != 0).any()):
                raise ValueError(f"{name}: router_balance aux_free left a routing bias that Qwen3-MoE's layout has "
                                 "no place for (transformers would route tokens to other experts); release a model "
                                 "trained with router_balance aux_loss or none")
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, i:].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def from_hf_experts(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Per-expert Qwen3-MoE names (or transformers 5's fused ones, kept) -> Kiln's 3-D weights; an expert count that
    does not match config.json's num_experts is refused naming the layer."""
    import re

    from kiln.pretrained.config import PretrainedError

    pattern = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    out: dict[str, Any] = {}
    per: dict[str, dict[int, dict[str, Any]]] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m:
            per.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for base, experts in per.items():
        if sorted(experts) != list(range(cfg.n_experts)) or any(len(v) != 3 for v in experts.values()):
            raise PretrainedError(f"{base}*: the weights hold experts {sorted(experts)[:4]}... ({len(experts)} "
                                  f"experts) but config.json says num_experts={cfg.n_experts}; the router and the "
                                  "experts must match")
        out[base + "gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]])
                                                  for e in range(cfg.n_experts)])
        out[base + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(cfg.n_experts)])
    for name, t in list(out.items()):
        if name.endswith(".mlp.gate.weight") and cfg.router_balance == "aux_free":
            out.setdefault(name.removesuffix("gate.weight") + "expert_bias", torch.zeros(cfg.n_experts))
        if name.endswith(".mlp.gate.weight") and t.shape[0] != cfg.n_experts:
            raise PretrainedError(f"{name}: a router over {t.shape[0]} experts but config.json says num_experts="
                                  f"{cfg.n_experts}; the router and the experts must match")
    return out
