"""Deduplication, one algorithm for every executor: URL, exact and MinHash near-duplicates as hash-partitioned
map and reduce passes over the clean shards, and line dedup as partitioned counting. The caller's map runs every
pass: ``LocalMap`` in this process, ``kiln.clean.ray_run.RayMap`` as Ray tasks; the functions are the same.

Every document has a corpus position (shard index, then row) and every rule keeps by minimum position, so the result
depends on neither the map, nor the number of partitions, nor the order in which results arrive:

- URL: among documents with a web URL, the first of each normalised URL is kept.
- exact: among the URL survivors, the first of each content hash is kept.
- MinHash (datasketch signatures): among the survivors of both, documents that agree on a whole band share a bucket;
  union-find over the buckets with two or more members gives the connected components, and inside each component a
  document is dropped, in corpus order, when a bucket it is in already holds a *kept* document, as the duplicate of
  the earliest such one (the first-kept rule of an LSH index queried before each insert). Keeping only the minimum
  of each component would drop more: in a chain A~B~C where A and C share no band, C is kept (B, a duplicate, keeps
  nothing out). The components bound which documents can affect each other; the rule decides inside each one.
- lines: the distinct qualifying lines of every surviving document, counted per hash partition; only the hashes
  seen in more than ``max_repeats`` documents come back, and ``LineDeduper`` removes them.

``dedup_decisions(results, cfg, LocalMap())`` over ``clean_shard`` results; try the near-duplicate rule alone with
``python -c "from kiln.clean.dedup import *; print(resolve_near([[0, 1], [1, 2]]))"`` (``{1: 0}``: A and C kept).
"""

from __future__ import annotations

import hashlib
import operator
import re
import string
import unicodedata
import zlib
from dataclasses import dataclass, field
from itertools import chain
from typing import Annotated, Any, Callable, Iterable, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import pyarrow.parquet as pq

from kiln.common.config import ConfigError, Domain, check_types
from kiln.common.text import ngram_hashes

CleanSettings = Any  # kiln.clean.config.CleanSettings, which imports this module's config classes

NORMALISE = ("none", "datatrove")  # text normalisation before shingling (see normalise_datatrove)


@dataclass
class MinHashConfig:
    enabled: bool = True  # drop near-duplicates (FineWeb: 5-gram word shingles, 14 bands x 8 rows, Jaccard ~0.75)
    ngram: Annotated[int, Domain(1)] = 5  # words per shingle
    num_perm: Annotated[int, Domain(1)] = 112  # hash permutations per signature; must equal bands * rows
    bands: Annotated[int, Domain(1)] = 14  # LSH bands: documents that agree on any whole band are near-duplicates
    rows: Annotated[int, Domain(1)] = 8  # hashes per band
    seed: Annotated[int, Domain(0)] = 1  # permutation seed, fixed so reruns drop the same documents
    normalise: str = "none"  # "datatrove": numbers to 0, punctuation and accents stripped before shingling (FineWeb)

    def __post_init__(self) -> None:
        check_types(self, "clean.minhash")
        if self.num_perm != self.bands * self.rows:
            raise ConfigError(
                f"clean.minhash: num_perm={self.num_perm} must equal bands * rows = "
                f"{self.bands} * {self.rows} = {self.bands * self.rows}; change num_perm, bands or rows."
            )
        if self.ngram < 1:
            raise ConfigError(f"clean.minhash.ngram must be >= 1, got {self.ngram}.")
        if self.normalise not in NORMALISE:
            raise ConfigError(f"clean.minhash.normalise must be one of {', '.join(NORMALISE)}, got {self.normalise!r}.")


def url_key(url: str) -> str:
    """A URL normalised for URL dedup: scheme and host lower-cased, default port and trailing '/' dropped."""
    if not url:
        return ""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return url.strip()
    host = (parts.hostname or "").lower()
    port = parts.port if parts.port not in (None, 80, 443) else None
    netloc = f"{host}:{port}" if port else host
    path = parts.path.rstrip("/") or ("" if not parts.query and not parts.fragment else "/")
    return urlunsplit((parts.scheme.lower(), netloc, path, parts.query, parts.fragment))


def content_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


# ---------------------------------------------------------------------------------------------- lines


@dataclass
class LineDedupConfig:
    """Line-level dedup across the corpus (Llama 3: lines seen more than 6 times per 30M documents go)."""

    enabled: bool = True  # remove lines that repeat across documents
    max_repeats: Annotated[int, Domain(1)] = 6  # a line seen in more documents than this is removed from every document
    min_line_chars: Annotated[int, Domain(0)] = 20  # shorter lines are never removed (code braces, short headings, list markers)

    def __post_init__(self) -> None:
        check_types(self, "clean.line_dedup")


def _line_hash(line: str) -> int:
    return int.from_bytes(hashlib.blake2b(line.encode(), digest_size=8).digest(), "little")


def line_keys(text: str, min_chars: int) -> set[int]:
    """Hashes of the distinct stripped lines of ``text`` with at least ``min_chars`` characters."""
    return {_line_hash(s) for s in (line.strip() for line in text.split("\n")) if len(s) >= min_chars}


class LineDeduper:
    """Removes the lines whose hashes are in ``over`` (counted in more than ``max_repeats`` documents by
    ``dedup_decisions``) from a text."""

    def __init__(self, cfg: LineDedupConfig, over: set[int]) -> None:
        self.cfg, self.over = cfg, over

    def apply(self, text: str) -> tuple[str, int, int]:
        """(text without over-repeated lines, lines removed, bytes removed)."""
        n, kept, removed, removed_bytes = self.cfg.min_line_chars, [], 0, 0
        for line in text.split("\n"):
            s = line.strip()
            if len(s) >= n and _line_hash(s) in self.over:
                removed += 1
                removed_bytes += len(line.encode()) + 1
            else:
                kept.append(line)
        return ("\n".join(kept).strip() if removed else text), removed, removed_bytes


# ---------------------------------------------------------------------------------------------- MinHash


# Punctuation becomes a word break (datatrove's MinHash also strips it): ASCII through a bytes table and the common
# typographic marks by bytes.replace, both in C (a str.translate dict or a regex costs 2-3x more per document).
_ASCII_PUNCT = bytes.maketrans(string.punctuation.encode(), b" " * len(string.punctuation))
_UNICODE_PUNCT = tuple(c.encode() for c in "“”‘’«»„…–—·•")
_ASCII_PUNCT_STR = str.maketrans(string.punctuation, " " * len(string.punctuation))


_NUMBERS = re.compile(r"\d+(?:\.\d+)?")


def normalise_datatrove(text: str) -> str:
    """Text as datatrove's ``simplify_text`` (its MinHash default) makes it: lower-cased, every number (digits,
    optionally a decimal part) replaced by 0, Unicode punctuation and symbols removed, accents stripped
    (NFD, combining marks dropped), whitespace collapsed to single spaces."""
    text = _NUMBERS.sub("0", text.lower())
    text = unicodedata.normalize("NFD", text)
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text
                   if not unicodedata.combining(c)) if not text.isascii() else text.translate(_ASCII_PUNCT_STR)
    return " ".join(text.split())


def words_of(text: str) -> list[bytes]:
    """Lower-cased words, punctuation removed, as UTF-8 bytes."""
    data = text.lower().encode().translate(_ASCII_PUNCT)
    if not text.isascii():
        for mark in _UNICODE_PUNCT:
            data = data.replace(mark, b" ")
    return data.split()


def shingles(text: str, n: int) -> list[bytes]:
    """Distinct n-word shingles of the lower-cased words (one shingle for shorter texts)."""
    words = words_of(text)
    return list({b" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))})


_FOLD = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier (golden ratio): its high 32 bits mix every input bit


def shingle_hashes(text: str, n: int) -> list[int]:
    """32-bit hashes of the n-word shingles of ``shingles(text, n)``, computed vectorised: crc32 per word (stable
    across processes), a polynomial rolling hash per n-gram, folded to 32 bits. Building and hashing a byte string
    per shingle in Python costs as much as datasketch's own update; this costs about half. Repeats are left in
    (a minimum is unchanged by them)."""
    words = words_of(text) or [b""]
    wh = np.fromiter(map(zlib.crc32, words), dtype=np.uint64, count=len(words))
    g = ngram_hashes(wh, min(n, len(wh)))  # (n_words - n + 1,) uint64
    return ((g * _FOLD) >> np.uint64(32)).tolist()


def _hashed_shingle_sets(texts: list[str], n: int) -> list[list[int]]:
    """``shingle_hashes`` for many texts at once: one vectorised pass over all their words (no n-gram crosses
    from one text into the next), so numpy's per-call cost is paid per batch, not per document."""
    words = [words_of(t) or [b""] for t in texts]
    lens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    flat = list(chain.from_iterable(words))
    wh = np.fromiter(map(zlib.crc32, flat), dtype=np.uint64, count=len(flat))
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    folded = (ngram_hashes(wh, n) * _FOLD) >> np.uint64(32) if len(wh) >= n else np.zeros(0, dtype=np.uint64)
    out = []
    for start, length in zip(starts.tolist(), lens.tolist()):
        if length >= n:
            out.append(folded[start : start + length - n + 1].tolist())
        else:  # shorter than one shingle: the whole text is the shingle
            out.append(((ngram_hashes(wh[start : start + length], length) * _FOLD) >> np.uint64(32)).tolist())
    return out


def signatures(texts: Iterable[str], cfg: MinHashConfig, batch: int = 512) -> list[np.ndarray]:
    """One (num_perm,) hash-value array per text, from ``MinHash.generator`` (datasketch's batch update), of the
    text as it is or, with ``cfg.normalise == "datatrove"``, of ``normalise_datatrove(text)``.

    The shingles arrive already hashed to 32 bits (``shingle_hashes``), so datasketch's per-item hash function
    is the identity (``operator.index``); its affine32 scheme re-mixes every input hash with the MurmurHash3
    finalizer before permuting, exactly as for crc32 of the shingle bytes.
    """
    texts = list(texts) if cfg.normalise == "none" else [normalise_datatrove(t) for t in texts]
    sets = chain.from_iterable(_hashed_shingle_sets(texts[i : i + batch], cfg.ngram)
                               for i in range(0, len(texts), batch))
    from datasketch import MinHash  # here, not at import: it loads scipy (0.8 s), which workers of other stages skip

    return [m.hashvalues for m in MinHash.generator(sets, num_perm=cfg.num_perm, seed=cfg.seed,
                                                     hashfunc=operator.index)]


# ---------------------------------------------------------------------------------------------- the passes


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


def dedup_keys(kept_path: str, offset: int, cfg: CleanSettings, partitions: int, sign: bool = False) -> list:
    """Map of pass A over one shard's kept.parquet (its first row at corpus position ``offset``): URL keys and
    content hashes, each as ``partitions`` dicts key -> positions, then the band keys as ``partitions``
    ``band_keys`` tuples; flat (3 * partitions values). ``sign``: compute the MinHash signatures from the text here
    instead of reading the ``minhash`` column."""
    cols = ["url", "text"] + (["minhash"] if cfg.minhash.enabled and not sign else [])
    t = pq.read_table(kept_path, columns=cols)
    out: list[list[dict[bytes, list[int]]]] = [[{} for _ in range(partitions)] for _ in range(2)]
    urls, texts = t.column("url").to_pylist(), t.column("text").to_pylist()
    for pos, (url, text) in enumerate(zip(urls, texts), offset):
        if cfg.url_dedup and url[:8].lower().startswith(("http://", "https://")):
            key = url_key(url).encode()
            out[0][_part(key, partitions)].setdefault(key, []).append(pos)
        if cfg.exact_dedup:
            key = content_hash(text)
            out[1][_part(key, partitions)].setdefault(key, []).append(pos)
    mh, n = cfg.minhash, len(texts)
    if not mh.enabled:
        sigs = np.zeros((0, mh.num_perm), np.uint32)
    elif sign:
        sigs = np.array(signatures(texts, mh), dtype=np.uint32).reshape(n, mh.num_perm)
    else:
        sigs = np.frombuffer(b"".join(t.column("minhash").to_pylist()), np.uint32).reshape(n, mh.num_perm)
    return [d for kind in out for d in kind] + band_keys(sigs, offset, mh.bands, mh.rows, partitions)


def band_keys(sigs: np.ndarray, offset: int, bands: int, rows: int, partitions: int) -> list[tuple]:
    """The (n, bands * rows) signatures of the documents at positions ``offset``... as their band keys, split by
    bucket into ``partitions`` tuples (positions, band numbers, (m, rows) band values); a band's first value picks
    the partition, so all members of a bucket meet in one reduce."""
    n = len(sigs)
    values = sigs.reshape(n, bands, rows)
    band = np.broadcast_to(np.arange(bands, dtype=np.int64), (n, bands))
    pos = np.broadcast_to(np.arange(offset, offset + n, dtype=np.int64)[:, None], (n, bands))
    part = (values[:, :, 0].astype(np.int64) + band) % partitions
    return [(pos[sel], band[sel], values[sel]) for sel in (part == p for p in range(partitions))]


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


def reduce_buckets(parts: list[tuple], dropped: set[int]) -> list[list[int]]:
    """Reduce of one partition of band keys (``band_keys`` tuples, one per shard): the sorted members of every
    bucket (a band number and its values, compared whole) with two or more; documents in ``dropped`` take no part."""
    pos = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
    band = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
    values = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0, 1), np.uint32)
    if dropped and len(pos):
        live = ~np.isin(pos, np.fromiter(dropped, np.int64, len(dropped)))
        pos, band, values = pos[live], band[live], values[live]
    if not len(pos):
        return []
    keys = np.ascontiguousarray(np.concatenate([band[:, None].astype(np.uint32), values], axis=1))
    _, bucket, counts = np.unique(keys.view(np.dtype((np.void, keys.shape[1] * 4))).ravel(), return_inverse=True,
                                  return_counts=True)
    multi = counts[bucket] > 1
    bucket, pos = bucket[multi], pos[multi]
    order = np.lexsort((pos, bucket))
    bucket, pos = bucket[order], pos[order]
    cuts = np.flatnonzero(np.diff(bucket)) + 1
    return [b.tolist() for b in np.split(pos, cuts)] if len(pos) else []


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
    """The first-kept rule inside one component, in corpus order: position -> the earliest kept document it shares
    a bucket with, for each one dropped. ``buckets`` are those whose members lie in the component."""
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
    n = cfg.line_dedup.min_line_chars
    out: list[list[int]] = [[] for _ in range(partitions)]
    for i, text in enumerate(texts):
        if offset + i not in dropped:
            for h in line_keys(text, n):
                out[h % partitions].append(h)
    return [np.asarray(x, dtype=np.uint64) for x in out]


def reduce_lines(parts: list[np.ndarray], max_repeats: int) -> np.ndarray:
    """Reduce of one line partition: the hashes counted in more than ``max_repeats`` documents."""
    values, counts = np.unique(np.concatenate(parts) if parts else np.zeros(0, np.uint64), return_counts=True)
    return values[counts > max_repeats]


@dataclass
class Decisions:
    """What the passes decided: position -> prior position per rule, and the over-repeated lines' hashes."""

    url: dict[int, int] = field(default_factory=dict)
    exact: dict[int, int] = field(default_factory=dict)
    near: dict[int, int] = field(default_factory=dict)
    over_lines: set[int] = field(default_factory=set)


def _reduce(fmap: Map, fn: Callable, keyed: list[list], which: int, extra: Any, partitions: int, label: str):
    jobs = [([k[which * partitions + p] for k in keyed], extra) for p in range(partitions)]
    return fmap(fn, jobs, label=label)


def dedup_decisions(results: list[dict[str, Any]], cfg: CleanSettings, fmap: Map, partitions: int = 4,
                    sign: bool = False) -> Decisions:
    """The passes over ``clean_shard`` results (sorted by shard index here): map keys, reduce URL, then exact, then
    band buckets, resolve near-duplicates, then count lines; each map or reduce runs through ``fmap`` (``partitions``
    reduces each; the result does not depend on it).
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
