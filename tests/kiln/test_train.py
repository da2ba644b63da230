"""Tests for kiln.train on one CPU process: loss falls, checkpoints, crash + bit-exact resume, config errors.

Run: python -m pytest tests/kiln/test_train.py -q   (tiny model, ~20 s; subprocess runs are marked slow)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import list_checkpoints, load_for_inference, load_state, verify_checkpoint
from kiln.config import ConfigError
from kiln.train import JobConfig, OptimConfig, lr_lambda, main


def result_of(job: Path) -> dict:
    return json.loads((Path(json.loads(job.read_text())["out_dir"]) / "result.json").read_text())


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


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, pretrain_job, train_runner):
    """One uninterrupted 30-step run: (job path, completed process)."""
    job = pretrain_job(tmp_path_factory.mktemp("baseline"))
    proc = train_runner(job)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return job, proc


@pytest.mark.slow
def test_validation_loss_falls_and_result_is_written(baseline) -> None:
    job, proc = baseline
    res = result_of(job)
    assert res["steps"] == 30 and res["tokens"] == 30 * 4 * 32
    assert res["world_size"] == 1 and res["device"] == "cpu" and res["resumed_from"] is None
    assert [h["step"] for h in res["history"]] == [0, 10, 20, 30]
    initial, final = res["initial_val_loss"], res["final_val_loss"]
    assert initial == pytest.approx(5.77, abs=0.3)  # about ln(320) for a fresh model
    assert final < initial - 1.0, (initial, final)
    assert res["history"][-1]["val_loss"] == final
    assert res["final_train_loss"] < initial - 1.0
    assert "step 0: val loss" in proc.stdout and "step 30/30" in proc.stdout


@pytest.mark.slow
def test_checkpoints_are_kept_verified_and_loadable(baseline, tiny_tokenizer) -> None:
    job, _ = baseline
    run = Path(json.loads(job.read_text())["out_dir"])
    ckpts = list_checkpoints(run / "checkpoints")
    assert [p.name for p in ckpts] == ["step_0000020", "step_0000030"]  # keep_last=2 pruned step 10
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000020", "step_0000030"]  # no staging
    meta = verify_checkpoint(ckpts[-1])
    assert set(meta["files"]) == {"state.pt", "tokenizer.json"}
    assert meta["step"] == 30 and meta["world_size"] == 1 and meta["task"] == "pretrain"
    assert meta["val_loss"] == result_of(job)["final_val_loss"]
    assert result_of(job)["checkpoint"] == str(ckpts[-1])
    state, _ = load_state(ckpts[-1])
    assert state["step"] == 30 and state["loader"]["window"] == 30 * 4
    assert state["scheduler"]["last_epoch"] == 30
    model, enc, _ = load_for_inference(run)
    assert enc.n_vocab == tiny_tokenizer[0].n_vocab
    assert model.num_params() == result_of(job)["params"]


@pytest.mark.slow
def test_crash_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, baseline, pretrain_job, train_runner) -> None:
    ref_job, _ = baseline
    job = pretrain_job(tmp_path, fail_at_step=15)
    run = Path(json.loads(job.read_text())["out_dir"])

    crashed = train_runner(job)
    assert crashed.returncode != 0
    assert "injected failure at step 15" in crashed.stderr
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_0000010"]
    assert not (run / "result.json").exists()

    resumed = train_runner(job)  # the same command again
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    res = result_of(job)
    assert res["resumed_from"] == str(run / "checkpoints" / "step_0000010")
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout

    ref_run = Path(json.loads(ref_job.read_text())["out_dir"])
    ref_state, _ = load_state(ref_run / "checkpoints" / "step_0000030")
    state, _ = load_state(run / "checkpoints" / "step_0000030")
    for part in ("model", "optimizer", "scheduler", "loader", "step"):
        assert_same(ref_state[part], state[part], part)
    ref_res = result_of(ref_job)
    assert res["history"] == ref_res["history"]  # identical validation losses at every eval
    assert res["final_val_loss"] == ref_res["final_val_loss"]
    assert res["final_train_loss"] == ref_res["final_train_loss"]

    # rerunning a finished job trains nothing and keeps the reported results
    main(["--config", str(job), "--device", "cpu"], reporter=ListReporter())  # in-process: no startup cost
    res2 = result_of(job)
    for key in ("steps", "final_val_loss", "final_train_loss", "initial_val_loss", "history", "checkpoint"):
        assert res2[key] == res[key], key
    assert res2["resumed_from"] == str(run / "checkpoints" / "step_0000030")


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
    ],
    ids=["model", "optim"],
)
def test_unknown_nested_key_is_named(tmp_path, pretrain_job, section, key, message) -> None:
    path = pretrain_job(tmp_path)
    job = json.loads(path.read_text())
    job[section][key] = 1
    path.write_text(json.dumps(job))
    with pytest.raises(ConfigError, match=message):
        main(["--config", str(path), "--device", "cpu"])
    assert not (tmp_path / "run").exists()  # rejected before anything is written


class ListReporter:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def test_injected_failure_before_the_first_checkpoint_happens_once(tmp_path, pretrain_job) -> None:
    # out_dir does not exist yet and no checkpoint is due before the failure
    path = pretrain_job(tmp_path, fail_at_step=2, max_steps=3, ckpt_interval=100, eval_interval=100, eval_batches=1)
    args = ["--config", str(path), "--device", "cpu"]
    with pytest.raises(RuntimeError, match="injected failure at step 2"):
        main(args, reporter=ListReporter())
    assert (tmp_path / "run" / ".failed_once").read_text() == "2"
    rep = ListReporter()
    summary = main(args, reporter=rep)  # no checkpoint yet: starts over and does not fail again
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
    assert job.task == "pretrain" and job.fail_at_step == -1 and job.grad_accum == 1


@pytest.mark.slow
def test_sft_job_fine_tunes_from_a_pretrained_checkpoint(tmp_path, baseline, pretrain_job) -> None:
    from kiln.instructions import build_pairs, write_jsonl

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
