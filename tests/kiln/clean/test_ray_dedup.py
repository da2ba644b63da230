"""Tests for kiln.clean.ray_dedup in one process: the sharded URL, exact, MinHash and line decisions equal the
in-process stage's (``FirstSeen`` and ``MinHashDeduper``), whatever the partitions and the order of the shards,
and the documented difference between keeping each component's minimum and the greedy rule.

Run: python -m pytest tests/kiln/clean/test_ray_dedup.py -q (a few seconds, no cluster).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.corpus import merge_shards
from kiln.clean.dedup import FirstSeen, LineDeduper, MinHashDeduper, content_hash, normalise_datatrove, signatures, url_key
from kiln.clean.ray_dedup import LocalMap, components, decided_stage, dedup_decisions, greedy, resolve_near
from kiln.clean.run import _clean_shards
from kiln.clean.shard import plan_shards
from kiln.common.config import ConfigError
from textgen import prose

CFG = CleanConfig.from_dict({"line_dedup": {"max_repeats": 2}})


def _sig(rng: random.Random, base: np.ndarray | None, share: list[int]) -> bytes:
    """A 112-value signature; with ``base``, bands ``share`` copied from it (8 rows a band)."""
    s = np.array([rng.getrandbits(32) for _ in range(112)], dtype=np.uint32)
    for b in share:
        s[8 * b: 8 * b + 8] = base[8 * b: 8 * b + 8]
    return s.tobytes()


def fake_results(tmp: Path, shards: int = 4, per: int = 40, seed: int = 0) -> list[dict]:
    """kept.parquet files of ``shards`` shards with shared URLs, identical texts, near-duplicate chains (signatures
    that share chosen bands with an earlier one) and lines repeated across documents."""
    rng, sigs, results = random.Random(seed), [], []
    for s in range(shards):
        rows = []
        for i in range(per):
            n = len(sigs)
            base = np.frombuffer(sigs[rng.randrange(n)], np.uint32) if n and rng.random() < 0.5 else None
            sig = _sig(rng, base, rng.sample(range(14), rng.choice([1, 1, 2])) if base is not None else [])
            sigs.append(sig)
            text = prose(rng.randrange(60)) + "\n" + f"a shared footer line number {rng.randrange(4)} of the site"
            url = f"https://ex.org/{rng.randrange(150)}" if rng.random() < 0.7 else f"local/{n}"
            rows.append({"id": f"s{s}-{i}", "url": url, "text": text, "minhash": sig})
        path = tmp / f"kept-{s}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        results.append({"shard": {"index": s}, "kept": str(path), "report": {"input_docs": per, "dropped_docs": 0}})
    return results


def in_process(results: list[dict], cfg) -> tuple[dict, set]:
    """What CorpusStage.dedup decides, with its own classes: position -> (reason, prior position); the lines that
    line dedup then removes."""
    rows = [r for res in sorted(results, key=lambda r: r["shard"]["index"]) for r in pq.read_table(res["kept"]).to_pylist()]
    urls, hashes, near, out, kept = FirstSeen(), FirstSeen(), MinHashDeduper(cfg.minhash), {}, []
    for pos, row in enumerate(rows):
        web = row["url"][:8].lower().startswith(("http://", "https://"))
        if web and (p := urls.check(url_key(row["url"]), pos)) is not None:
            out[pos] = ("url", p)
        elif (p := hashes.check(content_hash(row["text"]), pos)) is not None:
            out[pos] = ("exact", p)
        elif (p := near.check([pos], [np.frombuffer(row["minhash"], np.uint32)])[0]) is not None:
            out[pos] = ("near", p)
        else:
            kept.append(row["text"])
    lines = LineDeduper(cfg.line_dedup)
    for t in kept:
        lines.count(t)
    return out, {h for h, c in lines.counts.items() if c > cfg.line_dedup.max_repeats}


def as_dict(d) -> dict:
    return {**{p: ("url", q) for p, q in d.url.items()}, **{p: ("exact", q) for p, q in d.exact.items()},
            **{p: ("near", q) for p, q in d.near.items()}}


def test_sharded_decisions_equal_in_process_for_any_partitions_and_order(tmp_path: Path) -> None:
    results = fake_results(tmp_path)
    want, want_lines = in_process(results, CFG)
    assert {r for r, _ in want.values()} == {"url", "exact", "near"} and want_lines  # every rule fires
    for partitions, order in ((1, [0, 1, 2, 3]), (3, [3, 1, 0, 2]), (8, [2, 3, 1, 0])):
        d = dedup_decisions([results[i] for i in order], CFG, LocalMap(), partitions)
        assert as_dict(d) == want and d.over_lines == want_lines


def test_chain_is_kept_by_greedy_not_by_component_minimum(tmp_path: Path) -> None:
    """A~B (band 0) and B~C (band 1), A and C share no band: the in-process index keeps A and C (B, a duplicate,
    is never indexed); the component {A, B, C} would keep A alone. The sharded path keeps A and C."""
    rng = random.Random(1)
    a = np.frombuffer(_sig(rng, None, []), np.uint32)
    b = np.frombuffer(_sig(rng, a, [0]), np.uint32)
    c = np.frombuffer(_sig(rng, b, [1]), np.uint32)
    assert MinHashDeduper(CFG.minhash).check(["A", "B", "C"], [a, b, c]) == [None, "A", None]
    buckets = [[0, 1], [1, 2]]
    assert components(buckets) == [[0, 1, 2]]
    assert greedy([0, 1, 2], buckets) == {1: 0} == resolve_near(buckets)
    pq.write_table(pa.Table.from_pylist([{"url": "", "text": t, "minhash": s.tobytes()}
                                         for t, s in zip("xyz", (a, b, c))]), tmp_path / "k.parquet")
    res = [{"shard": {"index": 0}, "kept": str(tmp_path / "k.parquet"), "report": {"input_docs": 3, "dropped_docs": 0}}]
    assert dedup_decisions(res, CFG, LocalMap(), 2).near == {1: 0}


def test_merge_with_decisions_writes_the_in_process_corpus(tmp_path: Path) -> None:
    from test_clean import write_raw

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
    res = _clean_shards([(raw, s, tmp_path / f"s{s['index']}", cfg, None) for s in plan_shards(raw, 7)], cfg,
                        False, lambda m: None, 0.0)
    a = merge_shards(res, tmp_path / "a.parquet", tmp_path / "ra.parquet", cfg).to_dict()
    d = dedup_decisions(res[::-1], cfg, LocalMap(), 3)
    b = merge_shards(res, tmp_path / "b.parquet", tmp_path / "rb.parquet", cfg, stage=decided_stage(d)).to_dict()
    assert d.exact and d.near and d.over_lines
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
    assert pq.read_table(tmp_path / "ra.parquet").equals(pq.read_table(tmp_path / "rb.parquet"))
    timings = ("seconds", "stage_seconds", "docs_per_s", "mb_per_s")
    assert {k: v for k, v in a.items() if k not in timings} == {k: v for k, v in b.items() if k not in timings}


def test_datatrove_normalisation() -> None:
    assert normalise_datatrove("Café, 3.14 and 42 — “Résumé”!") == "cafe 0 and 0 resume"
    assert normalise_datatrove("In 1999, x+y=2.") == "in 0 x y 0"
    cfg = CleanConfig.from_dict({"minhash": {"normalise": "datatrove"}}).minhash
    plain = CleanConfig().minhash
    one, two = "Prices rose 12.5% in 2023 at the café.", "prices rose 7% in 2024 at the cafe"
    s1, s2 = signatures([one, two], cfg)
    assert (s1 == s2).all()  # numbers, accents, case and punctuation no longer tell them apart
    p1, p2 = signatures([one, two], plain)
    assert not (p1 == p2).all()
    assert CleanConfig().shard_stage_hash() != CleanConfig.from_dict({"minhash": {"normalise": "datatrove"}}).shard_stage_hash()
    with pytest.raises(ConfigError, match="normalise"):
        CleanConfig.from_dict({"minhash": {"normalise": "nfkc"}})
    with pytest.raises(ConfigError, match="executor"):
        CleanConfig.from_dict({"executor": "dask"})
    assert CleanConfig().shard_stage_hash() == CleanConfig.from_dict({"executor": "ray"}).shard_stage_hash()
