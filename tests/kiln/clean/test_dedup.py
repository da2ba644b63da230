"""Tests for kiln.clean.dedup, the one dedup algorithm of every executor: its URL, exact, MinHash and line decisions
equal a reference built from datasketch's own LSH index (queried before each insert) and plain dicts, whatever the
partitions, the order of the shards and the order in which the map runs its jobs; the chain a component's minimum
would get wrong; URL and line dedup through ``clean``.

Run: python -m pytest tests/kiln/clean/test_dedup.py -q (a few seconds, no cluster).
"""

from __future__ import annotations

import operator
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig
from kiln.clean.dedup import (LineDedupConfig, LineDeduper, LocalMap, components, content_hash, dedup_decisions,
                              greedy, line_keys, normalise_datatrove, resolve_near, signatures, url_key)
from kiln.clean.run import clean
from kiln.common.config import ConfigError
from textgen import prose

CFG = CleanConfig.from_dict({"line_dedup": {"max_repeats": 2}})
MINHASH_ONLY = CleanConfig.from_dict({"url_dedup": False, "exact_dedup": False, "line_dedup": {"enabled": False}})


class ReversedMap:
    """A map that runs its jobs last to first (results still in job order): the decisions must not change."""

    def __call__(self, fn, jobs, num_returns=1, label=""):
        return [fn(*job) for job in jobs[::-1]][::-1]


def _sig(rng: random.Random, base: np.ndarray | None, share: list[int]) -> bytes:
    """A 112-value signature; with ``base``, bands ``share`` copied from it (8 rows a band)."""
    s = np.array([rng.getrandbits(32) for _ in range(112)], dtype=np.uint32)
    for b in share:
        s[8 * b: 8 * b + 8] = base[8 * b: 8 * b + 8]
    return s.tobytes()


def kept_file(path: Path, rows: list[dict], index: int = 0) -> dict:
    """``rows`` (url, text, minhash) as one shard's kept.parquet, and the shard result naming it."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return {"shard": {"index": index}, "kept": str(path), "report": {"input_docs": len(rows), "dropped_docs": 0}}


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
        results.append(kept_file(tmp / f"kept-{s}.parquet", rows, s))
    return results


def lsh_index(sigs: list[np.ndarray], cfg) -> list[int | None]:
    """datasketch's MinHashLSH, queried before each insert: per document, None (kept and indexed) or the position
    of the earliest indexed document it collides with."""
    from datasketch import LeanMinHash, MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    scheme = MinHash(num_perm=2, seed=cfg.seed, hashfunc=operator.index).scheme
    out: list[int | None] = []
    for pos, values in enumerate(sigs):
        m = LeanMinHash(seed=cfg.seed, hashvalues=values, scheme=scheme)
        hits = lsh.query(m)
        out.append(min(hits) if hits else None)
        if not hits:
            lsh.insert(pos, m, check_duplication=False)
    return out


def reference(results: list[dict], cfg) -> tuple[dict, set]:
    """The decisions made one document at a time in corpus order: position -> (rule, prior position), and the line
    hashes counted in more than max_repeats surviving documents."""
    rows = [r for res in sorted(results, key=lambda r: r["shard"]["index"]) for r in pq.read_table(res["kept"]).to_pylist()]
    urls, hashes, out, survivors = {}, {}, {}, []
    for pos, row in enumerate(rows):
        web = row["url"][:8].lower().startswith(("http://", "https://"))
        if web and (p := urls.setdefault(url_key(row["url"]), pos)) != pos:
            out[pos] = ("url", p)
        elif (p := hashes.setdefault(content_hash(row["text"]), pos)) != pos:
            out[pos] = ("exact", p)
        else:
            survivors.append(pos)
    near = lsh_index([np.frombuffer(rows[p]["minhash"], np.uint32) for p in survivors], cfg.minhash)
    for pos, prior in zip(survivors, near):
        if prior is not None:
            out[pos] = ("near", survivors[prior])
    counts = Counter(h for p in survivors if p not in out for h in line_keys(rows[p]["text"], cfg.line_dedup.min_line_chars))
    return out, {h for h, c in counts.items() if c > cfg.line_dedup.max_repeats}


def as_dict(d) -> dict:
    return {**{p: ("url", q) for p, q in d.url.items()}, **{p: ("exact", q) for p, q in d.exact.items()},
            **{p: ("near", q) for p, q in d.near.items()}}


def test_decisions_equal_the_reference_for_any_partitions_order_and_map(tmp_path: Path) -> None:
    results = fake_results(tmp_path)
    want, want_lines = reference(results, CFG)
    assert {r for r, _ in want.values()} == {"url", "exact", "near"} and want_lines  # every rule fires
    for partitions, order, fmap in ((1, [0, 1, 2, 3], LocalMap()), (3, [3, 1, 0, 2], ReversedMap()),
                                    (8, [2, 3, 1, 0], LocalMap())):
        d = dedup_decisions([results[i] for i in order], CFG, fmap, partitions)
        assert as_dict(d) == want and d.over_lines == want_lines


def test_chain_is_kept_by_first_kept_rule_not_by_component_minimum(tmp_path: Path) -> None:
    """A~B (band 0) and B~C (band 1), A and C share no band: an LSH index keeps A and C (B, a duplicate, is never
    indexed); the component {A, B, C} would keep A alone. The first-kept rule inside the component keeps A and C."""
    rng = random.Random(1)
    a = np.frombuffer(_sig(rng, None, []), np.uint32)
    b = np.frombuffer(_sig(rng, a, [0]), np.uint32)
    c = np.frombuffer(_sig(rng, b, [1]), np.uint32)
    assert lsh_index([a, b, c], CFG.minhash) == [None, 0, None]
    buckets = [[0, 1], [1, 2]]
    assert components(buckets) == [[0, 1, 2]]
    assert greedy([0, 1, 2], buckets) == {1: 0} == resolve_near(buckets)
    res = [kept_file(tmp_path / "k.parquet", [{"url": "", "text": t, "minhash": s.tobytes()} for t, s in zip("xyz", (a, b, c))])]
    assert dedup_decisions(res, CFG, LocalMap(), 2).near == {1: 0}


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


def test_minhash_finds_the_edited_copies_from_text(tmp_path: Path) -> None:
    """Signatures computed in the map (``sign``) from text alone, as for any id/url/text Parquet."""
    texts = near_copies(12)
    res = [kept_file(tmp_path / "t.parquet", [{"url": "", "text": t} for t in texts])]
    d = dedup_decisions(res, MINHASH_ONLY, LocalMap(), 2, sign=True)
    assert d.near == {i: i - 1 for i in range(12) if i % 3 == 2} and not d.url and not d.exact
    sigs = signatures(texts, MINHASH_ONLY.minhash)
    assert lsh_index(sigs, MINHASH_ONLY.minhash) == [i - 1 if i % 3 == 2 else None for i in range(12)]


def test_url_key_normalises() -> None:
    assert url_key("HTTPS://Example.ORG:443/a/") == "https://example.org/a"
    assert url_key("http://example.org:8080/a?b=1#c") == "http://example.org:8080/a?b=1#c"
    assert url_key("https://example.org/") == url_key("https://example.org")


def test_line_deduper_removes_the_over_repeated_lines() -> None:
    boiler = "Subscribe to our newsletter for the latest updates"
    cfg = LineDedupConfig(max_repeats=6)
    d = LineDeduper(cfg, line_keys(boiler, cfg.min_line_chars))
    text, lines, nbytes = d.apply(prose(0) + "\n" + boiler)
    assert text == prose(0) and lines == 1 and nbytes == len(boiler) + 1
    assert d.apply(prose(50)) == (prose(50), 0, 0)
    assert line_keys("{\n}\n" + boiler, cfg.min_line_chars) == line_keys(boiler, 20)  # short lines never count


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
    few = CleanConfig.from_dict({"line_dedup": {"max_repeats": 10}})
    report = clean(tmp_path / "raw.parquet", tmp_path / "c.parquet", tmp_path / "r.parquet", few)
    assert "dedup:line" not in report.edits  # seen 8 times, allowed 10


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


def test_the_redis_backend_keys_are_gone() -> None:
    """One algorithm: the LSH index's backend and Redis keys are unknown keys now (errors, as every unknown key)."""
    for key in ("backend", "redis_host", "redis_port", "keep_index"):
        with pytest.raises(ConfigError, match=rf"clean\.minhash: unknown key '{key}'"):
            CleanConfig.from_dict({"minhash": {key: "memory"}})
