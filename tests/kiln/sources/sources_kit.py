"""Helpers for the kiln.sources tests: a local SourceSpec and its documents, and WARC files built with FastWARC.

Import from a test in this folder: ``from sources_kit import local, docs, page, warc_file``.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

from kiln.sources import SourceSpec, fetch, iter_documents


def local(path: Path | str, fmt: str, name: str = "loc", **kw) -> SourceSpec:
    return SourceSpec(name=name, kind="local", format=fmt, license="test-licence", path=str(path), **kw)


def docs(spec: SourceSpec, stats: dict | None = None) -> list[dict]:
    return list(iter_documents(spec, fetch(spec, "unused-cache"), stats))


def page(html: bytes, headers: bytes = b"Content-Type: text/html; charset=utf-8\r\n", status: bytes = b"200 OK") -> bytes:
    """An HTTP response as a WARC response record's block holds it."""
    return b"HTTP/1.1 " + status + b"\r\n" + headers + b"\r\n" + html


def warc_file(blocks: list[tuple[str, bytes]], gz: bool = False, record_type: str = "response",
              digests: bool = True) -> tuple[bytes, list[int]]:
    """A WARC file of one record per (target URI, block), each its own gzip member when ``gz`` (as crawlers write
    them); returns the file's bytes and where each record starts."""
    from fastwarc.warc import WarcRecord, WarcRecordType

    out, starts = b"", []
    for uri, block in blocks:
        r = WarcRecord()
        r.init_headers(record_type=getattr(WarcRecordType, record_type))
        r.headers["WARC-Target-URI"] = uri
        if record_type == "response":
            r.headers["Content-Type"] = "application/http; msgtype=response"
        r.set_bytes_content(block)
        buf = io.BytesIO()
        r.write(buf, checksum_data=digests)
        starts.append(len(out))
        out += gzip.compress(buf.getvalue(), mtime=0) if gz else buf.getvalue()
    return out, starts
