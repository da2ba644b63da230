"""Step 1b "clean": HTML extraction, Gopher/C4-style quality filters, exact and MinHash near-dedup.

Run `clean(Path("raw.parquet"), Path("clean.parquet"), Path("removed.parquet"), CleanConfig())` (Dagster wraps it).
"""

from __future__ import annotations

import dataclasses
import re
import time
import unicodedata
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import MinHash, MinHashLSH

from kiln.config import ConfigError, from_dict
from kiln.extract import extract_and_title
from kiln.storage import atomic_path, sha256_bytes

INPUT_COLUMNS = ["id", "source", "url", "text", "content_type", "bytes", "license"]
CONTENT_TYPES = ("text/html", "text/plain")


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,)}


def _check_types(cfg: Any, where: str) -> None:
    """ConfigError naming the key when a scalar field has the wrong type (e.g. a quoted number in YAML)."""
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), _TYPES.get(str(f.type))
        if allowed and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            raise ConfigError(f"{where}.{f.name} must be {f.type}, got {value!r}.")


@dataclass
class MinHashConfig:
    enabled: bool = True  # drop near-duplicates (FineWeb: 5-gram word shingles, 14 bands x 8 rows, Jaccard ~0.75)
    ngram: int = 5  # words per shingle
    num_perm: int = 112  # hash permutations per signature; must equal bands * rows
    bands: int = 14  # LSH bands: documents that agree on any whole band are near-duplicates
    rows: int = 8  # hashes per band
    seed: int = 1  # permutation seed, fixed so reruns drop the same documents

    def __post_init__(self) -> None:
        _check_types(self, "clean.minhash")
        if self.num_perm != self.bands * self.rows:
            raise ConfigError(
                f"clean.minhash: num_perm={self.num_perm} must equal bands * rows = "
                f"{self.bands} * {self.rows} = {self.bands * self.rows}; change num_perm, bands or rows."
            )
        if self.ngram < 1:
            raise ConfigError(f"clean.minhash.ngram must be >= 1, got {self.ngram}.")


@dataclass
class CleanConfig:
    # Gopher (Rae et al. 2021) and C4 quality rules; a document failing any one is dropped.
    min_words: int = 50  # fewer whitespace-separated words than this: too short to be prose
    max_words: int = 100_000  # more words than this: dumps, logs, concatenated pages
    min_mean_word_length: float = 3.0  # mean word length (punctuation stripped) below this: lists of tokens
    max_mean_word_length: float = 10.0  # ... above this: URLs, hashes, base64
    max_symbol_to_word_ratio: float = 0.1  # max of '#' count and '...'/'…' count, per word
    min_alpha_word_fraction: float = 0.8  # share of words with at least one letter
    max_duplicate_line_fraction: float = 0.3  # share of non-empty lines that repeat an earlier line
    max_bullet_lines_fraction: float = 0.9  # share of lines starting with a bullet (•, -, *, ...)
    max_ellipsis_lines_fraction: float = 0.3  # share of lines ending in '...' or '…' (truncated teasers)
    exact_dedup: bool = True  # drop documents whose clean text is identical to an earlier kept one
    minhash: MinHashConfig = field(default_factory=MinHashConfig)  # near-duplicate removal
    batch_size: int = 1024  # documents read from Parquet per batch
    progress_every: int = 2000  # call the progress callback about every this many documents
    examples_per_reason: int = 3  # snippets kept per drop reason in the report

    def __post_init__(self) -> None:
        if isinstance(self.minhash, dict):
            self.minhash = from_dict(MinHashConfig, self.minhash, "clean.minhash")
        _check_types(self, "clean")
        if self.min_words > self.max_words:
            raise ConfigError(f"clean: min_words={self.min_words} exceeds max_words={self.max_words}.")
        if self.min_mean_word_length > self.max_mean_word_length:
            raise ConfigError("clean: min_mean_word_length exceeds max_mean_word_length.")
        if self.batch_size < 1 or self.progress_every < 1:
            raise ConfigError("clean: batch_size and progress_every must be >= 1.")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, where: str = "clean") -> CleanConfig:
        """Strict build: unknown keys raise ConfigError naming the key."""
        return from_dict(cls, data, where)


# ---------------------------------------------------------------- documents and signals


@dataclass
class Doc:
    id: str
    source: str
    url: str
    text: str  # clean text once extracted and normalised
    content_type: str
    license: str
    input_bytes: int  # size of the raw record, for the byte accounting
    title: str = ""
    signals: dict[str, float] = field(default_factory=dict)


_LINE_BREAKS = {"\x85": "\n", "\u2028": "\n", "\u2029": "\n"}
_SPACES = {chr(c): " " for c in (0x0B, 0x0C, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000)}
_DROPPED = {chr(c): "" for c in (*range(0, 9), *range(14, 32), 0x7F, 0x200B, 0xFEFF)}
_REPLACE = {**_LINE_BREAKS, **_SPACES, **_DROPPED}
_ODD_CHARS = re.compile("[" + "".join(re.escape(c) for c in _REPLACE) + "]")  # a regex: fast when none occur
_BLANK_RUNS = re.compile(r"\n{3,}")
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~«»“”‘’„…–—·•"
_LETTER = re.compile(r"[^\W\d_]")
_WORD = re.compile(r"\w+")
BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "·", "▪", "●", "○", "■", "□", "➢", "►")


def normalize_text(text: str) -> str:
    """NFC; unify line breaks and odd spaces; drop control and zero-width chars; trim lines; <=1 blank line.

    Indentation is kept so code blocks survive.
    """
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _ODD_CHARS.sub(lambda m: _REPLACE[m.group()], text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


def text_signals(text: str) -> dict[str, float]:
    """The quality signals the filters read; also written as columns of the kept Parquet."""
    words = text.split()
    n = len(words)
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    n_lines = max(len(lines), 1)
    bare = [w.strip(_PUNCT) for w in words]
    bare = [w for w in bare if w]
    ellipses = text.count("...") + text.count("…")
    return {
        "words": n,
        "mean_word_length": sum(map(len, bare)) / len(bare) if bare else 0.0,
        "symbol_ratio": max(text.count("#"), ellipses) / n if n else 0.0,
        "alpha_word_fraction": sum(1 for w in words if _LETTER.search(w)) / n if n else 0.0,
        "duplicate_line_fraction": (len(lines) - len(set(lines))) / n_lines,
        "bullet_lines_fraction": sum(line.startswith(BULLETS) for line in lines) / n_lines,
        "ellipsis_lines_fraction": sum(line.endswith(("...", "…")) for line in lines) / n_lines,
    }


SIGNAL_TYPES = {"words": pa.int64()} | {
    k: pa.float64()
    for k in (
        "mean_word_length",
        "symbol_ratio",
        "alpha_word_fraction",
        "duplicate_line_fraction",
        "bullet_lines_fraction",
        "ellipsis_lines_fraction",
    )
}
KEPT_SCHEMA = pa.schema(
    [(c, pa.string()) for c in ("id", "source", "url", "text", "content_type")]
    + [("bytes", pa.int64()), ("license", pa.string()), ("title", pa.string())]
    + list(SIGNAL_TYPES.items())
)
REMOVED_SCHEMA = pa.schema(
    [(c, pa.string()) for c in ("id", "source", "url", "reason")]
    + [("bytes", pa.int64()), ("detail", pa.string()), ("duplicate_of", pa.string())]
)


# ---------------------------------------------------------------- filters


class Filter:
    """One quality rule, datatrove-style: `reason` returns None to keep a document, else a short drop reason.

    The runner counts drops per reason and keeps example snippets, so a filter only decides.
    """

    name: str = "filter"

    def reason(self, doc: Doc) -> str | None:
        raise NotImplementedError

    def detail(self, doc: Doc) -> str:
        """Why, in a few words, for removed.parquet."""
        return ""


class Threshold(Filter):
    """Drop when a signal is below a `min_*` config value or above a `max_*` one."""

    def __init__(self, name: str, signal: str, key: str, limit: float) -> None:
        self.name, self.signal, self.key, self.limit = name, signal, key, limit
        self.is_min = key.startswith("min_")

    def reason(self, doc: Doc) -> str | None:
        value = doc.signals[self.signal]
        return self.name if (value < self.limit if self.is_min else value > self.limit) else None

    def detail(self, doc: Doc) -> str:
        op = "<" if self.is_min else ">"
        return f"{self.signal}={doc.signals[self.signal]:.4g} {op} {self.key}={self.limit}"


# reason -> (config key, signal); read by default_filters and by EmptyCorpusError to name the key to loosen.
RULES: dict[str, tuple[str | None, str | None]] = {
    "extract:empty": (None, None),
    "gopher:too_few_words": ("min_words", "words"),
    "gopher:too_many_words": ("max_words", "words"),
    "gopher:short_mean_word_length": ("min_mean_word_length", "mean_word_length"),
    "gopher:long_mean_word_length": ("max_mean_word_length", "mean_word_length"),
    "gopher:symbol_to_word_ratio": ("max_symbol_to_word_ratio", "symbol_ratio"),
    "gopher:few_alpha_words": ("min_alpha_word_fraction", "alpha_word_fraction"),
    "gopher:duplicate_lines": ("max_duplicate_line_fraction", "duplicate_line_fraction"),
    "gopher:bullet_lines": ("max_bullet_lines_fraction", "bullet_lines_fraction"),
    "c4:ellipsis_lines": ("max_ellipsis_lines_fraction", "ellipsis_lines_fraction"),
    "dedup:exact": ("exact_dedup", None),
    "dedup:minhash": ("minhash.enabled", None),
}


def default_filters(cfg: CleanConfig) -> list[Filter]:
    """The quality rules of RULES that read a signal, in table order, with limits from ``cfg``."""
    return [
        Threshold(reason, signal, key, getattr(cfg, key))
        for reason, (key, signal) in RULES.items()
        if key and signal
    ]


# ---------------------------------------------------------------- dedup


class Deduper:
    """Exact (sha256 of clean text) then MinHash-LSH near-dedup; the first document of a cluster is kept."""

    def __init__(self, cfg: CleanConfig) -> None:
        self.cfg, self.mh = cfg, cfg.minhash
        self.hashes: dict[str, str] = {}  # text sha256 -> id of the kept document
        self.kept_ids: list[str] = []  # LSH key (int) -> id
        self.lsh = MinHashLSH(num_perm=self.mh.num_perm, params=(self.mh.bands, self.mh.rows))

    def shingles(self, text: str) -> list[bytes]:
        words = _WORD.findall(text.lower())
        n = self.mh.ngram
        return list({" ".join(words[i : i + n]).encode() for i in range(max(1, len(words) - n + 1))})

    def check(self, docs: list[Doc]) -> list[tuple[str, str] | None]:
        """For each doc, in order: None (kept and remembered) or (reason, id it duplicates)."""
        sigs: list[MinHash | None] = [None] * len(docs)
        if self.mh.enabled and docs:
            # crc32 (C, ~6x faster than datasketch's default sha1) is enough: datasketch's affine32
            # scheme re-mixes every input hash with the MurmurHash3 finalizer before permuting.
            shingles = (self.shingles(d.text) for d in docs)
            sigs = MinHash.bulk(shingles, num_perm=self.mh.num_perm, seed=self.mh.seed, hashfunc=zlib.crc32)
        out: list[tuple[str, str] | None] = []
        for doc, sig in zip(docs, sigs):
            digest = sha256_bytes(doc.text.encode()) if self.cfg.exact_dedup else ""
            if digest in self.hashes:
                out.append(("dedup:exact", self.hashes[digest]))
                continue
            if sig is not None:
                hits = self.lsh.query(sig)  # query before insert: the earlier document wins
                if hits:
                    out.append(("dedup:minhash", self.kept_ids[min(hits)]))
                    continue
                self.lsh.insert(len(self.kept_ids), sig, check_duplication=False)
                self.kept_ids.append(doc.id)
            if digest:
                self.hashes[digest] = doc.id
            out.append(None)
        return out


# ---------------------------------------------------------------- report


@dataclass
class CleanReport:
    input_docs: int = 0
    input_bytes: int = 0  # sum of the input `bytes` column
    kept_docs: int = 0
    kept_bytes: int = 0  # UTF-8 bytes of the clean text kept
    kept_input_bytes: int = 0  # input bytes of kept docs: kept_input_bytes + dropped_bytes == input_bytes
    dropped_docs: int = 0
    dropped_bytes: int = 0  # input bytes of dropped docs
    reasons: dict[str, dict[str, Any]] = field(default_factory=dict)  # reason -> {docs, bytes, examples}
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> kept/dropped docs and bytes
    dedup_rate: float = 0.0  # share of quality-passing docs dropped as exact or near duplicates
    seconds: float = 0.0
    docs_per_s: float = 0.0
    mb_per_s: float = 0.0  # input MB per second
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _source(self, source: str) -> dict[str, int]:
        return self.sources.setdefault(
            source, {"kept_docs": 0, "kept_bytes": 0, "dropped_docs": 0, "dropped_bytes": 0}
        )

    def keep(self, doc: Doc, clean_bytes: int) -> None:
        self.kept_docs += 1
        self.kept_bytes += clean_bytes
        self.kept_input_bytes += doc.input_bytes
        src = self._source(doc.source)
        src["kept_docs"] += 1
        src["kept_bytes"] += clean_bytes

    def drop(self, doc: Doc, reason: str, snippet_of: str, max_examples: int) -> None:
        self.dropped_docs += 1
        self.dropped_bytes += doc.input_bytes
        r = self.reasons.setdefault(reason, {"docs": 0, "bytes": 0, "examples": []})
        r["docs"] += 1
        r["bytes"] += doc.input_bytes
        if len(r["examples"]) < max_examples:
            r["examples"].append({"id": doc.id, "snippet": " ".join(snippet_of.split())[:200]})
        src = self._source(doc.source)
        src["dropped_docs"] += 1
        src["dropped_bytes"] += doc.input_bytes


class EmptyCorpusError(RuntimeError):
    """No document survived cleaning; the message says which rule removed the most and what to change."""

    def __init__(self, report: CleanReport, in_path: Path) -> None:
        self.report = report
        counts = ", ".join(f"{r}={v['docs']}" for r, v in report.reasons.items()) or "none (the input is empty)"
        msg = f"clean: kept 0 of {report.input_docs} documents from {in_path}. Dropped per reason: {counts}."
        if report.reasons:
            top = next(iter(report.reasons))
            key = RULES.get(top, (None, None))[0]
            if key:
                msg += f" Most drops come from '{top}' (config key clean.{key}): loosen clean.{key} or add sources."
            else:
                msg += f" Most drops come from '{top}', which no config key controls: add sources with real text."
        else:
            msg += " Add sources to the raw corpus."
        super().__init__(msg)


# ---------------------------------------------------------------- pipeline

Progress = Callable[[str], None]  # gets a one-line message; a logger's .info fits


def _open(in_path: Path) -> pq.ParquetFile:
    pf = pq.ParquetFile(in_path)
    missing = [c for c in INPUT_COLUMNS if c not in pf.schema_arrow.names]
    if missing:
        raise ValueError(
            f"{in_path}: missing column(s) {missing}; a raw corpus needs {INPUT_COLUMNS} "
            f"(has {pf.schema_arrow.names})."
        )
    return pf


def _to_doc(row: dict[str, Any], row_no: int, in_path: Path) -> Doc:
    doc_id = row["id"]
    if doc_id is None:
        raise ValueError(f"{in_path}: row {row_no} has no id; every raw document needs one.")
    ctype = row["content_type"]
    if ctype not in CONTENT_TYPES:
        raise ValueError(f"{in_path}: record id={doc_id!r}: content_type {ctype!r} is not one of {CONTENT_TYPES}.")
    text = row["text"] or ""
    size = row["bytes"] if row["bytes"] is not None else len(text.encode())
    return Doc(doc_id, row["source"] or "", row["url"] or "", text, ctype, row["license"] or "", size)


def _extract(doc: Doc) -> str:
    """(a) Replace the raw text by clean text (HTML main text), compute signals; return the raw text."""
    raw = doc.text
    if doc.content_type == "text/html":
        doc.text, doc.title = extract_and_title(raw)
    doc.text = normalize_text(doc.text)
    doc.signals = text_signals(doc.text)
    return raw


Verdict = tuple[str, str, "str | None"]  # (reason, detail, duplicate_of); None in its place means kept


def _judge(docs: list[Doc], filters: list[Filter], dedup: Deduper) -> tuple[list[Verdict | None], int]:
    """(b) quality filters, then (c) exact and (d) near dedup over the survivors; input order throughout.

    Returns one verdict per doc and how many docs passed the quality filters.
    """
    verdicts: list[Verdict | None] = []
    for doc in docs:
        verdict = None
        if not doc.text:
            verdict = ("extract:empty", f"{doc.content_type} of {doc.input_bytes} bytes has no main text", None)
        for f in filters if verdict is None else ():
            reason = f.reason(doc)
            if reason:
                verdict = (reason, f.detail(doc), None)
                break
        verdicts.append(verdict)
    survivors = [i for i, v in enumerate(verdicts) if v is None]
    for i, dup in zip(survivors, dedup.check([docs[i] for i in survivors])):
        if dup:
            verdicts[i] = (dup[0], f"duplicate of {dup[1]}", dup[1])
    return verdicts, len(survivors)


def _kept_row(doc: Doc, clean_bytes: int) -> dict[str, Any]:
    return {"id": doc.id, "source": doc.source, "url": doc.url, "text": doc.text, "content_type": doc.content_type,
            "bytes": clean_bytes, "license": doc.license, "title": doc.title, **doc.signals}


def _removed_row(doc: Doc, verdict: Verdict) -> dict[str, Any]:
    reason, detail, duplicate_of = verdict
    return {"id": doc.id, "source": doc.source, "url": doc.url, "reason": reason, "bytes": doc.input_bytes,
            "detail": detail, "duplicate_of": duplicate_of}


def clean(
    in_path: str | Path,
    out_path: str | Path,
    removed_path: str | Path,
    cfg: CleanConfig | None = None,
    progress: Progress | None = None,
    filters: list[Filter] | None = None,
) -> CleanReport:
    """Stream ``in_path`` through extraction, ``filters`` (default: the RULES table) and dedup.

    Writes kept docs (input order, clean text, signal columns) to ``out_path`` and dropped ones
    (id, source, url, reason, bytes, detail, duplicate_of) to ``removed_path``, both atomically.
    Raises EmptyCorpusError, writing neither file, when no document is kept.
    """
    in_path, cfg = Path(in_path), cfg or CleanConfig()
    filters = default_filters(cfg) if filters is None else filters
    report, dedup = CleanReport(config=dataclasses.asdict(cfg)), Deduper(cfg)
    t0, next_progress, quality_passed = time.perf_counter(), cfg.progress_every, 0

    def tick(final: bool = False) -> None:
        dt = max(time.perf_counter() - t0, 1e-9)
        report.seconds = round(dt, 3)
        report.docs_per_s = round(report.input_docs / dt, 1)
        report.mb_per_s = round(report.input_bytes / dt / 1e6, 3)
        if progress is not None:
            progress(f"clean: {'done, ' if final else ''}{report.input_docs} docs read, {report.kept_docs} kept, "
                     f"{report.docs_per_s:.0f} docs/s, {report.mb_per_s:.2f} MB/s")

    with _open(in_path) as pf, atomic_path(out_path) as kept_tmp, atomic_path(removed_path) as removed_tmp:
        with pq.ParquetWriter(kept_tmp, KEPT_SCHEMA) as kept_w, pq.ParquetWriter(removed_tmp, REMOVED_SCHEMA) as rm_w:
            for batch in pf.iter_batches(batch_size=cfg.batch_size, columns=INPUT_COLUMNS):
                docs = [_to_doc(row, report.input_docs + i, in_path) for i, row in enumerate(batch.to_pylist())]
                raw = [_extract(doc) for doc in docs]
                verdicts, passed = _judge(docs, filters, dedup)
                quality_passed += passed
                kept, removed = [], []
                for doc, raw_text, verdict in zip(docs, raw, verdicts):
                    report.input_docs += 1
                    report.input_bytes += doc.input_bytes
                    if verdict is None:
                        clean_bytes = len(doc.text.encode())
                        report.keep(doc, clean_bytes)
                        kept.append(_kept_row(doc, clean_bytes))
                    else:
                        report.drop(doc, verdict[0], doc.text or raw_text, cfg.examples_per_reason)
                        removed.append(_removed_row(doc, verdict))
                    if report.input_docs >= next_progress:
                        next_progress += cfg.progress_every
                        tick()
                kept_w.write_table(pa.Table.from_pylist(kept, schema=KEPT_SCHEMA))
                rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))

        report.reasons = dict(sorted(report.reasons.items(), key=lambda kv: (-kv[1]["docs"], kv[0])))
        dups = sum(report.reasons.get(r, {"docs": 0})["docs"] for r in ("dedup:exact", "dedup:minhash"))
        report.dedup_rate = round(dups / quality_passed, 4) if quality_passed else 0.0
        tick(final=True)
        if report.kept_docs == 0:
            raise EmptyCorpusError(report, in_path)
    return report
