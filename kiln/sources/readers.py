"""Format readers: raw documents from HTML and text files, JSON lines, Parquet rows and WARC or WET records.

Use from Python: ``for doc in iter_documents(spec, fetch(spec, cache_dir), stats): ...``. Bad input (undecodable bytes,
binary or oversized files and lines, corrupt or truncated WARC records) is skipped and counted with its file and byte
offset, unless a source sets ``on_bad_input: error``.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from kiln.sources.listing import InputFile, list_files
from kiln.sources.manifest import SourceError, SourceSpec, is_url

SKIP_REASONS = ("decode_errors", "binary", "too_large", "bad_record", "corrupt", "not_text")
SKIP_LOG_MAX = 50  # skipped items listed (file, offset, reason) per source; all are counted
COUNTERS = ("documents", "bytes", "files", "empty", *SKIP_REASONS)
_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_XML_ENCODING = re.compile(rb"""<\?xml[^>]*encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


class _Skips:
    """Counts skipped input by reason and lists the first few with file and offset; raises in error mode."""

    def __init__(self, spec: SourceSpec, counts: dict[str, Any]) -> None:
        self.spec, self.counts = spec, counts
        self.log: list[dict[str, Any]] = counts.setdefault("skipped", [])

    def __call__(self, reason: str, rel: str, offset: int | None, detail: str, fix: str = "") -> None:
        where = f"{rel}" + (f" at byte {offset}" if offset is not None else "")
        if self.spec.on_bad_input == "error":
            raise SourceError(
                f"source '{self.spec.name}': {where}: {detail}. Fix: {fix or 'repair or exclude the file'}; or set "
                f"`on_bad_input: skip` to skip and count such input."
            )
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.log) < SKIP_LOG_MAX:
            self.log.append({"file": rel, "offset": offset, "reason": reason, "detail": detail[:200]})


def _charset(spec: SourceSpec, data: bytes, declared: str | None = None) -> str:
    encoding = spec.encoding or declared or "utf-8"
    if spec.encoding is None and declared is None and spec.format in ("html", "warc"):
        head = data[:4096]
        m = _CHARSET.search(head) or _XML_ENCODING.search(head)
        if m:
            encoding = m.group(1).decode("ascii", "replace")
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        return "utf-8"


def _decode(spec: SourceSpec, data: bytes, rel: str, offset: int, skip: _Skips, declared: str | None = None) -> str | None:
    encoding = _charset(spec, data, declared)
    try:
        return data.decode("utf-8-sig" if encoding == "utf-8" else encoding)  # utf-8-sig also drops a BOM
    except UnicodeDecodeError as e:
        skip("decode_errors", rel, offset + e.start, f"not valid {encoding} (byte 0x{data[e.start]:02x})",
             "set `encoding:` on the source to the files' real encoding, or exclude the file")
        return None


def _binary(data: bytes) -> bool:
    """NUL bytes in the first 8 KiB: an image, archive or other binary file, not text."""
    return b"\x00" in data[:8192]


Chunk = tuple[str, str, "str | None", str]  # (id suffix, text, url or None, content type)


def _read_lines(f: Any, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(byte offset, line) per line of a binary stream; None for a line over ``limit`` bytes (read past, not kept)."""
    offset = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        start = offset
        offset += len(line)
        if len(line) > limit and not line.endswith(b"\n"):
            while True:  # read past the rest of the huge line in bounded pieces
                more = f.readline(1 << 20)
                offset += len(more)
                if not more or more.endswith(b"\n"):
                    break
            yield start, None
            continue
        yield start, line


def _jsonl(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    with file.open() as f:
        for lineno, (offset, raw) in enumerate(_read_lines(f, spec.max_record_bytes), 1):
            if raw is None:
                skip("too_large", file.rel, offset, f"line {lineno} is longer than max_record_bytes="
                     f"{spec.max_record_bytes}", "raise `max_record_bytes:` on the source")
                continue
            if not raw.strip():
                continue
            if _binary(raw):
                skip("binary", file.rel, offset, f"line {lineno} holds NUL bytes (binary data)")
                continue
            line = _decode(spec, raw, f"{file.rel} line {lineno}", offset, skip)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                skip("bad_record", file.rel, offset, f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})",
                     "fix the line, or drop the file with `exclude:`")
                continue
            if not isinstance(record, dict) or spec.text_field not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise SourceError(
                    f"source '{spec.name}': {file.rel} line {lineno} has no field '{spec.text_field}' (found: {keys}); "
                    f"set `text_field:` on the source."
                )
            text = record[spec.text_field]
            if text is not None and not isinstance(text, str):
                raise SourceError(
                    f"source '{spec.name}': {file.rel} line {lineno}: field '{spec.text_field}' holds a "
                    f"{type(text).__name__}, not a string; set `text_field:` to the field with the text."
                )
            url = record.get(spec.url_field) if spec.url_field else None
            yield f"#{lineno}", text or "", str(url) if url else None, "text/plain"


def _parquet(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    import pyarrow.lib

    with file.open() as f:
        try:
            pf = pq.ParquetFile(f)
        except (pyarrow.lib.ArrowException, OSError) as e:
            skip("corrupt", file.rel, None, f"not a readable Parquet file ({e})")
            return
        names = pf.schema_arrow.names
        if spec.text_field not in names or (spec.url_field and spec.url_field not in names):
            missing = spec.text_field if spec.text_field not in names else spec.url_field
            raise SourceError(f"source '{spec.name}': {file.rel} has no column '{missing}' (columns: "
                              f"{', '.join(names)}); set `text_field:`/`url_field:` on the source.")
        columns = [spec.text_field] + ([spec.url_field] if spec.url_field else [])
        row = 0
        for batch in pf.iter_batches(batch_size=1000, columns=columns):
            texts = batch.column(0).to_pylist()
            urls = batch.column(1).to_pylist() if spec.url_field else [None] * len(texts)
            for text, url in zip(texts, urls):
                row += 1
                if text is not None and not isinstance(text, str):
                    raise SourceError(f"source '{spec.name}': {file.rel}: column '{spec.text_field}' is not a string "
                                      "column; set `text_field:` to the column with the text.")
                if text is not None and len(text) > spec.max_record_bytes:
                    skip("too_large", file.rel, None, f"row {row} is longer than max_record_bytes")
                    continue
                yield f"#{row}", text or "", str(url) if url else None, "text/plain"


_TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")


def _warc(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    """Response records (warc) or conversion records (wet), streamed with FastWARC; bad records are skipped."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    wet = spec.format == "wet"
    types = WarcRecordType.conversion if wet else WarcRecordType.response
    with file.open() as f:
        records = ArchiveIterator(f, record_types=types, parse_http=False, fsspec_args=False)
        last = 0
        while True:
            try:
                record = next(records)
            except StopIteration:
                return
            except (OSError, ValueError) as e:
                skip("corrupt", file.rel, last, f"unreadable WARC data after byte {last} ({e}); rest of file skipped")
                return
            last = record.stream_pos
            try:
                if record.content_length > spec.max_record_bytes:
                    skip("too_large", file.rel, last, f"record of {record.content_length} bytes > max_record_bytes")
                    continue
                if "WARC-Block-Digest" in record.headers and not record.verify_block_digest(consume=False):
                    skip("corrupt", file.rel, last, "block digest mismatch: a truncated or altered record")
                    continue
                if not wet:
                    record.parse_http()  # after the digest check, which covers the HTTP headers too
                length = record.content_length
                body = record.reader.read()
                if len(body) < length:  # the file ends inside this record
                    skip("corrupt", file.rel, last, f"truncated record: {len(body)} of {length} bytes")
                    continue
                declared = "utf-8" if wet else record.http_charset
                if wet:
                    ctype = "text/plain"
                else:
                    status = record.http_headers.status_code if record.http_headers is not None else None
                    ctype = (record.http_content_type or "").lower()
                    if status != 200 or not ctype.startswith(_TEXT_TYPES):
                        skip("not_text", file.rel, last, f"HTTP {status} {ctype or 'no content type'}")
                        continue
                    ctype = "text/plain" if ctype.startswith("text/plain") else "text/html"
            except (OSError, ValueError) as e:
                skip("corrupt", file.rel, last, f"unreadable record ({e})")
                continue
            if _binary(body):
                skip("binary", file.rel, last, "record body holds NUL bytes")
                continue
            text = _decode(spec, body, file.rel, last, skip, declared=None if spec.encoding else declared)
            if text is None:
                continue
            uri = record.headers.get("WARC-Target-URI") or None
            yield f"@{last}", text, uri, ctype


def _whole_file(spec: SourceSpec, file: InputFile, skip: _Skips) -> Iterator[Chunk]:
    if file.size > spec.max_record_bytes:
        skip("too_large", file.rel, None, f"file of {file.size} bytes > max_record_bytes={spec.max_record_bytes}",
             "raise `max_record_bytes:` or split the file")
        return
    with file.open() as f:
        data = f.read()
    if _binary(data):
        skip("binary", file.rel, data.index(b"\x00"), "NUL bytes: a binary file, not text",
             "exclude it with `exclude:`")
        return
    text = _decode(spec, data, file.rel, 0, skip)
    if text is None:
        return
    ctype = "text/html" if spec.format == "html" else "text/plain"
    if spec.separator is None:
        yield "", text, None, ctype
        return
    for n, chunk in enumerate(re.split(spec.separator, text, flags=re.MULTILINE), 1):
        yield f"#{n}", chunk.strip("\r\n"), None, ctype


_READERS = {"jsonl": _jsonl, "parquet": _parquet, "warc": _warc, "wet": _warc, "html": _whole_file, "text": _whole_file}


def iter_documents(
    spec: SourceSpec, root: str | os.PathLike, stats: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the source's documents from the fetched folder (or URL) ``root``, in sorted file order, streaming.

    ``stats``, if given, is updated in place with documents, bytes, files, empty, one count per skip reason
    (decode_errors, binary, too_large, bad_record, corrupt, not_text) and ``skipped``: the first skipped items
    with file, byte offset and reason.
    """
    counts = stats if stats is not None else {}
    for key in COUNTERS:
        counts.setdefault(key, 0)
    skip = _Skips(spec, counts)
    read = _READERS[spec.format]
    taken = 0
    root = root if isinstance(root, str) and is_url(root) else Path(root)
    for file in list_files(spec, root):
        counts["files"] += 1
        if file.size == 0:
            counts["empty"] += 1
            continue
        try:
            for suffix, text, url, ctype in read(spec, file, skip):
                if not text.strip():
                    counts["empty"] += 1
                    continue
                size = len(text.encode("utf-8", "surrogatepass"))
                counts["documents"] += 1
                counts["bytes"] += size
                yield {
                    "id": f"{spec.name}/{file.rel}{suffix}",
                    "source": spec.name,
                    "url": url or file.uri + (suffix if suffix.startswith("#") else ""),
                    "text": text,
                    "content_type": ctype,
                    "bytes": size,
                    "license": spec.license,
                }
                taken += 1
                if spec.max_docs is not None and taken >= spec.max_docs:
                    return
        except OSError as e:  # a stream that breaks mid-file (network, truncated compression)
            skip("corrupt", file.rel, None, f"read failed: {e}")
