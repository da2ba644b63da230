"""Deduplication: URL, exact content hash, line-level across the corpus, and MinHash-LSH near-duplicates with
datasketch, its index in memory or on a Redis server (datasketch's Redis storage).

Used by kiln.clean.corpus; the first document of a cluster (in input order) is kept. Try the near-dup index alone:
``python -c "from kiln.clean.dedup import *; d = MinHashDeduper(MinHashConfig()); print(d.check(['a', 'b'], d.signatures(['x y z'] * 2)))"``.
"""

from __future__ import annotations

import hashlib
import operator
import re
import string
import unicodedata
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterable
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kiln.common.config import ConfigError, check_types
from kiln.common.text import ngram_hashes

BACKENDS = ("memory", "redis")
NORMALISE = ("none", "datatrove")  # text normalisation before shingling (see normalise_datatrove)


@dataclass
class MinHashConfig:
    enabled: bool = True  # drop near-duplicates (FineWeb: 5-gram word shingles, 14 bands x 8 rows, Jaccard ~0.75)
    ngram: int = 5  # words per shingle
    num_perm: int = 112  # hash permutations per signature; must equal bands * rows
    bands: int = 14  # LSH bands: documents that agree on any whole band are near-duplicates
    rows: int = 8  # hashes per band
    seed: int = 1  # permutation seed, fixed so reruns drop the same documents
    backend: str = "memory"  # where the LSH index lives: "memory" or "redis" (datasketch's Redis storage)
    redis_host: str = "127.0.0.1"  # Redis server host (backend redis)
    redis_port: int = 6379  # Redis server port (backend redis)
    redis_db: int = 0  # Redis database number (backend redis)
    redis_basename: str = ""  # key prefix of the index in Redis; empty: a fresh one per run, deleted afterwards
    keep_index: bool = False  # backend redis: leave the index in Redis after the run (to dedup later runs against it)
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
        if self.backend not in BACKENDS:
            raise ConfigError(f"clean.minhash.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}.")


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


class FirstSeen:
    """Remembers the first document id per key (content hash, URL); answers with it for later documents."""

    def __init__(self) -> None:
        self.first: dict[bytes | str, str] = {}

    def check(self, key: bytes | str, doc_id: str) -> str | None:
        """The id this key was first seen with, or None (and the key is remembered for ``doc_id``)."""
        prior = self.first.get(key)
        if prior is None:
            self.first[key] = doc_id
        return prior


def content_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


# ---------------------------------------------------------------------------------------------- lines


@dataclass
class LineDedupConfig:
    """Line-level dedup across the corpus (Llama 3: lines seen more than 6 times per 30M documents go)."""

    enabled: bool = True  # remove lines that repeat across documents
    max_repeats: int = 6  # a line seen in more documents than this is removed from every document
    min_line_chars: int = 20  # shorter lines are never removed (code braces, short headings, list markers)

    def __post_init__(self) -> None:
        check_types(self, "clean.line_dedup")


def _line_hash(line: str) -> int:
    return int.from_bytes(hashlib.blake2b(line.encode(), digest_size=8).digest(), "little")


class LineDeduper:
    """Two passes: ``count`` every document's distinct lines, then ``apply`` drops lines counted too often."""

    def __init__(self, cfg: LineDedupConfig) -> None:
        self.cfg = cfg
        self.counts: Counter[int] = Counter()

    def _keys(self, text: str) -> set[int]:
        n = self.cfg.min_line_chars
        return {_line_hash(s) for s in (line.strip() for line in text.split("\n")) if len(s) >= n}

    def count(self, text: str) -> None:
        self.counts.update(self._keys(text))

    def apply(self, text: str) -> tuple[str, int, int]:
        """(text without over-repeated lines, lines removed, bytes removed)."""
        limit, n = self.cfg.max_repeats, self.cfg.min_line_chars
        kept, removed, removed_bytes = [], 0, 0
        for line in text.split("\n"):
            s = line.strip()
            if len(s) >= n and self.counts[_line_hash(s)] > limit:
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


class MinHashDeduper:
    """Signatures with ``MinHash.bulk`` and an LSH index (``MinHashLSH``) in memory or in Redis.

    ``check`` queries before it inserts, so the earlier document of a pair is kept; index keys are
    (position, id) tuples so the earliest match is reported whichever backend answers.
    """

    def __init__(self, cfg: MinHashConfig) -> None:
        from datasketch import MinHash, MinHashLSH

        self.cfg = cfg
        self.position = 0
        self.basename = cfg.redis_basename or f"kiln-minhash-{uuid.uuid4().hex[:12]}"
        storage: dict[str, Any] = {"type": "dict"}
        if cfg.backend == "redis":
            storage = {"type": "redis", "basename": self.basename.encode(),
                       "redis": {"host": cfg.redis_host, "port": cfg.redis_port, "db": cfg.redis_db}}
            self._check_redis()
        self.lsh = MinHashLSH(num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows), storage_config=storage)
        self.scheme = MinHash(num_perm=2, seed=cfg.seed, hashfunc=operator.index).scheme

    def _check_redis(self) -> None:
        import redis

        cfg = self.cfg
        try:
            redis.Redis(host=cfg.redis_host, port=cfg.redis_port, db=cfg.redis_db, socket_connect_timeout=5).ping()
        except redis.RedisError as e:
            raise ConfigError(
                f"clean.minhash: backend redis, but no Redis server answers at {cfg.redis_host}:{cfg.redis_port} "
                f"({e}). Start one (redis-server --port {cfg.redis_port}) or set clean.minhash.backend: memory."
            ) from None

    def signatures(self, texts: Iterable[str]) -> list[np.ndarray]:
        return signatures(texts, self.cfg)

    def check(self, ids: list[str], sigs: list[np.ndarray]) -> list[str | None]:
        """For each document in order: None (kept and indexed) or the id of the earlier document it duplicates."""
        from datasketch import LeanMinHash

        out: list[str | None] = []
        for doc_id, values in zip(ids, sigs):
            m = LeanMinHash(seed=self.cfg.seed, hashvalues=values, scheme=self.scheme)
            hits = self.lsh.query(m)
            if hits:
                out.append(min(hits)[1])
                continue
            self.lsh.insert((self.position, doc_id), m, check_duplication=False)
            self.position += 1
            out.append(None)
        return out

    def close(self) -> None:
        """Delete the Redis index unless it is named and kept (``keep_index``)."""
        if self.cfg.backend == "redis" and not (self.cfg.redis_basename and self.cfg.keep_index):
            import redis

            r = redis.Redis(host=self.cfg.redis_host, port=self.cfg.redis_port, db=self.cfg.redis_db)
            keys = list(r.scan_iter(match=self.basename.encode() + b"*", count=1000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i : i + 1000])
