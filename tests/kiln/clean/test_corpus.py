"""Tests of kiln/clean/corpus.py: merging shards writes the same corpus whatever the dedup map and partitions."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from kiln.clean.config import CleanConfig
from kiln.clean.corpus import merge_shards
from kiln.clean.dedup import LocalMap, dedup_decisions
from kiln.clean.run import clean_shards
from kiln.clean.shard import plan_shards
from tests.kiln.clean.test_dedup import ReversedMap
from textgen import prose


def test_merge_writes_the_same_corpus_whatever_the_map_and_partitions(tmp_path: Path) -> None:
    from tests.kiln.clean.test_run import write_raw

    docs = []
    for i in range(30):
        text = prose(i % 12, 10)
        if i % 5 == 4:  # a near copy: one word changed
            words = text.split(" ")
            words[3] = "lighthouse"
            text = " ".join(words)
        docs.append({"text": text + "\nShared navigation footer of the example site, on every page."})
    raw = write_raw(tmp_path / "raw.parquet", docs)
    cfg = CleanConfig.from_dict({"shard_docs": 7, "line_dedup": {"max_repeats": 3}, "quality_model": {"enabled": False}})
    res = clean_shards(raw, plan_shards(raw, 7), lambda s: tmp_path / f"s{s['index']}", cfg, lambda m: None)
    d = dedup_decisions(res, cfg, LocalMap(), 1)
    assert d.exact and d.near and d.over_lines
    a = merge_shards(res, tmp_path / "a.parquet", tmp_path / "ra.parquet", cfg).to_dict()
    b = merge_shards(res[::-1], tmp_path / "b.parquet", tmp_path / "rb.parquet", cfg, fmap=ReversedMap(),
                     partitions=3).to_dict()
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
    assert pq.read_table(tmp_path / "ra.parquet").equals(pq.read_table(tmp_path / "rb.parquet"))
    timings = ("seconds", "stage_seconds", "docs_per_s", "mb_per_s")
    assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}
    removed = pq.read_table(tmp_path / "ra.parquet").to_pylist()
    assert sum(r["reason"] == "dedup:minhash" for r in removed) == len(d.near)
