"""The mixture of experts' parameter, FLOP and saved-activation counts: total and active (per token) parameters."""

from __future__ import annotations

from kiln.model.config import ModelConfig
from kiln.model.llama.counts import flops_per_token as dense_flops


def expert_params(cfg: ModelConfig) -> int:
    """One block's routed experts: E x (gate, up, down)."""
    return cfg.n_experts * 3 * cfg.n_embd * cfg.moe_intermediate_size


def layer_params(cfg: ModelConfig) -> int:
    """Attention (as llama's with QK-norm), two RMSNorms, the router, the routed and the shared experts."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    attn = 2 * c * c + 2 * c * kv + 2 * c + 2 * cfg.head_dim
    shared = 3 * c * cfg.n_shared_experts * cfg.moe_intermediate_size
    return attn + c * cfg.n_experts + expert_params(cfg) + shared


def active_layer_params(cfg: ModelConfig) -> int:
    """Parameters of one block a token passes through: the k routed experts it is sent to, not all E."""
    return layer_params(cfg) - (cfg.n_experts - cfg.n_experts_per_token) * 3 * cfg.n_embd * cfg.moe_intermediate_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token from the active parameters: llama's count (kiln.model.llama.flops_per_token) with the
    MLP as the k chosen experts and the shared ones, plus the router."""
    width = (cfg.n_experts_per_token + cfg.n_shared_experts) * cfg.moe_intermediate_size
    mlp_and_router = 3 * cfg.n_embd * width + cfg.n_embd * cfg.n_experts
    return dense_flops(cfg, seq_len, mlp=mlp_and_router)


def saved_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """Llama's (with QK-norm) for the attention half; for the MoE half, per token slot (k of them) the gathered input,
    SwiGLU's gate, silu(gate), up and product, the output and its weighted copy, plus the router's logits and
    probabilities (E each) and the shared experts' SwiGLU."""
    c, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    attn = 9 * c + 2 * kv + 3 * (c + kv)
    i = cfg.moe_intermediate_size
    moe = cfg.n_experts_per_token * (3 * c + 4 * i) + 2 * cfg.n_experts + 4 * cfg.n_shared_experts * i
    return attn + moe, 2 * c


def tensor_count(cfg: ModelConfig) -> dict[str, int]:
    """Total and active (per token) parameters, the tables included once: what the planner and the card report."""
    emb = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2)
    tail = cfg.n_embd
    return {"total": cfg.n_layer * layer_params(cfg) + emb + tail,
            "active": cfg.n_layer * active_layer_params(cfg) + emb + tail}
