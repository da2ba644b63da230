"""A GPT-2-style decoder-only transformer: one file, readable in one sitting.

Parameter names follow the Hugging Face GPT-2 layout (transformer.wte, transformer.h.N.attn.c_attn,
...) so release export is a rename-free transpose. Run a shape check with ``python -m kiln.model.gpt``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln.model import mup
from kiln.model.cache import KVCache
from kiln.model.config import MODEL_PRESETS, ModelConfig, padded_vocab, preset_fields  # noqa: F401  (re-exported)
from kiln.model.families import Family
from kiln.model.loss import linear_cross_entropy
from kiln.model.masks import check_attn_mask


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
            x = (checkpoint(block, x, None, attn_mask, use_reentrant=False) if recompute
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


def tp_plan(cfg: ModelConfig) -> dict:
    """Tensor and sequence parallelism (kiln.model.tensor_parallel): the token table row-parallel and the position
    table replicated, their sum cut into sequence shards at the first block; norms on sequence shards, the fused
    c_attn column-parallel by heads within each of q, k, v and c_fc by hidden units, both c_proj row-parallel back to
    sequence shards; the (tied) head column-parallel over the vocabulary."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    from kiln.model.tensor_parallel import FusedColwiseParallel, Replicated

    seq, whole = Shard(1), Replicate()
    layer = "transformer.h.*."
    return {
        "transformer.wte": RowwiseParallel(input_layouts=whole, output_layouts=whole, use_local_output=False),
        "transformer.wpe": Replicated(),
        # Block calls are block(x, cache, doc_mask); the first one cuts the embeddings' sum into sequence shards
        "transformer.h.0": PrepareModuleInput(input_layouts=(whole, None, None), desired_input_layouts=(seq, None, None),
                                              use_local_output=True),
        layer + "ln_1": SequenceParallel(),
        layer + "attn": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(whole, None, None)),
        layer + "attn.c_attn": FusedColwiseParallel(3),
        layer + "attn.c_proj": RowwiseParallel(output_layouts=seq),
        layer + "ln_2": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
        layer + "mlp.c_fc": ColwiseParallel(),
        layer + "mlp.c_proj": RowwiseParallel(output_layouts=seq),
        "transformer.ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole),  # logits; the loss reads the weight
    }


FAMILY = Family(
    name="gpt2", model=GPT, style="GPT-2-style",
    # no `family`: the default; mup_base_width is left out at 0 (kiln.model.config.OMITTED_AT_DEFAULT)
    fields=("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "mup_base_width"),
    embedding="transformer.wte.weight", lora_targets=("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
    tied=lambda cfg: True, kv_heads=lambda cfg: cfg.n_head, layer_params=layer_params,
    embedding_params=lambda cfg: (cfg.vocab_size + cfg.block_size) * cfg.n_embd,  # token and position tables
    final_norm_params=lambda cfg: (2 if cfg.bias else 1) * cfg.n_embd, saved_per_token=saved_per_token,
    flops_per_token=flops_per_token, hf_config=hf_config, hf_readers={"gpt2": read_hf_config},
    hf_transposed=("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"),
    hf_prefix="transformer.", tp_plan=tp_plan, mup_fold=mup_fold,
    first_stage=("transformer.wte", "transformer.wpe"), last_stage=("transformer.ln_f", "lm_head"),
    # c_attn's rows are held rank-interleaved under TP (q_r | k_r | v_r per rank): checkpoints save them in order
    tp_interleaved=True,
)


if __name__ == "__main__":
    m = GPT(ModelConfig())
    out = m(torch.zeros(2, 16, dtype=torch.long))
    print(tuple(out.shape), f"{m.num_params() / 1e6:.2f}M parameters")
