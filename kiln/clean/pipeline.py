"""Step 1b "clean": extraction, Unicode repair, language ID, quality rules, PII scrubbing, URL/exact/line/MinHash
dedup, a corpus-trained quality classifier, token-distribution outliers and source mixing, with a report of what
each rule removed.

Run ``clean("raw.parquet", "clean.parquet", "removed.parquet", CleanConfig())``; Dagster runs the per-document
stage (``clean_shard``) once per shard in parallel and then ``merge_shards``, which is what ``clean`` calls too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import tempfile
import time
import unicodedata
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.common.config import ConfigError, from_dict
from kiln.clean.dedup import (
    FirstSeen,
    LineDedupConfig,
    LineDeduper,
    MinHashConfig,
    MinHashDeduper,
    content_hash,
    signatures,
    url_key,
)
from kiln.clean.extract import extract_and_title
from kiln.filters.base import (
    C4Config,
    C4Filter,
    C4LineCleaner,
    Doc,
    DirtyWordsConfig,
    DirtyWordsFilter,
    FineWebConfig,
    FineWebFilter,
    Filter,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    LanguageConfig,
    LanguageFilter,
    Olmo2Config,
    Olmo2Filter,
    RepetitionConfig,
    ThresholdFilter,
    UrlFilter,
    UrlFilterConfig,
    check_types,
    matches_any,
    text_signals,
)
from kiln.clean.mixing import MixConfig, keep_sample, plan_mix
from kiln.clean.pii import PiiConfig, PiiScrubber
from kiln.clean.quality import QualityModelConfig, Reservoir, TokenDistribution, TokenOutlierConfig, mad_limit, train_classifier
from kiln.common.files import atomic_path, atomic_write_json, stable_hash

__all__ = ["CleanConfig", "CleanReport", "Doc", "EmptyCorpusError", "Filter", "MinHashConfig", "clean",
           "clean_shard", "default_filters", "merge_shards", "normalize_text", "plan_shards", "text_signals"]

INPUT_COLUMNS = ["id", "source", "url", "text", "content_type", "bytes", "license"]
CONTENT_TYPES = ("text/html", "text/plain")
CODE_VERSION = "2"  # bump when a change alters what the per-document stage writes (invalidates shard caches)


@dataclass
class CleanConfig(GopherQualityConfig):
    # The Gopher quality keys (min_words, max_words, ...) are inherited and sit at the top level.
    fix_unicode: bool = True  # repair mojibake and odd Unicode with ftfy before anything else
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)  # Gopher repetition rules
    language: LanguageConfig = field(default_factory=LanguageConfig)  # language identification
    c4: C4Config = field(default_factory=C4Config)  # C4 line and page rules
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)  # FineWeb's own rules
    olmo2: Olmo2Config = field(default_factory=Olmo2Config)  # OLMo 2's repetition rules
    dirty_words: DirtyWordsConfig = field(default_factory=DirtyWordsConfig)  # obscene-word ratio
    urls: UrlFilterConfig = field(default_factory=UrlFilterConfig)  # URL and domain blocklist
    exempt: dict[str, list[str]] = field(default_factory=dict)  # source glob -> globs of rules not applied to it
    pii: PiiConfig = field(default_factory=PiiConfig)  # e-mail, IP and phone placeholders
    url_dedup: bool = True  # drop documents whose normalised http(s) URL an earlier kept document had
    exact_dedup: bool = True  # drop documents whose clean text is identical to an earlier kept one
    minhash: MinHashConfig = field(default_factory=MinHashConfig)  # near-duplicate removal
    line_dedup: LineDedupConfig = field(default_factory=LineDedupConfig)  # lines repeated across the corpus
    token_outliers: TokenOutlierConfig = field(default_factory=TokenOutlierConfig)  # token-distribution outliers
    quality_model: QualityModelConfig = field(default_factory=QualityModelConfig)  # corpus-trained classifier
    mix: MixConfig = field(default_factory=MixConfig)  # target shares per group of sources
    shard_docs: int = 4000  # documents per shard of the per-document stage (the unit run in parallel and cached)
    workers: int = 1  # processes for the per-document stage when called as a library (Dagster fans out itself)
    batch_size: int = 1024  # documents read from Parquet per batch
    progress_every: int = 2000  # call the progress callback about every this many documents
    examples_per_reason: int = 3  # removed documents sampled per reason for the report (a few lines each)

    def __post_init__(self) -> None:
        nested = {f.name: f.default_factory for f in dataclasses.fields(self)
                  if dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING}
        for name, cls in nested.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, from_dict(cls, value, f"clean.{name}"))
            elif not isinstance(value, cls):
                raise ConfigError(f"clean.{name} must be a mapping of {cls.__name__} fields, got {value!r}.")
            check_types(getattr(self, name), f"clean.{name}")
        check_types(self, "clean")
        if not isinstance(self.exempt, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
                for k, v in self.exempt.items()):
            raise ConfigError(f"clean.exempt must map a source glob to a list of rule globs, got {self.exempt!r}.")
        if self.min_words > self.max_words:
            raise ConfigError(f"clean.min_words={self.min_words} exceeds clean.max_words={self.max_words}: lower "
                              f"clean.min_words or raise clean.max_words.")
        if self.min_mean_word_length > self.max_mean_word_length:
            raise ConfigError("clean: min_mean_word_length exceeds max_mean_word_length.")
        if min(self.batch_size, self.progress_every, self.shard_docs, self.workers) < 1:
            raise ConfigError("clean: batch_size, progress_every, shard_docs and workers must be >= 1.")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, where: str = "clean") -> CleanConfig:
        """Strict build: unknown keys raise ConfigError naming the key."""
        return from_dict(cls, data, where)

    def shard_stage_hash(self) -> str:
        """Hash of what the per-document stage depends on (shard caches are keyed by it)."""
        d = dataclasses.asdict(self)
        for k in ("url_dedup", "exact_dedup", "line_dedup", "token_outliers", "quality_model", "mix", "workers",
                  "batch_size", "progress_every", "examples_per_reason", "shard_docs"):
            d.pop(k)
        d["minhash"] = {k: v for k, v in d["minhash"].items() if k in ("enabled", "ngram", "num_perm", "seed")}
        return stable_hash([CODE_VERSION, d])


# ---------------------------------------------------------------- text normalisation

_LINE_BREAKS = {"\x85": "\n", "\u2028": "\n", "\u2029": "\n"}
_SPACES = {chr(c): " " for c in (0x0B, 0x0C, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x202F, 0x205F, 0x3000)}
_DROPPED = {chr(c): "" for c in (*range(0, 9), *range(14, 32), 0x7F, 0x200B, 0xFEFF)}
_REPLACE = {**_LINE_BREAKS, **_SPACES, **_DROPPED}
_ODD_CHARS = re.compile("[" + "".join(re.escape(c) for c in _REPLACE) + "]")  # a regex: fast when none occur
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """NFC; unify line breaks and odd spaces; drop control and zero-width chars; trim lines; <=1 blank line.

    Indentation is kept so code blocks survive.
    """
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _ODD_CHARS.sub(lambda m: _REPLACE[m.group()], text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


# What ftfy repairs shows up as a Latin-1 lead byte read as a character followed by a continuation byte or a
# cp1252 punctuation mark ("Ã©", "â€™"), terminal escapes, ligatures or lone surrogates. Only such texts are
# passed to ftfy (it runs at ~35 MB/s; the check at several hundred).
_NEEDS_FIX = re.compile(
    "[\u00c2-\u00f4][\u0080-\u00bf\u0152\u0153\u0160\u0161\u0178\u017d\u017e\u0192\u02c6\u02dc"
    "\u2013-\u2026\u2030\u2039\u203a\u20ac\u2122]|[\x1b\ufb00-\ufb06\ud800-\udfff]"
)


def needs_fix(text: str) -> bool:
    return not text.isascii() and _NEEDS_FIX.search(text) is not None


def fix_unicode(text: str) -> str:
    """ftfy's repair (mojibake, terminal escapes, ligatures, broken surrogates), typographic quotes kept."""
    import ftfy

    if not needs_fix(text):
        return text

    return ftfy.fix_text(text, ftfy.TextFixerConfig(uncurl_quotes=False, fix_character_width=False,
                                                     unescape_html=False, explain=False))


# ---------------------------------------------------------------- filters and the rule table


def default_filters(cfg: CleanConfig) -> list[Filter]:
    """The document rules in the order they run (first failing rule names the drop): URLs, Gopher quality,
    language, Gopher repetition, C4, FineWeb, OLMo 2, dirty words; disabled sections are left out."""
    out: list[Filter] = []
    if cfg.urls.enabled:
        out.append(UrlFilter(cfg.urls))
    out.append(GopherQuality(cfg))
    if cfg.language.enabled:
        out.append(LanguageFilter(cfg.language))
    if cfg.repetition.enabled:
        out.append(GopherRepetition(cfg.repetition))
    if cfg.c4.enabled:
        out.append(C4Filter(cfg.c4))
    if cfg.fineweb.enabled:
        out.append(FineWebFilter(cfg.fineweb))
    if cfg.olmo2.enabled:
        out.append(Olmo2Filter(cfg.olmo2))
    if cfg.dirty_words.enabled:
        out.append(DirtyWordsFilter(cfg.dirty_words))
    return out


# reason -> config key that controls it, for the rules that are not thresholds of a filter.
FIXED_RULES: dict[str, str | None] = {
    "extract:empty": None,
    "url:blocked_domain": "urls.blocked_domains",
    "url:banned_word": "urls.banned_url_words",
    "lang:not_allowed": "language.allowed",
    "lang:low_confidence": "language.max_rank",
    "c4:lorem_ipsum": "c4.lorem_ipsum",
    "c4:curly_bracket": "c4.curly_bracket",
    "c4:too_few_sentences": "c4.min_sentences",
    "dedup:url": "url_dedup",
    "dedup:exact": "exact_dedup",
    "dedup:minhash": "minhash.enabled",
    "dedup:lines": "line_dedup.max_repeats",
    "outlier:token_kl": "token_outliers.max_mad",
    "quality:low_score": "quality_model.min_score",
    "mix:downsampled": "mix.weights",
}


def rule_keys(cfg: CleanConfig | None = None) -> dict[str, str | None]:
    """Every drop reason -> the config key that controls it (read by EmptyCorpusError and the report)."""
    keys = dict(FIXED_RULES)
    for f in default_filters(cfg or CleanConfig()):
        if isinstance(f, ThresholdFilter):
            keys.update({r.reason: r.key for r in f.rules})
    return keys


# ---------------------------------------------------------------- report


def example_of(doc_id: str, text: str, lines: int = 4, width: int = 160) -> dict[str, Any]:
    """A removed document as a person skims it: a one-line snippet and its first few non-empty lines."""
    first = [s.strip()[:width] for s in text.split("\n") if s.strip()][:lines]
    return {"id": doc_id, "snippet": " ".join(text.split())[:200], "lines": first}


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
    edits: dict[str, dict[str, Any]] = field(default_factory=dict)  # rule that edits text -> {docs, items, bytes}
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> kept/dropped docs and bytes
    dedup_rate: float = 0.0  # share of quality-passing docs dropped as URL, exact or near duplicates
    stage_seconds: dict[str, float] = field(default_factory=dict)  # CPU seconds per stage, summed over shards
    quality_model: dict[str, Any] = field(default_factory=dict)  # classifier training metrics and threshold
    token_outliers: dict[str, Any] = field(default_factory=dict)  # KL median, MAD and limit
    mix: dict[str, Any] = field(default_factory=dict)  # groups, target shares, rates, final shares
    shards: int = 0  # shards of the per-document stage
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

    def keep(self, source: str, input_bytes: int, clean_bytes: int) -> None:
        self.kept_docs += 1
        self.kept_bytes += clean_bytes
        self.kept_input_bytes += input_bytes
        src = self._source(source)
        src["kept_docs"] += 1
        src["kept_bytes"] += clean_bytes

    def drop(self, doc_id: str, source: str, input_bytes: int, reason: str, text: str, max_examples: int) -> None:
        self.dropped_docs += 1
        self.dropped_bytes += input_bytes
        r = self.reasons.setdefault(reason, {"docs": 0, "bytes": 0, "examples": []})
        r["docs"] += 1
        r["bytes"] += input_bytes
        if len(r["examples"]) < max_examples:
            r["examples"].append(example_of(doc_id, text))
        src = self._source(source)
        src["dropped_docs"] += 1
        src["dropped_bytes"] += input_bytes

    def edit(self, rule: str, items: int, nbytes: int) -> None:
        e = self.edits.setdefault(rule, {"docs": 0, "items": 0, "bytes": 0})
        e["docs"] += 1
        e["items"] += items
        e["bytes"] += nbytes

    def merge(self, other: dict[str, Any], max_examples: int) -> None:
        """Add a shard's report (as a dict) to this one."""
        for k in ("input_docs", "input_bytes", "dropped_docs", "dropped_bytes"):
            setattr(self, k, getattr(self, k) + other[k])
        for reason, v in other["reasons"].items():
            r = self.reasons.setdefault(reason, {"docs": 0, "bytes": 0, "examples": []})
            r["docs"] += v["docs"]
            r["bytes"] += v["bytes"]
            r["examples"] = (r["examples"] + v["examples"])[:max_examples]
        for rule, v in other["edits"].items():
            e = self.edits.setdefault(rule, {"docs": 0, "items": 0, "bytes": 0})
            for k in e:
                e[k] += v[k]
        for s, v in other["sources"].items():
            src = self._source(s)
            src["dropped_docs"] += v["dropped_docs"]
            src["dropped_bytes"] += v["dropped_bytes"]
        for k, v in other["stage_seconds"].items():
            self.stage_seconds[k] = self.stage_seconds.get(k, 0.0) + v

    def table(self) -> list[dict[str, Any]]:
        """One row per rule that removed anything: rule, documents removed, bytes removed (dropped or edited)."""
        rows = [{"rule": r, "action": "drop", "documents": v["docs"], "bytes": v["bytes"]} for r, v in self.reasons.items()]
        rows += [{"rule": r, "action": "edit", "documents": v["docs"], "bytes": v["bytes"]} for r, v in self.edits.items()]
        return rows


class EmptyCorpusError(RuntimeError):
    """No document survived cleaning; the message says which rule removed the most and what to change."""

    def __init__(self, report: CleanReport, in_path: Path, keys: dict[str, str | None] | None = None) -> None:
        self.report = report
        counts = ", ".join(f"{r}={v['docs']}" for r, v in report.reasons.items()) or "none (the input is empty)"
        msg = f"clean: kept 0 of {report.input_docs} documents from {in_path}. Dropped per reason: {counts}."
        if report.reasons:
            top = next(iter(report.reasons))
            key = (keys or rule_keys()).get(top)
            if key:
                msg += f" Most drops come from '{top}' (config key clean.{key}): loosen clean.{key} or add sources."
            else:
                msg += f" Most drops come from '{top}', which no config key controls: add sources with real text."
        else:
            msg += " Add sources to the raw corpus."
        super().__init__(msg)


# ---------------------------------------------------------------- schemas

SIGNAL_TYPES: dict[str, pa.DataType] = {
    "words": pa.int64(),
    **{k: pa.float64() for k in ("mean_word_length", "symbol_ratio", "alpha_word_fraction", "duplicate_line_fraction",
                                 "bullet_lines_fraction", "ellipsis_lines_fraction")},
    "stop_words": pa.int64(),
    "language": pa.string(),
    "language_rank": pa.int64(),
    **{k: pa.float64() for k in ("duplicate_paragraph_fraction", "line_punct_fraction", "short_line_fraction",
                                 "top_word_fraction", "dirty_word_fraction")},
    "ngram_repeat_run": pa.int64(),
    "pii_replacements": pa.int64(),
    "lines_removed": pa.int64(),
    "token_kl": pa.float64(),
    "quality_score": pa.float64(),
}
DOC_COLUMNS = [(c, pa.string()) for c in ("id", "source", "url", "text", "content_type")] + [
    ("bytes", pa.int64()), ("license", pa.string()), ("title", pa.string())]
KEPT_SCHEMA = pa.schema(DOC_COLUMNS + list(SIGNAL_TYPES.items()))
# shard outputs also carry the raw size and the MinHash signature for the corpus stage
SHARD_SCHEMA = pa.schema(DOC_COLUMNS + [("input_bytes", pa.int64()), ("minhash", pa.binary())]
                         + list(SIGNAL_TYPES.items()))
REMOVED_SCHEMA = pa.schema(
    [(c, pa.string()) for c in ("id", "source", "url", "reason")]
    + [("bytes", pa.int64()), ("detail", pa.string()), ("duplicate_of", pa.string())]
)

Progress = Callable[[str], None]  # gets a one-line message; a logger's .info fits


# ---------------------------------------------------------------- shards


def _open(in_path: Path) -> pq.ParquetFile:
    pf = pq.ParquetFile(in_path)
    missing = [c for c in INPUT_COLUMNS if c not in pf.schema_arrow.names]
    if missing:
        raise ValueError(
            f"{in_path}: missing column(s) {missing}; a raw corpus needs {INPUT_COLUMNS} "
            f"(has {pf.schema_arrow.names})."
        )
    return pf


def plan_shards(in_path: str | Path, shard_docs: int) -> list[dict[str, Any]]:
    """Split the raw Parquet into shards of about ``shard_docs`` consecutive rows that never mix sources.

    Each shard is {"index", "source", "segments": [[row group, start, stop], ...], "docs", "key"}; ``key`` hashes
    the shard's rows (ids and sizes), so a shard whose documents did not change keeps its key when sources are
    added or removed around it.
    """
    in_path = Path(in_path)
    shards: list[dict[str, Any]] = []
    with _open(in_path) as pf:
        for rg in range(pf.num_row_groups):
            t = pf.read_row_group(rg, columns=["source", "id", "bytes"])
            sources, ids, sizes = (t.column(c).to_pylist() for c in ("source", "id", "bytes"))
            start = 0
            while start < len(ids):
                last = shards[-1] if shards else None
                if last is None or last["source"] != sources[start] or last["docs"] >= shard_docs:
                    last = {"index": len(shards), "source": sources[start], "segments": [], "docs": 0, "_h": []}
                    shards.append(last)
                stop = start
                while stop < len(ids) and sources[stop] == sources[start] and last["docs"] + stop - start < shard_docs:
                    stop += 1
                last["segments"].append([rg, start, stop])
                last["docs"] += stop - start
                last["_h"].append([ids[start:stop], sizes[start:stop]])
                start = stop
    for s in shards:
        s["key"] = stable_hash(s.pop("_h"))[:16]
    return shards


def _to_doc(row: dict[str, Any], where: str) -> Doc:
    doc_id = row["id"]
    if doc_id is None:
        raise ValueError(f"{where} has no id; every raw document needs one.")
    ctype = row["content_type"]
    if ctype not in CONTENT_TYPES:
        raise ValueError(f"{where}: record id={doc_id!r}: content_type {ctype!r} is not one of {CONTENT_TYPES}.")
    text = row["text"] or ""
    size = row["bytes"] if row["bytes"] is not None else len(text.encode())
    return Doc(doc_id, row["source"] or "", row["url"] or "", text, ctype, row["license"] or "", size)


class _Timer:
    """CPU seconds of this process per stage (wall time would count the waits of a busy machine)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.t = time.process_time()

    def lap(self, stage: str) -> None:
        now = time.process_time()
        self.seconds[stage] += now - self.t
        self.t = now


class ShardCleaner:
    """The per-document stage: extract, repair, normalise, C4 line removal, document rules, PII, MinHash signature."""

    def __init__(self, cfg: CleanConfig, filters: list[Filter] | None = None) -> None:
        self.cfg = cfg
        self.filters = default_filters(cfg) if filters is None else filters
        self.lines = C4LineCleaner(cfg.c4)
        self.pii = PiiScrubber(cfg.pii)

    def _exempt(self, doc: Doc) -> list[str]:
        return [r for pattern, rules in self.cfg.exempt.items() if matches_any(doc.source, [pattern]) for r in rules]

    def judge(self, doc: Doc, report: CleanReport, timer: _Timer) -> tuple[str, str] | None:
        """Run one document through the stage in place; returns (reason, detail) when it is dropped."""
        raw = doc.text
        if doc.content_type == "text/html":
            doc.text, doc.title = extract_and_title(raw)
        timer.lap("extract")
        if self.cfg.fix_unicode and doc.text:
            doc.text = fix_unicode(doc.text)
        doc.text = normalize_text(doc.text)
        timer.lap("unicode")
        if not doc.text:
            return "extract:empty", f"{doc.content_type} of {doc.input_bytes} bytes has no main text"
        doc.text, edits = self.lines.clean(doc.text)
        for rule, (n, nbytes) in edits.items():
            report.edit(rule, n, nbytes)
        timer.lap("c4_lines")
        if not doc.text:
            return "extract:empty", "no line left after C4 line removal"
        exempt = self._exempt(doc)
        for f in self.filters:
            if isinstance(f, ThresholdFilter) and exempt:
                rules, f.rules = f.rules, [r for r in f.rules if not matches_any(r.reason, exempt)]
                try:
                    reason = f.reason(doc)
                finally:
                    f.rules = rules
            else:
                reason = f.reason(doc)
            timer.lap(f"filter:{f.name}")
            if reason and not matches_any(reason, exempt):
                return reason, f.detail(doc)
        text, counts = self.pii.scrub(doc.text)
        n = sum(counts.values())
        if n:
            doc.text = text
            doc.reset()
            for kind, c in counts.items():
                if c:
                    report.edit(f"pii:{kind}", c, 0)
        doc.signals["pii_replacements"] = n
        timer.lap("pii")
        return None

    def run(self, docs: list[Doc], report: CleanReport, timer: _Timer) -> tuple[list[dict], list[dict]]:
        kept_docs, removed = [], []
        for doc in docs:
            raw = doc.text
            verdict = self.judge(doc, report, timer)
            report.input_docs += 1
            report.input_bytes += doc.input_bytes
            if verdict is None:
                kept_docs.append(doc)
            else:
                report.drop(doc.id, doc.source, doc.input_bytes, verdict[0], doc.text or raw,
                            self.cfg.examples_per_reason)
                removed.append(_removed_row(doc, verdict[0], verdict[1], None))
        sigs: list[bytes | None] = [None] * len(kept_docs)
        if self.cfg.minhash.enabled and kept_docs:
            sigs = [s.astype(np.uint32).tobytes() for s in signatures([d.text for d in kept_docs], self.cfg.minhash)]
        timer.lap("minhash_signatures")
        kept = [_kept_row(d, sig) for d, sig in zip(kept_docs, sigs)]
        return kept, removed


def _kept_row(doc: Doc, sig: bytes | None) -> dict[str, Any]:
    signals = {k: v for k, v in doc.signals.items() if k in SIGNAL_TYPES}
    return {"id": doc.id, "source": doc.source, "url": doc.url, "text": doc.text, "content_type": doc.content_type,
            "bytes": len(doc.text.encode()), "license": doc.license, "title": doc.title,
            "input_bytes": doc.input_bytes, "minhash": sig, **signals}


def _removed_row(doc: Doc | dict, reason: str, detail: str, duplicate_of: str | None) -> dict[str, Any]:
    get = (lambda k: doc[k]) if isinstance(doc, dict) else (lambda k: getattr(doc, k))  # noqa: E731
    size = doc["input_bytes"] if isinstance(doc, dict) else doc.input_bytes
    return {"id": get("id"), "source": get("source"), "url": get("url"), "reason": reason, "bytes": size,
            "detail": detail, "duplicate_of": duplicate_of}


def clean_shard(in_path: str | Path, shard: dict[str, Any], out_dir: str | Path, cfg: CleanConfig,
                filters: list[Filter] | None = None) -> dict[str, Any]:
    """Run the per-document stage over one shard; writes ``kept.parquet``, ``removed.parquet`` and
    ``report.json`` into ``out_dir`` (atomically; an existing complete shard is reused) and returns the result."""
    in_path, out_dir = Path(in_path), Path(out_dir)
    done = out_dir / "report.json"
    if done.is_file() and filters is None:
        return json.loads(done.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    report, timer = CleanReport(), _Timer()
    cleaner = ShardCleaner(cfg, filters)
    with _open(in_path) as pf, atomic_path(out_dir / "kept.parquet") as kept_tmp, \
            atomic_path(out_dir / "removed.parquet") as rm_tmp:
        with pq.ParquetWriter(kept_tmp, SHARD_SCHEMA) as kept_w, pq.ParquetWriter(rm_tmp, REMOVED_SCHEMA) as rm_w:
            for rg, first, stop in shard["segments"]:
                rows = pf.read_row_group(rg, columns=INPUT_COLUMNS).slice(first, stop - first)
                row_no = first
                for batch in rows.to_batches(max_chunksize=cfg.batch_size):
                    docs = [_to_doc(row, f"{in_path}: row group {rg}, row {row_no + i}")
                            for i, row in enumerate(batch.to_pylist())]
                    row_no += len(docs)
                    timer.lap("read")
                    kept, removed = cleaner.run(docs, report, timer)
                    kept_w.write_table(pa.Table.from_pylist(kept, schema=SHARD_SCHEMA))
                    rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))
                    timer.lap("write")
    report.stage_seconds = {k: round(v, 4) for k, v in timer.seconds.items()}
    result = {"shard": {k: v for k, v in shard.items()}, "dir": str(out_dir),
              "kept": str(out_dir / "kept.parquet"), "removed": str(out_dir / "removed.parquet"),
              "report": report.to_dict()}
    if filters is None:
        atomic_write_json(done, result)
    return result


# ---------------------------------------------------------------- corpus stage


def _iter_rows(paths: list[str], batch_size: int, columns: list[str] | None = None) -> Iterator[list[dict]]:
    for p in paths:
        with pq.ParquetFile(p) as pf:
            for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
                yield batch.to_pylist()


def merge_shards(results: list[dict[str, Any]], out_path: str | Path, removed_path: str | Path, cfg: CleanConfig,
                 progress: Progress | None = None, work_dir: str | Path | None = None,
                 artifacts_dir: str | Path | None = None) -> CleanReport:
    """The corpus stage over the shards (in shard order): URL, exact and MinHash dedup; line dedup; token
    outliers; the quality classifier; mixing. Writes the kept corpus and every removed row atomically."""
    t0 = time.perf_counter()
    say = progress or (lambda _m: None)
    report = CleanReport(config=dataclasses.asdict(cfg), shards=len(results))
    for r in sorted(results, key=lambda r: r["shard"]["index"]):
        report.merge(r["report"], cfg.examples_per_reason)
    results = sorted(results, key=lambda r: r["shard"]["index"])
    timer = _Timer()
    max_ex = cfg.examples_per_reason
    shard_removed = [r["removed"] for r in results]
    quality_passed = 0
    tmp_root = Path(tempfile.mkdtemp(prefix="kiln-clean-", dir=work_dir))
    try:
        with atomic_path(removed_path) as rm_tmp, pq.ParquetWriter(rm_tmp, REMOVED_SCHEMA) as rm_w:
            for batch in _iter_rows(shard_removed, cfg.batch_size):
                rm_w.write_table(pa.Table.from_pylist(batch, schema=REMOVED_SCHEMA))

            def drop(row: dict, reason: str, detail: str, dup: str | None, removed: list) -> None:
                report.drop(row["id"], row["source"], row["input_bytes"], reason, row["text"], max_ex)
                removed.append(_removed_row(row, reason, detail, dup))

            # pass A: URL, exact and near dedup in input order; count lines and words; sample for the classifier
            urls, hashes = FirstSeen(), FirstSeen()
            near = MinHashDeduper(cfg.minhash) if cfg.minhash.enabled else None
            lines = LineDeduper(cfg.line_dedup)
            dist = TokenDistribution(cfg.token_outliers)
            qm = cfg.quality_model
            pos, neg = Reservoir(qm.max_train_docs, qm.seed), Reservoir(qm.max_train_docs, qm.seed + 1)
            path_a = tmp_root / "a.parquet"
            try:
                with pq.ParquetWriter(path_a, SHARD_SCHEMA) as w:
                    for batch in _iter_rows([r["kept"] for r in results], cfg.batch_size):
                        quality_passed += len(batch)
                        timer.lap("read")
                        survivors, removed = [], []
                        for row in batch:
                            web = cfg.url_dedup and row["url"][:8].lower().startswith(("http://", "https://"))
                            prior = urls.check(url_key(row["url"]), row["id"]) if web else None
                            if prior is not None:
                                drop(row, "dedup:url", f"same URL as {prior}", prior, removed)
                                continue
                            prior = hashes.check(content_hash(row["text"]), row["id"]) if cfg.exact_dedup else None
                            if prior is not None:
                                drop(row, "dedup:exact", f"duplicate of {prior}", prior, removed)
                                continue
                            survivors.append(row)
                        timer.lap("dedup_exact_url")
                        if near is not None and survivors:
                            sigs = [np.frombuffer(r["minhash"], dtype=np.uint32) for r in survivors]
                            dups = near.check([r["id"] for r in survivors], sigs)
                            keep = []
                            for row, dup in zip(survivors, dups):
                                if dup is None:
                                    keep.append(row)
                                else:
                                    drop(row, "dedup:minhash", f"duplicate of {dup}", dup, removed)
                            survivors = keep
                        timer.lap("dedup_minhash")
                        for row in survivors:
                            if cfg.line_dedup.enabled:
                                lines.count(row["text"])
                            if cfg.token_outliers.enabled:
                                dist.add(row["text"])
                        timer.lap("corpus_counts")
                        if qm.enabled:
                            for row in survivors:
                                (pos if matches_any(row["source"], qm.reference_sources) else neg).add(row["text"])
                        timer.lap("quality_model")
                        w.write_table(pa.Table.from_pylist(survivors, schema=SHARD_SCHEMA))
                        rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))
            finally:
                if near is not None:
                    near.close()
            say(f"clean: dedup done, {report.input_docs - report.dropped_docs} documents left")

            # the classifier, trained on reference sources against random text from the rest of the corpus
            model = None
            if qm.enabled:
                if len(pos.items) >= 2 and len(neg.items) >= 2:
                    n = min(len(pos.items), len(neg.items))
                    model, metrics = train_classifier(pos.items[:n], neg.items[:n], qm)
                    report.quality_model = {"trained": True, "min_score": qm.min_score,
                                            "reference_sources": qm.reference_sources, **metrics}
                    if artifacts_dir is not None:
                        import torch

                        torch.save(model.state_dict(), Path(artifacts_dir) / "quality_model.pt")
                else:
                    report.quality_model = {
                        "trained": False, "reference_sources": qm.reference_sources,
                        "why": f"{len(pos.items)} reference and {len(neg.items)} other documents; at least 2 of each "
                               f"are needed (clean.quality_model.reference_sources)"}
                    say(f"clean: quality classifier skipped: {report.quality_model['why']}")
            pos = neg = None  # type: ignore[assignment]
            timer.lap("quality_model")
            if cfg.token_outliers.enabled:
                dist.freeze()

            # pass B: line dedup (edits text), token KL and classifier score per document
            path_b = tmp_root / "b.parquet"
            kl_values, sources, sizes, scores = [], [], [], []
            with pq.ParquetWriter(path_b, SHARD_SCHEMA) as w:
                for batch in _iter_rows([str(path_a)], cfg.batch_size):
                    out, removed = [], []
                    for row in batch:
                        if cfg.line_dedup.enabled:
                            text, n_lines, n_bytes = lines.apply(row["text"])
                            row["lines_removed"] = n_lines
                            if n_lines:
                                report.edit("dedup:line", n_lines, n_bytes)
                                if len(text.split()) < max(cfg.min_words, 1):
                                    drop(row, "dedup:lines", f"{n_lines} lines repeated across the corpus removed; "
                                         f"{len(text.split())} words left < min_words={cfg.min_words}", None, removed)
                                    continue
                                row["text"], row["bytes"] = text, len(text.encode())
                        out.append(row)
                    timer.lap("dedup_lines")
                    if cfg.token_outliers.enabled:
                        for row in out:
                            row["token_kl"] = dist.kl(row["text"])
                    timer.lap("token_outliers")
                    if model is not None:
                        for row, s in zip(out, model.score([r["text"] for r in out])):
                            row["quality_score"] = float(s)
                    timer.lap("quality_model")
                    for row in out:
                        kl_values.append(row["token_kl"] if row.get("token_kl") is not None else 0.0)
                        scores.append(row["quality_score"] if row.get("quality_score") is not None else 1.0)
                        sources.append(row["source"])
                        sizes.append(row["bytes"])
                    w.write_table(pa.Table.from_pylist(out, schema=SHARD_SCHEMA))
                    rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))
            lines = None  # type: ignore[assignment]

            # thresholds need the whole corpus: KL outliers by median + k * MAD, then the mix over what is left
            kl_limit = math.inf
            if cfg.token_outliers.enabled and len(kl_values) >= cfg.token_outliers.min_docs:
                med, mad, kl_limit = mad_limit(kl_values, cfg.token_outliers.max_mad)
                report.token_outliers = {"median_kl": round(med, 4), "mad_kl": round(mad, 4),
                                         "limit_kl": round(kl_limit, 4) if math.isfinite(kl_limit) else None}
            elif cfg.token_outliers.enabled:
                report.token_outliers = {"skipped": f"{len(kl_values)} documents < token_outliers.min_docs="
                                                    f"{cfg.token_outliers.min_docs}"}
            min_score = qm.min_score if model is not None else -1.0
            available: dict[str, int] = {}
            for kl, sc, src, size in zip(kl_values, scores, sources, sizes):
                if kl <= kl_limit and sc >= min_score:
                    available[src] = available.get(src, 0) + size
            mix = plan_mix(available, cfg.mix)
            timer.lap("mix")

            # pass C: apply the corpus thresholds and the mix; write the kept corpus
            kept_by_source: dict[str, int] = {}
            with atomic_path(out_path) as kept_tmp, pq.ParquetWriter(kept_tmp, KEPT_SCHEMA) as kept_w:
                for batch in _iter_rows([str(path_b)], cfg.batch_size):
                    kept, removed = [], []
                    for row in batch:
                        kl, score = row.get("token_kl"), row.get("quality_score")
                        if kl is not None and kl > kl_limit:
                            drop(row, "outlier:token_kl", f"token_kl={kl:.4g} > limit {kl_limit:.4g} (median "
                                 f"{report.token_outliers['median_kl']} + token_outliers.max_mad="
                                 f"{cfg.token_outliers.max_mad} x MAD)", None, removed)
                        elif score is not None and score < min_score:
                            drop(row, "quality:low_score", f"quality_score={score:.4g} < quality_model.min_score="
                                 f"{min_score}", None, removed)
                        elif not keep_sample(row["id"], mix["rates"].get(row["source"], 1.0), cfg.mix.seed):
                            drop(row, "mix:downsampled", f"source {row['source']} sampled at rate "
                                 f"{mix['rates'][row['source']]:.4g} by clean.mix.weights", None, removed)
                        else:
                            report.keep(row["source"], row["input_bytes"], row["bytes"])
                            kept_by_source[row["source"]] = kept_by_source.get(row["source"], 0) + row["bytes"]
                            kept.append({k: row.get(k) for k in KEPT_SCHEMA.names})
                    kept_w.write_table(pa.Table.from_pylist(kept, schema=KEPT_SCHEMA))
                    rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))
                timer.lap("write")
                total = sum(kept_by_source.values()) or 1
                for g in mix["groups"].values():
                    g["final_share"] = round(sum(kept_by_source.get(s, 0) for s in g["sources"]) / total, 4)
                report.mix = {**mix, "rates": {s: round(r, 6) for s, r in mix["rates"].items()},
                              "final_bytes": kept_by_source}
                report.reasons = dict(sorted(report.reasons.items(), key=lambda kv: (-kv[1]["docs"], kv[0])))
                dups = sum(report.reasons.get(r, {"docs": 0})["docs"] for r in ("dedup:url", "dedup:exact", "dedup:minhash"))
                report.dedup_rate = round(dups / quality_passed, 4) if quality_passed else 0.0
                for k, v in timer.seconds.items():
                    report.stage_seconds[k] = round(report.stage_seconds.get(k, 0.0) + v, 4)
                dt = max(time.perf_counter() - t0, 1e-9)
                report.seconds = round(dt, 3)
                if report.kept_docs == 0:
                    raise EmptyCorpusError(report, Path(results[0]["kept"]).parent if results else Path("."),
                                           rule_keys(cfg))
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return report


# ---------------------------------------------------------------- one call


def _clean_shard_job(args: tuple) -> dict[str, Any]:
    return clean_shard(*args)


def clean(
    in_path: str | Path,
    out_path: str | Path,
    removed_path: str | Path,
    cfg: CleanConfig | None = None,
    progress: Progress | None = None,
    filters: list[Filter] | None = None,
    work_dir: str | Path | None = None,
    artifacts_dir: str | Path | None = None,
) -> CleanReport:
    """Clean ``in_path`` in one call: every shard through ``clean_shard`` (``cfg.workers`` processes), then
    ``merge_shards``. Writes kept docs (input order, clean text, signal columns) to ``out_path`` and dropped ones
    (id, source, url, reason, bytes, detail, duplicate_of) to ``removed_path``, both atomically. Raises
    EmptyCorpusError, writing neither file, when no document is kept. ``filters`` replaces the document rules.
    """
    in_path, cfg = Path(in_path), cfg or CleanConfig()
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    shards = plan_shards(in_path, cfg.shard_docs)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-shards-", dir=work_dir))
    try:
        jobs = [(in_path, s, tmp / f"shard-{s['index']:05d}", cfg, filters) for s in shards]
        results: list[dict[str, Any]] = []
        done_docs, next_progress = 0, cfg.progress_every

        def tick(r: dict[str, Any]) -> None:
            nonlocal done_docs, next_progress
            results.append(r)
            done_docs += r["report"]["input_docs"]
            if done_docs >= next_progress:
                while next_progress <= done_docs:
                    next_progress += cfg.progress_every
                dt = max(time.perf_counter() - t0, 1e-9)
                nbytes = sum(x["report"]["input_bytes"] for x in results)
                say(f"clean: {done_docs} docs read, {done_docs - sum(x['report']['dropped_docs'] for x in results)} "
                    f"passed the document rules, {done_docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s")

        if cfg.workers > 1 and len(jobs) > 1 and filters is None:
            with ProcessPoolExecutor(min(cfg.workers, len(jobs)), mp_context=get_context("spawn")) as pool:
                for r in pool.map(_clean_shard_job, jobs):
                    tick(r)
        else:
            for job in jobs:
                tick(clean_shard(*job))
        if not shards:
            with _open(in_path):
                pass
        report = merge_shards(results, out_path, removed_path, cfg, progress, work_dir, artifacts_dir) if results \
            else _empty(in_path, out_path, removed_path, cfg)
    except EmptyCorpusError as e:
        raise EmptyCorpusError(e.report, in_path, rule_keys(cfg)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dt = max(time.perf_counter() - t0, 1e-9)
    report.seconds = round(dt, 3)
    report.docs_per_s = round(report.input_docs / dt, 1)
    report.mb_per_s = round(report.input_bytes / dt / 1e6, 3)
    say(f"clean: done, {report.input_docs} docs read, {report.kept_docs} kept, "
        f"{report.docs_per_s:.0f} docs/s, {report.mb_per_s:.2f} MB/s")
    return report


def _empty(in_path: Path, out_path: str | Path, removed_path: str | Path, cfg: CleanConfig) -> CleanReport:
    raise EmptyCorpusError(CleanReport(config=dataclasses.asdict(cfg)), in_path, rule_keys(cfg))


def shard_stage_key(shard: dict[str, Any], cfg: CleanConfig) -> str:
    """Cache key of one shard's output: its rows' hash and the per-document stage's config and code version."""
    return stable_hash([shard["key"], cfg.shard_stage_hash()])[:20]

