"""The job file: typed blocks, one validation (load_job) before launch, and rank 0's config error on every rank."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.lora import LoRAConfig
from kiln.posttrain.dpo import DpoJob
from kiln.posttrain.reward import RewardJob
from kiln.posttrain.rl import RlJob
from kiln.train.job import JobConfig, job_class, load_job
from kiln.train.optim import OptimConfig
from kiln.train.spikes import SpikeConfig
from tests.faults import Faults

LLAMA = {"family": "llama", "vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 4, "n_embd": 32,
         "n_kv_head": 2}


def test_the_blocks_are_built_once_as_their_dataclasses():
    job = load_job(JobConfig, {"model": LLAMA, "optim": {"name": "muon", "lr": 0.01}, "spikes": {"enabled": False},
                               "task": "sft", "lora": {"enabled": True, "rank": 4}})
    assert job.model == ModelConfig(**LLAMA) and job.model.intermediate_size == 128  # filled in by ModelConfig
    assert job.optim == OptimConfig(name="muon", lr=0.01) and job.spikes == SpikeConfig(enabled=False)
    assert job.lora == LoRAConfig(enabled=True, rank=4)
    # the record a run keeps: every field, the model as checkpoints store it, the data files left out
    params = job.params()
    llama_fields = {k: v for k, v in asdict(ModelConfig(**LLAMA)).items() if k not in ("bias",)
                    and not k.startswith(("n_expert", "moe_", "router_")) and k not in ("n_shared_experts",
                                                                                          "norm_topk_prob",
                                                                                          "capacity_factor",
                                                                                          "mup_base_width")}
    assert params["model"] == llama_fields  # the mixture-of-experts fields are not a llama's
    assert params["optim"]["lr"] == 0.01 and params["lora"]["rank"] == 4 and "train_files" not in params


def test_rl_and_ppo_watch_only_non_finite_losses_unless_told():
    assert RlJob().spikes == SpikeConfig(enabled=False)
    assert load_job(RlJob, {"init_from": "c", "train_files": ["p.jsonl"], "preference_coef": 0.0,
                            "spikes": {"window": 10}}).spikes.enabled


@pytest.mark.parametrize("cls,data,message", [
    (JobConfig, {"optim": {"lrr": 1}}, "base_model.optim: unknown key 'lrr'. Did you mean 'lr'?"),
    (JobConfig, {"model": {"n_embd": 65, "n_head": 2}}, "base_model: model.n_embd (65) must be divisible"),
    (JobConfig, {"lora": {"rank": 0}, "task": "sft"}, "base_model.lora.rank is 0: give >= 1"),
    (JobConfig, {"lora": {"enabled": True}}, "base_model.lora: LoRA adapts weights that exist; pretraining from random"),
    (JobConfig, {"document_mask": True, "task": "sft"}, "base_model.document_mask is a pretraining option"),
    (JobConfig, {"task": "sft", "parallelism": "fsdp", "lora": {"enabled": True}}, "a LoRA run replicates its model"),
    (DpoJob, {"train_files": ["p.jsonl"]}, "base_model.init_from is empty: a dpo job starts from"),
    (DpoJob, {"init_from": "c"}, "base_model.train_files is empty"),
    (RlJob, {"init_from": "c", "train_files": ["p.jsonl"], "group_size": 1}, "base_model.group_size is 1: give >= 2"),
    (RlJob, {"init_from": "c", "train_files": ["p.jsonl"], "reward": "chess"}, "'chess' is not a checkable task"),
    (RewardJob, {"init_from": "c", "train_files": ["p.jsonl"], "lora": {"enabled": True}},
     "the reward model trains every weight"),
])
def test_a_job_that_cannot_run_is_a_config_error_naming_the_key(cls, data, message):
    with pytest.raises(ConfigError) as e:
        load_job(cls, data, "base_model")
    assert message in str(e.value)


def test_every_task_has_a_job_class():
    from kiln.train.entry import TASKS

    assert {t: job_class(t).__name__ for t in TASKS} == {"pretrain": "JobConfig", "sft": "SftJob", "dpo": "DpoJob",
                                                         "rl": "RlJob", "reward": "RewardJob", "ppo": "PpoJob"}
    with pytest.raises(ConfigError, match="dpo_model.task: 'kto' is not a training task"):
        job_class("kto", "dpo_model")


def test_job_config_defaults_are_a_valid_pretrain_job() -> None:
    job = JobConfig()
    assert job.task == "pretrain" and Faults().fail_at_step == -1 and job.grad_accum == 1
    assert job.parallelism == "auto" and job.async_save and Faults().kill_at_steps == []
    assert not {"fail_at_step", "kill_at_steps", "save_pause_s", "inject_spike"} & set(vars(job))  # test-only: tests/faults.py


@pytest.mark.parametrize("task, data", [
    ("pretrain", {"max_steps": 7, "optim": {"lr": 0.004}, "model": {"n_layer": 2, "n_embd": 64}, "train_files": ["a.bin"]}),
    ("sft", {"task": "sft", "lora": {"enabled": True, "rank": 4}, "init_from": "ck"}),
    ("dpo", {"task": "dpo", "init_from": "ck", "max_steps": 3, "train_files": ["p.jsonl"]}),
    ("rl", {"task": "rl", "init_from": "ck", "seed": 5, "train_files": ["p.jsonl"], "preference_file": "p.jsonl"}),
])
def test_the_job_file_is_the_validated_job_which_the_worker_rebuilds_without_checking_again(task, data, monkeypatch):
    from kiln.train.job import CHECKED, job_file

    cls = job_class(task)
    job = load_job(cls, data)
    written = job_file(job)
    assert len(written[CHECKED]) == 64 and set(written) - {CHECKED} == set(asdict(job))
    monkeypatch.setattr(cls, "check", lambda self, where="job": pytest.fail("checked a second time"))
    assert load_job(cls, json.loads(json.dumps(written))) == job


def test_a_job_file_edited_after_it_was_written_is_validated_in_full():
    from kiln.train.job import job_file

    written = job_file(load_job(JobConfig, {"max_steps": 7}))
    edited = {**written, "max_steps": 0}  # the digest no longer matches
    with pytest.raises(ConfigError, match=r"job.max_steps"):
        load_job(JobConfig, edited)
    unknown = {**job_file(load_job(JobConfig, {})), "max_stepz": 3}
    with pytest.raises(ConfigError, match="unknown key 'max_stepz'"):
        load_job(JobConfig, unknown)
    assert load_job(JobConfig, {**written, "checked": "0" * 64}).max_steps == 7  # a wrong digest: checked, and fine
