"""Format readers: raw documents from HTML and text files, JSON lines, Parquet rows and WARC or WET records.

Use from Python: ``for doc in iter_documents(spec, fetch(spec, cache_dir), stats): ...``. Bad input (undecodable bytes,
binary or oversized files and lines, corrupt or truncated records, unreadable links) is skipped and counted with its
file and byte offset, or stops the run, as the source's ``on_bad_input`` says (see ``kiln.sources.tally``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

from kiln.sources.decode import decode, is_binary
from kiln.sources.listing import Chunk, InputFile, list_files
from kiln.sources.manifest import SourceError, SourceSpec, is_url
from kiln.sources.tally import COUNTERS, SKIP_LOG_MAX, SKIP_REASONS, Tally
from kiln.sources.warc import read_warc

__all__ = ["COUNTERS", "SKIP_LOG_MAX", "SKIP_REASONS", "file_documents", "iter_documents"]


def _read_lines(f: Any, limit: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(byte offset, length, line) per line of a binary stream; None for a line over ``limit`` bytes (read past in
    bounded pieces, not kept)."""
    offset = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        start = offset
        offset += len(line)
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                more = f.readline(1 << 20)
                offset += len(more)
                if not more or more.endswith(b"\n"):
                    break
            yield start, offset - start, None
            continue
        yield start, len(line), line


def _jsonl(spec: SourceSpec, file: InputFile, tally: Tally) -> Iterator[Chunk]:
    """One document per line holding a JSON object with a string ``text_field``; blank lines are no records."""
    good = 0  # records so far with a string text field: a later one without it is a bad record, not a wrong text_field
    with file.open() as f:
        for lineno, (offset, size, raw) in enumerate(_read_lines(f, spec.max_record_bytes), 1):
            tally.read(size)
            if raw is None:
                tally("too_large", file.rel, offset, f"line {lineno} is longer than max_record_bytes="
                      f"{spec.max_record_bytes}", "raise `max_record_bytes:` on the source")
                continue
            if not raw.strip():
                continue
            if is_binary(raw):
                tally("binary", file.rel, offset, f"line {lineno} holds NUL bytes (binary data)")
                continue
            line = decode(spec, raw, file.rel, offset, tally, record=f"line {lineno}")
            if line is None:
                continue
            record = _json_object(spec, file, tally, line, lineno, offset, good)
            if record is None:
                continue
            good += 1
            text, url = record[spec.text_field], record.get(spec.url_field) if spec.url_field else None
            yield Chunk(f"#{lineno}", text or "", str(url) if url else None, "text/plain", offset)


def _json_object(spec: SourceSpec, file: InputFile, tally: Tally, line: str, lineno: int, offset: int,
                 good: int) -> dict[str, Any] | None:
    """The line's JSON object if it has a string (or null) text field; else None, counted (or raised) by its cause."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        tally("bad_record", file.rel, offset, f"line {lineno} is not valid JSON ({e.msg} at column {e.colno})",
              "fix the line, or drop the file with `exclude:`")
        return None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits; nesting deeper than Python's stack
        tally("bad_record", file.rel, offset, f"line {lineno} is not readable JSON ({type(e).__name__}: "
              f"{str(e)[:80]})", "fix the line, or drop the file with `exclude:`")
        return None
    field = spec.text_field
    value = record.get(field) if isinstance(record, dict) else None
    if isinstance(record, dict) and (value is None or isinstance(value, str)) and field in record:
        return record
    if not isinstance(record, dict):
        detail = f"line {lineno} is a JSON {type(record).__name__}, not an object with field '{field}'"
    elif field not in record:
        detail = f"line {lineno} has no field '{field}' (found: {', '.join(map(str, record))[:120]})"
    else:
        detail = f"line {lineno}: field '{field}' holds a {type(value).__name__}, not a string"
    if good:  # earlier records had a string text field: this record is malformed, text_field is right
        fix = f"fix or remove line {lineno} (the {good} record(s) before it have a string '{field}')"
    else:
        fields = [k for k, v in record.items() if isinstance(v, str)] if isinstance(record, dict) else []
        fix = "set `text_field:` to the field that holds the text" + (f", e.g. `text_field: {fields[0]}`"
                                                                       if fields else "")
    reason = "wrong_type" if isinstance(record, dict) and field in record else "missing_field"
    tally(reason, file.rel, offset, detail, fix)
    return None


def _parquet(spec: SourceSpec, file: InputFile, tally: Tally) -> Iterator[Chunk]:
    """One document per row; a file or row group that does not read is skipped and counted by its rows."""
    import pyarrow.lib
    import pyarrow.parquet as pq

    with file.open() as f:
        tally.read(file.size)  # accounted in rows: documents + empty + skipped rows == the footer's row count
        try:
            pf = pq.ParquetFile(f)
            names = pf.schema_arrow.names
        except (pyarrow.lib.ArrowException, OSError, ValueError) as e:
            tally("corrupt", file.rel, None, f"not a readable Parquet file ({str(e)[:120]})")
            return
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups))  # a damaged total aside
        missing = next((c for c in (spec.text_field, spec.url_field) if c and c not in names), None)
        if missing is not None:
            tally("missing_field", file.rel, None, f"no column '{missing}' (columns: {', '.join(names)[:200]})",
                  "set `text_field:`/`url_field:` on the source", count=max(rows, 1))
            return
        kind = pf.schema_arrow.field(names.index(spec.text_field)).type  # by index: a name may be there twice
        if not _is_text_type(kind):
            tally("wrong_type", file.rel, None, f"column '{spec.text_field}' is {kind}, not a string column",
                  "set `text_field:` to the column with the text", count=max(rows, 1))
            return
        yield from _parquet_rows(spec, file, tally, pf)


def _is_text_type(kind: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        return _is_text_type(kind.value_type)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind) or \
        (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind))


def _parquet_rows(spec: SourceSpec, file: InputFile, tally: Tally, pf: Any) -> Iterator[Chunk]:
    import pyarrow.lib

    columns = [spec.text_field] + ([spec.url_field] if spec.url_field else [])
    row = 0
    for group in range(pf.num_row_groups):
        expected, done = pf.metadata.row_group(group).num_rows, 0
        try:
            for batch in pf.iter_batches(batch_size=1000, row_groups=[group], columns=columns):
                texts = batch.column(0).to_pylist()
                urls = batch.column(1).to_pylist() if spec.url_field else [None] * len(texts)
                for text, url in zip(texts, urls):
                    row, done = row + 1, done + 1
                    if text is not None and len(text) > spec.max_record_bytes:
                        tally("too_large", file.rel, None, f"row {row} is longer than max_record_bytes")
                        continue
                    yield Chunk(f"#{row}", text or "", str(url) if url else None, "text/plain", None)
        except (pyarrow.lib.ArrowException, OSError, ValueError) as e:
            why = f"({type(e).__name__}: {str(e)[:120]})"
        else:
            why = "(fewer rows than the footer says)"
        if done < expected:
            tally("corrupt", file.rel, None, f"row group {group}: rows {row + 1}-{row + expected - done} do not read "
                  f"{why}", count=expected - done)
            row += expected - done


def _whole_file(spec: SourceSpec, file: InputFile, tally: Tally) -> Iterator[Chunk]:
    """html and text: one document per file, or per ``separator`` chunk."""
    if file.size > spec.max_record_bytes:
        tally.read(file.size)
        tally("too_large", file.rel, None, f"file of {file.size} bytes > max_record_bytes={spec.max_record_bytes}",
              "raise `max_record_bytes:` or split the file")
        return
    with file.open() as f:
        data = f.read(spec.max_record_bytes + 1)
    tally.read(file.size)
    if is_binary(data):
        tally("binary", file.rel, data.index(b"\x00"), "NUL bytes: a binary file, not text",
              "exclude it with `exclude:`")
        return
    text = decode(spec, data, file.rel, 0, tally)
    if text is None:
        return
    ctype = "text/html" if spec.format == "html" else "text/plain"
    if spec.separator is None:
        yield Chunk("", text, None, ctype, 0)
        return
    for n, chunk in enumerate(re.split(spec.separator, text, flags=re.MULTILINE), 1):
        yield Chunk(f"#{n}", chunk.strip("\r\n"), None, ctype, None)


_READERS = {"jsonl": _jsonl, "parquet": _parquet, "warc": read_warc, "wet": read_warc, "html": _whole_file,
            "text": _whole_file}


def iter_documents(
    spec: SourceSpec, root: str | os.PathLike, stats: dict[str, Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Yield the source's documents from the fetched folder (or URL) ``root``, in sorted file order, streaming.

    ``stats``, if given, is updated in place with documents, bytes (of document text), files, empty, one count per
    skip reason (SKIP_REASONS), lost_bytes (input in no record read: unreadable stretches of a WARC file, the rest of
    a file whose stream broke) and ``skipped``: the first skipped items with file, byte offset, reason and detail.
    """
    counts = stats if stats is not None else {}
    tally = Tally(spec, counts)
    refused: list[tuple[str, str, str]] = []
    files = list_files(spec, root if isinstance(root, str) and is_url(root) else Path(root), refused)
    for rel, reason, detail in refused:
        tally(reason, rel, None, detail)
    taken = 0
    for file in files:
        counts["files"] += 1
        if file.size == 0:
            counts["empty"] += 1
            continue
        for doc in file_documents(spec, file, tally):
            yield doc
            taken += 1
            if spec.max_docs is not None and taken >= spec.max_docs:
                return


def file_documents(spec: SourceSpec, file: InputFile, tally: Tally) -> Iterator[dict[str, Any]]:
    """The documents of one file; what is skipped is counted in ``tally``, and its bytes in tally.input_bytes (read)
    or lost_bytes (in no record), which add up to the file's size. A local file that changed while it was read stops
    the source with a SourceError, whatever ``on_bad_input`` says."""
    counts = tally.counts
    before = tally.input_bytes + counts["lost_bytes"]
    try:
        for chunk in _READERS[spec.format](spec, file, tally):
            if not chunk.text.strip():
                counts["empty"] += 1
                continue
            try:
                size = len(chunk.text.encode("utf-8"))
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a JSON "\ud800" escape
                tally("decode_errors", file.rel, chunk.offset, f"record {chunk.suffix or 1}: text holds an unpaired "
                      f"surrogate U+{ord(chunk.text[e.start]):04X}, which UTF-8 cannot store")
                continue
            counts["documents"] += 1
            counts["bytes"] += size
            yield {
                "id": f"{spec.name}/{file.rel}{chunk.suffix}",
                "source": spec.name,
                "url": chunk.url or file.uri + (chunk.suffix if chunk.suffix.startswith("#") else ""),
                "text": chunk.text,
                "content_type": chunk.ctype,
                "bytes": size,
                "license": spec.license,
            }
    except OSError as e:  # a stream that breaks mid-file (network, truncated compression)
        _stop_if_changed(spec, file)
        lost = max(file.size - (tally.input_bytes + counts["lost_bytes"] - before), 0)
        tally("corrupt", file.rel, None, f"read failed: {e}; {lost} bytes not read", lost=lost)
    except SourceError:  # bad input that stops the run, which may be the file changing under the reader
        _stop_if_changed(spec, file)
        raise
    _stop_if_changed(spec, file)


def _stop_if_changed(spec: SourceSpec, file: InputFile) -> None:
    """A file that changed while it was read is not bad input to skip: what was read of it is no snapshot of it."""
    if file.change:
        raise SourceError(f"source '{spec.name}': file {file.rel} changed while it was read ({file.change}). "
                          f"Fix: rerun once it stops changing (copy it aside first if something keeps writing to it).")
