"""GPT-2's parameter, FLOP and saved-activation counts per block and per token (the planner's inputs)."""

from __future__ import annotations

from kiln.model.config import ModelConfig


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T."""
    n = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len


def layer_params(cfg: ModelConfig) -> int:
    """12 C^2 of matrices; 4 LayerNorm vectors (2 without bias) + 9 C of Linear biases (none without bias)."""
    c = cfg.n_embd
    return 12 * c**2 + (13 * c if cfg.bias else 2 * c)


def saved_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """The block input, LN outputs, q/k/v, the attention output and its contiguous copy, the MLP's 4C hidden before
    and after GELU: 17 C elements, 2 C of them the residual stream."""
    return 17 * cfg.n_embd, 2 * cfg.n_embd
