"""Tests for kiln.sources.warc: content-encoded HTTP bodies, and reading on past unreadable data with the bytes lost counted.

Run: python -m pytest tests/kiln/sources/test_warc.py -q   (one test reads the pinned pywb sdist's WARC files from the cache)
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import pytest
from tests.kiln.sources.sources_kit import docs, local, page, warc_file

from kiln.sources import SourceError, fetch, load_manifest
from kiln.sources.listing import list_files

REPO = Path(__file__).resolve().parents[3]
HTML = "<html><body><p>Caf\u00e9 cr\u00e8me, served compressed.</p></body></html>".encode()


def encoded(coding: str, body: bytes) -> bytes:
    return page(body, b"Content-Type: text/html; charset=utf-8\r\nContent-Encoding: " + coding.encode() + b"\r\n")


def read_accounted(path: Path, **kw) -> tuple[list[dict], dict, int]:
    """(documents, stats, input bytes read) of one WARC file, through the per-file reader."""
    from kiln.sources.readers import file_documents
    from kiln.sources.tally import Tally

    spec = local(path, "warc", "w", **kw)
    stats: dict = {}
    tally = Tally(spec, stats)
    (file,) = list_files(spec, path.parent)
    return list(file_documents(spec, file, tally)), stats, tally.input_bytes


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


def five_pages(gz: bool) -> tuple[bytes, list[int]]:
    return warc_file([(f"https://site.example/{i}", page(f"<html><body><p>Page {i}: ".encode() + b"word " * 200
                                                          + b"</p></body></html>")) for i in range(5)], gz=gz)


def test_a_gzip_error_mid_file_loses_only_that_member_and_counts_its_bytes(tmp_path: Path) -> None:
    data, starts = five_pages(gz=True)
    damaged = bytearray(data)
    damaged[starts[2] + 20 : starts[2] + 40] = b"\xff" * 20  # inside the third record's deflate stream
    (tmp_path / "crawl.warc.gz").write_bytes(bytes(damaged))
    stats: dict = {}
    got = docs(local(tmp_path / "crawl.warc.gz", "warc", "w"), stats)
    assert [d["url"] for d in got] == [f"https://site.example/{i}" for i in (0, 1, 3, 4)]  # the later ones too
    lost = starts[3] - starts[2]
    assert (stats["corrupt"], stats["lost_bytes"]) == (1, lost)
    assert read_accounted(tmp_path / "crawl.warc.gz")[2] + lost == len(data)
    assert stats["skipped"] == [{"file": "crawl.warc.gz", "offset": starts[2], "reason": "corrupt", "detail":
                                 f"unreadable WARC data (Gzip decompression error: data error): {lost} bytes lost, "
                                 f"reading resumed at byte {starts[3]}"}]
    with pytest.raises(SourceError, match=rf"crawl\.warc\.gz at byte {starts[2]}: unreadable WARC data .*Fix: "):
        docs(local(tmp_path / "crawl.warc.gz", "warc", "w", on_bad_input="fail"))


def test_garbage_between_or_after_records_is_lost_and_counted_the_rest_read(tmp_path: Path) -> None:
    data, starts = five_pages(gz=False)
    junk = b"\x00\x17 stray bytes\r\n"
    (tmp_path / "plain.warc").write_bytes(data[: starts[3]] + junk + data[starts[3]:])
    stats: dict = {}
    got = docs(local(tmp_path / "plain.warc", "warc", "w"), stats)
    assert len(got) == 5 and (stats["corrupt"], stats["lost_bytes"]) == (1, len(junk))
    assert stats["skipped"][0]["offset"] == starts[3]
    assert read_accounted(tmp_path / "plain.warc")[2] == len(data)  # every record's bytes, the junk's lost

    gz, _ = five_pages(gz=True)
    (tmp_path / "tail.warc.gz").write_bytes(gz + b"\x1f\x8b\x08\x00 cut-off member")
    stats = {}
    got = docs(local(tmp_path / "tail.warc.gz", "warc", "w"), stats)
    assert len(got) == 5 and (stats["corrupt"], stats["lost_bytes"]) == (1, 19)
    assert read_accounted(tmp_path / "tail.warc.gz")[2] == len(gz)
    assert stats["skipped"][0]["detail"].endswith("19 bytes lost, to the end of the file")


def test_a_real_web_archive_damaged_mid_file_keeps_the_records_after_the_damage(tmp_path: Path) -> None:
    spec = load_manifest(REPO / "conf/sources/warc.yaml")[0]
    cache = os.environ.get("KILN_SOURCE_CACHE") or os.path.expanduser("~/.cache/kiln/sources")
    original = fetch(spec, cache) / "pywb-2.10.0" / "sample_archive" / "warcs" / "iana.warc.gz"
    full = docs(local(original, "warc", "w"))
    data = bytearray(original.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 50] = b"\x00" * 50
    (tmp_path / "iana.warc.gz").write_bytes(bytes(data))
    stats: dict = {}
    got = docs(local(tmp_path / "iana.warc.gz", "warc", "w"), stats)
    assert stats["corrupt"] == 1 and 0 < stats["lost_bytes"] < 300_000
    lost_from = stats["skipped"][0]["offset"]
    before = [d for d in full if int(d["id"].rsplit("@", 1)[1]) < lost_from]
    after = [d for d in full if int(d["id"].rsplit("@", 1)[1]) >= lost_from + stats["lost_bytes"]]
    assert after and got == before + after  # every page outside the damaged member is kept, intact
    assert read_accounted(tmp_path / "iana.warc.gz")[2] + stats["lost_bytes"] == len(data)
