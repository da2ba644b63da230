"""Tests for kiln.clean.ray_data in one process (no cluster): row numbers recovered from Ray's row hash, and the
shards assembled from the map's pieces equal ``clean_shard``'s outputs whatever the block size and block order.

Run: python -m pytest tests/kiln/clean/test_ray_data.py -q (a few seconds).
"""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

from kiln.clean.config import CleanConfig
from kiln.clean.ray_data import PIECES, Plan, assemble_shard, doc_stage, file_rows, raw_source, shard_starts
from kiln.clean.shard import clean_shard, open_raw, plan_shards
from tests.kiln.clean.test_run import write_raw
from textgen import prose

CFG = CleanConfig.from_dict({"shard_docs": 9, "quality_model": {"enabled": False}})


def blocks(raw: Path, size: int, seed: int) -> list[pa.Table]:
    """The raw rows as Ray Data's reader gives them (``path`` and ``row_hash`` columns), in blocks of ``size``
    rows, shuffled."""
    t = pq.read_table(raw)
    t = t.append_column("path", pa.array([str(raw)] * t.num_rows))
    t = t.append_column("row_hash", pa.array(_compute_row_hashes(str(raw), 0, t.num_rows), pa.uint64()))
    out = [t.slice(i, size) for i in range(0, t.num_rows, size)]
    random.Random(seed).shuffle(out)
    return out


def test_row_numbers_come_back_from_the_row_hash(tmp_path: Path) -> None:
    t = pa.table({"path": ["bucket/raw.parquet"] * 5,
                  "row_hash": pa.array(_compute_row_hashes("bucket/raw.parquet", 1_000_000, 5), pa.uint64())})
    assert file_rows(t).tolist() == [1_000_000, 1_000_001, 1_000_002, 1_000_003, 1_000_004]
    bad = t.set_column(1, "row_hash", pa.array([1, 2, 3, 4, 5], pa.uint64()))
    with pytest.raises(RuntimeError, match="row_hash is no longer"):
        file_rows(bad)


def test_raw_source_paths_and_urls(tmp_path: Path) -> None:
    assert raw_source(tmp_path / "r.parquet") == (str(tmp_path / "r.parquet"), None)
    assert raw_source((tmp_path / "r.parquet").as_uri()) == (str(tmp_path / "r.parquet"), None)
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as z:
        z.writestr("in/r.parquet", b"PAR1")
    path, fs = raw_source(f"zip://in/r.parquet::{(tmp_path / 'a.zip').as_uri()}")
    assert path == "in/r.parquet" and fs.get_file_info(path).size == 4  # pyarrow's view of the fsspec filesystem
    with pytest.raises(ValueError, match="memory://"):
        raw_source("memory://x/r.parquet")


def test_pieces_assemble_to_clean_shard_for_any_block_size_and_order(tmp_path: Path) -> None:
    docs = [{"text": prose(i % 11, 8) if i % 4 else "too short"} for i in range(40)]
    raw = write_raw(tmp_path / "raw.parquet", docs, row_group_size=16)
    shards = plan_shards(raw, CFG.shard_docs)
    want = [clean_shard(raw, s, tmp_path / f"want{s['index']}", CFG, filters=None) for s in shards]
    assert len(shards) == 5 and any(w["report"]["dropped_docs"] for w in want)
    with open_raw(raw) as pf:
        starts = shard_starts(pf, shards)
    assert starts.tolist() == [0, 9, 18, 27, 36]
    for size, seed in ((40, 0), (7, 1), (3, 2)):
        work = tmp_path / f"w{size}"
        (work / PIECES).mkdir(parents=True)
        plan = Plan(str(raw), shards, starts, {3}, CFG, None, str(work))  # shard 3 reused from the cache
        pieces = [p for b in blocks(raw, size, seed) for p in doc_stage(b, plan).to_pylist()]
        assert {p["shard"] for p in pieces} == {0, 1, 2, 4}
        for s in shards:
            if s["index"] == 3:
                continue
            got = assemble_shard(s, [p for p in pieces if p["shard"] == s["index"]], str(work / f"s{s['index']}"),
                                 CFG, cache=True)
            w = want[s["index"]]
            for kind in ("kept", "removed"):
                assert pq.read_table(got[kind]).equals(pq.read_table(w[kind]))
            drop = lambda r: {k: v for k, v in r.items() if k != "stage_seconds"}  # noqa: E731
            assert drop(got["report"]) == drop(w["report"])
            assert (work / f"s{s['index']}" / "report.json").is_file()
    assert np.array_equal(file_rows(blocks(raw, 40, 0)[0]), np.arange(40))


def test_a_missing_or_repeated_piece_fails_the_stage() -> None:
    from kiln.clean.ray_run import RayClusterError, _check_complete

    todo = [{"index": 0, "source": "web", "docs": 10}]
    _check_complete(todo, {0: [{"first": 0, "docs": 6}, {"first": 6, "docs": 4}]})
    with pytest.raises(RayClusterError, match=r"shard 0 \(web\): .* returned 6 rows in 1 pieces for its 10 rows"):
        _check_complete(todo, {0: [{"first": 0, "docs": 6}]})
    with pytest.raises(RayClusterError, match="the corpus was not written"):
        _check_complete(todo, {0: [{"first": 0, "docs": 5}, {"first": 0, "docs": 5}]})
    with pytest.raises(RayClusterError, match="returned 0 rows in 0 pieces"):
        _check_complete(todo, {})
