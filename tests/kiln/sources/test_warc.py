"""Tests for kiln.sources.warc: content-encoded HTTP bodies, and reading on past unreadable data with the bytes lost counted.

Run: python -m pytest tests/kiln/sources/test_warc.py -q   (one test reads the pinned pywb sdist's WARC files from the cache)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tests.kiln.sources.sources_kit import docs, local, page, warc_file

from kiln.sources import SourceError, fetch, load_manifest
from kiln.sources.listing import list_files

REPO = Path(__file__).resolve().parents[3]


def read_accounted(path: Path, **kw) -> tuple[list[dict], dict, int]:
    """(documents, stats, input bytes read) of one WARC file, through the per-file reader."""
    from kiln.sources.readers import file_documents
    from kiln.sources.tally import Tally

    spec = local(path, "warc", "w", **kw)
    stats: dict = {}
    tally = Tally(spec, stats)
    (file,) = list_files(spec, path.parent)
    return list(file_documents(spec, file, tally)), stats, tally.input_bytes


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
