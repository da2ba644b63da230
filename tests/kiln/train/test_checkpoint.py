"""Tests for kiln.train.checkpoint, the on-disk format: bit-exact round trips, damage detection and fallback, pruning,
and loads that never run pickled code. The training loop's Checkpointer is tested in test_checkpointer.py.

Run: python -m pytest tests/kiln/train/test_checkpoint.py -q
"""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import (
    CHECKSUM,
    CheckpointError,
    file_digest,
    latest_good_checkpoint,
    list_checkpoints,
    load_for_inference,
    load_state,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    write_state_file,
)
from kiln.train.checkpointer import rng_state  # what a training checkpoint holds
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.common.files import sha256_file


def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


def trained(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = GPT(tiny_config())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randint(0, 320, (2, 8))).sum().backward()
    opt.step()
    return m, opt


def model_state(seed: int) -> dict:
    m, opt = trained(seed)
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "step": seed, "rng": [rng_state()],
            "loader": {"epoch": 0, "batch": seed}}


def save(root: Path, step: int, tokenizer: Path | None = None, keep_last: int = 3) -> Path:
    extra = {"tokenizer.json": tokenizer} if tokenizer else None
    return save_checkpoint(root, step, model_state(step), {"model": vars(tiny_config()), "val_loss": 1.5},
                           extra_files=extra, keep_last=keep_last)


def assert_same(a, b) -> None:
    """Deep equality where tensors must match bit for bit (dtype, shape and values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def test_save_verify_load_round_trip_is_bit_exact(tmp_path) -> None:
    state = model_state(7)
    path = save_checkpoint(tmp_path, 7, state, {"model": vars(tiny_config()), "val_loss": 2.25})
    assert path == tmp_path / "step_0000007"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "state.pt"]
    meta = verify_checkpoint(path)
    assert meta["step"] == 7 and meta["val_loss"] == 2.25 and meta["format"] == "full" and meta["checksum"] == CHECKSUM
    assert meta["files"] == {"state.pt": file_digest(path / "state.pt")}  # computed while writing, equal to a re-read
    loaded, meta2 = load_state(path)
    assert meta2 == meta
    assert_same(state, loaded)
    # tied weights stay one tensor on disk and after loading
    assert loaded["model"]["lm_head.weight"].data_ptr() == loaded["model"]["transformer.wte.weight"].data_ptr()


def test_older_sha256_checkpoints_still_verify(tmp_path) -> None:
    path = save(tmp_path, 3)
    meta = json.loads((path / "meta.json").read_text())
    del meta["checksum"]
    meta["files"] = {"state.pt": sha256_file(path / "state.pt")}
    (path / "meta.json").write_text(json.dumps(meta))
    assert verify_checkpoint(path)["step"] == 3


def test_extra_files_are_copied_and_checksummed(tmp_path, tiny_tokenizer) -> None:
    _, tok = tiny_tokenizer
    path = save(tmp_path / "ck", 1, tokenizer=tok)
    assert (path / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert verify_checkpoint(path)["files"]["tokenizer.json"] == file_digest(tok)


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_damaged_state_is_detected_and_latest_good_falls_back(tmp_path, damage) -> None:
    good = save(tmp_path, 10)
    bad = save(tmp_path, 20)
    f = bad / "state.pt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01  # one bit, same size
    f.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=r"state\.pt: checksum mismatch") as err:
        verify_checkpoint(bad)
    assert str(f) in str(err.value)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_state(bad)

    logged: list[str] = []
    assert latest_good_checkpoint(tmp_path, log=logged.append) == good
    assert len(logged) == 1 and "skipping damaged checkpoint" in logged[0] and str(f) in logged[0]
    assert resolve_checkpoint(tmp_path) == good


def test_missing_file_and_missing_meta_are_named(tmp_path) -> None:
    path = save(tmp_path, 3)
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"state\.pt: missing from checkpoint"):
        verify_checkpoint(path)
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no meta.json"):
        verify_checkpoint(path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta\.json: unreadable"):
        verify_checkpoint(tmp_path / "x")


def test_keep_last_plus_every_nth(tmp_path) -> None:
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000004", "step_0000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000004", "step_0000005"]  # no .step_* staging
    save(tmp_path, 6, keep_last=0)  # 0 keeps everything
    assert len(list_checkpoints(tmp_path)) == 3
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(tmp_path / "every", step, {"x": torch.zeros(1)}, {}, keep_last=1, keep_every=20)
    assert [p.name for p in list_checkpoints(tmp_path / "every")] == ["step_0000020", "step_0000040", "step_0000050"]
    assert prune_checkpoints(tmp_path / "every", keep_last=1) == [tmp_path / "every" / "step_0000020",
                                                                  tmp_path / "every" / "step_0000040"]


def test_failed_save_leaves_previous_checkpoint_and_no_staging(tmp_path) -> None:
    good = save(tmp_path, 1)
    with pytest.raises(FileNotFoundError):
        save_checkpoint(tmp_path, 2, model_state(2), {}, extra_files={"tokenizer.json": tmp_path / "nope.json"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001"]
    assert latest_good_checkpoint(tmp_path) == good


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, whose every write fails with ENOSPC")
def test_a_full_disk_reaches_the_caller_as_enospc_naming_the_file() -> None:
    """torch.save given a path reports a full disk as a RuntimeError with no errno; the state file is written
    through a Python file, so the caller (kiln.train.diskfull.no_space) can tell a full disk from a bug."""
    with pytest.raises(OSError) as raised:
        write_state_file(Path("/dev/full"), model_state(1))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == "/dev/full"


def test_saving_the_same_step_again_replaces_it(tmp_path) -> None:
    save_checkpoint(tmp_path, 5, {"x": torch.zeros(2)}, {})
    save_checkpoint(tmp_path, 5, {"x": torch.ones(2)}, {})
    state, _ = load_state(tmp_path / "step_0000005")
    assert torch.equal(state["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000005"]


class Payload:
    """Unpickling this calls Path.touch(marker): a stand-in for arbitrary code in a hostile checkpoint file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def reseal(path: Path) -> None:
    """Rewrite meta.json's checksums to match the files: only the loader's own care can protect now."""
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {name: file_digest(path / name) for name in meta["files"]}
    (path / "meta.json").write_text(json.dumps(meta))


def test_load_uses_weights_only_and_runs_no_pickled_code(tmp_path) -> None:
    path = save(tmp_path, 1)
    marker = tmp_path / "pwned"
    torch.save({"model": {}, "evil": Payload(marker)}, path / "state.pt")
    reseal(path)
    verify_checkpoint(path)
    with pytest.raises(Exception, match="Weights only load failed"):
        load_state(path)
    assert not marker.exists()


def test_resolve_checkpoint_accepts_folder_root_or_run_dir(tmp_path) -> None:
    run = tmp_path / "run"
    save(run / "checkpoints", 1)
    newest = save(run / "checkpoints", 2)
    assert resolve_checkpoint(newest) == newest
    assert resolve_checkpoint(run / "checkpoints") == newest
    assert resolve_checkpoint(run) == newest
    with pytest.raises(CheckpointError, match=r"no checkpoint found .*step_NNNNNNN"):
        resolve_checkpoint(tmp_path / "empty")


def test_load_for_inference_gives_eval_model_with_same_logits(tmp_path, tiny_tokenizer) -> None:
    enc, tok = tiny_tokenizer
    torch.manual_seed(3)
    m = GPT(tiny_config()).eval()
    save_checkpoint(tmp_path / "checkpoints", 4, {"model": m.state_dict()}, {"model": vars(tiny_config())},
                    extra_files={"tokenizer.json": tok})
    model, enc2, meta = load_for_inference(tmp_path)
    assert not model.training
    assert meta["step"] == 4 and meta["path"] == str(tmp_path / "checkpoints" / "step_0000004")
    assert enc2.encode_ordinary("the cat sees a dog") == enc.encode_ordinary("the cat sees a dog")
    idx = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), m(idx))
    assert model.lm_head.weight is model.transformer.wte.weight


def test_torch_save_without_the_hashing_writer_matches(tmp_path) -> None:
    """The checksum computed while writing equals one computed from the file (as verify does)."""
    state = model_state(3)
    t0 = time.perf_counter()
    path = save_checkpoint(tmp_path, 3, state, {})
    assert time.perf_counter() - t0 < 10
    assert json.loads((path / "meta.json").read_text())["files"]["state.pt"] == file_digest(path / "state.pt")
