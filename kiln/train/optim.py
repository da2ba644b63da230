"""The optimizer every training stage uses: AdamW with decay on matrices, linear warmup then cosine decay.

``make_optimizer(model, OptimConfig(lr=3e-4), device)`` and ``LambdaLR(optimizer, lr_lambda(cfg, max_steps))``;
only parameters that require gradients are optimized (LoRA trains its adapters alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class OptimConfig:
    lr: float = 2e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at max_steps
    warmup_steps: int = 50  # linear warmup from 0 to lr
    weight_decay: float = 0.1  # AdamW decay on matrices (not on biases, norms)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 disables)


def lr_lambda(opt: OptimConfig, max_steps: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to min_lr_ratio, as a multiplier of the peak lr."""

    def f(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        progress = min(1.0, (step - opt.warmup_steps) / max(1, max_steps - opt.warmup_steps))
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: torch.nn.Module, opt: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; the fused kernel (one pass over all parameters) on CUDA and CPU."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), fused=device.type in ("cuda", "cpu"),
    )


def make_scheduler(optimizer: torch.optim.Optimizer, opt: OptimConfig, max_steps: int):
    """The lr_lambda schedule as a LambdaLR: step it once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt, max_steps))
