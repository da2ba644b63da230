"""Tests of kiln/clean/report.py: the report's accounting adds up in input order, and an empty corpus names its top
reason and the config key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.report import CleanReport, EmptyCorpusError
from tests.kiln.clean.test_run import LINES, OTHER_PROSE, PROSE, run, violations


def test_report_accounting_adds_up_and_order_is_input_order(tmp_path: Path) -> None:
    cases = violations()
    docs = [{"text": PROSE, "source": "a"}, {"text": OTHER_PROSE, "source": "b"}]
    docs += [{"text": t, "source": "b"} for t in cases.values()] + [{"text": PROSE, "source": "a"}]
    calls: list[str] = []
    cfg = CleanConfig(batch_size=3, progress_every=4, shard_docs=4)
    report, kept, removed = run(tmp_path, docs, cfg, row_group_size=4, progress=calls.append)
    assert report.shards == 5  # shards never mix sources: a | b b b b | b b b b | b b | a

    assert report.input_docs == len(docs) == report.kept_docs + report.dropped_docs
    assert report.input_bytes == sum(len(d["text"].encode()) for d in docs)
    assert report.input_bytes == report.kept_input_bytes + report.dropped_bytes
    assert report.dropped_docs == sum(r["docs"] for r in report.reasons.values()) == len(removed)
    assert report.dropped_bytes == sum(r["bytes"] for r in report.reasons.values()) == sum(
        r["bytes"] for r in removed.values())
    assert report.kept_bytes == sum(k["bytes"] for k in kept)
    assert report.sources == {
        "a": {"kept_docs": 1, "kept_bytes": len(PROSE.encode()), "dropped_docs": 1,
              "dropped_bytes": len(PROSE.encode())},
        "b": {"kept_docs": 1, "kept_bytes": len(OTHER_PROSE.encode()), "dropped_docs": len(cases),
              "dropped_bytes": sum(len(t.encode()) for t in cases.values())},
    }
    ex = report.reasons["dedup:exact"]["examples"]
    assert ex == [{"id": f"d{len(docs) - 1}", "snippet": " ".join(PROSE.split())[:200],
                   "lines": [p[:160] for p in PROSE.split("\n\n")]}]  # a few lines each, for a person to judge
    assert all(len(e["snippet"]) <= 200 for r in report.reasons.values() for e in r["examples"])
    assert report.to_dict()["config"]["minhash"]["num_perm"] == 112

    assert [k["id"] for k in kept] == ["d0", "d1"]
    assert list(removed) == [f"d{i}" for i in range(2, len(docs))]
    # every progress_every docs, then one final call; a logger's .info can take the messages
    read = [c for c in calls if " docs read" in c]
    assert [c.split(" docs read")[0] for c in read] == ["clean: 5", "clean: 9", "clean: 12", "clean: done, 12"]
    assert "clean: quality classifier skipped: 0 reference and 2 other documents" in " ".join(calls)
    assert read[0].startswith("clean: 5 docs read, ") and read[-1].endswith(" MB/s") and "docs/s" in read[-1]


def test_empty_corpus_error_names_top_reason_and_key(tmp_path: Path) -> None:
    docs = [{"text": f"short note {i}"} for i in range(3)] + [{"text": "\n".join(f"- {l}" for l in LINES)}]
    with pytest.raises(EmptyCorpusError) as err:
        run(tmp_path, docs)
    msg = str(err.value)
    assert "kept 0 of 4 documents" in msg
    assert "gopher:too_few_words=3, gopher:bullet_lines=1" in msg
    assert "clean.min_words" in msg and "loosen" in msg and "add sources" in msg
    assert isinstance(err.value.report, CleanReport) and err.value.report.dropped_docs == 4
    assert not (tmp_path / "clean.parquet").exists() and not (tmp_path / "removed.parquet").exists()
