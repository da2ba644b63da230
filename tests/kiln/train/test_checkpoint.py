"""Tests for kiln.train.checkpoint: bit-exact round trips (full and sharded), damage detection and fallback, pruning,
background saves that training cannot disturb, and loads that never run pickled code.

Run: python -m pytest tests/kiln/train/test_checkpoint.py -q
"""

from __future__ import annotations

import json
import pickle
import random
import time
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import (
    CHECKSUM,
    Checkpointer,
    CheckpointError,
    checkpoint_identity,
    file_digest,
    latest_good_checkpoint,
    list_checkpoints,
    load_for_inference,
    load_state,
    prune_checkpoints,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
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


def test_rng_state_round_trip_reproduces_draws() -> None:
    saved = rng_state()
    a = (torch.rand(4), random.random())
    torch.manual_seed(99)
    random.seed(99)
    set_rng_state(saved)
    b = (torch.rand(4), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


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


def test_saving_the_same_step_again_replaces_it(tmp_path) -> None:
    save_checkpoint(tmp_path, 5, {"x": torch.zeros(2)}, {})
    save_checkpoint(tmp_path, 5, {"x": torch.ones(2)}, {})
    state, _ = load_state(tmp_path / "step_0000005")
    assert torch.equal(state["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000005"]


class _Payload:
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
    torch.save({"model": {}, "evil": _Payload(marker)}, path / "state.pt")
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


# --------------------------------------------------------------------------- Checkpointer (the training loop's)


def checkpointer(root: Path, sharded: bool = False, async_save: bool = True, **kw) -> Checkpointer:
    return Checkpointer(root, rank=0, world_size=1, sharded=sharded, async_save=async_save, keep_last=kw.pop("keep_last", 3),
                        log=kw.pop("log", lambda m: None), **kw)


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state_dict()["state"].values() for t in s.values()]


@pytest.mark.parametrize("sharded", [False, True], ids=["full", "sharded"])
def test_checkpointer_round_trip_into_a_fresh_model_and_optimizer(tmp_path, sharded, tiny_tokenizer) -> None:
    _, tok = tiny_tokenizer
    m, opt = trained(1)
    ck = checkpointer(tmp_path, sharded=sharded, extra_files={"tokenizer.json": tok})
    ck.save(5, m, opt, {"step": 5, "loader": {"epoch": 1}}, {"model": vars(tiny_config())})
    ck.wait()
    path = tmp_path / "step_0000005"
    meta = verify_checkpoint(path)
    assert meta["format"] == ("sharded" if sharded else "full") and ck.committed == [path]
    if sharded:  # torch.distributed.checkpoint's files, each in the checksum manifest
        assert {"model/.metadata", "model/__0_0.distcp", "state.pt", "tokenizer.json"} <= set(meta["files"])
    m2, opt2 = trained(2)
    extras, meta2 = checkpointer(tmp_path, sharded=sharded).load(ck.latest(), m2, opt2)
    assert extras == {"step": 5, "loader": {"epoch": 1}} and meta2["step"] == 5
    assert_same(m.state_dict(), m2.state_dict())
    for a, b in zip(optimizer_tensors(opt), optimizer_tensors(opt2)):
        assert torch.equal(a, b)
    state, _ = load_state(path)  # what evaluation and release read: one full model state either way
    assert_same(m.state_dict(), state["model"])


def test_identity_follows_the_weights_not_the_bookkeeping(tmp_path) -> None:
    """Two saves of bit-identical weights with different optimizer steps, extras and timings share an identity;
    one changed weight gives another."""
    m, opt = trained(1)
    a = checkpointer(tmp_path / "a")
    a.save(3, m, opt, {"step": 3, "run": {"lineage_s": 1.25}}, {"model": vars(tiny_config())})
    a.wait()
    m2, opt2 = trained(1)
    opt2.zero_grad()
    b = checkpointer(tmp_path / "b")
    b.save(9, m2, opt2, {"step": 9, "run": {"lineage_s": 7.5}}, {"model": vars(tiny_config()), "val_loss": 1.0})
    b.wait()
    ida, idb = checkpoint_identity(tmp_path / "a" / "step_0000003"), checkpoint_identity(tmp_path / "b" / "step_0000009")
    assert file_digest(tmp_path / "a" / "step_0000003" / "state.pt") != file_digest(tmp_path / "b" / "step_0000009" / "state.pt")
    assert ida == idb and len(ida) == 16
    with torch.no_grad():
        next(m2.parameters()).view(-1)[0] += 1e-6
    b.save(10, m2, opt2, {"step": 10}, {"model": vars(tiny_config())})
    b.wait()
    assert checkpoint_identity(tmp_path / "b" / "step_0000010") != ida


def test_background_save_is_a_snapshot_and_blocks_only_for_the_copy(tmp_path) -> None:
    m, opt = trained(1)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    ck = checkpointer(tmp_path, on_write=lambda path: time.sleep(0.5))  # the write itself takes over half a second
    blocked = ck.save(1, m, opt, {"step": 1}, {})
    assert blocked < 0.4 and list_checkpoints(tmp_path) == []  # training goes on while it is written
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)  # the next steps change the weights in place
    waited = ck.wait()
    assert waited > 0.05 and ck.blocked_s == pytest.approx(blocked + waited)
    state, _ = load_state(tmp_path / "step_0000001")
    assert_same(expected, state["model"])  # the checkpoint holds the weights as they were at save()


def test_checkpointer_reports_a_failed_background_save_and_keeps_the_previous(tmp_path) -> None:
    m, opt = trained(1)
    ck = checkpointer(tmp_path, extra_files={"tokenizer.json": tmp_path / "missing.json"})
    with pytest.raises(FileNotFoundError):
        save_checkpoint(tmp_path, 1, {"x": torch.zeros(1)}, {}, extra_files={"t": tmp_path / "missing.json"})
    good = save(tmp_path, 1)
    ck.save(2, m, opt, {"step": 2}, {})
    with pytest.raises(CheckpointError, match=r"saving .*step_0000002 failed: FileNotFoundError"):
        ck.wait()
    assert list_checkpoints(tmp_path) == [good]


def test_checkpointer_removes_staging_left_by_a_killed_save(tmp_path) -> None:
    good = save(tmp_path, 1)
    (tmp_path / ".step_0000002.partial").mkdir()
    (tmp_path / ".step_0000002.partial" / "state.pt").write_bytes(b"half a file")
    logged: list[str] = []
    ck = checkpointer(tmp_path, log=logged.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001"]
    assert "interrupted" in logged[0] and ck.latest() == good


def test_sharded_index_with_foreign_objects_is_refused(tmp_path) -> None:
    m, opt = trained(1)
    ck = checkpointer(tmp_path, sharded=True, async_save=False)
    ck.save(1, m, opt, {"step": 1}, {"model": vars(tiny_config())})
    path = tmp_path / "step_0000001"
    marker = tmp_path / "pwned"
    (path / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    reseal(path)
    with pytest.raises(CheckpointError, match=r"index refers to pathlib\.Path\.touch"):
        load_state(path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        checkpointer(tmp_path, sharded=True).load(path, *trained(2))
    assert not marker.exists()


def test_torch_save_without_the_hashing_writer_matches(tmp_path) -> None:
    """The checksum computed while writing equals one computed from the file (as verify does)."""
    state = model_state(3)
    t0 = time.perf_counter()
    path = save_checkpoint(tmp_path, 3, state, {})
    assert time.perf_counter() - t0 < 10
    assert json.loads((path / "meta.json").read_text())["files"]["state.pt"] == file_digest(path / "state.pt")
