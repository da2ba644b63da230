"""The model families by name: what Kiln knows about each architecture, declared once beside its model.

A family is a package under ``kiln/model/`` shaped as torchtitan shapes its models: ``model.py`` (the nn.Module),
``counts.py`` (parameters, FLOPs and saved activations per token, for the planner), ``parallelize.py`` (its tensor-
parallel plan and pipeline cut), ``state_dict_adapter.py`` (Hugging Face's config.json and weight names, both ways),
and an ``__init__.py`` whose ``FAMILY = Family(...)`` ties them together in seven fields. Cache, plan, LoRA, the
reward model, release and the pretrained import read only this. A new family is one package (or one module holding
a FAMILY) plus one line in FAMILY_MODULES.

``family("llama").model`` is ``kiln.model.llama.model.Llama``; ``build_model(ModelConfig(family="llama", ...))``
builds one.
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
FAMILY_MODULES = {"gpt2": "kiln.model.gpt2", "llama": "kiln.model.llama", "moe": "kiln.model.moe"}


@dataclass(frozen=True)
class Fields:
    """Which ModelConfig fields the family reads, how it completes and checks them."""

    names: tuple[str, ...]  # ModelConfig fields it uses, in the serialised form (kiln.model.config.model_dict)
    complete: Callable[[ModelConfig], None] = lambda cfg: None  # fill derived fields, check the family's rules
    fixed: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family always sets this way
    # (the mixture of experts' QK-norm), filled by ``complete``; not among ``names``, not settable


@dataclass(frozen=True)
class Parts:
    """The named pieces of the model that other code reaches into."""

    embedding: str  # the token table's parameter ("transformer.wte.weight")
    lora_targets: tuple[str, ...]  # each block's Linear layers (module name suffixes); LoRA's default is all of them
    tied: Callable[[ModelConfig], bool]  # whether the head shares the token table
    kv_heads: Callable[[ModelConfig], int]  # key/value heads per layer: what a KV cache holds
    head: str = "lm_head.weight"  # the output head's parameter

    @property
    def embedding_module(self) -> str:
        return self.embedding.removesuffix(".weight")


@dataclass(frozen=True)
class Counts:
    """Parameter, FLOP and activation counts of a ModelConfig of the family (the planner's inputs)."""

    layer_params: Callable[[ModelConfig], int]  # parameters of one block
    embedding_params: Callable[[ModelConfig], int]  # the tables and the head (a tied head counted once)
    final_norm_params: Callable[[ModelConfig], int]  # the norm after the last block
    saved_per_token: Callable[[ModelConfig], tuple[int, int]]  # (elements autograd keeps per token per block, of
    # which residual-stream elements), counted tensor by tensor (kiln.plan.memory.memory_breakdown)
    flops_per_token: Callable[[ModelConfig, int], float]  # training FLOPs per token at a sequence length
    active_layer_params: Callable[[ModelConfig], int] | None = None  # parameters of one block a token passes
    # through, where that is fewer than layer_params (a mixture of experts' k chosen experts of E); None: all
    routed: Callable[[ModelConfig], tuple[int, int, int]] | None = None  # a mixture of experts: (one block's
    # routed expert parameters, experts per block, experts per token), which the layout planner splits by ep


@dataclass(frozen=True)
class Parallelize:
    """How the family splits over ranks beyond data parallelism."""

    tp_plan: Callable[[ModelConfig], dict[str, Any]] | None = None  # module path -> ParallelStyle for tensor and
    # sequence parallelism (kiln.model.tensor_parallel.apply_tp); None: the family cannot be split that way
    tp_interleaved: bool = False  # whether tensor parallelism holds some rows rank-interleaved (GPT-2's fused q|k|v,
    # kiln.model.tensor_parallel.FusedColwiseParallel): its checkpoints gather one full state in the model's order
    first_stage: tuple[str, ...] = ()  # modules only the first pipeline stage holds (the tables before the blocks)
    last_stage: tuple[str, ...] = ()  # modules only the last pipeline stage holds (the final norm and the head)


@dataclass(frozen=True)
class StateDictAdapter:
    """The family as Hugging Face writes it: config.json, weight names and layout, for import and release."""

    style: str  # how the model card names the architecture ("GPT-2-style")
    hf_config: Callable[[ModelConfig, int], dict[str, Any]]  # config.json for transformers, given the EOT id
    readers: dict[str, Callable[[Path, dict], ModelConfig]]  # Hugging Face model_type -> config.json reader
    transposed: tuple[str, ...] = ()  # weights transformers stores transposed against nn.Linear (GPT-2's Conv1D)
    prefix: str = ""  # a prefix some Hugging Face files leave off the weight names (GPT2Model's "transformer.")
    buffers: tuple[str, ...] = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # names of non-weights
    # that older Hugging Face files carry (skipped on import)
    rename_out: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None  # renames after to_hf (the
    # per-expert names of a mixture of experts), refusing what the Hugging Face layout cannot hold
    rename_in: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None  # the inverse, before from_hf
    mup_fold: Callable[[dict[str, Any], ModelConfig, float, float], dict[str, Any]] | None = None  # (Kiln's state,
    # cfg, query factor, final-norm factor) -> the state with the query projection and the final norm's gain (and
    # bias) multiplied: how a muP model's attention scale and output multiplier go into Hugging Face's weights
    # (kiln.model.mup.hf_folds); None: a muP model of the family cannot be released


@dataclass(frozen=True)
class Family:
    """One architecture as the rest of Kiln sees it (every count is for a ModelConfig of this family)."""

    name: str
    model: Callable[[ModelConfig], nn.Module]  # the nn.Module class, built from a ModelConfig
    fields: Fields
    parts: Parts
    counts: Counts
    parallelize: Parallelize
    adapter: StateDictAdapter

    def to_hf(self, state: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """Kiln's state dict -> the names and layout transformers loads: float32, the transposed weights transposed,
        a tied head dropped (transformers ties it again from the embedding)."""
        out, ad = {}, self.adapter
        for name, t in state.items():
            if name == self.parts.head and self.parts.tied(cfg):
                continue
            t = t.detach().float()
            out[name] = (t.t() if name.endswith(ad.transposed) else t).contiguous()  # endswith(()) is False
        return ad.rename_out(out, cfg) if ad.rename_out is not None else out

    def from_hf(self, tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        """The inverse of to_hf, for a release bundle or an imported folder: old buffers skipped, a missing prefix
        added, transposed weights turned back, a tied head pointing at the token table."""
        ad, head, tied = self.adapter, self.parts.head, self.parts.tied(cfg)
        out: dict[str, Any] = {}
        if ad.rename_in is not None:
            tensors = ad.rename_in(tensors, cfg)
        for name, t in tensors.items():
            if name.endswith(ad.buffers) or (tied and name == head):
                continue
            if ad.prefix and name != head and not name.startswith(ad.prefix):
                name = ad.prefix + name
            out[name] = (t.t() if name.endswith(ad.transposed) else t).contiguous()
        if tied and self.parts.embedding in out:
            out[head] = out[self.parts.embedding]
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
    return of(cfg).counts.flops_per_token(cfg, seq_len)


def hf_readers() -> dict[str, tuple[Family, Callable[[Path, dict], ModelConfig]]]:
    """Every Hugging Face model_type some family imports -> (that family, its config.json reader)."""
    return {kind: (desc, read) for name in FAMILY_MODULES for desc in [family(name)]
            for kind, read in desc.adapter.readers.items()}
