"""Deduplication that shards across workers: URL, exact and MinHash dedup as hash-partitioned shuffles, line dedup
as partitioned counting, each step a map over the clean shards and a reduce per partition.

Every document has a corpus position (shard index, then row), the order the in-process path reads them in; every
rule keeps by minimum position, so the result depends on neither the number of workers, nor the partitions, nor
the order in which blocks arrive. The decisions equal ``kiln.clean.corpus.CorpusStage.dedup``'s exactly:

- URL: among documents with a web URL, the first of each normalised URL is kept (``FirstSeen`` sees every row).
- exact: among the URL survivors, the first of each content hash is kept.
- MinHash: among the survivors of both, documents that agree on a whole band share a bucket; union-find over the
  buckets with two or more members gives the connected components, and inside each component the in-process
  greedy rule is replayed in corpus order: a document is dropped when a bucket it is in already holds a *kept*
  document, as the duplicate of the earliest such one. Keeping only the minimum of each component would drop
  more: in a chain A~B~C where A and C share no band, the greedy index keeps C (B, a duplicate, is never
  indexed), so the components decide which documents can affect each other, and the greedy decides inside.
- lines: the distinct qualifying lines of every surviving document, counted per hash partition; only the hashes
  seen in more than ``max_repeats`` documents come back.

``dedup_decisions(results, cfg, LocalMap())`` runs it in this process (the tests compare it with the in-process
stage); ``kiln.clean.ray_run`` passes a map that runs the same functions as Ray tasks.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import pyarrow.parquet as pq

from kiln.clean.config import CleanSettings
from kiln.clean.corpus import CorpusStage
from kiln.clean.dedup import LineDeduper, content_hash, signatures, url_key

class Map(Protocol):
    """Runs ``fn`` over argument tuples and returns the results in the order of ``jobs``; ``fn`` returns
    ``num_returns`` values per job (a list when more than one)."""

    def __call__(self, fn: Callable, jobs: list[tuple], num_returns: int = 1, label: str = "") -> list[Any]: ...


class LocalMap:
    """The map of this process: one job after the other."""

    def __call__(self, fn: Callable, jobs: list[tuple], num_returns: int = 1, label: str = "") -> list[Any]:
        return [fn(*job) for job in jobs]


def _part(key: bytes, partitions: int) -> int:
    return zlib.crc32(key) % partitions


def dedup_keys(kept_path: str, offset: int, cfg: CleanSettings, partitions: int,
               sign: bool = False) -> list[dict[bytes, list[int]]]:
    """Map of pass A over one shard's kept.parquet (its first row at corpus position ``offset``): URL keys,
    content hashes and band keys, each as ``partitions`` dicts key -> positions, flat (3 * partitions dicts).
    ``sign``: compute the MinHash signatures from the text here instead of reading the ``minhash`` column."""
    cols = ["url", "text"] + (["minhash"] if cfg.minhash.enabled and not sign else [])
    t = pq.read_table(kept_path, columns=cols)
    out: list[list[dict[bytes, list[int]]]] = [[{} for _ in range(partitions)] for _ in range(3)]
    urls, texts = t.column("url").to_pylist(), t.column("text").to_pylist()
    sigs = [None] * len(texts)
    if cfg.minhash.enabled:
        sigs = ([s.astype(np.uint32).tobytes() for s in signatures(texts, cfg.minhash)] if sign
                else t.column("minhash").to_pylist())
    bands, rows = cfg.minhash.bands, cfg.minhash.rows
    for i, (url, text, sig) in enumerate(zip(urls, texts, sigs)):
        pos = offset + i
        if cfg.url_dedup and url[:8].lower().startswith(("http://", "https://")):
            key = url_key(url).encode()
            out[0][_part(key, partitions)].setdefault(key, []).append(pos)
        if cfg.exact_dedup:
            key = content_hash(text)
            out[1][_part(key, partitions)].setdefault(key, []).append(pos)
        if sig is not None:
            for b in range(bands):
                key = b.to_bytes(2, "little") + sig[4 * b * rows: 4 * (b + 1) * rows]
                out[2][_part(key, partitions)].setdefault(key, []).append(pos)
    return [d for kind in out for d in kind]


def _merged(parts: list[dict[bytes, list[int]]]) -> dict[bytes, list[int]]:
    merged: dict[bytes, list[int]] = {}
    for p in parts:
        for k, v in p.items():
            merged.setdefault(k, []).extend(v)
    return merged


def reduce_first(parts: list[dict[bytes, list[int]]], dropped: set[int]) -> dict[int, int]:
    """Reduce of one partition of URL or content keys (one dict per shard): position -> position of the first
    document with the same key, for every later one; documents in ``dropped`` take no part."""
    out: dict[int, int] = {}
    for members in _merged(parts).values():
        live = sorted(p for p in members if p not in dropped)
        for p in live[1:]:
            out[p] = live[0]
    return out


def reduce_buckets(parts: list[dict[bytes, list[int]]], dropped: set[int]) -> list[list[int]]:
    """Reduce of one partition of band keys: the sorted distinct members of every bucket with two or more."""
    out = []
    for members in _merged(parts).values():
        live = sorted({p for p in members if p not in dropped})
        if len(live) > 1:
            out.append(live)
    return out


def components(buckets: list[list[int]]) -> list[list[int]]:
    """Union-find over the buckets: the connected components (sorted positions), sorted by their first member."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for b in buckets:
        r0 = find(b[0])
        for p in b[1:]:
            r = find(p)
            if r != r0:
                parent[max(r, r0)] = min(r, r0)
                r0 = min(r, r0)
    groups: dict[int, list[int]] = {}
    for p in parent:
        groups.setdefault(find(p), []).append(p)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])


def greedy(component: list[int], buckets: list[list[int]]) -> dict[int, int]:
    """The in-process index's rule inside one component, in corpus order: position -> the earliest kept document
    it shares a bucket with, for each one dropped. ``buckets`` are those whose members lie in the component."""
    of: dict[int, list[int]] = {}
    for i, b in enumerate(buckets):
        for p in b:
            of.setdefault(p, []).append(i)
    first_kept: dict[int, int] = {}
    out: dict[int, int] = {}
    for p in component:
        hits = [first_kept[i] for i in of.get(p, ()) if i in first_kept]
        if hits:
            out[p] = min(hits)
            continue
        for i in of.get(p, ()):
            first_kept.setdefault(i, p)
    return out


def resolve_near(buckets: list[list[int]]) -> dict[int, int]:
    """Near-duplicates from all multi-member buckets: components by union-find, then ``greedy`` in each."""
    comp_of = {}
    comps = components(buckets)
    for c, members in enumerate(comps):
        for p in members:
            comp_of[p] = c
    by_comp: list[list[list[int]]] = [[] for _ in comps]
    for b in buckets:
        by_comp[comp_of[b[0]]].append(b)
    out: dict[int, int] = {}
    for members, bs in zip(comps, by_comp):
        out.update(greedy(members, bs))
    return out


def line_hashes(kept_path: str, offset: int, dropped: set[int], cfg: CleanSettings, partitions: int) -> list:
    """Map of the line count: every surviving document's distinct qualifying line hashes, per partition."""
    texts = pq.read_table(kept_path, columns=["text"]).column("text").to_pylist()
    keys = LineDeduper(cfg.line_dedup)._keys
    out: list[list[int]] = [[] for _ in range(partitions)]
    for i, text in enumerate(texts):
        if offset + i not in dropped:
            for h in keys(text):
                out[h % partitions].append(h)
    return [np.asarray(x, dtype=np.uint64) for x in out]


def reduce_lines(parts: list[np.ndarray], max_repeats: int) -> np.ndarray:
    """Reduce of one line partition: the hashes counted in more than ``max_repeats`` documents."""
    values, counts = np.unique(np.concatenate(parts) if parts else np.zeros(0, np.uint64), return_counts=True)
    return values[counts > max_repeats]


@dataclass
class Decisions:
    """What the sharded passes decided: position -> prior position per rule, and the over-repeated lines."""

    url: dict[int, int] = field(default_factory=dict)
    exact: dict[int, int] = field(default_factory=dict)
    near: dict[int, int] = field(default_factory=dict)
    over_lines: set[int] = field(default_factory=set)


def _reduce(fmap: Map, fn: Callable, keyed: list[list], which: int, extra: Any, partitions: int, label: str):
    jobs = [([k[which * partitions + p] for k in keyed], extra) for p in range(partitions)]
    return fmap(fn, jobs, label=label)


def dedup_decisions(results: list[dict[str, Any]], cfg: CleanSettings, fmap: Map, partitions: int = 4,
                    sign: bool = False) -> Decisions:
    """The sharded passes over ``clean_shard`` results (sorted by shard index here): map keys, reduce URL, then
    exact, then band buckets, resolve near-duplicates, then count lines; each map or reduce runs through ``fmap``.
    ``sign``: the maps compute the MinHash signatures themselves (MinHash alone over any id/url/text Parquet)."""
    results = sorted(results, key=lambda r: r["shard"]["index"])
    sizes = [r["report"]["input_docs"] - r["report"]["dropped_docs"] for r in results]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(int).tolist() if sizes else []
    keyed = fmap(dedup_keys, [(r["kept"], o, cfg, partitions, sign) for r, o in zip(results, offsets)],
                 num_returns=3 * partitions, label="dedup keys")
    d = Decisions()
    for part in _reduce(fmap, reduce_first, keyed, 0, set(), partitions, "URL dedup"):
        d.url.update(part)
    for part in _reduce(fmap, reduce_first, keyed, 1, set(d.url), partitions, "exact dedup"):
        d.exact.update(part)
    if cfg.minhash.enabled:
        dropped = set(d.url) | set(d.exact)
        buckets = [b for part in _reduce(fmap, reduce_buckets, keyed, 2, dropped, partitions, "MinHash buckets")
                   for b in part]
        d.near = resolve_near(buckets)
    if cfg.line_dedup.enabled:
        dropped = set(d.url) | set(d.exact) | set(d.near)
        hashed = fmap(line_hashes, [(r["kept"], o, dropped, cfg, partitions) for r, o in zip(results, offsets)],
                      num_returns=partitions, label="line hashes")
        jobs = [([h[p] for h in hashed], cfg.line_dedup.max_repeats) for p in range(partitions)]
        for over in fmap(reduce_lines, jobs, label="line counts"):
            d.over_lines.update(over.tolist())
    return d


class _CountedLines(LineDeduper):
    """A LineDeduper whose counts came from the sharded count: ``count`` does nothing, ``apply`` is unchanged."""

    def __init__(self, cfg, over: set[int]) -> None:
        super().__init__(cfg)
        self.counts = Counter(dict.fromkeys(over, cfg.max_repeats + 1))

    def count(self, text: str) -> None:
        pass


class DecidedStage(CorpusStage):
    """The corpus stage with pass A's dedup decisions taken from ``Decisions`` instead of the in-memory indexes;
    the drops, the removal report, its examples and every later pass are the in-process stage's own code."""

    decisions: Decisions = Decisions()

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ids: list[str] = []  # corpus position -> id, for the "duplicate of" details
        self.lines = _CountedLines(self.cfg.line_dedup, self.decisions.over_lines)

    def dedup(self, kept_paths: list[str]):
        minhash, self.cfg.minhash.enabled = self.cfg.minhash.enabled, False  # no in-memory index
        try:
            return super().dedup(kept_paths)
        finally:
            self.cfg.minhash.enabled = minhash

    def _exact_and_url(self, batch, urls, hashes, removed) -> list[dict]:
        """URL and exact drops in order, then the near-duplicates of what is left (the in-process order)."""
        d, survivors = self.decisions, []
        for row in batch:
            pos = len(self.ids)
            self.ids.append(row["id"])
            if pos in d.url:
                prior = self.ids[d.url[pos]]
                self.drop(row, "dedup:url", f"same URL as {prior}", prior, removed)
            elif pos in d.exact:
                prior = self.ids[d.exact[pos]]
                self.drop(row, "dedup:exact", f"duplicate of {prior}", prior, removed)
            else:
                survivors.append((pos, row))
        kept = []
        for pos, row in survivors:
            if pos in d.near:
                prior = self.ids[d.near[pos]]
                self.drop(row, "dedup:minhash", f"duplicate of {prior}", prior, removed)
            else:
                kept.append(row)
        return kept


def decided_stage(decisions: Decisions) -> type[CorpusStage]:
    """A ``DecidedStage`` class bound to ``decisions`` (what ``merge_shards(stage=...)`` takes)."""
    return type("DecidedStage", (DecidedStage,), {"decisions": decisions})
