"""WARC and WET records as documents, streamed with FastWARC: HTTP 200 text/HTML responses (warc, content-encoding
undone) or conversion records (wet); past unreadable data, reading resumes at the next record and the bytes lost are counted.

Use from Python: ``for chunk in read_warc(spec, file, tally): ...`` (``readers.iter_documents`` calls it per file).
"""

from __future__ import annotations

import re
import zlib
from typing import IO, Any, Generator, Iterator, NamedTuple

from kiln.sources.decode import ContentError, decode, is_binary, undo_content_encoding
from kiln.sources.listing import Chunk, InputFile
from kiln.sources.manifest import SourceSpec
from kiln.sources.tally import Tally

_TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")
_RESYNC = (b"\x1f\x8b\x08", b"\nWARC/1.")  # where a record can start: a gzip member, a WARC version line
_BLOCK = 1 << 20


class _Last(NamedTuple):
    pos: int  # where the record starts in the file
    length: int  # its Content-Length
    whole: bool  # False when the file ends inside it


def read_warc(spec: SourceSpec, file: InputFile, tally: Tally) -> Iterator[Chunk]:
    """The file's documents. After unreadable data (a gzip error, a malformed header, a cut-off member) reading
    resumes at the next gzip member or WARC header that reads; the bytes in between are one counted 'corrupt' skip
    and add to lost_bytes, so input_bytes + lost_bytes == the file size."""
    with file.open() as f:
        start = 0
        while start < file.size:
            f.seek(start)
            end, error = yield from _segment(spec, file, tally, f, start)
            tally.read(end - start)
            if error is None:
                return
            if tally.stops("corrupt"):
                tally("corrupt", file.rel, end, f"unreadable WARC data ({error[:100]})")
            start = _resync(f, end + 1, file.size)
            after = f"reading resumed at byte {start}" if start < file.size else "to the end of the file"
            tally("corrupt", file.rel, end, f"unreadable WARC data ({error[:100]}): {start - end} bytes lost, {after}",
                  lost=start - end)


def _segment(spec: SourceSpec, file: InputFile, tally: Tally, f: IO[bytes],
             start: int) -> Generator[Chunk, None, tuple[int, str | None]]:
    """Yield the documents of the records from byte ``start`` on; return (end of the last whole record, the error
    that stopped reading, or None when the rest of the file was read)."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    wanted = WarcRecordType.conversion if spec.format == "wet" else WarcRecordType.response
    records = ArchiveIterator(f, record_types=WarcRecordType.any_type, parse_http=False, fsspec_args=False)
    last: _Last | None = None
    same = 0  # records so far at the same position: one gzip member holding several records
    while True:
        try:
            record = next(records)
        except StopIteration:
            return _tail(f, last, start, file.size)
        except (OSError, ValueError) as e:
            return _end(f, last, start, file.size), str(e) or type(e).__name__
        pos, length = record.stream_pos, record.content_length  # of the whole block: parse_http changes it
        try:
            chunk, whole = _record(spec, file, tally, record, wanted)
        except (OSError, ValueError) as e:  # the record's own data does not read
            return max(pos, start), f"unreadable record ({e})"
        same = same + 1 if last is not None and pos <= last.pos else 0
        if chunk is not None and same:
            chunk = chunk._replace(suffix=f"@{pos}.{same}")
        last = _Last(pos, length, whole)
        if chunk is not None:
            yield chunk


def _record(spec: SourceSpec, file: InputFile, tally: Tally, record: Any, wanted: int) -> tuple[Chunk | None, bool]:
    """One record: (its document, or None when skipped and counted; False when the file ends inside it)."""
    pos, length = record.stream_pos, record.content_length
    if not record.record_type & wanted:  # requests, metadata, warcinfo: read, not documents
        return None, True
    if length > spec.max_record_bytes:
        tally("too_large", file.rel, pos, f"record of {length} bytes > max_record_bytes")
        return None, True
    if "WARC-Block-Digest" in record.headers and not record.verify_block_digest(consume=False):
        got = len(record.reader.read())
        if got < length:
            tally("corrupt", file.rel, pos, f"truncated record: {got} of {length} bytes")
            return None, False
        tally("corrupt", file.rel, pos, "block digest mismatch: a truncated or altered record")
        return None, True
    if spec.format == "wet":
        ctype, declared, coding = "text/plain", "utf-8", None
    else:
        record.parse_http()  # after the digest check, which covers the HTTP headers too
        status = record.http_headers.status_code if record.http_headers is not None else None
        ctype = (record.http_content_type or "").lower()
        if status != 200 or not ctype.startswith(_TEXT_TYPES):
            tally("not_text", file.rel, pos, f"HTTP {status} {ctype or 'no content type'}")
            return None, True
        ctype = "text/plain" if ctype.startswith("text/plain") else "text/html"
        declared, coding = record.http_charset, record.http_headers.get("Content-Encoding")
    length = record.content_length
    body = record.reader.read()
    if len(body) < length:  # the file ends inside this record
        tally("corrupt", file.rel, pos, f"truncated record: {len(body)} of {length} bytes")
        return None, False
    return _document(spec, file, tally, record, body, ctype, declared, coding), True


def _document(spec: SourceSpec, file: InputFile, tally: Tally, record: Any, body: bytes, ctype: str,
              declared: str | None, coding: str | None) -> Chunk | None:
    pos = record.stream_pos
    if coding:
        try:
            body = undo_content_encoding(body, coding, spec.max_record_bytes)
        except ContentError as e:
            tally(e.reason, file.rel, pos, str(e))
            return None
    if is_binary(body):
        tally("binary", file.rel, pos, "record body holds NUL bytes")
        return None
    text = decode(spec, body, file.rel, pos, tally, declared=None if spec.encoding else declared)
    if text is None:
        return None
    return Chunk(f"@{pos}", text, record.headers.get("WARC-Target-URI") or None, ctype, pos)


def _end(f: IO[bytes], last: _Last | None, start: int, size: int) -> int:
    """Where the last whole record ends (its start when that cannot be told), for a read that failed after it."""
    if last is None:
        return start
    end = _record_end(f, last.pos, last.length, size)
    return min(max(last.pos if end is None else end, start), size)


def _tail(f: IO[bytes], last: _Last | None, start: int, size: int) -> tuple[int, str | None]:
    """(end, error) when FastWARC stopped: the whole file, unless bytes after the last record are not blank."""
    if last is not None and not last.whole:  # a truncated record, already counted: it runs to the end
        return size, None
    if last is None:
        end: int | None = start
        error = "no WARC record here"
    else:
        end = _record_end(f, last.pos, last.length, size)
        error = "data after the last record is not a WARC record"
        if end is None:
            end, error = last.pos, "the file ends inside a gzip member or record"
    f.seek(end)
    if end >= size or (size - end <= 4096 and not f.read().strip()):
        return size, None
    return end, error


def _record_end(f: IO[bytes], pos: int, length: int, size: int) -> int | None:
    """The offset just past the record at ``pos``: its gzip member's end, or its header, block and CRLF CRLF."""
    f.seek(pos)
    if f.read(2) == b"\x1f\x8b":
        return _member_end(f, pos)
    f.seek(pos)
    blank = re.search(rb"\n\r*\n", f.read(64 << 10))  # the blank line after the header (CRLF, or as written)
    if blank is None:
        return None
    end = pos + blank.end() + length
    f.seek(end)
    tail = f.read(8)
    return min(end + len(tail) - len(tail.lstrip(b"\r\n")), size)  # the CRLF CRLF after the block


def _member_end(f: IO[bytes], pos: int) -> int | None:
    """The end of the gzip member at ``pos`` (decompressed in bounded pieces, output dropped); None if it does not end."""
    f.seek(pos)
    d, fed = zlib.decompressobj(31), 0
    while not d.eof:
        data = f.read(1 << 16)
        if not data:
            return None
        fed += len(data)
        try:
            while data and not d.eof:
                d.decompress(data, 1 << 20)
                data = d.unconsumed_tail
        except zlib.error:
            return None
    return pos + fed - len(d.unused_data)


def _resync(f: IO[bytes], start: int, size: int) -> int:
    """The first offset from ``start`` on where a gzip member or a WARC header starts that reads; else ``size``."""
    pos = max(start - 1, 0)  # one byte back: a header line is found by the newline before it
    while pos < size:
        f.seek(pos)
        block = f.read(_BLOCK)
        hits = sorted(m.start() + (magic[0] == 10) for magic in _RESYNC for m in re.finditer(re.escape(magic), block))
        for hit in hits:
            if pos + hit >= start and _plausible(f, pos + hit):
                return pos + hit
        if len(block) < _BLOCK:
            break
        pos += len(block) - 8  # overlap, so a marker across two blocks is found
    return size


def _plausible(f: IO[bytes], pos: int) -> bool:
    """A gzip member that decompresses to a WARC header, or a WARC version line."""
    f.seek(pos)
    head = f.read(1 << 14)
    if head.startswith(b"\x1f\x8b"):
        try:
            return zlib.decompressobj(31).decompress(head, 16).startswith(b"WARC/")
        except zlib.error:
            return False
    return re.match(rb"WARC/1\.\d\r?\n", head) is not None
