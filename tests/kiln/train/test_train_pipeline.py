"""Tests for the training job on pipeline stages (job.layout.pp, kiln.model.pipeline_parallel) on two gloo
processes: both families follow the one-process loss curve over 30 steps (GPT-2 on 1F1B with its tied head across
the stages, Llama on interleaved 1F1B with two stages per rank), resume from a mid-run checkpoint bit for
bit as a restart after SIGKILL does, and reshard: a pipeline checkpoint resumes on one process and under FSDP2.
On four processes, pp 2 x dp_shard 2 and pp 2 x tp 2 follow one process too, and the latter's checkpoint resumes on
one. A run hit by a poisoned batch, a preemption and a SIGKILL rolls back, saves, resumes and ends where one process
through the same faults ends. Layouts the job cannot run are config errors before anything trains.

Run: python -m pytest tests/kiln/train/test_train_pipeline.py -q   (torchrun launches of two and four processes)
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
from tests.kiln.train.test_train_tensor_parallel import (RESUME_AT, STEPS, assert_restart_is_bit_identical,
                                                         assert_same_curve, in_process, job_for, result_of,
                                                         resume_copy)

# two micro-batches of 4 sequences a step: the one-process run accumulates them, the pipeline runs them as its
# micro-batches; GPT-2 on 1F1B (a block per stage) attending within documents, Llama's 4 blocks as 4 stages, two
# per rank
CASES = {
    "gpt2": ({"document_mask": True}, {"layout": {"pp": 2}}),  # the (B, 1, T, T) mask cut into micro-batches too
    "llama": ({"model_fields": {"n_layer": 4}, "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.1}},
              {"layout": {"pp": 2}, "pipeline": {"schedule": "interleaved_1f1b", "virtual_stages": 2}}),
}


def pp_job(pretrain_job, path: Path, family: str, pipelined: bool = True, **kw) -> Path:
    shared, pp = CASES[family]
    fields = dict(shared)
    model = fields.pop("model_fields", {})
    job = job_for(pretrain_job, path, family, grad_accum=2, **{**fields, **(pp if pipelined else {}), **kw})
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


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory, pretrain_job, train_runner, pp_reference):
    """``pp_runs(family)``: (family, the pipeline job, its one-process reference result, the launch): 30 steps on
    two ranks, pp 2, launched once per module."""
    made: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in made:
            job = pp_job(pretrain_job, tmp_path_factory.mktemp(f"pp-{family}"), family)
            proc = train_runner(job, nproc=2)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            made[family] = (family, job, pp_reference(family), proc)
        return made[family]

    return get


@pytest.fixture(params=list(CASES))
def pp_run(request, pp_runs):
    return pp_runs(request.param)


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
    if family == "gpt2":  # validated masked and unmasked, as one process does
        assert [h["val_loss_unmasked"] for h in res["history"]] == pytest.approx(
            [h["val_loss_unmasked"] for h in ref["history"]], abs=1e-4)
        assert res["history"][-1]["val_loss_unmasked"] != res["history"][-1]["val_loss"]
    schedule = "interleaved_1f1b, 2 stages per rank" if family == "llama" else "1f1b"
    assert f"pipeline parallel 2 ({schedule}, 2 micro-batches; pp 2)" in proc.stdout, proc.stdout
    meta = verify_checkpoint(Path(res["checkpoint"]))
    assert meta["format"] == "sharded" and meta["optim_state"] == "flat"
    assert meta["job"]["layout"]["pp"] == 2 and meta["job"]["pipeline"]["schedule"] == CASES[family][1].get(
        "pipeline", {"schedule": "1f1b"})["schedule"]

    # a restart after a crash resumes from the newest good checkpoint: the same run, bit for bit
    assert_restart_is_bit_identical(pp_resume(res, tmp_path / "again", pretrain_job, family), res, train_runner)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_one_process_and_releases_whole(tmp_path, pp_run, pretrain_job) -> None:
    """The stages' shards resume as one whole model on the same curve, and the release (Hugging Face safetensors)
    gathered from them gives the one-process run's logits."""
    import torch

    from kiln.release.bundle import load_release, write_release

    family, job, ref, _ = pp_run
    one = in_process(pp_resume(result_of(job), tmp_path, pretrain_job, family, pipelined=False))
    assert one["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and "layout" not in one
    assert_same_curve(one, ref)
    logits = []
    for name, res in (("pp", result_of(job)), ("one", ref)):
        write_release(res["checkpoint"], tmp_path / name, card="# card\n")
        model, _ = load_release(tmp_path / name)
        with torch.no_grad():
            logits.append(model(torch.arange(32).remainder(model.config.vocab_size)[None]))
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=0)


FSDP_SPLIT = {"micro_batch": 2, "eval_batches": 8}  # two data-parallel ranks of 2 sequences: the same 4 a micro-step


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_fsdp2(tmp_path, pp_runs, pretrain_job, train_runner) -> None:
    """Resharding through torch.distributed.checkpoint: each rank's stages saved by name (Llama's interleaved
    stages, two per rank), loaded as FSDP2's dim-0 shards of the whole model on two data-parallel ranks."""
    family, job, ref, _ = pp_runs("llama")
    resumed = pp_resume(result_of(job), tmp_path, pretrain_job, family, pipelined=False, parallelism="fsdp",
                        **FSDP_SPLIT)
    proc = train_runner(resumed, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(resumed)
    assert res["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and res["parallelism"] == "fsdp"
    assert_same_curve(res, ref)


@pytest.mark.slow
def test_fsdp2_over_pipeline_stages_on_four_ranks_follows_one_process(tmp_path, pretrain_job, train_runner,
                                                                     pp_reference) -> None:
    """pp 2 x dp_shard 2: each stage sharded by FSDP2 over the two data-parallel ranks, which read disjoint rows."""
    ref = pp_reference("gpt2")
    job = pp_job(pretrain_job, tmp_path, "gpt2", **FSDP_SPLIT)
    proc = train_runner(job, nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 1} and res["parallelism"] == "fsdp"
    assert res["tokens"] == ref["tokens"]
    digests = res["rank_param_digests"]  # ranks 0, 1 hold stage 0; ranks 2, 3 stage 1 (pp is the outer dim)
    assert digests[0] == digests[1] != digests[2] == digests[3]
    assert_same_curve(res, ref)
    assert "pipeline parallel 2 (1f1b, 2 micro-batches; pp 2 x dp_shard 2)" in proc.stdout


@pytest.mark.slow
def test_tensor_parallel_pipeline_stages_on_four_ranks_follow_one_process_and_resume_on_one(tmp_path, pretrain_job,
                                                                                          train_runner,
                                                                                          pp_reference) -> None:
    """pp 2 x tp 2 (Llama, two interleaved stages per rank, each split over two ranks): the one-process curve; its
    checkpoint (every rank's shards of its stages) resumes on one process on the same curve."""
    ref = pp_reference("llama")
    job = pp_job(pretrain_job, tmp_path / "pptp", "llama", layout={"pp": 2, "tp": 2})
    proc = train_runner(job, nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2} and res["tokens"] == ref["tokens"]
    digests = res["rank_param_digests"]  # ranks 0, 1 hold stages 0 and 2; ranks 2, 3 stages 1 and 3
    assert digests[0] == digests[1] != digests[2] == digests[3]
    assert_same_curve(res, ref)
    assert "pipeline parallel 2 (interleaved_1f1b, 2 stages per rank, 2 micro-batches; pp 2 x tp 2)" in proc.stdout
    one = in_process(pp_resume(res, tmp_path / "one", pretrain_job, "llama", pipelined=False))
    assert one["resumed_from"].endswith(f"step_{RESUME_AT:07d}")
    assert_same_curve(one, ref)

@pytest.mark.slow
def test_rollback_preemption_and_sigkill_under_a_pipeline_end_where_one_process_ends(tmp_path, pretrain_job,
                                                                                   train_runner) -> None:
    """A poisoned batch (17, at 1000x the lr) rolls the pipeline back to step 10; SIGTERM on rank 1 at step 24 stops
    both ranks after step 25 with its checkpoint saved; the next launch is SIGKILLed at step 27 and the third
    finishes. The one-process run through the same spike ends on the same curve."""
    from kiln.train import logbook
    from kiln.train.loop import main
    from kiln.train.preempt import PREEMPTED_EXIT
    from tests.conftest import single_thread
    from tests.faults import Faults, injector

    spikes = {"ckpt_interval": 5, "keep_last": 4, "optim": {"lr": 3e-3, "warmup_steps": 5},
              "spikes": {"warmup_steps": 5, "window": 20, "rollback_steps": 5, "skip_batches": 3}}
    one = pp_job(pretrain_job, tmp_path / "one", "gpt2", pipelined=False, **spikes)
    with single_thread():
        ref = main(["--config", str(one), "--device", "cpu"], callbacks=[injector(spike_batch=17, spike_lr_factor=1000.0)])
    assert [e["event"] for e in ref["events"]] == ["rollback"] and ref["events"][0]["to_step"] == 10

    job = pp_job(pretrain_job, tmp_path / "pp", "gpt2", **spikes)

    def launch(**faults) -> subprocess.CompletedProcess:
        f = Faults(**faults).write(tmp_path / "faults.json")
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "tests.faults", "--faults", str(f), "--config", str(job), "--device", "cpu",
                               "--timeout-s", "120"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                              timeout=240)

    proc = launch(spike_batch=17, spike_lr_factor=1000.0, term_at_step=24, term_rank=1)
    assert proc.returncode != 0 and str(PREEMPTED_EXIT) in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result_of(job)["preemption"]["saved_step"] == 25
    proc = launch(kill_at_steps=[27])
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    proc = launch()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["resumed_from"].endswith("step_0000025") and res["steps"] == STEPS
    same = ("event", "step", "to_step", "skipped_batches")
    assert [{k: e[k] for k in same} for e in res["events"]] == [{k: ref["events"][0][k] for k in same}]
    assert res["events"][0]["loss"] == pytest.approx(ref["events"][0]["loss"], rel=1e-4)
    assert_same_curve(res, ref)
    rows = logbook.attempts(Path(json.loads(job.read_text())["out_dir"]))
    got = [(r["attempt"], r["outcome"], r["from_step"], r["to_step"]) for r in rows]
    assert got == [("1.0", "rolled_back", 0, 18), ("1.1", "preempted", 10, 25), ("2.0", "killed", 25, 27),
                   ("3.0", "completed", 25, STEPS)], got
    assert res["goodput"]["goodput"] < 1.0 and res["goodput"]["redone_steps_s"] > 0  # steps 10-18, 26, 27 redone

@pytest.mark.parametrize("fields, world, message", [
    ({"layout": {"pp": 2, "tp": 2}}, 4, "job.layout: pp 2 with tp 2 for the gpt2 family: its tensor-parallel "
                                        "q|k|v rows are held rank-interleaved"),
    ({"layout": {"pp": 2, "tp": 2}, "model_fields": {"family": "llama", "n_kv_head": 2, "tie_embeddings": False}}, 8,
     "job.layout: pp 2 x dp_shard 2 x tp 2 on 8 ranks; pipeline stages are split by tensor parallelism or sharded"),
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
    fields = dict(fields)
    model = fields.pop("model_fields", {})
    data = json.loads(job_for(pretrain_job, tmp_path, "gpt2", **{"grad_accum": 2, **fields}).read_text())
    data["model"].update(model)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(JobConfig, data, "job").check_layout("job", world)


def test_a_pipeline_job_records_its_schedule_and_others_keep_their_record(pretrain_job, tmp_path) -> None:
    plain = load_job(JobConfig, json.loads(job_for(pretrain_job, tmp_path, "gpt2").read_text()))
    assert "pipeline" not in plain.params() and "layout" not in plain.params()
    piped = load_job(JobConfig, json.loads(pp_job(pretrain_job, tmp_path, "llama").read_text()))
    assert piped.params()["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": -1, "tp": 1}
    assert piped.params()["pipeline"] == {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 0}
    assert piped.pipeline_config().microbatches == 2  # 0: grad_accum
