"""Tests of kiln/sources/decode.py: content-encoded WARC bodies are decoded, and bodies that do not decode are counted by
cause."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from tests.kiln.sources.sources_kit import docs, local, page, warc_file

HTML = "<html><body><p>Caf\u00e9 cr\u00e8me, served compressed.</p></body></html>".encode()


def encoded(coding: str, body: bytes) -> bytes:
    return page(body, b"Content-Type: text/html; charset=utf-8\r\nContent-Encoding: " + coding.encode() + b"\r\n")


def test_content_encoded_bodies_are_decoded(tmp_path: Path) -> None:
    import brotli

    raw_deflate = zlib.compressobj(wbits=-15)
    bodies = {
        "gzip": gzip.compress(HTML), "x-gzip": gzip.compress(HTML), "deflate": zlib.compress(HTML),
        "deflate ": raw_deflate.compress(HTML) + raw_deflate.flush(),  # raw RFC 1951, as some servers send it
        "br": brotli.compress(HTML), "gzip, br": brotli.compress(gzip.compress(HTML)), "identity": HTML,
    }
    data, _ = warc_file([(f"https://enc.example/{i}", encoded(c, b)) for i, (c, b) in enumerate(bodies.items())])
    (tmp_path / "enc.warc").write_bytes(data)
    stats: dict = {}
    got = docs(local(tmp_path / "enc.warc", "warc", "e"), stats)
    assert [d["text"] for d in got] == [HTML.decode()] * len(bodies)
    assert (stats["binary"], stats["decode_errors"], stats["corrupt"]) == (0, 0, 0)


def test_bodies_that_do_not_decode_are_counted_by_cause(tmp_path: Path) -> None:
    bomb = gzip.compress(b"<p>" + b"a" * 2_000_000 + b"</p>")  # 2 MB of page from 2 KB
    cut = gzip.compress(HTML)[:-12]
    data, starts = warc_file([
        ("https://enc.example/zstd", encoded("zstd", b"(\xb5/\xfd...")),
        ("https://enc.example/cut", encoded("gzip", cut)),
        ("https://enc.example/bad", encoded("deflate", b"not deflate data at all")),
        ("https://enc.example/bomb", encoded("gzip", bomb)),
        ("https://enc.example/ok", encoded("gzip", gzip.compress(HTML))),
    ])
    (tmp_path / "enc.warc").write_bytes(data)
    stats: dict = {}
    got = docs(local(tmp_path / "enc.warc", "warc", "e", max_record_bytes=100_000), stats)
    assert [d["url"] for d in got] == ["https://enc.example/ok"]
    assert (stats["unsupported_encoding"], stats["corrupt"], stats["too_large"]) == (1, 2, 1)
    assert [(s["offset"], s["reason"], s["detail"]) for s in stats["skipped"]] == [
        (starts[0], "unsupported_encoding", "unsupported content-encoding zstd"),
        (starts[1], "corrupt", f"gzip body is cut off ({len(cut)} bytes, stream incomplete)"),
        (starts[2], "corrupt", "deflate body does not decompress (Error -3 while decompressing data: incorrect "
                               "header check)"),
        (starts[3], "too_large", "gzip body decodes to over max_record_bytes=100000"),
    ]
