"""Tests for JobConfig.document_mask in pretraining (kiln.train.pretrain, kiln.train.loop): the EOT id comes from the
shards' manifest or the tokenizer, the mask reaches the model in training and validation, and a run trains with it.

Run: python -m pytest tests/kiln/train/test_pretrain.py -q
"""

from __future__ import annotations

import json
import math
import shutil
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.model.masks import document_mask
from kiln.train.dist import DistInfo
from kiln.train.job import JobConfig, load_job
from kiln.train.loop import main, make_stage
from kiln.train.pretrain import PretrainStage, document_eot

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class Quiet:
    def log(self, message: str) -> None: ...


class Spy(torch.nn.Module):
    """Records each call's keyword arguments; returns a zero loss, or zero logits without targets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def forward(self, x, y=None, **kw):
        self.calls.append(kw)
        return torch.zeros(()) if y is not None else torch.zeros(*x.shape, 512)


def job_of(pretrain_job, tmp_path: Path, **overrides) -> JobConfig:
    return load_job(JobConfig, json.loads(pretrain_job(tmp_path, **overrides).read_text()))


def test_the_option_is_off_by_default() -> None:
    assert JobConfig().document_mask is False


def test_the_eot_id_comes_from_the_shard_manifest(tmp_path, pretrain_job, tiny_tokenizer, tiny_shards) -> None:
    enc, _ = tiny_tokenizer
    manifest = json.loads((tiny_shards / "manifest.json").read_text())
    job = job_of(pretrain_job, tmp_path, document_mask=True, tokenizer="")
    assert document_eot(job) == manifest["eot_token"] == enc.eot_token == 297  # the tiny BPE's <|endoftext|>


def test_without_a_manifest_the_tokenizer_gives_it_and_without_both_an_error_names_the_key(
        tmp_path, pretrain_job, tiny_tokenizer, tiny_shards) -> None:
    enc, tok = tiny_tokenizer
    bare = tmp_path / "bare"  # llm.c-style shards: no manifest.json beside them
    bare.mkdir()
    files = [str(shutil.copy(p, bare)) for p in sorted(tiny_shards.glob("*.bin"))]
    job = job_of(pretrain_job, tmp_path, document_mask=True, train_files=files, val_files=[])
    assert document_eot(job) == enc.eot_token
    job.tokenizer = ""
    with pytest.raises(ValueError, match=r"manifest.json with 'eot_token' beside .*bare.* job.tokenizer is empty"):
        document_eot(job)


def test_the_manifests_must_agree_on_the_eot(tmp_path, pretrain_job, tiny_shards) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_shards, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "eot_token": 7}))
    job = job_of(pretrain_job, tmp_path, document_mask=True, val_files=[str(p) for p in other.glob("val_*.bin")])
    with pytest.raises(ValueError, match="disagree on eot_token"):
        document_eot(job)


@pytest.mark.parametrize("on", [False, True])
def test_the_mask_reaches_the_model_in_training_and_validation(tmp_path, pretrain_job, on) -> None:
    stage = PretrainStage(job_of(pretrain_job, tmp_path, document_mask=on), CPU)
    spy = Spy()
    trainer = SimpleNamespace(model=spy, info=CPU, autocast=nullcontext, pipe=None)
    x, y = next(stage.batches(0))  # (4, 32) each, from the loader
    stage.loss(trainer, (x, y))
    val = stage.validate(trainer)
    if not on:
        assert spy.calls == [{}] * 5 and set(val) == {"val_loss"}  # the model is called as before: model(x, y)
        return
    assert stage.eot == 297 and int((x == 297).sum()) > 0  # the windows do hold document boundaries
    assert torch.equal(spy.calls[0]["attn_mask"], document_mask(x, 297))
    assert len(spy.calls) == 9 and all("attn_mask" in c for c in spy.calls[1:5]) and spy.calls[5:] == [{}] * 4
    assert set(val) == {"val_loss", "val_loss_unmasked"}  # the same batches measured masked and across documents


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_pretraining_run_with_the_mask_trains_and_reports_both_losses(tmp_path, pretrain_job, model_dict,
                                                                         family) -> None:
    model = {**model_dict, "family": family, **({"bias": False, "n_kv_head": 1} if family == "llama" else {})}
    path = pretrain_job(tmp_path, document_mask=True, model=model, max_steps=12, eval_interval=6, ckpt_interval=12)
    summary = main(["--config", str(path), "--device", "cpu"], reporter=Quiet())
    first, last = summary["history"][0], summary["history"][-1]
    assert [h["step"] for h in summary["history"]] == [0, 6, 12]
    assert last["val_loss"] < first["val_loss"] - 0.5, summary["history"]
    assert abs(first["val_loss"] - first["val_loss_unmasked"]) > 1e-6  # the mask changed what the model saw
    assert all(math.isfinite(h["val_loss"]) and math.isfinite(h["val_loss_unmasked"]) for h in summary["history"])


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory, pretrain_job) -> dict:
    """12 masked steps on one process, in-process on one thread (as the torchrun workers run)."""
    from tests.kiln.train.test_train_distributed import job_for as distributed_job

    job = distributed_job(pretrain_job, tmp_path_factory.mktemp("masked-one"), 1, document_mask=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["--config", str(job), "--device", "cpu"], reporter=Quiet())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_fsdp2_with_the_mask_follows_the_one_process_curve(tmp_path, pretrain_job, train_runner,
                                                         masked_reference) -> None:
    """Each data-parallel rank masks its own rows (the loader's one path under DDP and FSDP2 alike), and FSDP2's
    sharded weights see the same masked attention as one process."""
    parallelism = "fsdp"
    from tests.kiln.train.test_train_distributed import assert_same_curve, job_for as distributed_job, result_of

    job = distributed_job(pretrain_job, tmp_path, 2, parallelism=parallelism, document_mask=True)
    proc = train_runner(job, nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = result_of(job)
    assert res["parallelism"] == parallelism and res["world_size"] == 2
    assert_same_curve(res, masked_reference)
    assert [h["val_loss_unmasked"] for h in res["history"]] == pytest.approx(
        [h["val_loss_unmasked"] for h in masked_reference["history"]], abs=1e-4)
