"""Llama as Hugging Face writes it: LlamaForCausalLM's (or, with QK-norm, Qwen3ForCausalLM's) config.json both
ways, and muP's multipliers folded into the weights for release."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def hf_config(cfg: ModelConfig, eot: int) -> dict:
    """config.json of LlamaForCausalLM (Qwen3ForCausalLM with qk_norm, which is where they differ). The rotary base
    is written both ways transformers has read it (rope_theta; rope_parameters since v5)."""
    out = {
        "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if cfg.qk_norm else "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": cfg.tie_embeddings, "use_cache": True,
        "torch_dtype": "float32", "dtype": "float32",
    }
    if cfg.qk_norm:  # Qwen3's sliding-window attention, off: every layer attends to the whole context
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layer,
                   layer_types=["full_attention"] * cfg.n_layer)
    else:
        out.update(mlp_bias=False, pretraining_tp=1)
    return out


def read_hf_config(path, doc: dict, qk_norm: bool = False) -> ModelConfig:
    """A Llama-style config.json (llama; mistral without a sliding window; qwen3 with QK-norm) as ModelConfig;
    anything Kiln's Llama computes differently is refused."""
    from kiln.pretrained.config import require, rope_theta

    n_embd, n_head = doc["hidden_size"], doc["num_attention_heads"]
    require(path, doc, "hidden_act", lambda v: v == "silu", "SwiGLU with SiLU")
    require(path, doc, "attention_bias", lambda v: v is False, "no attention biases")
    require(path, doc, "mlp_bias", lambda v: v is False, "no MLP biases")
    require(path, doc, "head_dim", lambda v: v == n_embd // n_head, "head_dim = hidden_size / num_attention_heads")
    require(path, doc, "use_sliding_window", lambda v: v is False, "full attention")
    require(path, doc, "sliding_window", lambda v: False, "full attention")
    require(path, doc, "pretraining_tp", lambda v: v == 1, "no tensor-parallel slicing")
    return ModelConfig(
        family="llama", vocab_size=doc["vocab_size"], block_size=doc["max_position_embeddings"],
        n_layer=doc["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=doc.get("num_key_value_heads") or n_head, intermediate_size=doc["intermediate_size"],
        rope_theta=rope_theta(path, doc), norm_eps=float(doc.get("rms_norm_eps", 1e-6)), qk_norm=qk_norm,
        tie_embeddings=bool(doc.get("tie_word_embeddings", False)), bias=False,
    )


def mup_fold(state: dict, cfg: ModelConfig, q: float, out: float) -> dict:
    """``state`` with muP's multipliers folded in (kiln.model.mup.hf_folds): every layer's queries times ``q`` (q_proj's
    weight and any bias; with QK-norm its query gain instead, since the norm undoes a scaled projection; the rotation
    is linear and commutes), the final norm's weight times ``out``."""
    query = ("self_attn.q_norm.weight",) if cfg.qk_norm else ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
    folded = dict(state)
    for name, t in state.items():
        if name.endswith(query):
            folded[name] = t.detach().float() * q
        elif name == "model.norm.weight":
            folded[name] = t.detach().float() * out
    return folded
