"""Tests for the training job under tensor parallelism (job.layout.tp, kiln.model.tensor_parallel) on two gloo
processes: both families follow the one-process loss curve over 30 steps, and a SIGKILL while a checkpoint is being written
(under tp, and under dp_shard x tp) resumes from the checkpoint before it bit for bit; they reshard: a tensor-parallel checkpoint resumes on one process, an FSDP2 one
under tensor parallelism. GPT-2 also trains under FSDP2 x TP on four processes. Layouts the job cannot run are config
errors before anything trains.

Run: python -m pytest tests/kiln/train/test_train_tensor_parallel.py -q   (five torchrun launches of two processes)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kiln.common.config import ConfigError
from kiln.train.checkpoint import verify_checkpoint
from kiln.train.job import JobConfig, load_job
from kiln.train.loop import main
from tests.conftest import LineReporter, single_thread

STEPS = 30
RESUME_AT = 20  # the checkpoint the resumed runs start from (the one before the end)
FAMILIES = {"gpt2": {}, "llama": {"family": "llama", "n_kv_head": 2, "tie_embeddings": False}}
# the curve of two tensor-parallel ranks sits 1e-7 to 1e-6 from one process (the vocabulary-parallel loss and the
# row-parallel matmuls sum in another order); 30 AdamW steps keep it under this
CURVE_ABS = 1e-4


def job_for(pretrain_job, path: Path, family: str, **kw) -> Path:
    """30 steps of 4 sequences, no dropout, checkpoints every 10 steps, the same 16 validation windows."""
    model = {**json.loads(pretrain_job(path).read_text())["model"], "dropout": 0.0, **FAMILIES[family]}
    return pretrain_job(path, **{"model": model, "eval_batches": 4, "eval_interval": 10, "ckpt_interval": 10,
                                 "log_interval": 5, "keep_last": 3, **kw})


def result_of(job: Path) -> dict:
    return json.loads((Path(json.loads(job.read_text())["out_dir"]) / "result.json").read_text())


def in_process(job: Path) -> dict:
    """The job run in this process on one thread (as the subprocesses run: the same sums in the same order)."""
    with single_thread():
        return main(["--config", str(job), "--device", "cpu"], reporter=LineReporter())


def assert_same_curve(res: dict, ref: dict, abs: float = CURVE_ABS) -> None:
    assert [c[0] for c in res["curve"]] == [c[0] for c in ref["curve"]]
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in ref["curve"]], abs=abs)
    assert [h["val_loss"] for h in res["history"]] == pytest.approx([h["val_loss"] for h in ref["history"]], abs=abs)


def resume_copy(run: Path, dest: Path, pretrain_job, family: str, **kw) -> Path:
    """A copy of finished ``run`` in ``dest`` without the checkpoints after RESUME_AT nor its result; its job."""
    shutil.copytree(run, dest / "run")
    for ckpt in (dest / "run" / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > RESUME_AT:
            shutil.rmtree(ckpt)
    (dest / "run" / "result.json").unlink()
    return job_for(pretrain_job, dest, family, **kw)


TP2 = {"layout": {"tp": 2}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pretrain_job):
    """``reference(family)``: the one-process result of job_for's job, run once per module."""
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = in_process(job_for(pretrain_job, tmp_path_factory.mktemp(f"one-{family}"), family))
        return made[family]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def tp_run(request, tmp_path_factory, pretrain_job, train_runner, reference):
    """(family, the tensor-parallel job, its one-process reference result): 30 steps on two ranks, tp 2."""
    family = request.param
    ref = reference(family)
    job = job_for(pretrain_job, tmp_path_factory.mktemp(f"tp-{family}"), family, **TP2)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return family, job, ref, proc


@pytest.mark.slow
def test_tensor_parallel_training_follows_one_process_and_resumes_bit_for_bit(tmp_path, tp_run, pretrain_job,
                                                                               train_runner) -> None:
    family, job, ref, proc = tp_run
    res = result_of(job)
    assert res["world_size"] == 2 and res["steps"] == STEPS and res["parallelism"] == "none"
    assert res["layout"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert res["tokens"] == STEPS * 4 * 32  # both ranks read the same 4 sequences: one data-parallel rank
    assert len(set(res["rank_param_digests"])) == 1  # the gathered weights agree on both ranks
    assert_same_curve(res, ref)
    assert "tensor parallel 2 (tp 2)" in proc.stdout
    meta = verify_checkpoint(Path(res["checkpoint"]))
    # GPT-2's fused q|k|v rows are held rank-interleaved: one full state in the model's order, gathered on rank 0
    assert meta["format"] == ("full" if family == "gpt2" else "sharded")
    assert meta["job"]["layout"] == {"dp_replicate": 1, "dp_shard": -1, "tp": 2}

    # a SIGKILL while a checkpoint is being written: the same command resumes from the one before, bit for bit
    killed = job_for(pretrain_job, tmp_path / "killed", family, **TP2)
    assert_sigkill_during_a_save_resumes_bit_identical(killed, res, train_runner)


KILL_AT = 21  # SIGKILL of rank 0 here, while the step-20 checkpoint is still being written (save_pause_s)


def faulted(job: Path, faults_file: Path, nproc: int, **faults):
    """The job on ``nproc`` ranks through tests.faults (test-only fault injection)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env
    from tests.faults import Faults

    f = Faults(**faults).write(faults_file)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "-m", "tests.faults", "--faults", str(f), "--config", str(job), "--device", "cpu",
                           "--timeout-s", "180"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)


def assert_restart_is_bit_identical(resumed: Path, res: dict, train_runner, nproc: int = 2) -> None:
    """Job ``resumed`` (a copy of the run of result ``res`` cut back to RESUME_AT) ends as that run did, bit for bit."""
    proc = train_runner(resumed, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = result_of(resumed)
    assert again["resumed_from"].endswith(f"step_{RESUME_AT:07d}")
    assert again["rank_param_digests"] == res["rank_param_digests"]
    assert again["curve"] == res["curve"] and again["history"] == res["history"]


def assert_sigkill_during_a_save_resumes_bit_identical(job: Path, res: dict, train_runner, nproc: int = 2) -> None:
    """Job ``job`` (the config of the run of result ``res``, in a new folder) is SIGKILLed at step KILL_AT while its
    step-20 checkpoint is being written in the background (every write held 2 s): that checkpoint never commits, the
    same command resumes from step 10 and ends as the uninterrupted run did, bit for bit."""
    run = Path(json.loads(job.read_text())["out_dir"])
    proc = faulted(job, job.with_name("faults.json"), nproc, kill_at_steps=[KILL_AT], save_pause_s=2.0)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert not (run / "result.json").exists() and (run / f".killed_at_{KILL_AT}").exists()
    ckpts = run / "checkpoints"
    assert (ckpts / "step_0000010").is_dir() and not (ckpts / "step_0000020").exists()  # 20 was mid-write
    assert [p.name for p in ckpts.iterdir() if p.name.startswith(".step_0000020")], list(ckpts.iterdir())
    proc = train_runner(job, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = result_of(job)
    assert again["resumed_from"].endswith("step_0000010") and again["goodput"]["sessions"] == 2
    assert again["rank_param_digests"] == res["rank_param_digests"]
    assert again["curve"] == res["curve"] and again["history"] == res["history"]


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_on_one_process(tmp_path, tp_run, pretrain_job) -> None:
    family, job, ref, _ = tp_run
    run = Path(result_of(job)["checkpoint"]).parents[1]
    one = in_process(resume_copy(run, tmp_path, pretrain_job, family))  # no layout: one rank, the whole model
    assert one["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and "layout" not in one
    assert_same_curve(one, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_fsdp2_checkpoint_resumes_under_tensor_parallelism(tmp_path, pretrain_job, train_runner, reference,
                                                             family) -> None:
    """Resharding through torch.distributed.checkpoint: saved as FSDP2's dim-0 shards on two ranks, loaded as
    tensor-parallel shards (llama: by their offsets; GPT-2: whole, then its q|k|v rows interleaved by rank)."""
    ref = reference(family)
    # two data-parallel ranks of 2 sequences (the same 4 a step); validation reads the same 16 windows on each
    fsdp = job_for(pretrain_job, tmp_path / "fsdp", family, parallelism="fsdp", micro_batch=2, eval_batches=8)
    proc = train_runner(fsdp, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = result_of(fsdp)
    assert saved["parallelism"] == "fsdp" and "layout" not in saved
    assert verify_checkpoint(Path(saved["checkpoint"]))["format"] == "sharded"
    resumed = resume_copy(Path(saved["checkpoint"]).parents[1], tmp_path / "tp", pretrain_job, family, **TP2)
    proc = train_runner(resumed, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(resumed)
    assert res["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and res["layout"]["tp"] == 2
    assert_same_curve(res, ref)


@pytest.mark.slow
def test_gpt2_under_fsdp2_and_tensor_parallelism_follows_one_process_and_resumes(tmp_path, pretrain_job,
                                                                                         train_runner, reference) -> None:
    """dp_shard 2 x tp 2 on four ranks for GPT-2, whose fused q|k|v rows tensor parallelism holds rank-interleaved
    (FusedColwiseParallel) and FSDP2 shards again: the curve follows one process; a restart from the step-20
    checkpoint after a SIGKILL during the next save is bit for bit; that checkpoint resumes on one process."""
    ref = reference("gpt2")
    split = {"layout": {"tp": 2, "dp_shard": 2}, "micro_batch": 2, "eval_batches": 8}  # two data ranks of 2 rows
    job = job_for(pretrain_job, tmp_path / "2x2", "gpt2", **split)
    proc = train_runner(job, nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2} and res["parallelism"] == "fsdp"
    assert res["tokens"] == ref["tokens"] and len(set(res["rank_param_digests"])) == 1
    assert_same_curve(res, ref)
    assert verify_checkpoint(Path(res["checkpoint"]))["format"] == "full"
    run = Path(res["checkpoint"]).parents[1]
    killed = job_for(pretrain_job, tmp_path / "killed", "gpt2", **split)  # SIGKILL mid-save under dp_shard x tp
    assert_sigkill_during_a_save_resumes_bit_identical(killed, res, train_runner, nproc=4)
    one = in_process(resume_copy(run, tmp_path / "one", pretrain_job, "gpt2"))  # the whole model, one rank
    assert one["resumed_from"].endswith(f"step_{RESUME_AT:07d}")
    assert_same_curve(one, ref)


@pytest.mark.parametrize("fields, world, message", [
    ({"layout": {"tp": 3}}, 6, "job.layout.tp: 3 does not divide model.n_head (2)"),
    ({"layout": {"tp": 2}}, 3, "must multiply to the world size 3"),
    ({"layout": {"tp": 2}, "parallelism": "ddp"}, 4, "job.parallelism: 'ddp' with layout.tp 2"),
    ({"layout": {"tp": 2, "dp_replicate": 2}}, 4, "job.layout.dp_replicate: 2"),
    ({"layout": {"tp": 2}, "task": "sft", "lora": {"enabled": True}}, 2, "job.layout.tp: 2 with lora.enabled"),
])
def test_a_layout_the_job_cannot_train_is_a_config_error_naming_the_field(tmp_path, pretrain_job, fields, world,
                                                                          message) -> None:
    data = json.loads(job_for(pretrain_job, tmp_path, "gpt2", **fields).read_text())
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(JobConfig, data, "job").check_layout("job", world)


def test_a_job_without_a_layout_records_what_it_did_before(pretrain_job, tmp_path) -> None:
    """job.params() (MLflow params, meta.json, the logbook) leaves the default layout out, so runs that split
    nothing keep their records; a split one records its layout."""
    plain = load_job(JobConfig, json.loads(job_for(pretrain_job, tmp_path, "gpt2").read_text()))
    assert "layout" not in plain.params()
    split = load_job(JobConfig, json.loads(job_for(pretrain_job, tmp_path, "gpt2", **TP2).read_text()))
    assert split.params()["layout"] == {"dp_replicate": 1, "dp_shard": -1, "tp": 2}
