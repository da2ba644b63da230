"""Tests for the training job on pipeline stages (job.layout.pp, kiln.model.pipeline_parallel) on two gloo
processes: both families follow the one-process loss curve over 30 steps (GPT-2 on 1F1B with its tied head across
the stages, Llama on interleaved 1F1B with two stages per rank), resume from a mid-run checkpoint bit for
bit as a restart after SIGKILL does, and reshard: a pipeline checkpoint resumes on one process and under FSDP2. A
run hit by a poisoned batch, a preemption and a SIGKILL rolls back, saves, resumes and ends where one process
through the same faults ends. Layouts the job cannot run are config errors before anything trains.

Run: python -m pytest tests/kiln/train/test_train_pipeline.py -q   (torchrun launches of two processes)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.common.config import ConfigError
from kiln.train.checkpoint import verify_checkpoint
from kiln.train.job import JobConfig, load_job
from tests.conftest import ROOT, subprocess_env
from tests.kiln.train.test_train_tensor_parallel import (RESUME_AT, STEPS, assert_same_curve, in_process, job_for,
                                                         result_of, resume_copy)

# two micro-batches of 4 sequences a step: the one-process run accumulates them, the pipeline runs them as its
# micro-batches; GPT-2 on 1F1B (a block per stage), Llama's 4 blocks as 4 stages, two per rank
CASES = {
    "gpt2": ({}, {"layout": {"pp": 2}}),
    "llama": ({"model_fields": {"n_layer": 4}, "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.1}},
              {"layout": {"pp": 2}, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}),
}


def pp_job(pretrain_job, path: Path, family: str, pipelined: bool = True, **kw) -> Path:
    shared, pp = CASES[family]
    fields = dict(shared)
    model = fields.pop("model_fields", {})
    job = job_for(pretrain_job, path, family, grad_accum=2, **fields, **(pp if pipelined else {}), **kw)
    if model:
        data = json.loads(job.read_text())
        data["model"].update(model)
        job.write_text(json.dumps(data, indent=2))
    return job


def pp_resume(res: dict, dest: Path, pretrain_job, family: str, pipelined: bool = True, **kw) -> Path:
    """A copy of the finished run of result ``res`` in ``dest`` cut back to its step-RESUME_AT checkpoint; its job
    (on pipeline stages or not)."""
    resume_copy(Path(res["checkpoint"]).parents[1], dest, pretrain_job, family)
    return pp_job(pretrain_job, dest, family, pipelined, **kw)


@pytest.fixture(scope="module")
def pp_reference(tmp_path_factory, pretrain_job):
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = in_process(pp_job(pretrain_job, tmp_path_factory.mktemp(f"one-{family}"), family, False))
        return made[family]

    return get


@pytest.fixture(scope="module", params=list(CASES))
def pp_run(request, tmp_path_factory, pretrain_job, train_runner, pp_reference):
    """(family, the pipeline job, its one-process reference result, the launch): 30 steps on two ranks, pp 2."""
    family = request.param
    ref = pp_reference(family)
    job = pp_job(pretrain_job, tmp_path_factory.mktemp(f"pp-{family}"), family)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return family, job, ref, proc


@pytest.mark.slow
def test_pipeline_training_follows_one_process_and_resumes_bit_for_bit(tmp_path, pp_run, pretrain_job,
                                                                      train_runner) -> None:
    family, job, ref, proc = pp_run
    res = result_of(job)
    assert res["world_size"] == 2 and res["steps"] == STEPS and res["parallelism"] == "none"
    assert res["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert res["pipeline"]["microbatches"] == 2 and res["params"] == ref["params"]
    assert res["tokens"] == STEPS * 8 * 32  # both stages read the same 8 sequences: one data-parallel rank
    assert len(set(res["rank_param_digests"])) == 2  # each rank holds other blocks
    assert_same_curve(res, ref)
    schedule = "interleaved_1f1b, 2 stages per rank" if family == "llama" else "1f1b"
    assert f"pipeline parallel 2 ({schedule}, 2 micro-batches; pp 2)" in proc.stdout, proc.stdout
    meta = verify_checkpoint(Path(res["checkpoint"]))
    assert meta["format"] == "sharded" and meta["optim_state"] == "flat"
    assert meta["job"]["layout"]["pp"] == 2 and meta["job"]["pipeline"]["schedule"] == CASES[family][1].get(
        "pipeline", {"schedule": "1f1b"})["schedule"]

    # a restart after a crash resumes from the newest good checkpoint: the same run, bit for bit
    resumed = pp_resume(res, tmp_path / "again", pretrain_job, family)
    proc = train_runner(resumed, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = result_of(resumed)
    assert again["resumed_from"].endswith(f"step_{RESUME_AT:07d}")
    assert again["rank_param_digests"] == res["rank_param_digests"]
    assert again["curve"] == res["curve"] and again["history"] == res["history"]


@pytest.mark.parametrize("fields, world, message", [
    ({"layout": {"pp": 2, "tp": 2}}, 4, "job.layout: pp 2 with tp 2; the training job runs pipeline stages alone or "
                                        "sharded by FSDP2"),
    ({"layout": {"pp": 2}, "parallelism": "ddp"}, 4, "job.parallelism: 'ddp' with layout.pp 2"),
    ({"layout": {"pp": 2}, "task": "sft", "lora": {"enabled": True}}, 2, "job.layout.pp: 2 with lora.enabled"),
    ({"layout": {"pp": 3}}, 3, "job.layout.pp: 3 ranks x 1 stages each must divide the 2 layers (model.n_layer); pp "
                               "may be 1, 2"),
    ({"layout": {"pp": 2}, "grad_accum": 1}, 2, "job.pipeline.microbatches: 1; a multiple of pp (2), so that every "
                                                "stage works in the steady state (pipeline.microbatches 0 takes "
                                                "grad_accum, 1: raise job.grad_accum"),
    ({"layout": {"pp": 2}, "pipeline": {"microbatches": 6}}, 2, "job.pipeline.microbatches: 6 must divide the batch "
                                                                 "of 8 sequences per step"),
    ({"layout": {"pp": 2}, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}, 2,
     "job.layout.pp: 2 ranks x 2 stages each must divide the 2 layers (model.n_layer); pp may be 1"),
    ({"layout": {"pp": 2}, "pipeline": {"schedule": "dualpipe"}}, 2, "job.pipeline.schedule: 'dualpipe'; choose one"),
    ({"layout": {"pp": 2, "dp_shard": 2}}, 2, "pp 2 x dp_replicate 1 x dp_shard 2 x tp 1 must multiply to the world "
                                              "size 2"),
])
def test_a_pipeline_the_job_cannot_train_is_a_config_error_naming_the_field(tmp_path, pretrain_job, fields, world,
                                                                            message) -> None:
    data = json.loads(job_for(pretrain_job, tmp_path, "gpt2", **{"grad_accum": 2, **fields}).read_text())
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(JobConfig, data, "job").check_layout("job", world)


def test_a_pipeline_job_records_its_schedule_and_others_keep_their_record(pretrain_job, tmp_path) -> None:
    plain = load_job(JobConfig, json.loads(job_for(pretrain_job, tmp_path, "gpt2").read_text()))
    assert "pipeline" not in plain.params() and "layout" not in plain.params()
    piped = load_job(JobConfig, json.loads(pp_job(pretrain_job, tmp_path, "llama").read_text()))
    assert piped.params()["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": -1, "tp": 1}
    assert piped.params()["pipeline"] == {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 0}
    assert piped.pipeline_config().microbatches == 2  # 0: grad_accum
