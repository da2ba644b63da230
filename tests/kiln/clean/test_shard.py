"""Tests for kiln.clean.shard: shard cache keys that cover content, the limits that turn a pathological document
into a counted skip, progress lines, and stale staging files removed from the shard cache.

Run: python -m pytest tests/kiln/clean/test_shard.py -q
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig, rule_keys
from kiln.clean.report import EmptyCorpusError
from kiln.clean.run import clean
from kiln.clean.shard import clean_shard, plan_shards, remove_stale_staging, shard_stage_key
from textgen import prose
from tests.kiln.clean.test_run import PROSE  # the same page as the clean tests
from kiln.common.config import ConfigError
from tests.kiln.filters.filters_kit import SENTENCES


def write_raw(path: Path, texts: list[str], ctype: str = "text/plain", **columns: list[Any]) -> Path:
    rows = [{"id": f"d{i}", "source": "test", "url": f"https://example.org/{i}", "content_type": ctype,
             "license": "CC0", "text": t, "bytes": len(t.encode())} for i, t in enumerate(texts)]
    for name, values in columns.items():
        for row, value in zip(rows, values):
            row[name] = value
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


def nested_html(depth: int) -> str:
    """A page of ``depth`` nested <div>s, about 41 bytes a level (20,000 levels are about 0.8 MB)."""
    return "<html><body>" + '<div class="nest">some words here, ' * depth + "</div>" * depth + "</body></html>"


# ---------------------------------------------------------------- cache keys cover content


def test_editing_a_document_in_place_at_equal_size_gives_new_keys_and_the_new_text(tmp_path: Path) -> None:
    raw, cache, cfg = tmp_path / "raw.parquet", tmp_path / "clean_shards", CleanConfig()
    texts = [PROSE, prose(1), prose(2)]
    write_raw(raw, texts)
    before = plan_shards(raw, 2)
    first = [clean_shard(raw, s, cache / shard_stage_key(s, cfg), cfg) for s in before]
    assert "rocky point" in pq.read_table(first[0]["kept"]).column("text")[0].as_py()

    edited = texts[:]
    edited[0] = PROSE.replace("rocky point", "sandy point")  # same length, same bytes, same id
    assert len(edited[0].encode()) == len(texts[0].encode())
    write_raw(raw, edited)  # in place
    after = plan_shards(raw, 2)
    assert [s["segments"] for s in after] == [s["segments"] for s in before]
    assert after[0]["key"] != before[0]["key"] and after[1]["key"] == before[1]["key"]  # only the edited shard
    assert shard_stage_key(after[0], cfg) != shard_stage_key(before[0], cfg)
    again = clean_shard(raw, after[0], cache / shard_stage_key(after[0], cfg), cfg)
    text = pq.read_table(again["kept"]).column("text")[0].as_py()
    assert "sandy point" in text and "rocky point" not in text

    report = clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet", cfg)
    corpus = pq.read_table(tmp_path / "clean.parquet").to_pylist()
    assert report.kept_docs == 3 and "sandy point" in corpus[0]["text"]


@pytest.mark.parametrize("column, value", [("url", "https://example.org/X"), ("content_type", "text/html"),
                                           ("license", "CC-BY"), ("source", "tset"), ("bytes", 7), ("id", "d9"),
                                           ("text", PROSE[::-1]), ("text", None), ("url", None)])
def test_every_input_column_is_in_the_shard_key(tmp_path: Path, column: str, value: Any) -> None:
    base = write_raw(tmp_path / "a.parquet", [PROSE, PROSE])
    other = write_raw(tmp_path / "b.parquet", [PROSE, PROSE], **{column: [value]})  # the first row's only
    assert plan_shards(base, 10)[0]["key"] != plan_shards(other, 10)[0]["key"]
    same = write_raw(tmp_path / "c.parquet", [PROSE, PROSE])
    assert plan_shards(base, 10)[0]["key"] == plan_shards(same, 10)[0]["key"]


# ---------------------------------------------------------------- limits


def test_deeply_nested_html_is_a_counted_skip_in_seconds(tmp_path: Path) -> None:
    page = nested_html(20_000)
    assert 0.8e6 < len(page) < 1.1e6
    raw = write_raw(tmp_path / "raw.parquet", [page, f"<html><body><p>{PROSE}</p></body></html>"], "text/html")
    t0 = time.perf_counter()
    report = clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet")
    seconds = time.perf_counter() - t0
    assert seconds < 10, f"a nested page took {seconds:.1f} s"
    removed = pq.read_table(tmp_path / "removed.parquet").to_pylist()
    assert [(r["id"], r["reason"]) for r in removed] == [("d0", "extract:too_deep")]
    assert "max_html_depth=512" in removed[0]["detail"]
    assert report.reasons["extract:too_deep"]["docs"] == 1 and report.kept_docs == 1
    assert rule_keys()["extract:too_deep"] == "max_html_depth"


def test_a_deep_page_alone_names_its_config_key_in_the_empty_corpus_error(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "raw.parquet", [nested_html(3000)], "text/html")
    with pytest.raises(EmptyCorpusError, match=r"'extract:too_deep' \(config key clean.max_html_depth\)"):
        clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet")


def test_a_page_under_the_depth_limit_is_extracted(tmp_path: Path) -> None:
    page = "<html><body>" + "<div>" * 40 + f"<p>{PROSE}</p>" + "</div>" * 40 + "</body></html>"
    raw = write_raw(tmp_path / "raw.parquet", [page], "text/html")
    report = clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet", CleanConfig(max_html_depth=60))
    assert report.kept_docs == 1
    with pytest.raises(EmptyCorpusError, match="extract:too_deep=1"):
        clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet", CleanConfig(max_html_depth=30))


def test_a_document_over_the_size_limit_is_a_counted_skip(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "raw.parquet", [PROSE * 3, PROSE])
    cfg = CleanConfig(max_input_bytes=len(PROSE) + 10)
    report = clean(raw, tmp_path / "clean.parquet", tmp_path / "removed.parquet", cfg)
    removed = pq.read_table(tmp_path / "removed.parquet").to_pylist()
    assert [(r["id"], r["reason"]) for r in removed] == [("d0", "extract:too_large")]
    assert removed[0]["detail"] == f"{len(PROSE) * 3} bytes > max_input_bytes={len(PROSE) + 10}"
    assert report.reasons["extract:too_large"]["bytes"] == len(PROSE) * 3
    assert rule_keys()["extract:too_large"] == "max_input_bytes"


def test_the_limits_are_typed_config_keys() -> None:
    cfg = CleanConfig()
    assert (cfg.max_input_bytes, cfg.max_html_depth) == (8 << 20, 512)
    with pytest.raises(Exception, match="max_html_depth"):
        CleanConfig(max_html_depth="deep")
    with pytest.raises(Exception, match="max_input_bytes"):
        CleanConfig(max_input_bytes=0)


# ---------------------------------------------------------------- progress


def test_a_shard_reports_progress_with_rate_and_time_left(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "raw.parquet", [PROSE] * 7)
    shard = plan_shards(raw, 100)[0]
    lines: list[str] = []
    cfg = CleanConfig(progress_every=3, batch_size=2)
    clean_shard(raw, shard, tmp_path / "out", cfg, progress=lines.append)
    assert [line.split(",")[0] for line in lines] == [f"clean shard 0 (test): {n} of 7 docs" for n in (3, 6, 7)]
    assert all("docs/s" in line and "s left" in line for line in lines)
    assert lines[-1].endswith("0 s left")


# ---------------------------------------------------------------- staging leftovers


def test_stale_staging_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    cache = tmp_path / "clean_shards"
    key, other = cache / "0123456789abcdef0123", cache / "fedcba98765432100123"
    key.mkdir(parents=True)
    other.mkdir()
    old = time.time() - 3 * 3600
    stale = [key / ".kept.parquet.a1b2c3d4.tmp", key / ".report.json.zz_9x8y7.tmp", other / ".removed.parquet.q.tmp"]
    kept = [key / "kept.parquet", key / "notes.tmp", key / ".kept.parquet.a1b2.bak", cache / ".kept.parquet.x.tmp",
            other / ".other.parquet.a1b2.tmp"]
    for p in stale + kept:
        p.write_bytes(b"x")
        os.utime(p, (old, old))
    fresh = key / ".removed.parquet.n3w.tmp"  # a writer that is still running
    fresh.write_bytes(b"x")
    assert sorted(remove_stale_staging(cache)) == sorted(stale)
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept + [fresh])
    assert remove_stale_staging(tmp_path / "missing") == []


def test_a_shard_stage_removes_its_stale_staging_files(tmp_path: Path) -> None:
    raw = write_raw(tmp_path / "raw.parquet", [PROSE])
    shard, cfg = plan_shards(raw, 10)[0], CleanConfig()
    out = tmp_path / "clean_shards" / shard_stage_key(shard, cfg)
    out.mkdir(parents=True)
    left = out / ".kept.parquet.k1ll3d.tmp"
    left.write_bytes(b"half a file")
    old = time.time() - 3 * 3600
    os.utime(left, (old, old))
    result = clean_shard(raw, shard, out, cfg)
    assert not left.exists() and result["report"]["input_docs"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["kept.parquet", "removed.parquet", "report.json"]


def test_rules_run_in_the_pipeline_with_exemptions(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    no_punct = "\n".join(s.rstrip(".") for s in SENTENCES)
    rows = [{"id": f"d{i}", "source": src, "url": "", "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"}
            for i, (src, t) in enumerate([("web", prose(9)), ("web", no_punct), ("code", no_punct)])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "raw.parquet")
    cfg = CleanConfig.from_dict({"exempt": {"code": ["fineweb:*"]}})
    report = clean(tmp_path / "raw.parquet", tmp_path / "c.parquet", tmp_path / "r.parquet", cfg)
    kept = pq.read_table(tmp_path / "c.parquet").column("id").to_pylist()
    assert kept == ["d0", "d2"]  # the code source is exempt from FineWeb's rules
    assert report.reasons["fineweb:line_punct_ratio"]["docs"] == 1
    assert report.reasons["fineweb:line_punct_ratio"]["examples"][0]["lines"][0] == SENTENCES[0].rstrip(".")
    with pytest.raises(ConfigError, match="exempt must map"):
        CleanConfig.from_dict({"exempt": {"code": "fineweb:*"}})
