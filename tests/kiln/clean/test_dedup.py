"""Tests for kiln.clean.dedup: URL, line-level and MinHash dedup, with the LSH index in memory and on a real Redis server.

Run: python -m pytest tests/kiln/clean/test_dedup.py -q (the Redis tests start ``redis-server`` on a free local port and
are skipped only where the binary is not installed).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.run import clean
from kiln.common.config import ConfigError
from kiln.clean.dedup import LineDedupConfig, LineDeduper, MinHashConfig, MinHashDeduper, url_key
from textgen import prose
from ports import free_port


@pytest.fixture(scope="module")
def redis_port():
    """A throwaway redis-server on 127.0.0.1 (no persistence), stopped after the module."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not answer within 5 s")
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def near_copies(n: int) -> list[str]:
    """n documents; every third is a lightly edited copy of the one before it."""
    texts = []
    for i in range(n):
        if i % 3 == 2:
            words = texts[-1].split()
            words[5] = "lighthouse"
            texts.append(" ".join(words))
        else:
            texts.append(prose(100 + i, 10))
    return texts


def test_url_key_normalises() -> None:
    assert url_key("HTTPS://Example.ORG:443/a/") == "https://example.org/a"
    assert url_key("http://example.org:8080/a?b=1#c") == "http://example.org:8080/a?b=1#c"
    assert url_key("https://example.org/") == url_key("https://example.org")


def test_minhash_memory_finds_the_edited_copies() -> None:
    texts = near_copies(12)
    d = MinHashDeduper(MinHashConfig())
    out = d.check([f"d{i}" for i in range(12)], d.signatures(texts))
    assert out == [f"d{i - 1}" if i % 3 == 2 else None for i in range(12)]


def test_redis_index_gives_the_same_result_as_memory(redis_port: int) -> None:
    import redis

    texts = near_copies(30)
    ids = [f"d{i}" for i in range(30)]
    mem = MinHashDeduper(MinHashConfig())
    sigs = mem.signatures(texts)
    expected = mem.check(ids, sigs)
    assert sum(x is not None for x in expected) == 10
    red = MinHashDeduper(MinHashConfig(backend="redis", redis_port=redis_port))
    try:
        assert red.check(ids, sigs) == expected
        assert red.check(["again"], sigs[:1]) == ["d0"]  # the index lives in Redis
        assert any(True for _ in redis.Redis(port=redis_port).scan_iter(match=red.basename.encode() + b"*"))
    finally:
        red.close()
    assert not list(redis.Redis(port=redis_port).scan_iter(match=red.basename.encode() + b"*"))  # cleaned up

    kept = MinHashDeduper(MinHashConfig(backend="redis", redis_port=redis_port, redis_basename="kiln-test-keep",
                                        keep_index=True))
    kept.check(ids[:3], sigs[:3])
    kept.close()
    again = MinHashDeduper(MinHashConfig(backend="redis", redis_port=redis_port, redis_basename="kiln-test-keep"))
    assert again.check(["later"], sigs[:1]) == ["d0"]  # a named, kept index dedups a later run against this one
    again.close()


def test_clean_with_redis_backend_equals_memory(tmp_path: Path, redis_port: int) -> None:
    texts = near_copies(18)
    rows = [{"id": f"d{i}", "source": "web", "url": "", "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"} for i, t in enumerate(texts)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "raw.parquet", row_group_size=5)
    results = {}
    for backend in ("memory", "redis"):
        cfg = CleanConfig.from_dict({"minhash": {"backend": backend, "redis_port": redis_port}, "shard_docs": 5})
        out = tmp_path / backend
        out.mkdir()
        report = clean(tmp_path / "raw.parquet", out / "c.parquet", out / "r.parquet", cfg)
        results[backend] = (pq.read_table(out / "c.parquet").to_pylist(), pq.read_table(out / "r.parquet").to_pylist(),
                            report.reasons["dedup:minhash"]["docs"])
    assert results["memory"] == results["redis"]
    assert results["memory"][2] == 6


def test_redis_backend_names_the_server_when_it_is_down() -> None:
    port = free_port()
    with pytest.raises(ConfigError, match=rf"no Redis server answers at 127.0.0.1:{port}.*backend: memory"):
        MinHashDeduper(MinHashConfig(backend="redis", redis_port=port))
    with pytest.raises(ConfigError, match="backend must be one of memory, redis"):
        MinHashConfig(backend="cassandra")


def test_line_dedup_across_documents() -> None:
    boiler = "Subscribe to our newsletter for the latest updates"
    docs = [prose(i) + "\n" + boiler for i in range(8)]
    d = LineDeduper(LineDedupConfig(max_repeats=6))
    for t in docs:
        d.count(t)
    text, lines, nbytes = d.apply(docs[0])
    assert text == prose(0) and lines == 1 and nbytes == len(boiler) + 1
    assert d.apply(prose(50)) == (prose(50), 0, 0)
    few = LineDeduper(LineDedupConfig(max_repeats=10))
    for t in docs:
        few.count(t)
    assert few.apply(docs[0])[1] == 0  # seen 8 times, allowed 10


def test_url_and_line_dedup_in_the_pipeline(tmp_path: Path) -> None:
    boiler = "Share this article with your friends and family today"
    texts = [prose(200 + i) + "\n" + boiler for i in range(9)]
    urls = [f"https://site.example/{i}" for i in range(8)] + ["HTTPS://site.example/0/"]
    rows = [{"id": f"d{i}", "source": "web", "url": u, "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"} for i, (t, u) in enumerate(zip(texts, urls))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "raw.parquet")
    report = clean(tmp_path / "raw.parquet", tmp_path / "c.parquet", tmp_path / "r.parquet")
    removed = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(r["id"], r["reason"], r["duplicate_of"]) for r in removed] == [("d8", "dedup:url", "d0")]
    kept = pq.read_table(tmp_path / "c.parquet").to_pylist()
    assert all(boiler not in k["text"] for k in kept) and kept[0]["lines_removed"] == 1
    assert report.edits["dedup:line"] == {"docs": 8, "items": 8, "bytes": 8 * (len(boiler) + 1)}
