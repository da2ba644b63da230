"""GPT-2 as Hugging Face writes it: GPT2LMHeadModel's config.json both ways, and muP's multipliers folded into the
weights for release."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def hf_config(cfg: ModelConfig, eot: int) -> dict:
    """config.json of GPT2LMHeadModel."""
    if not cfg.bias:
        raise ValueError("Hugging Face GPT-2 needs biases: release a model trained with model.bias=true")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
        "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True, "torch_dtype": "float32",
        "dtype": "float32",
    }


def read_hf_config(path, doc: dict) -> ModelConfig:
    """A GPT-2 config.json as ModelConfig; anything Kiln's GPT computes differently is refused."""
    from kiln.pretrained.config import require

    n_embd = doc["n_embd"]
    require(path, doc, "n_inner", lambda v: v == 4 * n_embd, "Kiln's GPT-2 MLP is 4 x n_embd wide")
    require(path, doc, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "tanh GELU only")
    require(path, doc, "layer_norm_epsilon", lambda v: abs(v - 1e-5) < 1e-12, "LayerNorm epsilon 1e-5")
    require(path, doc, "tie_word_embeddings", lambda v: v is True, "the head is tied to the embedding")
    require(path, doc, "scale_attn_weights", lambda v: v is True, "attention scaled by 1/sqrt(head size)")
    require(path, doc, "scale_attn_by_inverse_layer_idx", lambda v: v is False, "no per-layer attention scaling")
    require(path, doc, "add_cross_attention", lambda v: v is False, "decoder only")
    return ModelConfig(vocab_size=doc["vocab_size"], block_size=doc.get("n_positions") or doc["n_ctx"],
                       n_layer=doc["n_layer"], n_head=doc["n_head"], n_embd=n_embd, dropout=0.0, bias=True)


def mup_fold(state: dict, cfg: ModelConfig, q: float, out: float) -> dict:
    """``state`` with muP's multipliers folded in (kiln.model.mup.hf_folds): the query rows of every c_attn (the first
    n_embd of its 3 n_embd output rows, weight and bias) times ``q``, ln_f's weight and bias times ``out``."""
    c, folded = cfg.n_embd, dict(state)
    for name, t in state.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            t = t.detach().float().clone()
            t[:c] *= q  # (3C, C) or (3C,): q | k | v
            folded[name] = t
        elif name in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
            folded[name] = t.detach().float() * out
    return folded
