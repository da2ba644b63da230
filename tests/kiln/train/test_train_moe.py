"""Tests for training the moe family (kiln.model.moe) with expert parallelism (job.layout.ep) on two gloo processes:
EP2 x FSDP2 follows the one-process loss curve over 30 steps with the same expert load, resumes bit for bit from
its expert-sharded checkpoint after a SIGKILL, and the checkpoint reshards to one process; aux-free balancing
moves its biases the same way on both; under pipeline stages it follows one process and reports every block's load;
tensor parallelism (with sequence parallelism through the experts) composes with FSDP2, EP and PP, on two and four
processes; layouts that cannot run are config errors before anything trains.

Run: python -m pytest tests/kiln/train/test_train_moe.py -q   (torchrun launches of two and four processes)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.common.config import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.parallel import MeshLayout
from kiln.train.checkpoint import load_state, verify_checkpoint
from tests.kiln.train.test_train_tensor_parallel import RESUME_AT, STEPS, in_process, resume_copy, result_of

MOE = {"family": "moe", "n_experts": 4, "n_experts_per_token": 2, "moe_intermediate_size": 32, "dropout": 0.0,
       "router_balance": "aux_free", "router_bias_rate": 0.01, "router_z_loss_coef": 0.001}
EP2 = {"layout": {"ep": 2}, "parallelism": "fsdp", "micro_batch": 2, "eval_batches": 8}  # 4 sequences a step
# two ranks sum the experts' and the sharded gradients in another order: 1e-7 apart per step, under this after 30
CURVE_ABS = 2e-4


def assert_same_load(res: dict, ref: dict) -> None:
    """The same tokens reach the same experts: equal totals, and per expert within 1% of the busiest (a decision
    whose top-k margin is below float rounding may go the other way on another machine)."""
    got, want = torch.tensor(res["expert_load"]["by_layer"]), torch.tensor(ref["expert_load"]["by_layer"])
    assert got.shape == want.shape and got.sum() == want.sum(), (got, want)
    assert (got - want).abs().max() <= 0.01 * want.max(), (got, want)


def moe_job(pretrain_job, path: Path, **kw) -> Path:
    """30 steps of 4 sequences of a 2-layer mixture of 4 experts (2 per token), checkpoints every 10 steps."""
    model = {**json.loads(pretrain_job(path).read_text())["model"], **MOE}
    return pretrain_job(path, **{"model": model, "eval_batches": 4, "eval_interval": 10, "ckpt_interval": 10,
                                 "log_interval": 5, "keep_last": 3, **kw})


# resume_copy builds its job with job_for(family): the moe family's fields ride in through the overrides
def moe_resume_copy(run: Path, dest: Path, pretrain_job, **kw) -> Path:
    resume_copy(run, dest, pretrain_job, "gpt2")
    return moe_job(pretrain_job, dest, **kw)


def run_dir_of(job: Path) -> Path:
    return Path(json.loads(job.read_text())["out_dir"])


def faulted(job: Path, faults_file: Path, **faults):
    """The job on two ranks through tests.faults (test-only fault injection)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env
    from tests.faults import Faults

    f = Faults(**faults).write(faults_file)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "tests.faults", "--faults", str(f), "--config", str(job), "--device", "cpu", "--timeout-s",
                           "120"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def one(tmp_path_factory, pretrain_job) -> dict:
    return in_process(moe_job(pretrain_job, tmp_path_factory.mktemp("moe-one")))


@pytest.mark.slow
def test_expert_parallel_training_follows_one_process_resumes_and_reshards(tmp_path, one, pretrain_job,
                                                                          train_runner) -> None:
    job = moe_job(pretrain_job, tmp_path / "ep", **EP2)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["world_size"] == 2 and res["steps"] == STEPS and res["parallelism"] == "fsdp"
    assert res["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in one["curve"]], abs=CURVE_ABS)
    assert [h["val_loss"] for h in res["history"]] == pytest.approx([h["val_loss"] for h in one["history"]],
                                                                    abs=CURVE_ABS)
    assert one["final_val_loss"] < one["initial_val_loss"] - 0.5  # and the mixture learns
    # the same tokens reach the same experts: the load, counted over both ranks, is one process's
    assert_same_load(res, one)
    assert sum(map(sum, one["expert_load"]["by_layer"])) == STEPS * 4 * 32 * 2 * 2  # steps x tokens x k x layers
    assert len(set(res["rank_param_digests"])) == 1
    meta = verify_checkpoint(Path(res["checkpoint"]))
    assert meta["format"] == "sharded" and meta["job"]["layout"]["ep"] == 2
    state, _ = load_state(Path(res["checkpoint"]))  # the shards read back as one model: every expert, the biases
    assert state["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    assert state["model"]["model.layers.1.mlp.expert_bias"].abs().sum() > 0

    # SIGKILL at step 23 (rank 0 kills itself; torchrun takes the other down), then the same command again: it
    # resumes from the step-20 expert-sharded checkpoint and ends as the uninterrupted run did, bit for bit
    again = moe_job(pretrain_job, tmp_path / "again", **EP2)
    proc = faulted(again, tmp_path / "faults.json", kill_at_steps=[23], kill_after_save=True)
    assert proc.returncode != 0 and not (run_dir_of(again) / "result.json").exists(), proc.stderr[-3000:]
    proc = train_runner(again, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res2 = result_of(again)
    assert res2["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and res2["goodput"]["sessions"] == 2
    assert res2["rank_param_digests"] == res["rank_param_digests"]
    assert res2["curve"] == res["curve"] and res2["history"] == res["history"]

    # the expert-sharded checkpoint resumes on one process, on the one-process curve
    solo = moe_resume_copy(Path(res["checkpoint"]).parents[1], tmp_path / "solo", pretrain_job)
    res3 = in_process(solo)
    assert res3["resumed_from"].endswith(f"step_{RESUME_AT:07d}") and res3["world_size"] == 1
    assert [c[1] for c in res3["curve"]] == pytest.approx([c[1] for c in one["curve"]], abs=CURVE_ABS)


def test_layouts_expert_parallelism_cannot_run_are_config_errors_naming_the_field() -> None:
    moe = ModelConfig(family="moe", n_experts=6, n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(ConfigError, match=r"job.layout.ep: 4 must divide model.n_experts \(6\); ep may be 1, 2, 3, 6"):
        MeshLayout(ep=4).resolve(4, moe, "job.layout")
    with pytest.raises(ConfigError, match=r"job.layout.ep: 2; the experts are split over the dp_shard ranks, so ep "
                                          r"must equal dp_shard \(4\): set ep to 4 or 1"):
        MeshLayout(ep=2).resolve(4, moe, "job.layout")
    with pytest.raises(ConfigError, match=r"job.layout.ep: 2; expert parallelism splits a mixture of experts, and "
                                          r"the llama family has none"):
        MeshLayout(ep=2).resolve(2, ModelConfig(family="llama"), "job.layout")
    with pytest.raises(ConfigError, match=r"job.layout.ep: 2 with dp_replicate 2; expert parallelism splits the "
                                          r"experts over the dp_shard ranks"):
        MeshLayout(ep=2, dp_replicate=2).resolve(4, moe, "job.layout")
    assert MeshLayout(ep=2, tp=2).resolve(4, moe, "job.layout").describe() == "dp_shard 2 x tp 2 x ep 2"
    assert MeshLayout(ep=3).resolve(3, moe, "job.layout").record() == {"dp_replicate": 1, "dp_shard": 3, "tp": 1,
                                                                        "ep": 3}


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["aux_loss", "aux_free"])
def test_a_mixture_under_pipeline_stages_follows_one_process_and_reports_every_blocks_load(tmp_path, pretrain_job,
                                                                                           train_runner, balance) -> None:
    """pp 2 (a block per stage) with the z-loss and the balance loss or aux-free biases, against one process cutting
    each step into the same two micro-batches: the balance loss is computed per micro-batch (its f and P are a
    micro-batch's), so the same micro-batches give the same curve; the biases move on real tokens only (not on the
    schedule's shape-inference forwards); the report holds both stages' blocks."""
    model = {**json.loads(pretrain_job(tmp_path / "x").read_text())["model"], **MOE, "router_balance": balance,
             "router_aux_loss_coef": 0.01}
    same = {"model": model, "grad_accum": 2, "micro_batch": 2}
    job = moe_job(pretrain_job, tmp_path / "pp", layout={"pp": 2}, **same)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res, one = result_of(job), in_process(moe_job(pretrain_job, tmp_path / "one", **same))
    assert res["layout"]["pp"] == 2 and res["steps"] == STEPS
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in one["curve"]], abs=1e-4)
    assert_same_load(res, one)  # both blocks, in order
    assert sum(map(sum, res["expert_load"]["by_layer"])) == STEPS * 4 * 32 * 2 * 2


@pytest.fixture(scope="module")
def one_in_two(tmp_path_factory, pretrain_job) -> dict:
    """The one-process run with each step cut into the two micro-batches of 2 a pipeline runs."""
    return in_process(moe_job(pretrain_job, tmp_path_factory.mktemp("moe-one-2"), grad_accum=2, micro_batch=2))


COMPOSED = {  # layout, processes, job fields, which one-process run it follows
    "tp 2": ({"tp": 2}, 2, {}, "one"),
    "dp_shard 2 x tp 2 x ep 2": ({"tp": 2, "ep": 2}, 4, {"parallelism": "fsdp", "micro_batch": 2, "eval_batches": 8},
                                 "one"),
    "pp 2 x tp 2": ({"tp": 2, "pp": 2}, 4, {"grad_accum": 2, "micro_batch": 2}, "one_in_two"),
    "pp 2 x dp_shard 2 x ep 2": ({"pp": 2, "ep": 2}, 4, {"parallelism": "fsdp", "grad_accum": 2, "micro_batch": 1,
                                                         "eval_batches": 8}, "one_in_two"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPOSED))
def test_the_mixture_composes_with_tensor_pipeline_and_expert_parallelism(tmp_path, request, pretrain_job,
                                                                          train_runner, name) -> None:
    """Each rank of a tensor-parallel group routes its sequence shard through experts it holds whole (gradients
    summed across the group); with ep the experts are split over the data-shard ranks of each tensor-parallel rank.
    Every layout follows one process (aux-free biases and z-loss on) with the same expert load, and its checkpoint
    reads back as one model."""
    layout, nproc, fields, ref_name = COMPOSED[name]
    ref = request.getfixturevalue(ref_name)
    job = moe_job(pretrain_job, tmp_path / "run", layout=layout, **fields)
    proc = train_runner(job, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["world_size"] == nproc and all(res["layout"][k] == v for k, v in layout.items())
    assert_same_load(res, ref)
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in ref["curve"]], abs=CURVE_ABS)
    assert [h["val_loss"] for h in res["history"]] == pytest.approx([h["val_loss"] for h in ref["history"]],
                                                                    abs=CURVE_ABS)
    state, _ = load_state(Path(res["checkpoint"]))
    assert state["model"]["model.layers.1.mlp.experts.down_proj"].shape == (4, 48, 32)
    assert state["model"]["model.layers.0.self_attn.q_norm.weight"].shape == (24,)
