"""The per-document stage of cleaning, one shard at a time: extraction, Unicode repair, normalisation, C4 line
removal, the registered filters, PII scrubbing and MinHash signatures. Dagster runs one op per shard in parallel.

``clean_shard(raw, plan_shards(raw, 4000)[0], "out/", CleanConfig())`` writes kept.parquet, removed.parquet and
report.json into ``out/`` (reused when already complete).
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from kiln.clean.config import CleanSettings, default_filters
from kiln.clean.dedup import signatures
from kiln.clean.extract import extract_and_title, too_deep
from kiln.clean.pii import PiiScrubber
from kiln.clean.report import CleanReport
from kiln.clean.schema import CONTENT_TYPES, INPUT_COLUMNS, REMOVED_SCHEMA, STAGE_SIGNALS, shard_schema, signal_types
from kiln.clean.text import fix_unicode
from kiln.common.files import atomic_path, atomic_write_json, process_start_time, stable_hash
from kiln.common.text import normalize_text
from kiln.filters import registry
from kiln.filters.base import Doc, Filter, ThresholdFilter, matches_any
from kiln.filters.c4 import C4LineCleaner
from kiln.filters.registry import RegistryError

Progress = Callable[[str], None]  # gets a one-line message; a logger's .info fits


def open_raw(in_path: Path | str) -> pq.ParquetFile:
    """The raw corpus Parquet (a path, or an fsspec URL such as memory://raw.parquet), checked for the columns
    cleaning reads (ValueError naming the file if one is missing)."""
    if isinstance(in_path, str) and "://" in in_path:
        import fsspec

        fs, path = fsspec.core.url_to_fs(in_path)
        pf = pq.ParquetFile(fs.open(path, "rb"))
        pf.filesystem = fs  # alive as long as the file: a zip:// filesystem closes its archive when collected
    else:
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
    the content of the shard's rows (every column the stage reads, text included), so a document edited in place
    changes its shard's key even at an equal size, and a shard whose rows did not change keeps its key when
    sources are added or removed around it.
    """
    in_path = in_path if isinstance(in_path, str) and "://" in in_path else Path(in_path)
    shards: list[dict[str, Any]] = []
    with open_raw(in_path) as pf:
        for rg in range(pf.num_row_groups):
            t = pf.read_row_group(rg, columns=INPUT_COLUMNS)
            sources = t.column("source").to_pylist()
            start, n = 0, len(sources)
            while start < n:
                last = shards[-1] if shards else None
                if last is None or last["source"] != sources[start] or last["docs"] >= shard_docs:
                    last = {"index": len(shards), "source": sources[start], "segments": [], "docs": 0, "_h": []}
                    shards.append(last)
                stop = start
                while stop < n and sources[stop] == sources[start] and last["docs"] + stop - start < shard_docs:
                    stop += 1
                last["segments"].append([rg, start, stop])
                last["docs"] += stop - start
                last["_h"].append(rows_digest(t.slice(start, stop - start)))
                start = stop
    for s in shards:
        s["key"] = stable_hash(s.pop("_h"))[:16]
    return shards


def rows_digest(rows: pa.Table) -> str:
    """xxh3-128 of the rows' content in every input column, so any edit changes it: which values are null, then
    each string's length and UTF-8 bytes straight from the Arrow buffers (xxh3 hashes GB/s, so planning costs about
    one read of the raw file), or the values of another type."""
    h = xxhash.xxh3_128()
    for name in INPUT_COLUMNS:
        h.update(name.encode())
        for arr in rows.column(name).chunks:
            n, off, buffers = len(arr), arr.offset, arr.buffers()
            h.update(n.to_bytes(8, "little"))
            if arr.null_count:
                h.update(np.unpackbits(np.frombuffer(buffers[0], np.uint8), bitorder="little")[off:off + n].tobytes())
            if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
                h.update(repr(arr.to_pylist()).encode())
                continue
            width = np.int32 if pa.types.is_string(arr.type) else np.int64
            offsets = np.frombuffer(buffers[1], width)[off:off + n + 1].astype(np.int64) if n else np.zeros(1, np.int64)
            h.update((offsets - offsets[0]).tobytes())
            if buffers[2] is not None:
                h.update(memoryview(buffers[2])[offsets[0]:offsets[-1]])
    return h.hexdigest()


def shard_stage_key(shard: dict[str, Any], cfg: CleanSettings) -> str:
    """Cache key of one shard's output: its rows' hash and the per-document stage's config and code version."""
    return stable_hash([shard["key"], cfg.shard_stage_hash()])[:20]


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


class Timer:
    """CPU seconds of this process per stage (wall time would count the waits of a busy machine)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.t = time.process_time()

    def lap(self, stage: str) -> None:
        now = time.process_time()
        self.seconds[stage] += now - self.t
        self.t = now


class ShardMeter:
    """Progress of one shard through ``say``: documents done, docs/s and the time left, about every
    ``cfg.progress_every`` documents, at least every ``cfg.progress_seconds`` while they come slowly, and at the end."""

    def __init__(self, shard: dict[str, Any], cfg: CleanSettings, say: Progress) -> None:
        self.label, self.total, self.say = f"clean shard {shard['index']} ({shard['source']})", shard["docs"], say
        self.every, self.seconds = cfg.progress_every, cfg.progress_seconds
        self.done, self.next = 0, cfg.progress_every
        self.t0 = self.last = time.perf_counter()

    def step(self) -> None:
        """One more document done."""
        self.done += 1
        now = time.perf_counter()
        if self.done < self.next and self.done != self.total and now - self.last < self.seconds:
            return
        while self.next <= self.done:
            self.next += self.every
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        self.say(f"{self.label}: {self.done} of {self.total} docs, {rate:.0f} docs/s, "
                 f"about {(self.total - self.done) / rate:.0f} s left")


class ShardCleaner:
    """The per-document stage: extract, repair, normalise, C4 line removal, document rules, PII, MinHash signature."""

    def __init__(self, cfg: CleanSettings, filters: list[Filter] | None = None) -> None:
        self.cfg = cfg
        self.filters = default_filters(cfg) if filters is None else filters
        self.lines = C4LineCleaner(cfg.c4)
        self.pii = PiiScrubber(cfg.pii)
        self.columns = frozenset(signal_types())
        self.declared = registry.declared_signals() | STAGE_SIGNALS.keys()

    def _exempt(self, doc: Doc) -> list[str]:
        return [r for pattern, rules in self.cfg.exempt.items() if matches_any(doc.source, [pattern]) for r in rules]

    def limits(self, doc: Doc) -> tuple[str, str] | None:
        """(reason, detail) when the raw document is past a limit that keeps one document from stalling a shard:
        work on a document grows with its size, and extraction with the square of an HTML page's nesting depth."""
        cfg = self.cfg
        if (size := max(doc.input_bytes, len(doc.text))) > cfg.max_input_bytes:
            return "extract:too_large", f"{size} bytes > max_input_bytes={cfg.max_input_bytes}"
        if doc.content_type == "text/html" and too_deep(doc.text, cfg.max_html_depth):
            return "extract:too_deep", f"elements nested deeper than max_html_depth={cfg.max_html_depth}"
        return None

    def judge(self, doc: Doc, report: CleanReport, timer: Timer) -> tuple[str, str] | None:
        """Run one document through the stage in place; returns (reason, detail) when it is dropped."""
        if (verdict := self.limits(doc)) is not None:
            timer.lap("extract")
            return verdict
        if doc.content_type == "text/html":
            doc.text, doc.title = extract_and_title(doc.text)
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
        verdict = self._filter(doc, timer)
        if verdict is not None:
            return verdict
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

    def _filter(self, doc: Doc, timer: Timer) -> tuple[str, str] | None:
        """The document rules in order, less the ones exempt for the document's source; the first that drops wins."""
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
            self._check_signals(f, doc)
            if reason and not matches_any(reason, exempt):
                return reason, f.detail(doc)
        return None

    def _check_signals(self, f: Filter, doc: Doc) -> None:
        extra = doc.signals.keys() - self.declared
        if extra and (bad := sorted(k for k in extra if not k.startswith("_"))):
            raise RegistryError(
                f"filter {f.name!r} wrote signal(s) {bad} (document {doc.id!r}) that no line of kiln.filters.registry "
                f"declares: add them to the filter's signals= (an Arrow type keeps one as a kept-corpus column, None "
                f"leaves it out), or name a scratch value with a leading '_'.")

    def run(self, docs: list[Doc], report: CleanReport, timer: Timer,
            meter: ShardMeter | None = None) -> tuple[list[dict], list[dict]]:
        kept_docs, removed = [], []
        for doc in docs:
            raw = doc.text
            verdict = self.judge(doc, report, timer)
            if meter is not None:
                meter.step()
            report.input_docs += 1
            report.input_bytes += doc.input_bytes
            if verdict is None:
                kept_docs.append(doc)
            else:
                report.drop(doc.id, doc.source, doc.input_bytes, verdict[0], doc.text or raw,
                            self.cfg.examples_per_reason)
                removed.append(removed_row(doc, verdict[0], verdict[1], None))
        sigs: list[bytes | None] = [None] * len(kept_docs)
        if self.cfg.minhash.enabled and kept_docs:
            sigs = [s.astype(np.uint32).tobytes() for s in signatures([d.text for d in kept_docs], self.cfg.minhash)]
        timer.lap("minhash_signatures")
        kept = [self._kept_row(d, sig) for d, sig in zip(kept_docs, sigs)]
        return kept, removed

    def _kept_row(self, doc: Doc, sig: bytes | None) -> dict[str, Any]:
        signals = {k: v for k, v in doc.signals.items() if k in self.columns}
        return {"id": doc.id, "source": doc.source, "url": doc.url, "text": doc.text, "content_type": doc.content_type,
                "bytes": len(doc.text.encode()), "license": doc.license, "title": doc.title,
                "input_bytes": doc.input_bytes, "minhash": sig, **signals}


def removed_row(doc: Doc | dict, reason: str, detail: str, duplicate_of: str | None) -> dict[str, Any]:
    """A row of removed.parquet for a document (or a shard row) dropped with ``reason``."""
    get = (lambda k: doc[k]) if isinstance(doc, dict) else (lambda k: getattr(doc, k))  # noqa: E731
    size = doc["input_bytes"] if isinstance(doc, dict) else doc.input_bytes
    return {"id": get("id"), "source": get("source"), "url": get("url"), "reason": reason, "bytes": size,
            "detail": detail, "duplicate_of": duplicate_of}


def clean_shard(in_path: str | Path, shard: dict[str, Any], out_dir: str | Path, cfg: CleanSettings,
                filters: list[Filter] | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Run the per-document stage over one shard; writes ``kept.parquet``, ``removed.parquet`` and
    ``report.json`` into ``out_dir`` (atomically; an existing complete shard is reused; temporary files a killed
    run left there are removed first) and returns the result. ``progress`` gets ``ShardMeter``'s lines."""
    in_path, out_dir = Path(in_path), Path(out_dir)
    done = out_dir / "report.json"
    if done.is_file() and filters is None:
        return json.loads(done.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale(out_dir, stale_before())
    report, timer = CleanReport(), Timer()
    cleaner = ShardCleaner(cfg, filters)
    meter = ShardMeter(shard, cfg, progress) if progress is not None else None
    schema = shard_schema()
    with open_raw(in_path) as pf, atomic_path(out_dir / "kept.parquet") as kept_tmp, \
            atomic_path(out_dir / "removed.parquet") as rm_tmp:
        with pq.ParquetWriter(kept_tmp, schema) as kept_w, pq.ParquetWriter(rm_tmp, REMOVED_SCHEMA) as rm_w:
            for rg, first, stop in shard["segments"]:
                rows = pf.read_row_group(rg, columns=INPUT_COLUMNS).slice(first, stop - first)
                row_no = first
                for batch in rows.to_batches(max_chunksize=cfg.batch_size):
                    docs = [_to_doc(row, f"{in_path}: row group {rg}, row {row_no + i}")
                            for i, row in enumerate(batch.to_pylist())]
                    row_no += len(docs)
                    timer.lap("read")
                    kept, removed = cleaner.run(docs, report, timer, meter)
                    kept_w.write_table(pa.Table.from_pylist(kept, schema=schema))
                    rm_w.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA))
                    timer.lap("write")
    report.stage_seconds = {k: round(v, 4) for k, v in timer.seconds.items()}
    result = {"shard": {k: v for k, v in shard.items()}, "dir": str(out_dir),
              "kept": str(out_dir / "kept.parquet"), "removed": str(out_dir / "removed.parquet"),
              "report": report.to_dict()}
    if filters is None:
        atomic_write_json(done, result)
    return result


# ---------------------------------------------------------------- what killed runs left in the shard cache

# atomic_path's temporary files of a shard's three outputs (".kept.parquet.<random>.tmp"); nothing else is removed
STAGING = re.compile(r"\.(?:kept\.parquet|removed\.parquet|report\.json)\.[A-Za-z0-9_]+\.tmp")
SHARD_DIR = re.compile(r"[0-9a-f]{20}")  # a folder named by shard_stage_key
STALE_SECONDS = 3600.0  # a live writer touches its file every batch; one untouched this long is a killed run's


def stale_before() -> float:
    """Unix time before which a temporary file is a leftover: older than this process and than STALE_SECONDS, so
    a writer still running in a parallel shard (whose file it touches every batch) is never removed."""
    now = time.time()
    return min(process_start_time() or now, now - STALE_SECONDS)


def _remove_stale(folder: Path, before: float) -> list[Path]:
    gone = []
    for p in folder.iterdir():
        if STAGING.fullmatch(p.name) and p.is_file() and p.stat().st_mtime < before:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def remove_stale_staging(cache_root: str | Path) -> list[Path]:
    """Remove the temporary files killed runs left in the shard folders (named by ``shard_stage_key``) under
    ``cache_root``, those older than ``stale_before()``; returns what was removed. Only STAGING names are touched."""
    root = Path(cache_root)
    if not root.is_dir():
        return []
    before = stale_before()
    return [p for d in sorted(root.iterdir()) if SHARD_DIR.fullmatch(d.name) and d.is_dir()
            for p in _remove_stale(d, before)]


def cached_shards(in_path: str | Path, cfg: CleanSettings, cache_root: str | Path
                  ) -> tuple[list[dict[str, Any]], Callable[[dict[str, Any]], Path]]:
    """The shards of ``in_path`` and where each one's per-document output is kept under ``cache_root`` (keyed by its
    rows and the stage's config, so any corpus cleaned with the same rules reuses it), after removing what killed
    runs left there: what clean_corpus and a data ablation's points both clean through."""
    cache_root = Path(cache_root)
    remove_stale_staging(cache_root)
    return plan_shards(in_path, cfg.shard_docs), lambda s: cache_root / shard_stage_key(s, cfg)
