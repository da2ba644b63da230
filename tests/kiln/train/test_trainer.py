"""Tests of kiln/train/trainer.py, run through kiln.train.loop on one CPU process: loss falls, checkpoints, recovery from
real kills (SIGKILL at a random step, during a save; torchrun's restarts: tests/resources/test_torchrun.py)
bit-identical to an uninterrupted run, damaged checkpoints, fine-tuning and LoRA from a checkpoint (spike rollback:
test_spikes.py; config errors: test_loop.py).

Run: python -m pytest tests/kiln/train/test_trainer.py -q   (tiny model; subprocess runs are marked slow)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import list_checkpoints, load_for_inference, load_state, verify_checkpoint
from kiln.train.loop import main
from tests.conftest import OPTIMS, LineReporter as ListReporter, single_thread as one_thread
from tests.faults import Faults, injector, seeded_kill_step

ROOT = Path(__file__).resolve().parents[3]
COMPARED = ("model", "optimizer", "scheduler", "loader", "step")  # the state that must match bit for bit


def result_of(job: Path) -> dict:
    return json.loads((run_dir(job) / "result.json").read_text())


def run_dir(job: Path) -> Path:
    return Path(json.loads(job.read_text())["out_dir"])


def assert_same(a, b, where: str = "state") -> None:
    """Deep equality where tensors must match bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs (max abs diff {(a.double() - b.double()).abs().max().item()})"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_final_state(ref_job: Path, job: Path, step: int = 30) -> None:
    """The last checkpoint's state, the validation history, the last loss and every rank's weights: bit for bit."""
    ref_state, _ = load_state(run_dir(ref_job) / "checkpoints" / f"step_{step:07d}")
    state, _ = load_state(run_dir(job) / "checkpoints" / f"step_{step:07d}")
    for part in COMPARED:
        assert_same(ref_state[part], state[part], part)
    ref, res = result_of(ref_job), result_of(job)
    assert res["history"] == ref["history"]  # identical validation losses at every eval
    assert res["final_train_loss"] == ref["final_train_loss"]
    assert res["rank_param_digests"] == ref["rank_param_digests"]


def popen_train(job: Path, **faults) -> subprocess.Popen:
    """``python -m kiln.train`` on ``job``; with ``faults`` (tests/faults.py Faults fields), through tests/faults.py."""
    from tests.conftest import subprocess_env

    entry = ["-m", "kiln.train"]
    if faults:
        entry = ["tests/faults.py", "--faults", str(Faults(**faults).write(job.parent / "faults.json"))]
    return subprocess.Popen([sys.executable, *entry, "--config", str(job), "--device", "cpu"], cwd=ROOT,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def assert_muon_state(state: dict) -> None:
    """The checkpoint holds Muon's momentum for a block matrix and AdamW's moments for the embedding."""
    opt = state["optimizer"]["state"]
    assert set(opt["transformer.h.0.attn.c_attn.weight"]) == {"momentum_buffer"}
    assert set(opt["transformer.wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.slow
def test_validation_loss_falls_and_result_is_written(baseline) -> None:
    job, logged = baseline
    res = result_of(job)
    assert res["steps"] == 30 and res["tokens"] == 30 * 4 * 32 and res["data_batches"] == 30
    assert res["world_size"] == 1 and res["device"] == "cpu" and res["resumed_from"] is None
    assert res["parallelism"] == "none" and res["events"] == []
    assert [h["step"] for h in res["history"]] == [0, 10, 20, 30]
    assert [c[0] for c in res["curve"]] == [10, 20, 30]
    initial, final = res["initial_val_loss"], res["final_val_loss"]
    assert initial == pytest.approx(5.77, abs=0.3)  # about ln(320) for a fresh model
    assert final < initial - 1.0, (initial, final)
    assert res["history"][-1]["val_loss"] == final
    assert res["final_train_loss"] < initial - 1.0
    assert res["tokens_per_s"] > 0 and 0 < res["mfu"] < 1 and res["peak_flops_per_device"] > 1e8
    assert 0 < res["peak_memory_gb"] < 2
    assert "step 0: val loss" in logged and "step 30/30" in logged
    line = next(ln for ln in logged.splitlines() if ln.startswith("step 20/30"))
    assert "tok/s" in line and "MFU" in line and "GiB" in line and "left" in line
    good = res["goodput"]
    assert good["sessions"] == 1 and good["redone_steps_s"] == 0 and 0 < good["goodput"] < 1


@pytest.mark.slow
def test_checkpoints_are_kept_verified_and_loadable(baseline, tiny_tokenizer) -> None:
    job, _ = baseline
    run = run_dir(job)
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_0000020", "step_0000030"]  # keep_last=2 pruned step 10
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000020", "step_0000030"]  # no staging
    meta = verify_checkpoint(ckpts[-1])
    assert set(meta["files"]) == {"state.pt", "tokenizer.json"} and meta["format"] == "full"
    assert meta["step"] == 30 and meta["world_size"] == 1 and meta["task"] == "pretrain"
    assert meta["val_loss"] == result_of(job)["final_val_loss"] and meta["job"]["seed"] == 1234
    res = result_of(job)
    assert res["checkpoint"] == str(ckpts[-1])
    assert [c["step"] for c in res["checkpoints"]] == [20, 30]
    state, _ = load_state(ckpts[-1])
    assert state["step"] == 30 and state["loader"]["batch"] == 30
    assert state["scheduler"]["last_epoch"] == 30 and len(state["rng"]) == 1
    assert state["run"]["data_batches"] == 30 and state["spikes"]["seen"] == 30
    model, enc, _ = load_for_inference(run)
    assert enc.n_vocab == tiny_tokenizer[0].n_vocab
    assert model.num_params() == res["params"]


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, baselines, pretrain_job, train_runner) -> None:
    """With Muon: the checkpoint holds Muon's momentum for the block matrices and AdamW's moments for the rest, and
    both come back bit for bit (the AdamW-only job's resume is checked by the kill-during-save test below)."""
    optim = "muon"
    ref_job, _ = baselines(optim)
    # anywhere: mid-interval, at or just after a save; seeded, so that a failure can be replayed
    kill_step, replay = seeded_kill_step("test_sigkill_at_a_random_step_then_resume_is_bit_identical", 5, 27)
    job = pretrain_job(tmp_path, log_interval=1, **OPTIMS[optim])  # progress lines say where the run is
    proc = popen_train(job)
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(f"step {kill_step}/30"):
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, replay
    run = run_dir(job)
    assert not (run / "result.json").exists()
    resumed = train_runner(job)  # the same command again
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    res = result_of(job)
    # the progress line comes before that step's save: the newest checkpoint is the one before, or (a save in
    # flight when the kill came) the one before that
    saved = [None] + [f"step_{s:07d}" for s in (10, 20) if s < kill_step]
    got = Path(res["resumed_from"]).name if res["resumed_from"] else None
    assert got in saved[-2:], (replay, got)
    assert_same_final_state(ref_job, job)
    assert res["goodput"]["sessions"] == 2 and res["goodput"]["redone_steps_s"] > 0
    assert_muon_state(load_state(run / "checkpoints" / "step_0000030")[0])  # Muon ran on the block matrices
    assert res["final_val_loss"] < res["initial_val_loss"] - 1.0, res["history"]  # and the tiny model learns with it

    # rerunning a finished job trains nothing and keeps the reported results
    main(["--config", str(job), "--device", "cpu"], reporter=ListReporter())  # in-process: no startup cost
    res2 = result_of(job)
    for key in ("steps", "final_val_loss", "final_train_loss", "initial_val_loss", "history", "checkpoint"):
        assert res2[key] == res[key], key
    assert res2["resumed_from"] == str(run / "checkpoints" / "step_0000030")


@pytest.mark.slow
def test_kill_during_save_and_a_damaged_checkpoint_fall_back_to_an_older_one(tmp_path, baseline, pretrain_job,
                                                                           train_runner) -> None:
    ref_job, _ = baseline
    job = pretrain_job(tmp_path, ckpt_interval=5, keep_last=3)
    run = run_dir(job)
    proc = popen_train(job, save_pause_s=2.0)  # each write holds for 2 s
    staging = run / "checkpoints" / ".step_0000010.partial" / "state.pt"
    deadline = time.time() + 120
    while not staging.exists() and proc.poll() is None and time.time() < deadline:  # the second save is being
        time.sleep(0.02)  # written, not yet committed
    assert proc.poll() is None, proc.stdout.read()[-3000:]  # type: ignore[union-attr]
    assert staging.exists() and list_checkpoints(run / "checkpoints") == [run / "checkpoints" / "step_0000005"]
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert verify_checkpoint(run / "checkpoints" / "step_0000005")["step"] == 5  # the previous one is intact

    # and the newest complete checkpoint is damaged on disk: one flipped bit
    resumed = train_runner(job)  # without the pause
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "removed .step_0000010.partial: a save that was interrupted" in resumed.stdout
    assert result_of(job)["resumed_from"].endswith("step_0000005")
    assert_same_final_state(ref_job, job)

    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_0000020", "step_0000025", "step_0000030"]
    f = ckpts[-1] / "state.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0x10
    f.write_bytes(bytes(data))
    rep = ListReporter()
    with one_thread():  # as the subprocesses: another thread count sums matmuls in another order
        summary = main(["--config", str(job), "--device", "cpu"], reporter=rep)  # in-process rerun
    assert any("skipping damaged checkpoint" in ln and str(f) in ln and "checksum mismatch" in ln for ln in rep.lines)
    assert summary["resumed_from"].endswith("step_0000025") and summary["steps"] == 30
    state, _ = load_state(ckpts[-1])  # step 30 rewritten from step 25: the same bits as before the damage
    ref_state, _ = load_state(run_dir(ref_job) / "checkpoints" / "step_0000030")
    for part in COMPARED:
        assert_same(ref_state[part], state[part], part)


def test_injected_failure_before_the_first_checkpoint_happens_once(tmp_path, pretrain_job) -> None:
    # out_dir does not exist yet and no checkpoint is due before the failure
    path = pretrain_job(tmp_path, max_steps=3, ckpt_interval=100, eval_interval=100, eval_batches=1)
    args, crash = ["--config", str(path), "--device", "cpu"], [injector(fail_at_step=2)]
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        main(args, reporter=ListReporter(), callbacks=crash)
    assert (tmp_path / "run" / ".failed_once").read_text() == "2"
    rep = ListReporter()
    summary = main(args, reporter=rep, callbacks=crash)  # no checkpoint yet: starts over and does not fail again
    assert summary["steps"] == 3 and summary["resumed_from"] is None
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_0000003"]


@pytest.mark.slow
def test_sft_job_fine_tunes_from_a_pretrained_checkpoint(tmp_path, baseline, pretrain_job) -> None:
    from kiln.posttrain.instructions import build_pairs, write_jsonl

    ref_job, _ = baseline
    pairs = tmp_path / "pairs.jsonl"
    write_jsonl(build_pairs([], n_arithmetic=300, seed=0, val_permille=200, max_doc_pairs=0), pairs)
    path = pretrain_job(tmp_path, task="sft", train_files=[str(pairs)], val_files=[], max_steps=8,
                        eval_interval=8, eval_batches=2, init_from=json.loads(ref_job.read_text())["out_dir"])
    rep = ListReporter()
    summary = main(["--config", str(path), "--device", "cpu"], reporter=rep)
    assert rep.lines[0].startswith("initialised weights from ") and rep.lines[0].endswith("step_0000030")
    assert summary["task"] == "sft" and summary["steps"] == 8
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0, summary["history"]


def test_continued_pretraining_with_lora_trains_adapters_on_the_start_weights(baseline, pretrain_job, tmp_path) -> None:
    """A pretraining job with init_from and lora.enabled (the finetune preset's LoRA; QLoRA is the same trainer path,
    tests/kiln/model/test_qlora.py): the start weights stay frozen, the adapters train, the saved weights are the
    merged plain model, and the loss falls."""
    job_path, _ = baseline
    start = list_checkpoints(Path(json.loads(job_path.read_text())["out_dir"]) / "checkpoints")[-1]
    job = pretrain_job(tmp_path, init_from=str(start), max_steps=10, eval_interval=5, ckpt_interval=10,
                       lora={"enabled": True, "rank": 4}, optim={"lr": 1e-2, "warmup_steps": 2})
    rep = ListReporter()
    with one_thread():
        main(["--config", str(job), "--device", "cpu"], reporter=rep)
    text = "\n".join(rep.lines)
    assert "LoRA rank 4 on" in text and f"initialised weights from {start}" in text
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["final_val_loss"] < result["initial_val_loss"]
    base_state, _ = load_state(start)
    end_state, _ = load_state(list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    assert set(end_state["model"]) == set(base_state["model"])  # merged: plain weights, no adapter tensors
    moved = [k for k in base_state["model"] if not torch.equal(base_state["model"][k], end_state["model"][k])]
    assert moved and all(k.endswith(".weight") and base_state["model"][k].dim() == 2 for k in moved)


def test_cpu_bf16_trains_under_bf16_autocast_to_about_the_fp32_loss(tmp_path, baseline, pretrain_job) -> None:
    """cpu_bf16: the same 30 steps with the matmuls in bf16 end near the fp32 run's loss, not on its weights, and
    the checkpoint keeps fp32 weights (autocast casts inside the forward only)."""
    from kiln.train.loop import main
    from tests.conftest import single_thread

    job = pretrain_job(tmp_path, cpu_bf16=True)
    with single_thread():
        main(["--config", str(job), "--device", "cpu"])
    ref, res = result_of(baseline[0]), result_of(job)
    assert res["final_val_loss"] == pytest.approx(ref["final_val_loss"], abs=0.1)
    assert res["final_val_loss"] != ref["final_val_loss"]  # the bf16 products moved the run
    state, _ = load_state(Path(res["checkpoint"]))
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
