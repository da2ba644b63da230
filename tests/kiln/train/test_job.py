"""The job file: typed blocks, one validation (load_job) before launch, and rank 0's config error on every rank."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch.distributed
import torch.multiprocessing as mp

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.lora import LoRAConfig
from kiln.posttrain.dpo import DpoJob
from kiln.posttrain.reward import RewardJob
from kiln.posttrain.rl import RlJob
from kiln.train.job import JobConfig, job_class, load_job
from kiln.train.launch import RunSpec
from kiln.train.optim import OptimConfig
from kiln.train.spikes import SpikeConfig
from tests.ports import free_port

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
    assert load_job(RlJob, {"init_from": "c", "train_files": ["p.jsonl"], "spikes": {"window": 10}}).spikes.enabled


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

    assert {t: job_class(t).__name__ for t in TASKS} == {"pretrain": "JobConfig", "sft": "JobConfig", "dpo": "DpoJob",
                                                         "rl": "RlJob", "reward": "RewardJob", "ppo": "PpoJob"}
    with pytest.raises(ConfigError, match="dpo_model.task: 'kto' is not a training task"):
        job_class("kto", "dpo_model")


def test_a_spec_is_validated_as_the_job_file_it_writes(tmp_path):
    plan = {"model": {"vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}, "seq_len": 16,
            "micro_batch": 2, "grad_accum": 1, "hardware": {"device": "cpu"}}
    spec = RunSpec("pretrain", {"optim": {"lr": 0.01}, "max_steps": 3}, plan, {"token_shards": "s1"}, "tok.json")
    job = spec.validate("base_model")
    assert job.optim.lr == 0.01 and job.max_steps == 3 and job.model.n_embd == 32
    # the job file itself is the spec's fields as they were given: nothing the validation filled in is written
    assert spec.job(tmp_path, "uri", "run") == {
        "task": "pretrain", "out_dir": str(tmp_path), "tokenizer": "tok.json", "model": plan["model"], "seq_len": 16,
        "micro_batch": 2, "grad_accum": 1, "parallelism": "auto", "activation_checkpointing": False, "compile": False,
        "mlflow_tracking_uri": "uri", "mlflow_run_id": "run", "optim": {"lr": 0.01}, "max_steps": 3}
    bad = RunSpec("pretrain", {"optim": {"warmup_stpes": 3}}, plan, {}, "tok.json")
    with pytest.raises(ConfigError, match="base_model.optim: unknown key 'warmup_stpes'. Did you mean 'warmup_steps'"):
        bad.validate("base_model")


def test_a_plan_that_splits_the_experts_writes_its_ep_into_the_job(tmp_path):
    model = {"family": "moe", "vocab_size": 64, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32,
             "n_experts": 4}
    plan = {"model": model, "seq_len": 16, "micro_batch": 2, "grad_accum": 1, "hardware": {"device": "cpu"},
            "parallelism": "fsdp", "layout": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "ep": 2}}
    spec = RunSpec("pretrain", {}, plan, {}, "tok.json")
    assert spec.job(tmp_path, "uri", "run")["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}
    job = spec.validate("base_model")
    assert job.layout.ep == 2
    job.check_layout("job", 2)
    with pytest.raises(ConfigError, match=r"job.layout.ep: 2 must divide model.n_experts \(3\)"):
        RunSpec("pretrain", {}, {**plan, "model": {**model, "n_experts": 3}}, {}, "t").validate("job").check_layout(
            "job", 2)


def _rank(rank: int, port: int, path: str, out: str) -> None:
    from kiln.train.dist import broadcast_config, setup_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    info = setup_distributed("cpu", 60)
    try:
        broadcast_config(JobConfig, path if rank == 0 else None, info)
        result = "built"
    except ConfigError as e:
        result = str(e)
    Path(out, f"rank{rank}").write_text(result)
    torch.distributed.destroy_process_group()


def test_rank_zeros_config_error_is_raised_on_every_rank(tmp_path):
    """Only rank 0 reads and checks the job file; the other rank gets its error instead of waiting for a job."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"optim": {"lrr": 1}}))
    mp.start_processes(_rank, args=(free_port(), str(path), str(tmp_path)), nprocs=2, start_method="spawn")
    assert {p.name: p.read_text() for p in tmp_path.glob("rank*")} == {
        r: "job.optim: unknown key 'lrr'. Did you mean 'lr'? Allowed keys: " + ", ".join(sorted(asdict(OptimConfig())))
        + "." for r in ("rank0", "rank1")}
