"""The model families by name: build a model, count its training FLOPs, from one ModelConfig.

``build_model(ModelConfig(family="llama", ...))`` returns a ``kiln.model.llama.Llama``; a new family is one model
file plus one line in FAMILY_MODULES.
"""

from __future__ import annotations

import importlib

import torch.nn as nn

from kiln.model.config import FAMILIES, ModelConfig

FAMILY_MODULES = {"gpt2": ("kiln.model.gpt", "GPT"), "llama": ("kiln.model.llama", "Llama")}
assert set(FAMILY_MODULES) == set(FAMILIES), "every family in kiln.model.config.FAMILIES needs a model module"


def model_class(family: str) -> type[nn.Module]:
    module, name = FAMILY_MODULES[family]
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model of ``cfg.family``."""
    return model_class(cfg.family)(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of ``cfg``'s family (PaLM appendix B's 6N + 12 L H Q T)."""
    return importlib.import_module(FAMILY_MODULES[cfg.family][0]).flops_per_token(cfg, seq_len)
