"""Tests of kiln/evaluation/tasks.py: the held-out task files built from documents, deterministic per seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kiln.evaluation import CHANCE, TASK_NAMES, NotEnoughDocumentsError, build_tasks
from tests.kiln.evaluation.evaluation_kit import enc, make_docs  # noqa: F401  (enc is a fixture)


def test_build_tasks_files_and_determinism(tmp_path, enc):
    docs = make_docs(50)
    info = build_tasks(docs, tmp_path / "a", n_items=20, seed=7)
    assert set(info) == set(TASK_NAMES)
    again = build_tasks(docs, tmp_path / "b", n_items=20, seed=7)
    other = build_tasks(docs, tmp_path / "c", n_items=20, seed=8)
    for task, meta in info.items():
        spec = yaml.safe_load(Path(meta["path"]).read_text())
        assert spec["task"] == task and spec["dataset_path"] == "json"
        data = Path(spec["dataset_kwargs"]["data_files"]["test"])
        assert data.is_absolute() and data == Path(meta["data"]).resolve()
        assert meta["items"] == 20 and meta["chance"] == CHANCE[task]
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        assert len(rows) == 20
        assert data.read_text() == Path(again[task]["data"]).read_text()
        assert data.read_text() != Path(other[task]["data"]).read_text()
    for row in map(json.loads, Path(info["kiln_continuation"]["data"]).read_text().splitlines()):
        assert len(set(row["choices"])) == 4 and 0 <= row["label"] < 4
        assert row["context"] + " " + row["choices"][row["label"]] in " ".join(docs[row["doc_index"]].split())
    for row in map(json.loads, Path(info["kiln_lastword"]["data"]).read_text().splitlines()):
        assert row["target"].startswith(" ") and row["context"] + row["target"] in docs[row["doc_index"]]
    with pytest.raises(NotEnoughDocumentsError, match=r"kiln_heldout_ppl: needs n_items=30 .* only 10 come from the 10"):
        build_tasks(docs[:10], tmp_path / "d", n_items=30, seed=0)

    # n_items as a cap with a floor, and several disjoint passages per document
    few = build_tasks(docs[:10], tmp_path / "e", n_items=30, seed=0, min_items=5, per_doc=3)
    assert few["kiln_heldout_ppl"]["items"] == 10  # one per document
    assert 10 < few["kiln_continuation"]["items"] <= 30 and 10 < few["kiln_lastword"]["items"] <= 30
    for task in ("kiln_continuation", "kiln_lastword"):
        rows = [json.loads(line) for line in Path(few[task]["data"]).read_text().splitlines()]
        per_doc = {}
        for r in rows:
            per_doc.setdefault(r["doc_index"], []).append(r["context"])
        assert max(map(len, per_doc.values())) <= 3
        assert all(len(set(c)) == len(c) for c in per_doc.values())  # disjoint passages, no repeats
        assert [r["id"] for r in rows] == list(range(len(rows)))
    with pytest.raises(NotEnoughDocumentsError, match="at most 1 per document"):
        build_tasks(docs[:10], tmp_path / "f", n_items=30, seed=0, min_items=11)
