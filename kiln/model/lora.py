"""LoRA adapters for post-training a Kiln model of any family: low-rank updates on the attention and MLP projections.

``apply_lora(model, LoRAConfig(rank=8))`` freezes the model and adds trainable adapters; ``merged_state_dict``
gives plain weights (W + scale * B @ A), so checkpoints and release bundles never hold adapters.
``LoRAConfig(rank=8, quantize="nf4")`` is QLoRA: each target's frozen weight is held in 4-bit NF4 (kiln.model.quant)
and dequantised on the fly; the trainer merges the adapters into the full-precision weights it quantised (its
starting checkpoint's), so what is saved and released is plain weights without the 4-bit error.
Written by hand rather than with peft: peft pulls transformers and accelerate, and the whole method is one matmul.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Annotated, Iterator, Literal, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.common.config import Domain, check_domains
from kiln.model.quant import check_nf4_shape, dequantize, is_nf4, nf4_linear, to_nf4_weight

# The default targets, GPT-2's four projections, mean every Linear layer of the model's family
# (kiln.model.families.Parts.lora_targets), so a LoRA config without targets fits any model.
DEFAULT_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def family_layers() -> dict[str, tuple[str, ...]]:
    """Each registered family's block Linear layers (module name suffixes)."""
    from kiln.model.families import family, names

    return {name: family(name).parts.lora_targets for name in names()}


QUANTIZE = ("none", "nf4")  # LoRAConfig.quantize values


@dataclass
class LoRAConfig:
    enabled: bool = False  # train adapters instead of every weight
    rank: Annotated[int, Domain(1)] = 8  # inner dimension r of B (out, r) @ A (r, in)
    alpha: Annotated[float, Domain(0, low_open=True)] = 16.0  # the update is scaled by alpha / rank
    dropout: Annotated[float, Domain(0, 1, high_open=True)] = 0.0  # dropout on the adapter's input
    # module name suffixes that get adapters; the default (GPT-2's four) means every projection of the model's family
    targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS))
    quantize: Literal["none", "nf4"] = "none"  # the targets' frozen weights: as they are, or 4-bit NF4 (QLoRA)

    def __post_init__(self) -> None:
        check_domains(self, "lora")  # rank >= 1 and the rest, for a config made in code as from_dict checks it
        if self.quantize not in QUANTIZE:
            raise ValueError(f"lora.quantize: unknown value {self.quantize!r}; choose 'none' (the frozen weights as "
                             "they are) or 'nf4' (4-bit NormalFloat, QLoRA)")
        layers = family_layers()
        known = {t for names in layers.values() for t in names}
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            raise ValueError(f"lora.targets: unknown module {unknown[0]!r}; choose from "
                             + "; ".join(f"{fam}: {', '.join(names)}" for fam, names in layers.items()))


def family_targets(cfg: LoRAConfig, family: str) -> list[str]:
    """The targets ``cfg`` names, checked against ``family``'s Linear layers. The default (every GPT-2 projection)
    means every projection of ``family``, so a LoRA config without targets fits any model."""
    valid = family_layers()[family]
    if sorted(cfg.targets) == sorted(DEFAULT_TARGETS):
        return list(valid)
    wrong = [t for t in cfg.targets if t not in valid]
    if wrong:
        raise ValueError(f"lora.targets: {wrong[0]!r} is not a layer of the {family} family; choose from {', '.join(valid)}")
    return list(cfg.targets)


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update; B starts at zero so the output starts unchanged.

    ``quantize="nf4"`` replaces the frozen weight by its NF4Tensor (QLoRA); the adapters stay float32 either way."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, quantize: str = "none",
                 name: str = "linear"):
        super().__init__()
        self.base = base
        self.name = name
        for p in self.base.parameters():
            p.requires_grad_(False)
        if quantize == "nf4":
            base.weight = nn.Parameter(to_nf4_weight(base.weight, name), requires_grad=False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.scale = alpha / rank
        self.dropout = dropout
        self.active = True  # False computes the frozen layer alone (the reference model)

    @property
    def quantized(self) -> bool:
        return is_nf4(self.base.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            out = nf4_linear(x, self.base.weight, self.base.bias)  # (..., out), dequantised in x's dtype
        else:
            out = self.base(x)  # (..., out)
        if not self.active:
            return out
        h = F.dropout(x, self.dropout, self.training).to(self.lora_A.dtype) @ self.lora_A.t()  # (..., r)
        return out + ((h @ self.lora_B.t()) * self.scale).to(out.dtype)  # (..., out)

    def merged_weight(self, full: torch.Tensor | None = None) -> torch.Tensor:
        """W + scale * B @ A as a plain (out, in) tensor in the frozen weight's dtype. ``full``: the weight an NF4
        base was quantised from, which W is then (so the merged weight does not keep the quantisation error); else
        the NF4 weight dequantised."""
        w = dequantize(self.base.weight)  # (out, in)
        if full is not None:
            if tuple(full.shape) != tuple(w.shape):
                raise ValueError(f"the full-precision weight of {self.name} has shape {tuple(full.shape)}, the adapted "
                                 f"layer {tuple(w.shape)}: it is not this model's starting weight")
            w = full.to(device=w.device, dtype=w.dtype)
        return (w + self.scale * (self.lora_B @ self.lora_A)).to(w.dtype)


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the target Linear layers of its family (quantising their weights
    when ``cfg.quantize`` says so); return the wrapped names. Every target is checked before any is changed."""
    config = getattr(model, "config", None)
    targets = family_targets(cfg, getattr(config, "family", "gpt2"))
    for p in model.parameters():
        p.requires_grad_(False)
    found = []  # (parent, attribute, full name) of each target
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and any(full.endswith(t) for t in targets):
                found.append((module, child_name, full))
    if not found:
        raise ValueError(f"lora.targets {targets} matched no nn.Linear in the model")
    if cfg.quantize == "nf4":
        for module, child_name, full in found:
            check_nf4_shape(full, getattr(module, child_name).weight)
    for module, child_name, full in found:
        setattr(module, child_name, LoRALinear(getattr(module, child_name), cfg.rank, cfg.alpha, cfg.dropout,
                                               cfg.quantize, full))
    if cfg.quantize == "nf4":  # identical on every rank (quantised from the same weights): DDP leaves them alone
        model._ddp_params_and_buffers_to_ignore = [f"{full}.base.weight" for _, _, full in found]
    return [full for _, _, full in found]


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def merged_state_dict(model: nn.Module, base: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict under its plain names with every adapter folded into its weight. ``base``: the plain
    state dict an NF4 (QLoRA) model was quantised from; its adapters are then folded into those full-precision
    weights, so that saved and released weights do not carry the 4-bit base's error (nor, stage after stage, compound
    it). Without it an NF4 weight is dequantised first."""
    state = {}
    adapters = dict(lora_modules(model))
    for key, t in model.state_dict().items():
        owner = next((n for n in adapters if key.startswith(n + ".")), None)
        if owner is None:
            state[key] = t
            continue
        rest = key[len(owner) + 1:]
        if rest == "base.weight":
            full = base.get(f"{owner}.weight") if base is not None and adapters[owner].quantized else None
            state[f"{owner}.weight"] = adapters[owner].merged_weight(full).detach().clone()
        elif rest == "base.bias":
            state[f"{owner}.bias"] = t
        # lora_A / lora_B are folded into the weight above
    return state


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter matrices (what a LoRA run needs to resume on top of its frozen base)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith(("lora_A", "lora_B"))}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = set(lora_state_dict(model))
    if set(state) != expected:
        missing = sorted(expected - set(state))[:3]
        extra = sorted(set(state) - expected)[:3]
        raise ValueError(f"LoRA state does not match the model's adapters (missing {missing}, unexpected {extra}); "
                         "resume with the same lora settings")
    model.load_state_dict(state, strict=False)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the frozen base model (the reference for DPO and the RL KL penalty) without a second copy."""
    mods = [m for _, m in lora_modules(model)]
    saved = [m.active for m in mods]
    for m in mods:
        m.active = False
    try:
        yield
    finally:
        for m, a in zip(mods, saved):
            m.active = a


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
