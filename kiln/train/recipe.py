"""Pretraining recipes as data: what bench/speedrun.py races and what the demo's base_model runs.

A recipe is the part of a pretraining job that decides how fast loss falls: ``model`` (ModelConfig fields),
``optim`` (OptimConfig fields), ``seq_len``, ``micro_batch`` (sequences per step on one process), ``max_steps``, and
``layout`` ("threads": one process using every core; "ddp2": two processes of one thread each), and optionally
``cpu_bf16`` (bf16 autocast on CPU), ``compile``, ``seed``, ``document_mask``.
"""

from __future__ import annotations

from typing import Any

from kiln.common.config import deep_merge as merge  # noqa: F401 (recipes merge as presets do)

# The demo's recipe before the speedrun: GPT-2 family, AdamW, warmup + cosine, 16 x 256 tokens a step, 800 steps.
BASELINE_RECIPE: dict[str, Any] = {
    "model": {"family": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 256},
    "optim": {"name": "adamw", "lr": 2e-3, "warmup_steps": 50, "schedule": "cosine", "min_lr_ratio": 0.1},
    "seq_len": 256, "micro_batch": 16, "max_steps": 800, "layout": "threads",
}


def demo_recipe() -> dict[str, Any]:
    """The recipe the demo preset trains with, read from the defaults it runs on: the llama family at the demo
    size (conf/presets/demo.yaml), kiln.plan.memory.BatchConfig's batch and steps, OptimConfig with PRETRAIN_OPTIM,
    and the CPU plan's precision on this machine (cpu_bf16_choice: bf16 autocast where the CPU multiplies bf16
    natively)."""
    from kiln.model.config import MODEL_PRESETS
    from kiln.plan.memory import BatchConfig, HardwareConfig, ParallelConfig, cpu_bf16_choice
    from kiln.train.optim import PRETRAIN_OPTIM, OptimConfig

    batch, optim = BatchConfig(), OptimConfig(**PRETRAIN_OPTIM)
    return {"model": {"family": "llama", **MODEL_PRESETS["llama"]["demo"]},
            "optim": {k: getattr(optim, k) for k in ("name", "lr", "warmup_steps", "schedule", "min_lr_ratio")},
            "seq_len": batch.seq_len, "micro_batch": batch.global_batch, "max_steps": batch.max_steps,
            "layout": "threads", "cpu_bf16": bool(cpu_bf16_choice(ParallelConfig(), HardwareConfig(device="cpu")))}
