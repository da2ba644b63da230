"""Tests for kiln.train.loop on one CPU process: loss falls, checkpoints, recovery from real kills (SIGKILL at a random
step, during a save; torchrun's restarts: tests/resources/test_torchrun.py) bit-identical to an uninterrupted run, damaged checkpoints,
loss-spike rollback, goodput, config errors.

Run: python -m pytest tests/kiln/train/test_train.py -q   (tiny model; subprocess runs are marked slow)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import list_checkpoints, load_for_inference, load_state, verify_checkpoint
from kiln.common.config import ConfigError
from kiln.train.spikes import SpikeConfig, SpikeDetector, SpikeError
from kiln.train.loop import JobConfig, main
from kiln.train.optim import OptimConfig, lr_lambda
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


def spike_job(pretrain_job, path: Path, **spikes) -> Path:
    """30 steps at a steadier setting than the baseline (lr 3e-3, 8 sequences a step), checkpoints every 5 steps."""
    return pretrain_job(path, micro_batch=8, ckpt_interval=5, keep_last=3, optim={"lr": 3e-3, "warmup_steps": 5},
                        spikes={"warmup_steps": 5, "window": 20, "rollback_steps": 5, "skip_batches": 3, **spikes})


POISON = [injector(spike_batch=17, spike_lr_factor=1000.0)]  # data batch 17 at 1000x the lr: wrecks the model


@pytest.mark.slow
def test_loss_spike_rolls_back_skips_the_batches_and_recovers(tmp_path, pretrain_job) -> None:
    """PaLM's recipe brings a run hit by a poisoned batch back to within a few percent of the clean run."""
    with one_thread():
        clean = main(["--config", str(spike_job(pretrain_job, tmp_path / "clean")), "--device", "cpu"],
                     reporter=ListReporter())
        broken = main(["--config", str(spike_job(pretrain_job, tmp_path / "off", enabled=False)), "--device", "cpu"],
                      reporter=ListReporter(), callbacks=POISON)
    assert clean["events"] == [] and broken["events"] == []
    assert broken["final_val_loss"] > 2 * clean["final_val_loss"], (broken["final_val_loss"], clean["final_val_loss"])

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("spikes")).info.run_id
    job = spike_job(pretrain_job, tmp_path / "on")
    job.write_text(json.dumps({**json.loads(job.read_text()), "mlflow_tracking_uri": uri, "mlflow_run_id": run_id}))
    rep = ListReporter()
    with one_thread():
        res = main(["--config", str(job), "--device", "cpu"], reporter=rep, callbacks=POISON)
    [event] = res["events"]
    assert event["event"] == "rollback" and event["step"] == 19 and event["to_step"] == 10, event
    assert event["skipped_batches"] == 9  # batches 10..18 (the poisoned 17 among them) are never trained again
    assert res["steps"] == 30 and res["data_batches"] == 39
    assert abs(res["final_val_loss"] - clean["final_val_loss"]) / clean["final_val_loss"] < 0.03
    assert any("loss spike at step 19" in w and "Rolled back to step 10" in w for w in rep.warnings)
    spikes = client.get_metric_history(run_id, "spike")
    assert [(m.step, m.value) for m in spikes] == [(19, 1.0)]
    assert client.get_metric_history(run_id, "system/kiln.goodput")[0].value == pytest.approx(res["goodput"]["goodput"])
    assert res["goodput"]["redone_steps_s"] > 0  # steps 11..18 were trained twice


def test_spikes_give_up_after_max_rollbacks(tmp_path, pretrain_job) -> None:
    job = spike_job(pretrain_job, tmp_path, max_rollbacks=0)
    with pytest.raises(SpikeError, match=r"loss spike at step 19 .* after 0 rollbacks \(spikes\.max_rollbacks=0\)"):
        main(["--config", str(job), "--device", "cpu"], reporter=ListReporter(), callbacks=POISON)


def test_spikes_before_the_first_checkpoint_drop_updates_then_give_up(tmp_path, pretrain_job) -> None:
    job = spike_job(pretrain_job, tmp_path)
    job.write_text(json.dumps({**json.loads(job.read_text()), "ckpt_interval": 100}))  # nothing to roll back to
    rep = ListReporter()
    with pytest.raises(SpikeError, match=r"after 10 updates in a row were dropped, with no checkpoint yet"):
        main(["--config", str(job), "--device", "cpu"], reporter=rep, callbacks=POISON)
    dropped = [w for w in rep.warnings if "no checkpoint to roll back to, so this update is skipped" in w]
    assert len(dropped) == 10 and dropped[0].startswith("loss spike at step 19")


def test_spike_detector_thresholds_and_state() -> None:
    det = SpikeDetector(SpikeConfig(warmup_steps=2, window=10, loss_zscore=4, loss_rise=0.2, grad_ratio=5))
    for loss in (9.0, 6.0):  # warmup: the fast early fall is not a yardstick
        assert det.check(loss, 1.0) is None
    assert det.losses == deque([])
    for loss in (3.0, 2.9, 3.1, 3.0, 2.95):
        assert det.check(loss, 1.0) is None
    kind, why = det.check(6.0, 1.0)
    assert kind == "loss" and "std above its recent mean" in why and det.rolls_back((kind, why))
    assert det.check(3.2, 1.0) is None  # a bump, not a spike
    kind, why = det.check(3.0, 9.0)
    assert kind == "grad" and "gradient norm 9 is 9.0x its recent median" in why and not det.rolls_back((kind, why))
    assert det.rolls_back(det.check(float("nan"), 1.0))
    saved = det.state_dict()
    twin = SpikeDetector(det.cfg)
    twin.load_state_dict(json.loads(json.dumps(saved)))
    assert twin.check(6.0, 1.0) == det.check(6.0, 1.0) and twin.state_dict() == det.state_dict()
    strict = SpikeDetector(SpikeConfig(warmup_steps=0, rollback_on_grad=True, grad_ratio=5))
    for _ in range(5):
        strict.check(3.0, 1.0)
    assert strict.rolls_back(strict.check(3.0, 9.0))
    assert all(SpikeDetector(SpikeConfig()).check(x, 1.0) is None for x in (5.0, 50.0, 500.0))  # no baseline yet


@pytest.mark.slow
def test_unknown_job_key_exits_non_zero_naming_it(tmp_path, pretrain_job, train_runner) -> None:
    job = pretrain_job(tmp_path, learning_rate=0.1)
    proc = train_runner(job)
    assert proc.returncode != 0
    assert "job: unknown key 'learning_rate'" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "section,key,message",
    [
        ("model", "n_layers", r"job\.model: unknown key 'n_layers'\. Did you mean 'n_layer'\?"),
        ("optim", "warmup", r"job\.optim: unknown key 'warmup'\. Did you mean 'warmup_steps'\?"),
        ("spikes", "rollback_step", r"job\.spikes: unknown key 'rollback_step'\. Did you mean 'rollback_steps'\?"),
    ],
    ids=["model", "optim", "spikes"],
)
def test_unknown_nested_key_is_named(tmp_path, pretrain_job, section, key, message) -> None:
    path = pretrain_job(tmp_path)
    job = json.loads(path.read_text())
    job.setdefault(section, {})[key] = 1
    path.write_text(json.dumps(job))
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(path), "--device", "cpu"])
    assert not (tmp_path / "run").exists()  # rejected before anything is written


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


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, min_lr_ratio=0.1), max_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_job_config_defaults_are_a_valid_pretrain_job() -> None:
    job = JobConfig()
    assert job.task == "pretrain" and Faults().fail_at_step == -1 and job.grad_accum == 1
    assert job.parallelism == "auto" and job.async_save and Faults().kill_at_steps == []
    assert not {"fail_at_step", "kill_at_steps", "save_pause_s", "inject_spike"} & set(vars(job))  # test-only: tests/faults.py


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


def test_a_cuda_rank_without_its_gpu_says_so(monkeypatch) -> None:
    from kiln.train.dist import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="rank 1: 2 ranks per node need 2 GPUs but this machine has 1"):
        setup_distributed("cuda", 60)


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
