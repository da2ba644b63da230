"""Tests for kiln.evaluation.checkpoints: partition keys, discovery, pruned checkpoints, score history and curves.

Run: python -m pytest tests/kiln/evaluation/test_checkpoints.py -q   (files only; under a second)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.train.checkpoint import CheckpointError
from kiln.evaluation import checkpoints as kc


def ckpt(root: Path, run: str, step: int, mtime: float) -> Path:
    folder = root / run / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text("{}")
    os.utime(folder / "meta.json", (mtime, mtime))
    return folder


def test_keys_round_trip_and_bad_keys_are_named():
    assert kc.checkpoint_key("76f1bb8d0d3fe2cf", 200) == "76f1bb8d0d3fe2cf-step0000200"
    assert kc.parse_key("a-b-step0000200") == ("a-b", 200)
    assert kc.parse_key("run-step12345678") == ("run", 12345678)
    with pytest.raises(ValueError, match="'step_200'"):
        kc.parse_key("step_200")


def test_discover_resolve_and_latest(tmp_path):
    ckpt(tmp_path, "runA", 200, 300)
    ckpt(tmp_path, "runA", 100, 100)
    ckpt(tmp_path, "runB", 50, 200)
    (tmp_path / "runA" / "checkpoints" / ".step_0000300.tmp").mkdir()  # a save in progress is not a checkpoint
    (tmp_path / "runC" / "checkpoints" / "step_0000010").mkdir(parents=True)  # no meta.json: incomplete
    (tmp_path / "runA" / "job.json").write_text(json.dumps({"mlflow_run_id": "abc"}))
    refs = kc.discover(tmp_path)
    assert [r.key for r in refs] == ["runA-step0000100", "runB-step0000050", "runA-step0000200"]  # by write time
    assert kc.resolve(tmp_path, "runB-step0000050").path == tmp_path / "runB" / "checkpoints" / "step_0000050"
    with pytest.raises(CheckpointError, match=r"runA-step0000300: .*keep_last"):
        kc.resolve(tmp_path, "runA-step0000300")
    assert [r.key for r in kc.latest_per_run(refs, 5)] == ["runA-step0000200", "runB-step0000050"]
    assert [r.key for r in kc.latest_per_run(refs, 1)] == ["runA-step0000200"]
    assert kc.training_run_id(tmp_path, "runA") == "abc" and kc.training_run_id(tmp_path, "runB") is None
    assert kc.discover(tmp_path / "missing") == []


def test_score_history_takes_the_newest_result_per_step_and_curves_split_by_metric(tmp_path):
    def write(step: int, version: str, acc: float, mtime: float) -> None:
        f = tmp_path / f"step_{step:07d}" / version / kc.SCORES_FILE
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps({"step": step, "tasks": {
            "kiln_continuation": {"acc": 0.1, "acc_norm": acc, "chance": 0.25, "contaminated": 2},
            "kiln_mmlu": {"acc": 0.3, "chance": 0.25, "contaminated": 0},
            "kiln_heldout_ppl": {"bits_per_byte": 3.0 - step / 100, "chance": None}},
            "tasks_clean": {"kiln_continuation": {"acc_norm": acc - 0.05, "chance": 0.25},
                            "kiln_mmlu": {"acc": 0.3, "chance": 0.25}}}))
        os.utime(f, (mtime, mtime))

    write(200, "v1", 0.30, 10)
    write(100, "v1", 0.20, 5)
    write(200, "v2", 0.40, 20)  # re-evaluated later: this one counts
    hist = kc.score_history(tmp_path)
    assert [(h["step"], h["tasks"]["kiln_continuation"]["acc_norm"]) for h in hist] == [(100, 0.2), (200, 0.4)]
    c = kc.curves(hist)
    assert c["accuracy"]["kiln_continuation acc_norm"] == [(100, 0.2), (200, 0.4)]
    assert c["accuracy"]["kiln_continuation acc_norm (clean)"] == [(100, pytest.approx(0.15)), (200, pytest.approx(0.35))]
    assert c["accuracy"]["chance 0.25"] == [(100, 0.25), (200, 0.25)]  # one line for both tasks at 0.25
    assert set(c["accuracy"]) == {"kiln_continuation acc_norm", "kiln_continuation acc_norm (clean)", "kiln_mmlu acc",
                                  "chance 0.25"}  # no clean line where nothing was contaminated
    assert c["bits_per_byte"] == {"kiln_heldout_ppl bits_per_byte": [(100, 2.0), (200, 1.0)]}
