"""The optimizer every training stage uses, and its learning-rate schedule.

``make_optimizer(model, OptimConfig(...), device)`` then ``make_scheduler(optimizer, cfg, max_steps)``; only
parameters that require gradients are optimized (LoRA trains its adapters alone).

- ``name: adamw``: AdamW on everything, weight decay on matrices only (not biases, norms).
- ``name: muon``: torch.optim.Muon (momentum, then Newton-Schulz orthogonalised updates) on the 2-D weight matrices
  inside the transformer blocks, AdamW on the rest (embeddings, the output head, norms, biases), as in the Muon
  papers and nanochat. The two run as one optimizer object (MuonAdamW), so a checkpoint holds both states and the
  scheduler drives both groups.
- ``schedule: cosine``: linear warmup, cosine decay to ``min_lr_ratio`` at max_steps. ``schedule: wsd``: linear
  warmup, constant, then a linear decay to ``min_lr_ratio`` over the last ``decay_fraction`` of the steps.
"""

from __future__ import annotations

import math
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable

import torch

BLOCK_MARKERS = (".h.", ".layers.")  # parameter names inside a transformer block, for both families


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw", or "muon": Muon on the blocks' weight matrices, AdamW on the rest
    lr: float = 2e-3  # peak learning rate after warmup (AdamW's; Muon's is muon_lr)
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio at max_steps
    warmup_steps: int = 50  # linear warmup from 0 to lr
    schedule: str = "cosine"  # "cosine" decay after warmup, or "wsd": warmup, stable, then linear decay
    decay_fraction: float = 0.3  # wsd: share of max_steps spent decaying at the end
    weight_decay: float = 0.1  # decoupled decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 disables)
    muon_lr: float = 0.02  # muon: peak learning rate of the block matrices (scaled by sqrt(max(1, rows/cols)))
    muon_momentum: float = 0.95  # muon: momentum (Nesterov)

    def __post_init__(self):
        if self.name not in ("adamw", "muon"):
            raise ValueError(f"optim.name: {self.name!r} is not an optimizer; choose adamw or muon")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"optim.schedule: {self.schedule!r} is not a schedule; choose cosine or wsd")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction: {self.decay_fraction} must be between 0 and 1")


def lr_lambda(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """The schedule as a multiplier of each group's peak lr: linear warmup, then cosine or warmup-stable-decay."""
    decay_start = max(opt.warmup_steps, round(max_steps * (1 - opt.decay_fraction)))

    def f(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        if opt.schedule == "wsd":
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
            return 1.0 - (1.0 - opt.min_lr_ratio) * progress
        progress = min(1.0, (step - opt.warmup_steps) / max(1, max_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on some parameters and torch.optim.AdamW on the others, as one optimizer.

    ``param_groups`` is the two optimizers' groups in order (the same dicts, so an LR scheduler sets both), and
    ``state_dict`` is one standard optimizer state dict over that order, which is what torch.distributed.checkpoint
    maps to parameter names: a checkpoint holds Muon's momentum and AdamW's moments and resumes both exactly.
    Written here because torch ships the two optimizers but no way to run them as one.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):  # noqa: D107 (no Optimizer.__init__:
        self.parts = (muon, adamw)                                       # the parts own the groups and state)
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> ChainMap:
        return ChainMap(*(part.state for part in self.parts))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state, groups, offset = {}, [], 0
        for part in self.parts:
            sd = part.state_dict()
            state.update({i + offset: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split by group position: the first groups are Muon's. Keys may be ids or (from
        torch.distributed.checkpoint) parameter names; each part's Optimizer.load_state_dict maps them by order."""
        groups = list(state_dict["param_groups"])
        for part in self.parts:
            mine, groups = groups[:len(part.param_groups)], groups[len(part.param_groups):]
            keys = {k for g in mine for k in g["params"]}
            part.load_state_dict({"state": {k: s for k, s in state_dict["state"].items() if k in keys},
                                  "param_groups": mine})

    def __repr__(self) -> str:
        return f"MuonAdamW({', '.join(type(p).__name__ for p in self.parts)})"


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA and CPU) with decay on matrices only, or MuonAdamW with Muon on the blocks' matrices."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if opt.name == "muon" and p.dim() == 2 and any(m in f".{n}" for m in BLOCK_MARKERS)]
    chosen = {id(p) for p in muon}
    decay = [p for _, p in named if p.dim() >= 2 and id(p) not in chosen]
    no_decay = [p for _, p in named if p.dim() < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), fused=device.type in ("cuda", "cpu"),
    )
    if not muon:
        return adamw
    return MuonAdamW(torch.optim.Muon(muon, lr=opt.muon_lr, weight_decay=opt.weight_decay,
                                      momentum=opt.muon_momentum, nesterov=True), adamw)


def make_scheduler(optimizer: torch.optim.Optimizer, opt: OptimConfig, max_steps: int):
    """The lr_lambda schedule as a LambdaLR: step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt, max_steps))
