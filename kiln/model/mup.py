"""muP, the maximal-update parametrisation (Yang et al. 2022, "Tensor Programs V", arXiv 2203.03466), as one option of
the model config: ``ModelConfig(..., n_embd=512, mup_base_width=64)``; 0 (the default) is the standard one.

Under muP the best learning rate (and init scale) of a narrow model is that of a wide one, so an lr sweep at the base
width transfers: ``python bench/bench_mup.py --shards DIR`` shows it on the demo's tokens. The gpt2 and llama families
(and families made from them) support it; the moe family refuses the field (its router and 3-D experts have no rule
here yet). The model files, the optimizer (kiln.train.optim.make_optimizer) and the release export
(kiln.release.hf.to_hf_state_dict) read the numbers below; tests/kiln/model/test_mup.py checks them.

Width and the base model. ``mup_base_width`` is the n_embd of the base model the hyperparameters were tuned on; the
width multiplier is m = n_embd / mup_base_width. Depth and the head count stay fixed across widths (the heads grow
wider: head_dim d = n_embd / n_head, the base's d_base = mup_base_width / n_head), as in the paper's transformer
experiments. Every hidden matrix (attention q/k/v/o, MLP) is scaled by the one m; that is the paper's per-matrix
fan_in ratio when the MLP width grows with n_embd (gpt2's 4 C; llama's default 8/3 C, rounded up to a multiple of 64,
is within a few percent of it; a fixed ``intermediate_size`` across widths is not muP for down_proj).

The rules, mapped to the paper (Table 3, muP's Adam rows, and its equivalent multiplier form, Table 8; here each is
written relative to the standard parametrisation (SP) of the same model at the base width, so that at
n_embd == mup_base_width the muP model IS the SP model: the same init draws, logits and learning rates, bit for bit):

- Hidden weights (fan_in and fan_out both grow with width). Table 3 "hidden weights": init variance 1/fan_in, Adam lr
  1/fan_in. Here: Kiln's init std (0.02, GPT-2's scaled 0.02 / sqrt(2 n_layer) on residual projections) times
  ``hidden_init_scale`` = 1/sqrt(m); AdamW lr times ``hidden_lr_scale`` = 1/m (kiln.train.optim.adamw_groups).
  Muon's matrices keep muon_lr: its orthogonalised update has spectral norm ~ lr sqrt(max(1, fan_out/fan_in)), the
  spectral condition for feature learning of hidden layers at any width (Yang, Simon, Bernstein 2023), so no width
  factor is missing.
- Input weights and all biases and norm gains (one dimension grows with width). Table 3 "input weights & all biases":
  init variance 1/fan_in (a fixed fan_in: the vocabulary, or 1) and Adam lr 1, both independent of width. Here: the
  token and position tables, every bias and norm weight keep their init and lr.
- Output weights (fan_in grows, fan_out is the vocabulary). Table 3 "output weights": init variance 1/fan_in^2, Adam
  lr 1/fan_in; in multiplier form (Table 8, the mup package's MuReadout) the logits are multiplied by 1/fan_in-ratio
  and the weight keeps a width-independent init and lr. Here: the head's input (the final norm's output) is multiplied
  by ``output_scale`` = 1/m, so every path that applies the head sees it: the logits, the chunked loss
  (kiln.model.loss.LinearCrossEntropy), head_inputs / token_logprobs of post-training, generation. A tied head is the
  paper's shared readout: the table keeps the embedding's init and lr.
- Attention scores (the paper's attention-logit rule for transformers: 1/d instead of 1/sqrt(d), because q and k become
  correlated during training and their dot product grows like d, not sqrt(d)). Here: ``attention_scale``,
  sqrt(d_base) / d, which is 1/sqrt(d) at the base width, passed as scaled_dot_product_attention's ``scale`` in every
  attention path (plain, document masks, the KV cache, tensor parallelism: one call per family).

Weight decay: the hidden matrices' AdamW group keeps optim.weight_decay, so torch's decoupled decay (lr x wd per step)
shrinks with their lr like the update does (the mup package's ``decoupled_wd=True``; its default instead multiplies wd
by m, keeping lr x wd fixed). The paper does not settle it; bench/bench_mup.py sweeps with weight decay 0.

Release: transformers' GPT-2 and Llama have no output multiplier and a fixed 1/sqrt(d) attention scale, but both
muP multipliers fold exactly into weights that exist there (``hf_folds``): 1/m into the final norm's gain (and bias),
which scales the head's input as Kiln does, tied head or not; sqrt(d_base / d) = 1/sqrt(m) into the query projection
(its bias too), or into QK-norm's query gain where there is one (the norm would undo a scaled projection); rotary
positions are linear, so they commute with it. The exported model computes the same function (to float rounding of
one multiply per folded weight: none when m is a power of 4). A family without a fold rule (StateDictAdapter.mup_fold) is
refused with an error naming model.mup_base_width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.model.config import ModelConfig


def enabled(cfg: ModelConfig) -> bool:
    """Whether ``cfg`` is a muP model (mup_base_width > 0), whatever its width multiplier."""
    return getattr(cfg, "mup_base_width", 0) > 0


def width_mult(cfg: ModelConfig) -> float:
    """m = n_embd / mup_base_width; 1.0 for the standard parametrisation."""
    return cfg.n_embd / cfg.mup_base_width if enabled(cfg) else 1.0


def scaled(cfg: ModelConfig) -> bool:
    """Whether any muP multiplier differs from 1 (muP away from its base width)."""
    return width_mult(cfg) != 1.0


def hidden_init_scale(cfg: ModelConfig) -> float:
    """Factor on the init std of the blocks' weight matrices: 1/sqrt(m)."""
    return 1.0 / math.sqrt(width_mult(cfg))


def hidden_lr_scale(cfg: ModelConfig) -> float:
    """Factor on AdamW's lr for the blocks' weight matrices: 1/m."""
    return 1.0 / width_mult(cfg)


def output_scale(cfg: ModelConfig) -> float | None:
    """Multiplier of the head's input (so of the logits): 1/m; None where it is 1, so the standard model's graph has no
    extra multiply."""
    return 1.0 / width_mult(cfg) if scaled(cfg) else None


def attention_scale(cfg: ModelConfig) -> float | None:
    """scaled_dot_product_attention's ``scale``: sqrt(d_base) / d; None (its default, 1/sqrt(d)) where they agree."""
    if not scaled(cfg):
        return None
    return math.sqrt(cfg.mup_base_width / cfg.n_head) / cfg.head_dim


def hf_folds(cfg: ModelConfig) -> tuple[float, float]:
    """(query factor, final-norm factor) that fold the attention scale and the output multiplier into the weights of a
    standard (1/sqrt(d), no multiplier) model: (sqrt(d_base / d), 1/m)."""
    m = width_mult(cfg)
    return 1.0 / math.sqrt(m), 1.0 / m

