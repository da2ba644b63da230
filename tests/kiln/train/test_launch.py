"""Tests of kiln/train/launch.py: a run spec is validated as the job file it writes, and a plan that splits the experts
writes its ep into the job."""

from __future__ import annotations

import pytest

from kiln.common.config import ConfigError
from kiln.train.launch import RunSpec


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
    # a plan that trains under bf16 autocast on CPU (kiln.plan.memory.cpu_bf16_choice) says so in the job
    bf16 = RunSpec("pretrain", {}, {**plan, "cpu_bf16": True}, {}, "tok.json")
    assert bf16.job(tmp_path, "uri", "run")["cpu_bf16"] is True and bf16.validate("base_model").cpu_bf16
    assert bf16.key != RunSpec("pretrain", {}, plan, {}, "tok.json").key  # another run: other floats
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
