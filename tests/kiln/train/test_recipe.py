"""Tests for kiln.train.recipe: the baseline recipe the speedrun races against, the demo recipe read from the defaults
the demo runs on (the llama demo size, the batch defaults, the pretraining optimizer) rather than written out, both
valid pretraining jobs, and merge leaving the recipe it extends untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.model.config import MODEL_PRESETS, ModelConfig
from kiln.plan import memory
from kiln.plan.memory import BatchConfig, native_cpu_bf16
from kiln.train import optim
from kiln.train.job import JobConfig, load_job
from kiln.train.optim import PRETRAIN_OPTIM, OptimConfig
from kiln.train.recipe import BASELINE_RECIPE, demo_recipe, merge

KEYS = {"model", "optim", "seq_len", "micro_batch", "max_steps", "layout"}


def as_job(recipe: dict) -> JobConfig:
    data = {"model": {**recipe["model"], "vocab_size": 4096}, "optim": recipe["optim"],
            **{k: recipe[k] for k in ("seq_len", "micro_batch", "max_steps")}}
    return load_job(JobConfig, data, "recipe")


def test_the_baseline_is_gpt2_with_adamw_and_cosine_on_16_by_256_tokens_for_800_steps():
    assert set(BASELINE_RECIPE) == KEYS and BASELINE_RECIPE["layout"] == "threads"
    job = as_job(BASELINE_RECIPE)
    assert job.model == ModelConfig(family="gpt2", n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=4096)
    assert (job.optim.name, job.optim.lr, job.optim.schedule, job.optim.warmup_steps) == ("adamw", 2e-3, "cosine", 50)
    assert (job.seq_len * job.micro_batch, job.max_steps) == (16 * 256, 800)


def test_the_demo_recipe_is_the_llama_demo_size_the_batch_defaults_and_the_pretraining_optimizer():
    recipe, batch, opt = demo_recipe(), BatchConfig(), OptimConfig(**PRETRAIN_OPTIM)
    assert set(recipe) == KEYS | {"cpu_bf16"} and recipe["layout"] == "threads"
    assert recipe["cpu_bf16"] is native_cpu_bf16()  # the CPU plan's precision on this machine
    assert recipe["model"] == {"family": "llama", **MODEL_PRESETS["llama"]["demo"]}
    assert recipe["optim"] == {"name": opt.name, "lr": opt.lr, "warmup_steps": opt.warmup_steps,
                               "schedule": opt.schedule, "min_lr_ratio": opt.min_lr_ratio}
    assert {k: recipe["optim"][k] for k in PRETRAIN_OPTIM} == PRETRAIN_OPTIM  # the pretraining choices win
    # one process runs the whole global batch as its micro-batch
    assert (recipe["seq_len"], recipe["micro_batch"], recipe["max_steps"]) == (batch.seq_len, batch.global_batch,
                                                                               batch.max_steps)
    job = as_job(recipe)
    assert job.model.family == "llama" and job.optim == opt


def test_the_demo_recipe_follows_the_defaults_it_is_read_from(monkeypatch):
    monkeypatch.setitem(MODEL_PRESETS["llama"], "demo", {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128})
    monkeypatch.setitem(optim.PRETRAIN_OPTIM, "lr", 5e-4)

    @dataclass
    class OtherBatch(BatchConfig):
        seq_len: int = 128
        global_batch: int = 12
        max_steps: int = 90

    monkeypatch.setattr(memory, "BatchConfig", OtherBatch)
    recipe = demo_recipe()
    assert recipe["model"] == {"family": "llama", "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128}
    assert recipe["optim"]["lr"] == 5e-4 and recipe["optim"]["name"] == PRETRAIN_OPTIM["name"]
    assert (recipe["seq_len"], recipe["micro_batch"], recipe["max_steps"]) == (128, 12, 90)
    monkeypatch.setattr(memory, "native_cpu_bf16", lambda: True)
    assert demo_recipe()["cpu_bf16"] is True
    monkeypatch.setattr(memory, "native_cpu_bf16", lambda: False)
    assert demo_recipe()["cpu_bf16"] is False


def test_a_recipe_is_a_fresh_copy_and_merge_changes_only_what_it_names():
    recipe = demo_recipe()
    recipe["model"]["n_layer"] = 99
    assert demo_recipe()["model"]["n_layer"] == MODEL_PRESETS["llama"]["demo"]["n_layer"] != 99
    base = demo_recipe()
    faster = merge(base, {"optim": {"lr": 1e-3}, "micro_batch": 16})
    assert faster["optim"] == {**base["optim"], "lr": 1e-3} and faster["micro_batch"] == 16
    assert faster["model"] == base["model"] and base == demo_recipe()  # the recipe merged into is unchanged
