"""A Llama-style decoder-only transformer: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.

Parameter names follow the Hugging Face ``LlamaForCausalLM`` layout (model.embed_tokens, model.layers.N.self_attn.
q_proj, ...; with ``qk_norm`` the ``Qwen3ForCausalLM`` one), so import and release are renames of nothing. The
rotation is Hugging Face's (halves, not interleaved pairs). Run a shape check with ``python -m kiln.model.llama``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln.model import mup
from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig
from kiln.model.families import Family
from kiln.model.loss import linear_cross_entropy
from kiln.model.masks import check_attn_mask
from kiln.model.parallel import local_param


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
            x = (checkpoint(block, x, cos, sin, None, attn_mask, use_reentrant=False) if recompute
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


def flops_per_token(cfg: ModelConfig, seq_len: int, mlp: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): 6N over the matmul weights + 12 L H Q T for attention. ``mlp``:
    the matmul weights one token meets in a block's MLP, where they are not SwiGLU's three (a mixture of experts)."""
    hs = cfg.head_dim
    attn = cfg.n_embd * hs * (2 * cfg.n_head + 2 * cfg.n_kv_head)  # q, o and k, v projections
    mlp = 3 * cfg.n_embd * cfg.intermediate_size if mlp is None else mlp
    n = cfg.n_layer * (attn + mlp) + cfg.vocab_size * cfg.n_embd  # the head is a matmul, tied or not
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq_len


def complete(cfg: ModelConfig) -> None:
    """Fill the derived fields (key/value heads, SwiGLU width) and check the grouped-query and rotary shapes."""
    if cfg.n_kv_head == 0:
        cfg.n_kv_head = cfg.n_head
    if cfg.n_head % cfg.n_kv_head:
        raise ValueError(f"model.n_head ({cfg.n_head}) must be a multiple of model.n_kv_head ({cfg.n_kv_head})")
    if cfg.intermediate_size == 0:
        cfg.intermediate_size = -(-(8 * cfg.n_embd // 3) // 64) * 64
    if (cfg.n_embd // cfg.n_head) % 2:
        raise ValueError(f"model.n_embd / model.n_head = {cfg.n_embd // cfg.n_head} must be even for rotary embeddings")


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


def tp_plan(cfg: ModelConfig) -> dict:
    """Tensor and sequence parallelism (kiln.model.tensor_parallel): the embedding row-parallel into sequence
    shards, norms on sequence shards, q/k/v and gate/up column-parallel (whole heads and hidden units per rank),
    o/down row-parallel back to sequence shards, the head column-parallel over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from kiln.model.tensor_parallel import LocalReplicated

    seq, whole = Shard(1), Replicate()
    layer = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=seq),
        layer + "input_layernorm": SequenceParallel(),
        # Block calls self_attn(x, cos, sin, cache, doc_mask): only x is gathered
        layer + "self_attn": PrepareModuleInput(input_layouts=(seq, None, None, None, None),
                                                desired_input_layouts=(whole, None, None, None, None)),
        **{layer + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        layer + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        layer + "post_attention_layernorm": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        layer + "mlp.gate_proj": ColwiseParallel(),
        layer + "mlp.up_proj": ColwiseParallel(),
        layer + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole),  # logits; the loss reads the weight
        # QK-norm: one weight per head dimension, shared by the heads every rank holds a share of
        **({layer + f"self_attn.{n}_norm": LocalReplicated() for n in "qk"} if cfg.qk_norm else {}),
    }


FAMILY = Family(
    name="llama", model=Llama, style="Llama-style",
    fields=("family", "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "n_kv_head",
            "intermediate_size", "rope_theta", "norm_eps", "qk_norm", "tie_embeddings",
            "mup_base_width"),  # left out at 0 (kiln.model.config.OMITTED_AT_DEFAULT)
    embedding="model.embed_tokens.weight",
    lora_targets=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"),
    tied=lambda cfg: cfg.tie_embeddings, kv_heads=lambda cfg: cfg.n_kv_head, complete=complete,
    layer_params=layer_params,
    embedding_params=lambda cfg: cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2),  # + untied head
    final_norm_params=lambda cfg: cfg.n_embd,  # RMSNorm: a weight only
    saved_per_token=saved_per_token, flops_per_token=flops_per_token, hf_config=hf_config, tp_plan=tp_plan,
    first_stage=("model.embed_tokens",), last_stage=("model.norm", "lm_head"), mup_fold=mup_fold,
    # Mistral without a sliding window is Llama's computation under another name
    hf_readers={"llama": read_hf_config, "mistral": read_hf_config,
                "qwen3": lambda path, doc: read_hf_config(path, doc, qk_norm=True)},
)


if __name__ == "__main__":
    m = Llama(ModelConfig(family="llama"))
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters")
