"""Tests for kiln.train.checkpointer, the training loop's Checkpointer: round trips into a fresh model and optimizer
(full and sharded), identities that follow the weights, background saves that training cannot disturb, failed and
killed saves, refused sharded indexes, and the RNG states a checkpoint carries.

Run: python -m pytest tests/kiln/train/test_checkpointer.py -q
"""

from __future__ import annotations

import pickle
import random
import time
from pathlib import Path

import pytest
import torch

from kiln.train.checkpoint import (CheckpointError, checkpoint_identity, file_digest, list_checkpoints, load_state,
                                   save_checkpoint, verify_checkpoint)
from kiln.train.checkpointer import Checkpointer, rng_state, set_rng_state
from tests.kiln.train.test_checkpoint import Payload, assert_same, reseal, save, tiny_config, trained


def test_rng_state_round_trip_reproduces_draws() -> None:
    saved = rng_state()
    a = (torch.rand(4), random.random())
    torch.manual_seed(99)
    random.seed(99)
    set_rng_state(saved)
    b = (torch.rand(4), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


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


def test_a_save_in_flight_when_training_crashes_is_committed_not_lost(tmp_path) -> None:
    m, opt = trained(1)
    logged: list[str] = []
    ck = checkpointer(tmp_path, log=logged.append, on_write=lambda path: time.sleep(0.5))
    ck.save(1, m, opt, {"step": 1}, {})
    assert list_checkpoints(tmp_path) == []  # the crash comes while step 1 is being written
    assert ck.finish_after_crash() is True and [p.name for p in list_checkpoints(tmp_path)] == ["step_0000001"]
    assert ck.finish_after_crash() is False and logged == []  # nothing in flight any more
    slow = checkpointer(tmp_path, log=logged.append, on_write=lambda path: time.sleep(1.0))
    slow.save(2, m, opt, {"step": 2}, {})
    assert slow.finish_after_crash(timeout_s=0.1) is False and "did not finish within 0 s" in logged[-1]
    failing = checkpointer(tmp_path, log=logged.append, extra_files={"t": tmp_path / "missing.json"})
    failing.save(3, m, opt, {"step": 3}, {})
    assert failing.finish_after_crash() is False and "failed too: FileNotFoundError" in logged[-1]


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
    (path / "model" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(path)
    with pytest.raises(CheckpointError, match=r"index refers to pathlib\.Path\.touch"):
        load_state(path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        checkpointer(tmp_path, sharded=True).load(path, *trained(2))
    assert not marker.exists()
