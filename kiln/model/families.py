"""The model families by name: what Kiln knows about each architecture, declared once beside its model.

Each model file ends with a ``FAMILY = Family(...)``: its class, the ModelConfig fields it uses, its embedding and
head, the layers LoRA adapts, its key/value heads, the parameter, FLOP and activation counts the planner uses, its
Hugging Face config and weight layout for import and release, and its tensor-parallel plan. Cache, plan, LoRA, the reward model, release and the
pretrained import read only this. A new family is one model file plus one line in FAMILY_MODULES.

``family("llama").model`` is ``kiln.model.llama.Llama``; ``build_model(ModelConfig(family="llama", ...))`` builds one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.nn as nn

# ``ModelConfig`` (kiln.model.config) appears in annotations only: the config module reads this registry, so this
# module does not import it back.

# family name -> the module whose FAMILY describes it
FAMILY_MODULES = {"gpt2": "kiln.model.gpt", "llama": "kiln.model.llama", "moe": "kiln.model.moe"}


@dataclass(frozen=True)
class Family:
    """One architecture as the rest of Kiln sees it (every count is for a ModelConfig of this family)."""

    name: str
    model: Callable[[ModelConfig], nn.Module]  # the nn.Module class, built from a ModelConfig
    style: str  # how the model card names the architecture ("GPT-2-style")
    fields: tuple[str, ...]  # ModelConfig fields it uses, in the serialised form (kiln.model.config.model_dict)
    embedding: str  # the token table's parameter ("transformer.wte.weight")
    lora_targets: tuple[str, ...]  # each block's Linear layers (module name suffixes); LoRA's default is all of them
    tied: Callable[[ModelConfig], bool]  # whether the head shares the token table
    kv_heads: Callable[[ModelConfig], int]  # key/value heads per layer: what a KV cache holds
    layer_params: Callable[[ModelConfig], int]  # parameters of one block
    embedding_params: Callable[[ModelConfig], int]  # the tables and the head (a tied head counted once)
    final_norm_params: Callable[[ModelConfig], int]  # the norm after the last block
    saved_per_token: Callable[[ModelConfig], tuple[int, int]]  # (elements autograd keeps per token per block, of
    # which residual-stream elements), counted tensor by tensor (kiln.plan.memory.memory_breakdown)
    flops_per_token: Callable[[ModelConfig, int], float]  # training FLOPs per token at a sequence length
    hf_config: Callable[[ModelConfig, int], dict[str, Any]]  # config.json for transformers, given the EOT id
    hf_readers: dict[str, Callable[[Path, dict], ModelConfig]]  # Hugging Face model_type -> config.json reader
    head: str = "lm_head.weight"  # the output head's parameter
    complete: Callable[[ModelConfig], None] = lambda cfg: None  # fill derived fields, check the family's rules
    hf_transposed: tuple[str, ...] = ()  # weights transformers stores transposed against nn.Linear (GPT-2's Conv1D)
    hf_prefix: str = ""  # a prefix some Hugging Face files leave off the weight names (GPT2Model's "transformer.")
    tp_plan: Callable[[ModelConfig], dict[str, Any]] | None = None  # module path -> ParallelStyle for tensor and
    # sequence parallelism (kiln.model.tensor_parallel.apply_tp); None: the family cannot be split that way
    tp_interleaved: bool = False  # whether tensor parallelism holds some rows rank-interleaved (GPT-2's fused q|k|v,
    # kiln.model.tensor_parallel.FusedColwiseParallel): its checkpoints gather one full state in the model's order
    first_stage: tuple[str, ...] = ()  # modules only the first pipeline stage holds (the tables before the blocks)
    last_stage: tuple[str, ...] = ()  # modules only the last pipeline stage holds (the final norm and the head)
    buffers: tuple[str, ...] = field(default=(".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))
    # names of non-weights that older Hugging Face files carry (skipped on import)
    fixed: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family always sets this way
    # (the mixture of experts' QK-norm), filled by ``complete``; not among ``fields``, not settable
    active_layer_params: Callable[[ModelConfig], int] | None = None  # parameters of one block a token passes
    # through, where that is fewer than layer_params (a mixture of experts' k chosen experts of E); None: all
    routed: Callable[[ModelConfig], tuple[int, int, int]] | None = None  # a mixture of experts: (one block's
    # routed expert parameters, experts per block, experts per token), which the layout planner splits by ep
    hf_out: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None  # renames after to_hf (the
    # per-expert names of a mixture of experts), refusing what the Hugging Face layout cannot hold
    hf_in: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None  # the inverse, before from_hf
    mup_fold: Callable[[dict[str, Any], ModelConfig, float, float], dict[str, Any]] | None = None  # (Kiln's state,
    # cfg, query factor, final-norm factor) -> the state with the query projection and the final norm's gain (and
    # bias) multiplied: how a muP model's attention scale and output multiplier go into Hugging Face's weights
    # (kiln.model.mup.hf_folds); None: a muP model of the family cannot be released

    @property
    def embedding_module(self) -> str:
        return self.embedding.removesuffix(".weight")

    def to_hf(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """Kiln's state dict -> the names and layout transformers loads: float32, the transposed weights transposed,
        a tied head dropped (transformers ties it again from the embedding)."""
        out = {}
        for name, t in state.items():
            if name == self.head and self.tied(cfg):
                continue
            t = t.detach().float()
            out[name] = (t.t() if name.endswith(self.hf_transposed) else t).contiguous()  # endswith(()) is False
        return self.hf_out(out, cfg) if self.hf_out is not None else out

    def from_hf(self, tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The inverse of to_hf, for a release bundle or an imported folder: old buffers skipped, a missing prefix
        added, transposed weights turned back, a tied head pointing at the token table."""
        tied = self.tied(cfg)
        out: dict[str, Any] = {}
        if self.hf_in is not None:
            tensors = self.hf_in(tensors, cfg)
        for name, t in tensors.items():
            if name.endswith(self.buffers) or (tied and name == self.head):
                continue
            if self.hf_prefix and name != self.head and not name.startswith(self.hf_prefix):
                name = self.hf_prefix + name
            out[name] = (t.t() if name.endswith(self.hf_transposed) else t).contiguous()
        if tied and self.embedding in out:
            out[self.head] = out[self.embedding]
        return out


def names() -> tuple[str, ...]:
    return tuple(FAMILY_MODULES)


def family(name: str) -> Family:
    """The descriptor of family ``name``; an unknown name is an error listing the known ones."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"model.family: unknown family {name!r}; choose one of {', '.join(FAMILY_MODULES)}")
    desc = importlib.import_module(FAMILY_MODULES[name]).FAMILY
    if desc.name != name:
        raise ValueError(f"{FAMILY_MODULES[name]}.FAMILY is named {desc.name!r}, registered as {name!r}")
    return desc


def of(cfg: ModelConfig) -> Family:
    return family(cfg.family)


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model of ``cfg.family``."""
    return of(cfg).model(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of ``cfg``'s family (PaLM appendix B's 6N + 12 L H Q T)."""
    return of(cfg).flops_per_token(cfg, seq_len)


def hf_readers() -> dict[str, tuple[Family, Callable[[Path, dict], ModelConfig]]]:
    """Every Hugging Face model_type some family imports -> (that family, its config.json reader)."""
    return {kind: (desc, read) for name in FAMILY_MODULES for desc in [family(name)]
            for kind, read in desc.hf_readers.items()}
