"""Tests for kiln.clean.shard: the limits that turn a pathological document into a counted skip.

Run: python -m pytest tests/kiln/clean/test_shard.py -q
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig, rule_keys
from kiln.clean.report import EmptyCorpusError
from kiln.clean.run import clean

PROSE = (
    "The old lighthouse stood on a rocky point at the edge of the harbour, and for more than a century "
    "its keepers climbed the spiral stairs every evening to light the lamp.\n\n"
    "Ships coming home through the winter storms looked for its steady beam long before they could see "
    "the town itself. When the lamp was finally automated, the last keeper moved into a cottage near the "
    "quay, where he spent his afternoons repairing nets and telling visitors about the wrecks he had seen.\n\n"
    "Today the tower is a small museum, and children can still climb to the top to watch the boats."
)


def write_raw(path: Path, texts: list[str], ctype: str = "text/plain") -> Path:
    rows = [{"id": f"d{i}", "source": "test", "url": f"https://example.org/{i}", "content_type": ctype,
             "license": "CC0", "text": t, "bytes": len(t.encode())} for i, t in enumerate(texts)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


def nested_html(depth: int) -> str:
    """A page of ``depth`` nested <div>s, about 41 bytes a level (20,000 levels are about 0.8 MB)."""
    return "<html><body>" + '<div class="nest">some words here, ' * depth + "</div>" * depth + "</body></html>"


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
