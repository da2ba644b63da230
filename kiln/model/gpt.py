"""A GPT-2-style decoder-only transformer: one file, readable in one sitting.

Parameter names follow the Hugging Face GPT-2 layout (transformer.wte, transformer.h.N.attn.c_attn,
...) so release export is a rename-free transpose. Run a shape check with ``python -m kiln.model.gpt``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln.model.loss import LinearCrossEntropy


@dataclass
class GPTConfig:
    vocab_size: int = 8192  # tokens the embedding covers (padded up to a multiple of 64 for speed)
    block_size: int = 256  # longest context the position embedding covers
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 256  # residual stream width; must divide by n_head
    dropout: float = 0.0  # dropout on attention and MLP outputs (0 for pretraining)
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")


# Named sizes: the CPU configs Kiln's presets use and the GPT-2 family (Radford et al. 2019). The GPT-2 sizes
# take GPT-2's vocabulary (50257, padded to 50304) from the tokenizer; block_size is their context length.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),  # CI and the smoke preset, <1M parameters
    "demo": dict(n_layer=4, n_head=4, n_embd=256, block_size=256),  # the CPU demo (the GPTConfig defaults)
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # GPT-2 small, 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1.56B
}


def preset_fields(name: str) -> dict[str, int]:
    """GPTConfig fields of a named size; an unknown name is an error that lists the known ones."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return dict(MODEL_PRESETS[name])


def padded_vocab(n_vocab: int, multiple: int = 64) -> int:
    """Round the tokenizer's vocabulary up so the embedding matmul gets friendly shapes."""
    return ((n_vocab + multiple - 1) // multiple) * multiple


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C)
        return F.dropout(self.c_proj(h), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.checkpoint_blocks = False  # recompute block activations in backward (kiln.model.parallel.apply_activation_checkpointing)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE", False):
                std /= math.sqrt(2 * self.config.n_layer)  # GPT-2's scaled residual init
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size) float32; with targets (B, T) (-100 skipped), the mean
        next-token cross-entropy instead, computed a chunk of tokens at a time so the logits never exist whole
        (kiln.model.loss.LinearCrossEntropy)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than model.block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.transformer.h:
            # with recompute, only the block's input (B, T, C) is kept for backward; its insides are rerun
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is not None:
            return LinearCrossEntropy.apply(x.view(B * T, -1), self.lm_head.weight, targets.reshape(B * T))  # ()
        return self.lm_head(x).float()  # (B, T, V)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        stop_token: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample continuations of idx (B, T); temperature 0 means greedy."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size :]  # (B, <=block)
            logits = self(ctx)[:, -1, :]  # (B, V)
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
            if stop_token is not None and bool((nxt == stop_token).all()):
                break
        return idx


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B: 6N + 12 L H Q T."""
    n = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.vocab_size * cfg.n_embd
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len


if __name__ == "__main__":
    m = GPT(GPTConfig())
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters")
