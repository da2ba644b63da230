"""Tests for kiln.train.loop on several CPU processes (gloo): DDP and FSDP2 follow the one-process loss curve with
identical parameters on every rank (with AdamW, and with Muon on the block matrices), two "nodes" rendezvous on
127.0.0.1, a sharded checkpoint resumes on one rank or bit-identical on two, and the data is sharded across ranks.

Run: python -m pytest tests/kiln/train/test_train_distributed.py -q   (a few torchrun launches; OMP_NUM_THREADS=1 each)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from kiln.train.checkpoint import load_state, verify_checkpoint
from kiln.tokens.loader import TokenLoader
from kiln.tokens.shards import shard_paths
from kiln.train.loop import main
from ports import free_port
from tests.conftest import OPTIMS, single_thread

ROOT = Path(__file__).resolve().parents[3]
STEPS = 12


def job_for(pretrain_job, path: Path, ranks: int, **kw) -> Path:
    """12 steps of 4 sequences a step (split over ``ranks``), no dropout, the same 16 validation windows."""
    model = {**json.loads(pretrain_job(path).read_text())["model"], "dropout": 0.0}
    micro = 4 // ranks
    return pretrain_job(path, model=model, micro_batch=micro, eval_batches=16 // micro, max_steps=STEPS,
                        eval_interval=6, ckpt_interval=6, log_interval=2, keep_last=2, **kw)


def result_of(job: Path) -> dict:
    return json.loads((Path(json.loads(job.read_text())["out_dir"]) / "result.json").read_text())


def assert_same_curve(res: dict, ref: dict, abs: float = 1e-4) -> None:
    assert [c[0] for c in res["curve"]] == [c[0] for c in ref["curve"]]
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in ref["curve"]], abs=abs)
    assert [h["val_loss"] for h in res["history"]] == pytest.approx([h["val_loss"] for h in ref["history"]], abs=abs)


@pytest.fixture(scope="module")
def references(tmp_path_factory, pretrain_job):
    """``references(optim)``: the same 12 steps with optimizer ``optim`` (OPTIMS) on one process, in-process on one
    thread (as the subprocesses run), made once."""
    runs: dict[str, dict] = {}

    def get(optim: str) -> dict:
        if optim not in runs:
            job = job_for(pretrain_job, tmp_path_factory.mktemp(f"one-{optim}"), 1, **OPTIMS[optim])
            with single_thread():
                runs[optim] = main(["--config", str(job), "--device", "cpu"], reporter=_Quiet())
        return runs[optim]

    return get


@pytest.fixture(scope="module")
def reference(references) -> dict:
    """The same 12 steps on one process, in-process on one thread (as the subprocesses run)."""
    return references("adamw")


class _Quiet:
    def log(self, message: str) -> None:
        pass


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, pretrain_job, train_runner):
    """The 12 steps under DDP on two processes with AdamW, made once: (job, completed process)."""
    job = job_for(pretrain_job, tmp_path_factory.mktemp("ddp"), 2, parallelism="ddp")
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return job, proc


@pytest.mark.slow
def test_ddp_on_two_processes_follows_the_one_process_curve(ddp, reference) -> None:
    """With AdamW (Muon on two ranks is checked under FSDP2, where its matrices are sharded)."""
    job, proc = ddp
    res = result_of(job)
    assert res["world_size"] == 2 and res["steps"] == STEPS and res["parallelism"] == "ddp"
    assert res["tokens"] == STEPS * 2 * 32 * 2  # micro_batch x seq_len x 2 ranks per step
    assert len(res["rank_param_digests"]) == 2 and len(set(res["rank_param_digests"])) == 1  # identical replicas
    assert_same_curve(res, reference)
    assert proc.stdout.count("step 0: val loss") == 1  # only rank 0 reports

    ckpt = Path(res["checkpoint"])
    meta = verify_checkpoint(ckpt)
    assert meta["world_size"] == 2 and meta["format"] == "full" and meta["parallelism"] == "ddp"
    state, _ = load_state(ckpt)
    assert state["loader"]["global_batch"] == 4 and state["loader"]["batch"] == STEPS
    assert len(state["rng"]) == 2 and not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])


@pytest.mark.slow
def test_fsdp2_trains_the_same_and_its_sharded_checkpoint_resumes_on_one_or_two_ranks(tmp_path, pretrain_job,
                                                                                    train_runner, references) -> None:
    """With Muon on the block matrices and AdamW on the rest; on two ranks the resume is bit-identical to the
    uninterrupted run. Muon's bf16 Newton-Schulz magnifies the ranks' 1e-7 gradient rounding: the curve sits 5e-5 to
    6e-5 from one process on one CPU kind and 1.1e-4 on AuthenticAMD-AVX512 (AdamW's far closer), hence 2e-4 here."""
    optim = "muon"  # Muon on the block matrices, AdamW on the rest: both optimizers' sharded state
    reference = references(optim)
    job = job_for(pretrain_job, tmp_path / "fsdp", 2, parallelism="fsdp", **OPTIMS[optim])
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["parallelism"] == "fsdp" and res["world_size"] == 2
    assert len(set(res["rank_param_digests"])) == 1  # the gathered parameters agree on both ranks
    assert_same_curve(res, reference, abs=2e-4)
    ckpt = Path(res["checkpoint"])
    meta = verify_checkpoint(ckpt)
    assert meta["format"] == "sharded"
    assert {"model/.metadata", "model/__0_0.distcp", "model/__1_0.distcp", "state.pt"} <= set(meta["files"])
    state, _ = load_state(ckpt)  # consumers get one full model state
    assert state["model"]["transformer.wte.weight"].shape == (320, 48)
    # the shards hold Muon's momentum for the block matrices, AdamW's moments for the rest
    keys = set(FileSystemReader(str(ckpt / "model")).read_metadata().state_dict_metadata)
    assert "optim.state.transformer.h.1.mlp.c_fc.weight.momentum_buffer" in keys
    assert "optim.state.transformer.wte.weight.exp_avg_sq" in keys
    assert not any(k.startswith("optim.state.transformer.h.") and k.endswith("weight.exp_avg")
                   and ".ln_" not in k for k in keys)

    # resume onto one rank: drop the last checkpoint, continue from the sharded step-6 one with 4 sequences a step
    run = Path(json.loads(job.read_text())["out_dir"])
    job1 = copy_before_the_end(run, tmp_path / "one_rank", pretrain_job, 1, **OPTIMS[optim])
    resumed = train_runner(job1)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    res1 = result_of(job1)
    assert res1["resumed_from"].endswith("step_0000006") and res1["parallelism"] == "none"
    assert_same_curve(res1, reference, abs=2e-4)

    # and onto two ranks again (each rank's optimizer state from its own shards): the uninterrupted run, bit for bit
    job2 = copy_before_the_end(run, tmp_path / "two_ranks", pretrain_job, 2, parallelism="fsdp", **OPTIMS[optim])
    resumed = train_runner(job2, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    res2 = result_of(job2)
    assert res2["resumed_from"].endswith("step_0000006") and res2["parallelism"] == "fsdp"
    assert res2["rank_param_digests"] == res["rank_param_digests"]
    assert res2["history"] == res["history"] and res2["curve"] == res["curve"]


def copy_before_the_end(run: Path, dest: Path, pretrain_job, ranks: int, **kw) -> Path:
    """A copy of finished ``run`` in ``dest`` without its last checkpoint and result; its job for ``ranks``."""
    shutil.copytree(run, dest / "run")
    shutil.rmtree(dest / "run" / "checkpoints" / f"step_{STEPS:07d}")
    (dest / "run" / "result.json").unlink()
    return job_for(pretrain_job, dest, ranks, **kw)


@pytest.mark.slow
def test_two_nodes_rendezvous_on_localhost_and_train_to_the_same_result(tmp_path, pretrain_job, ddp) -> None:
    """torchrun --nnodes=2 twice (one process each) with c10d rendezvous on 127.0.0.1: the commands are the
    resource's own; the result matches two processes on one node bit for bit."""
    from resources.torchrun import TorchrunResource
    from tests.conftest import subprocess_env

    job = job_for(pretrain_job, tmp_path, 2, parallelism="ddp")
    endpoint = f"127.0.0.1:{free_port()}"
    cmds = [TorchrunResource(nnodes=2, node_rank=r, rdzv_endpoint=endpoint, pg_timeout_s=120).command(1, job, "cpu", "nodes")
            for r in (0, 1)]
    assert "--nnodes=2" in cmds[0] and f"--rdzv_endpoint={endpoint}" in cmds[1] and "--rdzv_backend=c10d" in cmds[0]
    procs = [subprocess.Popen(c, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in cmds]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    res, ref = result_of(job), result_of(ddp[0])
    assert res["world_size"] == 2 and res["steps"] == STEPS
    assert res["rank_param_digests"] == ref["rank_param_digests"]  # bit-identical to one node with two processes
    assert res["history"] == ref["history"] and res["curve"] == ref["curve"]
    assert sum("step 0: val loss" in o for o in outs) == 1  # one rank 0 across both nodes


def test_ranks_get_disjoint_windows_that_make_up_the_single_process_batch(tiny_shards) -> None:
    paths = shard_paths(tiny_shards, "train")
    r0, r1 = (TokenLoader(paths, 4, 32, rank=r, world_size=2, seed=7) for r in (0, 1))
    single = TokenLoader(paths, 8, 32, rank=0, world_size=1, seed=7)
    for _ in range(5):
        (x0, y0), (x1, y1), (x, y) = r0.next_batch(), r1.next_batch(), single.next_batch()
        assert x0.shape == x1.shape == (4, 32)
        assert not torch.equal(x0, x1)
        rows0, rows1 = {tuple(r) for r in x0.tolist()}, {tuple(r) for r in x1.tolist()}
        assert not rows0 & rows1
        # 2 ranks x 4 windows is the same global batch as 1 rank x 8, in rank order
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one


@pytest.mark.slow
def test_a_stop_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, pretrain_job, train_runner, ddp) -> None:
    """SIGTERM reaches rank 1 alone after step 3: the flag rides on step 4's loss all-reduce, both ranks stop after
    step 4, its checkpoint is saved, the job exits with PREEMPTED_EXIT; the relaunch ends where the uninterrupted
    DDP run did, bit for bit."""
    from kiln.train import logbook
    from kiln.train.preempt import PREEMPTED_EXIT
    from tests.conftest import subprocess_env
    from tests.faults import Faults

    job = job_for(pretrain_job, tmp_path, 2, parallelism="ddp")
    faults = Faults(term_at_step=3, term_rank=1).write(tmp_path / "faults.json")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.faults", "--faults", str(faults), "--config", str(job), "--device", "cpu",
                           "--timeout-s", "120"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0 and str(PREEMPTED_EXIT) in proc.stderr, proc.stderr[-3000:]  # torchrun's summary
    res = result_of(job)
    assert res["outcome"] == "preempted" and res["steps"] == 4 and res["preemption"]["saved_step"] == 4
    assert res["preemption"]["signal"] == ""  # rank 0 got no signal itself: it stopped on rank 1's
    assert len(set(res["rank_param_digests"])) == 1
    resumed = train_runner(job, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    res = result_of(job)
    assert res["resumed_from"].endswith("step_0000004") and res["steps"] == STEPS
    assert res["rank_param_digests"] == result_of(ddp[0])["rank_param_digests"]
    rows = logbook.attempts(Path(json.loads(job.read_text())["out_dir"]))
    assert [(r["outcome"], r["to_step"], r["steps_lost"]) for r in rows] == [("preempted", 4, 0), ("completed", STEPS, 0)]
