"""Pretraining recipes as data: what bench/speedrun.py races and what the demo's base_model runs.

A recipe is the part of a pretraining job that decides how fast loss falls: ``model`` (ModelConfig fields),
``optim`` (OptimConfig fields), ``seq_len``, ``micro_batch`` (sequences per step on one process), ``max_steps``, and
``layout`` ("threads": one process using every core; "ddp2": two processes of one thread each).
"""

from __future__ import annotations

import copy
from typing import Any

# The demo's recipe before the speedrun: GPT-2 family, AdamW, warmup + cosine, 16 x 256 tokens a step, 800 steps.
BASELINE_RECIPE: dict[str, Any] = {
    "model": {"family": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256},
    "optim": {"name": "adamw", "lr": 2e-3, "warmup_steps": 50, "schedule": "cosine", "min_lr_ratio": 0.1},
    "seq_len": 256, "micro_batch": 16, "max_steps": 800, "layout": "threads",
}

# The demo's recipe now, chosen by bench/speedrun.py --ablate (see its table in bench/README.md).
DEMO_RECIPE: dict[str, Any] = {
    "model": {"family": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256},
    "optim": {"name": "muon", "lr": 2e-3, "warmup_steps": 50, "schedule": "wsd", "min_lr_ratio": 0.1},
    "seq_len": 256, "micro_batch": 16, "max_steps": 400, "layout": "threads",
}


def merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``change`` applied, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for k, v in change.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
