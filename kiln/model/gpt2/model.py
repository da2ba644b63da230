"""A GPT-2-style decoder-only transformer: one file, readable in one sitting.

Parameter names follow the Hugging Face GPT-2 layout (transformer.wte, transformer.h.N.attn.c_attn,
...) so release export is a rename-free transpose. Run a shape check with ``python -m kiln.model.gpt2.model``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model import mup
from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.loss import linear_cross_entropy
from kiln.model.masks import check_attn_mask
from kiln.model.recompute import checkpoint_block


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        self.dropout = cfg.dropout
        self.scale = mup.attention_scale(cfg)  # None: 1/sqrt(hs); muP: sqrt(hs_base) / hs (kiln.model.mup)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C) (C / tp each under tensor parallelism)
        hs = C // self.n_head
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        mask, causal = doc_mask, doc_mask is None  # (B, 1, T, T) bool: causal within documents (kiln.model.masks)
        if cache is not None:
            k, v, mask = cache.attend(self.layer, k, v)  # (B, nh, S, hs) each, S = cached + T
            causal = False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, 4C)
        return F.dropout(self.c_proj(h), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, doc_mask)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.checkpoint_blocks = False  # recompute block activations in backward (kiln.model.parallel.apply_activation_checkpointing)
        self.output_scale = mup.output_scale(cfg)  # muP's 1/m on the head's input (so on the logits); None: none
        self.apply(self._init_weights)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE", False):
                std /= math.sqrt(2 * self.config.n_layer)  # GPT-2's scaled residual init
            if module is not self.lm_head and mup.enabled(self.config):  # the blocks' matrices; the (tied) head is
                std *= mup.hidden_init_scale(self.config)  # the table's, width-independent
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size) float32; with targets (B, T) (-100 skipped), the mean
        next-token cross-entropy instead, computed a chunk of tokens at a time so the logits never exist whole
        (kiln.model.loss.LinearCrossEntropy). With a ``cache``, idx holds only the new positions, which start at
        ``cache.pos``. ``attn_mask`` (B, 1, T, T) bool (kiln.model.masks.document_mask) replaces the causal mask in
        training; positions stay absolute (the window's, not the document's)."""
        B, T = idx.shape[:2]
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than model.block_size={self.config.block_size}")
        check_attn_mask(attn_mask, B, T, cache)
        if "wte" in self.transformer:
            pos = torch.arange(start, start + T, device=idx.device)  # (T,)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        else:  # a later pipeline stage: idx is the previous stage's output (B, T, C)
            x = idx
        recompute = self.checkpoint_blocks and torch.is_grad_enabled() and cache is None
        for block in self.transformer.h:
            # with recompute, only the block's input (B, T, C) is kept for backward; its insides are rerun
            x = (checkpoint_block(block, x, None, attn_mask) if recompute
                 else block(x, cache, attn_mask))  # (B, T, C)
        if cache is not None:
            cache.advance(T)
        if "ln_f" not in self.transformer:  # a pipeline stage before the last
            return x  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        if self.output_scale is not None:  # on the head's input, so the logits, the loss and head_inputs all see it
            x = x * self.output_scale
        if targets is not None:
            return linear_cross_entropy(x, self.lm_head.weight, targets)  # ()
        return self.lm_head(x).float()  # (B, T, V)


if __name__ == "__main__":
    m = GPT(ModelConfig())
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters")
