"""Llama's parameter, FLOP and saved-activation counts per block and per token (the planner's inputs)."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int, mlp: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): 6N over the matmul weights + 12 L H Q T for attention. ``mlp``:
    the matmul weights one token meets in a block's MLP, where they are not SwiGLU's three (a mixture of experts)."""
    hs = cfg.head_dim
    attn = cfg.n_embd * hs * (2 * cfg.n_head + 2 * cfg.n_kv_head)  # q, o and k, v projections
    mlp = 3 * cfg.n_embd * cfg.intermediate_size if mlp is None else mlp
    n = cfg.n_layer * (attn + mlp) + cfg.vocab_size * cfg.n_embd  # the head is a matmul, tied or not
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len


def layer_params(cfg: ModelConfig) -> int:
    """q, o and the narrower k, v projections (no biases), SwiGLU's gate, up and down, two RMSNorm weights, and
    with QK-norm one RMSNorm weight per head dimension for q and for k."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    qk_norm = 2 * cfg.head_dim if cfg.qk_norm else 0
    return 2 * c * c + 2 * c * kv + 3 * c * cfg.intermediate_size + 2 * c + qk_norm


def saved_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """The block input, each RMSNorm's normalised input (for its weight's gradient) and output, rotated q and k, v,
    the attention output and its contiguous copy, the residual after attention; SwiGLU's gate, silu(gate), up and
    their product (measured with saved_tensors_hooks: 9 C + 2 kv + 4 I, within 0.3 C). QK-norm keeps q, k, their
    normalised copies and more (measured 2.7 (C + kv))."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    n = 9 * c + 2 * kv + 4 * cfg.intermediate_size
    return n + (3 * (c + kv) if cfg.qk_norm else 0), 2 * c
