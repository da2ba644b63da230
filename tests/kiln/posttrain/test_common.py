"""Tests of kiln/posttrain/common.py: preference splits train on every file and hold out only the first file's val rows."""

from __future__ import annotations

import pytest

from kiln.posttrain.common import read_preference_splits
from kiln.posttrain.instructions import write_jsonl


def _row(i: int, split: str, kind: str = "arithmetic", error: str = "off_by_small") -> dict:
    return {"id": f"{split}{i}{kind}", "prompt": f"What is {i} + 1?", "kind": kind, "split": split, "source_id": "s",
            "chosen": f"{i + 1}.", "rejected": f"{i + 2}.", "error": error}


def test_preference_splits_train_on_every_file_and_hold_out_only_the_first_files_val_rows(tmp_path) -> None:
    checkable, judged = tmp_path / "prefs.jsonl", tmp_path / "judged.jsonl"
    write_jsonl([_row(i, "train") for i in range(5)] + [_row(i, "val") for i in range(4)]
                + [_row(9, "train", "doc_section", "other_section")], checkable)
    write_jsonl([_row(i, "train", error="judge") for i in range(3)] + [_row(0, "val", error="judge")]
                + [_row(7, "train", "doc_section", "judge")], judged)
    mixed = read_preference_splits([checkable, judged], [checkable], eval_pairs=3)
    assert mixed.train_by_file == [6, 4] and len(mixed.train) == 10
    assert [r["error"] for r in mixed.train[6:]] == ["judge"] * 4 and all(r["split"] == "train" for r in mixed.train)
    assert [r["id"] for r in mixed.val] == ["val0arithmetic", "val1arithmetic", "val2arithmetic"]
    assert all(r["error"] != "judge" for r in mixed.val)  # the judged file's own val row is never read
    alone = read_preference_splits([judged], [checkable], eval_pairs=10, kinds=["arithmetic"])
    assert alone.train_by_file == [3] and len(alone.val) == 4 and all(r["error"] == "off_by_small" for r in alone.val)
    before = read_preference_splits([checkable], [], eval_pairs=10)  # no val_files: the training file's val rows
    assert before.train_by_file == [6] and len(before.val) == 4
    write_jsonl([_row(0, "train", "doc_section", "judge")], judged)
    with pytest.raises(ValueError, match=f"{judged}: no 'train' rows of kind \\['arithmetic'\\]"):
        read_preference_splits([checkable, judged], [checkable], eval_pairs=4, kinds=["arithmetic"])
