"""Tests for kiln.train.diskfull: a full disk found however a save wrapped it, and named by its path.

Run: python -m pytest tests/kiln/train/test_diskfull.py -q
"""

from __future__ import annotations

import errno
import os

import pytest

from kiln.train.checkpoint import CheckpointError
from kiln.train.diskfull import describe, naming, no_space, record


def enospc(filename: str | None = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *([filename] if filename else []))


def test_the_first_enospc_is_found_under_the_errors_raised_after_it():
    first = enospc()
    with pytest.raises(OSError) as raised:
        try:
            with naming("/runs/a/checkpoints/.step_0000008.partial"):
                raise CheckpointError("saving step 8 failed") from first
        except CheckpointError:
            raise enospc("/runs/a/logbook.jsonl")  # the logbook's write, failing while the save's error is handled
    assert no_space(raised.value) is first and first.filename == "/runs/a/checkpoints/.step_0000008.partial"
    assert no_space(RuntimeError("not a full disk")) is None and no_space(OSError(errno.EIO, "EIO")) is None


def test_a_torch_distributed_checkpoint_failure_is_searched_rank_by_rank():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise enospc()
    except OSError as e:
        wrapped = _wrap_exception(e)
    with pytest.raises(CheckpointException) as raised, naming("/runs/a/.step_0000004.partial/model"):
        raise CheckpointException("save failed", {1: wrapped})
    assert no_space(raised.value).filename == "/runs/a/.step_0000004.partial/model"


def test_naming_keeps_the_file_a_failed_open_named():
    with pytest.raises(OSError) as raised, naming("/runs/a"):
        raise enospc("/runs/a/result.json")
    assert raised.value.filename == "/runs/a/result.json"


def test_the_record_names_the_path_and_the_space_left_there(tmp_path):
    rec = record(enospc(str(tmp_path / "gone" / "state.pt")), fallback_path="/unused")
    assert rec["path"] == str(tmp_path / "gone" / "state.pt") and 0 <= rec["free_bytes"] <= rec["total_bytes"]
    text = describe(rec)
    assert text.startswith(f"No space left on device (ENOSPC) writing {tmp_path / 'gone' / 'state.pt'} (")
    assert " free of " in text
    assert record(enospc(), fallback_path=str(tmp_path))["path"] == str(tmp_path)
    assert describe({"path": "/x", "free_bytes": None}).endswith("(free space on that filesystem unreadable)")
