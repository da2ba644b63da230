"""Bytes to text for the readers: the charset (configured, declared or UTF-8), a binary check, and HTTP
content-encodings (gzip, deflate, br) undone with output bounded by ``max_record_bytes``.

Use from Python: ``text = decode(spec, data, "a.html", 0, tally)``; ``body = undo_content_encoding(body, "gzip", 1 << 20)``.
"""

from __future__ import annotations

import codecs
import re
import zlib

from kiln.sources.manifest import SourceSpec
from kiln.sources.tally import Tally

_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_XML_ENCODING = re.compile(rb"""<\?xml[^>]*encoding\s*=\s*["']([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


def is_text_encoding(name: str) -> bool:
    """A codec that turns bytes into text (not 'rot13', 'hex' or 'zlib', which ``bytes.decode`` refuses)."""
    try:
        b"x".decode(name, "ignore")  # b"" would not tell
    except LookupError:
        return False
    return True


def charset(spec: SourceSpec, data: bytes, declared: str | None = None) -> str:
    """The codec name for ``data``: the source's ``encoding``, else the declared one (HTTP, or an HTML meta tag or
    XML declaration for html and warc), else UTF-8; an unknown or non-text declared name falls back to UTF-8."""
    encoding = spec.encoding or declared or "utf-8"
    if spec.encoding is None and declared is None and spec.format in ("html", "warc"):
        head = data[:4096]
        m = _CHARSET.search(head) or _XML_ENCODING.search(head)
        if m:
            encoding = m.group(1).decode("ascii", "replace")
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return "utf-8"
    return name if is_text_encoding(name) else "utf-8"


def decode(spec: SourceSpec, data: bytes, rel: str, offset: int, tally: Tally, declared: str | None = None,
           record: str = "") -> str | None:
    """``data`` as text, or None after counting it as decode_errors (with the byte offset of the first bad byte)."""
    encoding = charset(spec, data, declared)
    try:
        return data.decode("utf-8-sig" if encoding == "utf-8" else encoding)  # utf-8-sig also drops a BOM
    except UnicodeDecodeError as e:
        bad = f" (byte 0x{data[e.start]:02x})" if e.start < len(data) else " (cut off at the end)"
        tally("decode_errors", rel, offset + e.start, f"not valid {encoding}{bad}",
              "set `encoding:` on the source to the files' real encoding, or exclude the file", record=record)
        return None


def is_binary(data: bytes) -> bool:
    """NUL bytes in the first 8 KiB: an image, archive or other binary file, not text."""
    return b"\x00" in data[:8192]


class ContentError(ValueError):
    """An HTTP body that cannot be decoded; ``reason`` is its skip reason (corrupt, too_large, unsupported_encoding)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def undo_content_encoding(body: bytes, header: str, limit: int) -> bytes:
    """The body with its Content-Encoding (e.g. "gzip", "deflate", "br", "gzip, br") undone, last applied first;
    output over ``limit`` bytes (a decompression bomb or a huge page) raises ContentError("too_large")."""
    if not body:
        return body
    for name in reversed([c.strip().lower() for c in header.split(",")]):
        if name in ("", "identity"):
            continue
        if name in ("gzip", "x-gzip", "deflate"):
            body = _inflate(body, name, limit)
        elif name == "br":
            body = _unbrotli(body, limit)
        else:
            raise ContentError("unsupported_encoding", f"unsupported content-encoding {name[:40]}")
    return body


def _inflate(body: bytes, name: str, limit: int) -> bytes:
    """gzip or deflate; deflate comes zlib-wrapped (RFC 1950) or, from some servers, raw (RFC 1951)."""
    failure = None
    for wbits in (47, -15):  # 47: a gzip or zlib header, detected; -15: raw deflate
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, limit + 1)
        except zlib.error as e:
            failure = failure or ContentError("corrupt", f"{name} body does not decompress ({e})")
            continue
        if len(out) > limit:
            raise ContentError("too_large", f"{name} body decodes to over max_record_bytes={limit}")
        if d.eof:
            return out
        failure = failure or ContentError("corrupt", f"{name} body is cut off ({len(body)} bytes, stream incomplete)")
    raise failure


def _unbrotli(body: bytes, limit: int) -> bytes:
    try:
        import brotli  # Google's binding; optional
    except ImportError:
        raise ContentError("unsupported_encoding", "unsupported content-encoding br (install brotli)") from None
    d = brotli.Decompressor()
    try:
        out = d.process(body, output_buffer_limit=limit + 1)
    except brotli.error as e:
        raise ContentError("corrupt", f"br body does not decompress ({e})") from None
    if len(out) > limit:
        raise ContentError("too_large", f"br body decodes to over max_record_bytes={limit}")
    if not d.is_finished():
        raise ContentError("corrupt", f"br body is cut off ({len(body)} bytes, stream incomplete)")
    return out
