"""A Llama-style decoder-only transformer: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.

Parameter names follow the Hugging Face ``LlamaForCausalLM`` layout (model.embed_tokens, model.layers.N.self_attn.
q_proj, ...; with ``qk_norm`` the ``Qwen3ForCausalLM`` one), so import and release are renames of nothing. The
rotation is Hugging Face's (halves, not interleaved pairs). Run a shape check with ``python -m kiln.model.llama.model``.
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
from kiln.model.parallel import local_param
from kiln.model.recompute import checkpoint_block


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (block_size, head_dim) float32: position p turns channel pair (i, i + hs/2) by p / theta^(2i/hs)."""
    hs = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32, device=device) / hs)  # (hs/2,)
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32, device=device), inv_freq)  # (S, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (S, hs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hs) rotated by cos, sin (T, hs); computed in float32, returned in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # 2 x (B, nh, T, hs/2)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.n_kv_head, self.hs = layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.o_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        if cfg.qk_norm:
            self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.dropout = cfg.dropout
        self.scale = mup.attention_scale(cfg)  # None: 1/sqrt(hs); muP: sqrt(hs_base) / hs (kiln.model.mup)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # -1: the heads this rank computes (all of them, or n_head / tp under tensor parallelism)
        q = self.q_proj(x).view(B, T, -1, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        if self.qk_norm:
            # functional, with the local copy of the weights under tensor parallelism (kiln.model.parallel)
            q = F.rms_norm(q, (self.hs,), local_param(self.q_norm.weight), self.q_norm.eps)
            k = F.rms_norm(k, (self.hs,), local_param(self.k_norm.weight), self.k_norm.eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        mask, causal = doc_mask, doc_mask is None  # (B, 1, T, T) bool: causal within documents (kiln.model.masks)
        if cache is not None:
            k, v, mask = cache.attend(self.layer, k, v)  # (B, nkv, S, hs) each, S = cached + T
            causal = False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=self.n_kv_head != self.n_head,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, nh*hs)
        return F.dropout(self.o_proj(y), self.dropout, self.training)  # (B, T, C)


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, width: int = 0):
        super().__init__()
        width = width or cfg.intermediate_size  # kiln.model.moe's shared experts pass their own
        self.gate_proj = nn.Linear(cfg.n_embd, width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.n_embd, bias=False)
        self.down_proj.RESIDUAL_SCALE = True  # type: ignore[attr-defined]
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, I)
        return F.dropout(self.down_proj(h), self.dropout, self.training)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg)  # a sparse family passes its mixture of experts

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, doc_mask)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, C)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                layers=nn.ModuleList([self.make_block(cfg, i) for i in range(cfg.n_layer)]),
                norm=nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # (block_size, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (block_size, hs)
        self.checkpoint_blocks = False  # recompute block activations in backward (kiln.model.parallel)
        self.output_scale = mup.output_scale(cfg)  # muP's 1/m on the head's input (so on the logits); None: none
        self.apply(self._init_weights)

    def make_block(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Block ``layer`` (a subclass changes what a block holds: kiln.model.moe's experts)."""
        return Block(cfg, layer)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE", False):
                std /= math.sqrt(2 * self.config.n_layer)  # scaled residual init, as GPT-2
            if module is not self.lm_head and mup.enabled(self.config):  # the blocks' matrices; the head (tied or
                std *= mup.hidden_init_scale(self.config)  # not) is the readout, width-independent
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.config.tie_embeddings:
            n -= self.model.embed_tokens.weight.numel()  # the untied input table is a lookup, not compute
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size) float32; with targets (B, T) (-100 skipped), the mean
        next-token cross-entropy, a chunk of tokens at a time (kiln.model.loss.LinearCrossEntropy). With a
        ``cache``, idx holds only the new positions, which start at ``cache.pos``. ``attn_mask`` (B, 1, T, T) bool
        (kiln.model.masks.document_mask) replaces the causal mask in training. Rotary positions stay the window's:
        attention scores depend on q and k positions only through their difference, so within one document they
        equal those of the document run from position 0 (to float rounding)."""
        B, T = idx.shape[:2]
        if idx.dim() == 3 and targets is not None:  # a later pipeline stage's input: under sequence parallelism
            T = targets.shape[1]  # each rank holds T / tp of the positions; the targets span them all
        start = cache.pos if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than model.block_size={self.config.block_size}")
        check_attn_mask(attn_mask, B, T, cache)
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]  # (T, hs) each
        # a later pipeline stage has no table: idx is the previous stage's output (B, T, C)
        x = self.model.embed_tokens(idx) if "embed_tokens" in self.model else idx  # (B, T, C)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled() and cache is None
        for block in self.model.layers:
            x = (checkpoint_block(block, x, cos, sin, None, attn_mask) if recompute
                 else block(x, cos, sin, cache, attn_mask))  # (B, T, C)
        if cache is not None:
            cache.advance(T)
        if "norm" not in self.model:  # a pipeline stage before the last
            return x  # (B, T, C)
        x = self.model.norm(x)  # (B, T, C)
        if self.output_scale is not None:  # on the head's input, so the logits, the loss and head_inputs all see it
            x = x * self.output_scale
        if targets is not None:
            return linear_cross_entropy(x, self.lm_head.weight, targets)  # ()
        return self.lm_head(x).float()  # (B, T, V)


if __name__ == "__main__":
    m = Llama(ModelConfig(family="llama"))
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters")
