"""Tests for training the llama family (kiln.model.llama) with kiln.train: its loss falls, a SIGKILL mid-run resumes
bit-identical to an uninterrupted run, and DDP and FSDP2 on two gloo processes follow the one-process curve (the
FSDP2 sharded checkpoint reassembles into a llama on one rank). The SIGKILL resume runs with Muon (AdamW on the head and embeddings).

Run: python -m pytest tests/kiln/train/test_train_llama.py -q   (a few subprocess runs of a tiny model; marked slow)
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import list_checkpoints, load_for_inference, load_state, verify_checkpoint
from kiln.train.loop import main
from tests.conftest import OPTIMS
from tests.faults import seeded_kill_step
from tests.kiln.train.test_trainer import COMPARED, ListReporter, assert_same, one_thread, popen_train, run_dir

STEPS = 12


def llama_job(pretrain_job, model_dict, path: Path, ranks: int = 1, **kw) -> Path:
    """12 steps of 4 sequences (split over ``ranks``) of a 2-layer llama with grouped-query attention and an
    untied head; checkpoints every 4 steps; the same 16 validation windows whatever the ranks."""
    model = {"family": "llama", "vocab_size": model_dict["vocab_size"], "block_size": 32, "n_layer": 2, "n_head": 4,
             "n_kv_head": 2, "n_embd": 32, "tie_embeddings": False}
    micro = 4 // ranks
    return pretrain_job(path, model=model, micro_batch=micro, eval_batches=16 // micro, max_steps=STEPS,
                        eval_interval=4, ckpt_interval=4, log_interval=1, keep_last=3, **kw)


def result_of(job: Path) -> dict:
    return json.loads((run_dir(job) / "result.json").read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory, pretrain_job, model_dict):
    """``references(optim)``: the 12 steps uninterrupted on one process with optimizer ``optim`` (OPTIMS), in-process
    on one thread (as the subprocesses run), made once: (job path, summary)."""
    runs: dict[str, tuple[Path, dict]] = {}

    def get(optim: str) -> tuple[Path, dict]:
        if optim not in runs:
            job = llama_job(pretrain_job, model_dict, tmp_path_factory.mktemp(f"llama-one-{optim}"), **OPTIMS[optim])
            with one_thread():
                runs[optim] = job, main(["--config", str(job), "--device", "cpu"], reporter=ListReporter())
        return runs[optim]

    return get


@pytest.fixture(scope="module")
def reference(references) -> tuple[Path, dict]:
    """The 12 steps uninterrupted on one process, in-process on one thread (as the subprocesses run)."""
    return references("adamw")


def assert_same_curve(res: dict, ref: dict) -> None:
    assert [c[0] for c in res["curve"]] == [c[0] for c in ref["curve"]]
    assert [c[1] for c in res["curve"]] == pytest.approx([c[1] for c in ref["curve"]], abs=1e-4)
    assert [h["val_loss"] for h in res["history"]] == pytest.approx([h["val_loss"] for h in ref["history"]], abs=1e-4)


@pytest.mark.slow
def test_llama_trains_and_resumes_bit_identical_after_a_sigkill(tmp_path, references, pretrain_job, model_dict,
                                                               train_runner) -> None:
    """With Muon, whose checkpoint holds Muon's momentum for the projections and AdamW's moments for the head."""
    optim = "muon"
    ref_job, ref = references(optim)
    assert ref["steps"] == STEPS and ref["final_val_loss"] < ref["initial_val_loss"] - 0.3, ref["history"]
    model, _, meta = load_for_inference(run_dir(ref_job))
    assert type(model).__name__ == "Llama" and meta["model"]["family"] == "llama"
    assert model.num_params() == ref["params"]

    # the progress line of step k comes before step k's save, and a save runs in the background until the next one
    # starts: once step 9 is printed, the step-4 save has committed (step 8's waited for it), so a checkpoint exists
    kill_step, replay = seeded_kill_step("test_llama_trains_and_resumes_bit_identical_after_a_sigkill", 9, 11)
    job = llama_job(pretrain_job, model_dict, tmp_path, **OPTIMS[optim])
    proc = popen_train(job)
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(f"step {kill_step}/{STEPS}"):
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, replay
    assert not (run_dir(job) / "result.json").exists()
    resumed = train_runner(job)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    res = result_of(job)
    assert res["resumed_from"] and Path(res["resumed_from"]).name in ("step_0000004", "step_0000008"), replay
    assert res["goodput"]["sessions"] == 2
    last = f"step_{STEPS:07d}"
    ref_state, _ = load_state(run_dir(ref_job) / "checkpoints" / last)
    state, _ = load_state(run_dir(job) / "checkpoints" / last)
    assert "lm_head.weight" in state["model"] and "model.layers.1.mlp.gate_proj.weight" in state["model"]
    for part in COMPARED:
        assert_same(ref_state[part], state[part], part)
    assert res["history"] == ref["history"] and res["final_train_loss"] == ref["final_train_loss"]
    opt = state["optimizer"]["state"]  # Muon's momentum for the projections, AdamW's moments for the head, restored
    assert set(opt["model.layers.1.mlp.gate_proj.weight"]) == {"momentum_buffer"}
    assert set(opt["lm_head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_llama_on_two_processes_follows_the_one_process_curve(tmp_path, reference, pretrain_job, model_dict,
                                                              train_runner, strategy) -> None:
    _, ref = reference
    job = llama_job(pretrain_job, model_dict, tmp_path, ranks=2, parallelism=strategy)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["world_size"] == 2 and res["steps"] == STEPS and res["parallelism"] == strategy
    assert len(set(res["rank_param_digests"])) == 1  # identical full parameters on both ranks
    assert_same_curve(res, ref)
    ckpt = list_checkpoints(run_dir(job) / "checkpoints")[-1]
    assert verify_checkpoint(ckpt)["format"] == ("sharded" if strategy == "fsdp" else "full")
    state, _ = load_state(ckpt)  # a sharded one is reassembled into the llama's full state dict
    ref_state, _ = load_state(Path(ref["checkpoint"]))
    assert state["model"].keys() == ref_state["model"].keys()
    for k, v in ref_state["model"].items():
        torch.testing.assert_close(state["model"][k], v, rtol=0, atol=2e-4)
