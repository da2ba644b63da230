"""Tests of kiln/sources/readers.py: local parsing (HTML, text, JSONL, separators, bad UTF-8 and JSON), WARC, WET and Parquet
(manifests, package fetch and collect: test_manifest.py, test_packages.py, test_pipeline.py).

Run: python -m pytest tests/kiln/sources/test_readers.py -q   (the WARC tests fetch the pinned pywb sdist once into the cache)
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kiln.sources import SourceError, SourceSpec, fetch, iter_documents, load_manifest
from ports import free_port

REPO = Path(__file__).resolve().parents[3]


def local(path: Path | str, fmt: str, name: str = "loc", **kw) -> SourceSpec:
    return SourceSpec(name=name, kind="local", format=fmt, license="test-licence", path=str(path), **kw)


def docs(spec: SourceSpec, stats: dict | None = None) -> list[dict]:
    return list(iter_documents(spec, fetch(spec, "unused-cache"), stats))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "web" / "sub").mkdir(parents=True)
    (root / "web" / "a.html").write_text("<html><body><p>Hello <b>web</b></p></body></html>", encoding="utf-8")
    (root / "web" / "sub" / "b.html").write_bytes(
        b'<html><head><meta http-equiv="Content-Type" content="text/html; charset=iso-8859-1"></head>'
        b"<body>St\xe9phane</body></html>"
    )
    (root / "notes.txt").write_text("\ufeffPlain notes.\n", encoding="utf-8")
    (root / "blank.txt").write_text("  \n\n", encoding="utf-8")
    lines = [{"text": "first", "u": "https://example.org/1"}, {"text": "second"}, {"text": "   "}]
    (root / "data.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n", encoding="utf-8")
    return root


def test_local_folder_html_text_jsonl(tree: Path) -> None:
    html = docs(local(tree, "html", "web"))
    assert [d["id"] for d in html] == ["web/web/a.html", "web/web/sub/b.html"]
    assert html[0]["text"].startswith("<html><body><p>Hello <b>web</b>")  # raw HTML kept
    assert html[1]["text"].endswith("<body>Stéphane</body></html>")  # declared charset honoured
    assert {d["content_type"] for d in html} == {"text/html"}
    assert html[0]["url"] == (tree / "web" / "a.html").resolve().as_uri()
    assert html[1]["bytes"] == len(html[1]["text"].encode("utf-8"))
    assert html[0]["license"] == "test-licence" and html[0]["source"] == "web"

    stats: dict = {}
    text = docs(local(tree, "text", "txt"), stats)
    assert [(d["id"], d["text"]) for d in text] == [("txt/notes.txt", "Plain notes.\n")]  # BOM dropped
    assert {k: v for k, v in stats.items() if v} == {"documents": 1, "bytes": 13, "files": 2, "empty": 1}

    stats = {}
    rows = docs(local(tree, "jsonl", "j", url_field="u"), stats)
    assert [(d["id"], d["text"], d["content_type"]) for d in rows] == [
        ("j/data.jsonl#1", "first", "text/plain"),
        ("j/data.jsonl#2", "second", "text/plain"),
    ]
    assert rows[0]["url"] == "https://example.org/1"
    assert rows[1]["url"].endswith("/data.jsonl#2") and rows[1]["url"].startswith("file://")
    assert stats["empty"] == 1


def test_local_path_as_file_glob_and_include(tree: Path) -> None:
    assert [d["id"] for d in docs(local(tree / "notes.txt", "text"))] == ["loc/notes.txt"]
    assert [d["id"] for d in docs(local(f"{tree}/web/**/*.html", "html"))] == ["loc/a.html", "loc/sub/b.html"]
    only = local(tree, "html", include=["web/*.html"], exclude=["*/a.*"])
    assert docs(only) == []
    with pytest.raises(SourceError, match="local path .* not found"):
        fetch(local(tree / "missing", "text"), "unused")


def test_separator_split_and_max_docs(tmp_path: Path) -> None:
    (tmp_path / "cookies").write_text("First quote.\n%\n  indented\n  art\n%\n\n%\nLast one.\n%\n", encoding="utf-8")
    stats: dict = {}
    got = docs(local(tmp_path / "cookies", "text", "f", separator="^%$"), stats)
    assert [(d["id"], d["text"]) for d in got] == [
        ("f/cookies#1", "First quote."),
        ("f/cookies#2", "  indented\n  art"),  # indentation kept, only the newlines around a chunk go
        ("f/cookies#4", "Last one."),
    ]
    assert got[0]["url"].endswith("/cookies#1")
    assert stats["empty"] == 2  # the blank chunk and the one after the final '%'
    assert len(docs(local(tmp_path / "cookies", "text", "f", separator="^%$", max_docs=2))) == 2


def test_invalid_utf8_skipped_and_counted_or_error(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    stats: dict = {}
    assert [d["text"] for d in docs(local(tmp_path, "text"), stats)] == ["fine"]  # default: skip and count
    assert stats["decode_errors"] == 1 and stats["files"] == 2
    assert stats["skipped"] == [{"file": "bad.txt", "offset": 3, "reason": "decode_errors",
                                 "detail": "not valid utf-8 (byte 0xe9)"}]
    with pytest.raises(SourceError) as err:
        docs(local(tmp_path, "text", on_bad_input="error"))
    msg = str(err.value)
    assert "bad.txt at byte 3" in msg and "on_bad_input: skip" in msg and "encoding:" in msg
    assert [d["text"] for d in docs(local(tmp_path, "text", encoding="latin-1"))] == ["café au lait", "fine"]

    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(SourceError, match="rows.jsonl line 2 at byte 28"):
        docs(local(tmp_path / "rows.jsonl", "jsonl", on_bad_input="error"))
    stats = {}
    assert [d["text"] for d in docs(local(tmp_path / "rows.jsonl", "jsonl"), stats)] == ["ok"]
    assert stats["decode_errors"] == 1 and stats["skipped"][0]["offset"] == 28


def test_bad_json_line_and_missing_field(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n\n{"text": "b",}\n{"text": "c"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"x\.jsonl at byte 15: line 3 is not valid JSON"):
        docs(local(tmp_path, "jsonl", on_bad_input="error"))
    stats: dict = {}
    assert [d["text"] for d in docs(local(tmp_path, "jsonl"), stats)] == ["a", "c"]
    assert stats["bad_record"] == 1 and stats["skipped"][0]["offset"] == 15
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match="no field 'text' .*body.*text_field"):
        docs(local(tmp_path, "jsonl"))


# ---------------------------------------------------------------------------------------------- WARC, WET, Parquet


@pytest.fixture(scope="session")
def pywb_warcs() -> Path:
    """The pywb 2.10.0 sdist's sample_archive/warcs, fetched by name with kiln.sources.fetch (sha256-pinned, cached)."""
    spec = load_manifest(REPO / "conf/sources/warc.yaml")[0]
    cache = os.environ.get("KILN_SOURCE_CACHE") or os.path.expanduser("~/.cache/kiln/sources")
    return fetch(spec, cache) / "pywb-2.10.0" / "sample_archive" / "warcs"


def test_warc_on_a_real_web_archive(pywb_warcs: Path) -> None:
    stats: dict = {}
    got = docs(local(pywb_warcs / "iana.warc.gz", "warc", "iana"), stats)
    assert len(got) == stats["documents"] == 16  # the HTTP 200 text/html responses
    assert stats["not_text"] == 32  # scripts, images, styles and redirects: skipped, counted
    first = got[0]
    assert first["id"] == "iana/iana.warc.gz@334" and first["url"] == "http://www.iana.org/"
    assert first["content_type"] == "text/html" and "Internet Assigned Numbers Authority" in first["text"]
    assert len({d["id"] for d in got}) == 16 and all(d["url"].startswith("http") for d in got)
    from kiln.clean.extract import html_to_text

    assert "Internet Assigned Numbers Authority" in html_to_text(first["text"])


def test_truncated_and_corrupt_warc_records_are_skipped_and_the_rest_kept(pywb_warcs: Path, tmp_path: Path) -> None:
    full = docs(local(pywb_warcs / "iana.warc.gz", "warc", "w"))
    data = (pywb_warcs / "iana.warc.gz").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "iana.warc.gz").write_bytes(data[: len(data) // 2])  # truncated mid-record
    stats: dict = {}
    cut = docs(local(tmp_path / "cut" / "iana.warc.gz", "warc", "w"), stats)
    assert 0 < len(cut) < len(full) and cut == full[: len(cut)]  # what is kept is intact
    assert stats["corrupt"] == 1 and stats["skipped"][-1]["reason"] == "corrupt"
    assert stats["skipped"][-1]["file"] == "iana.warc.gz" and stats["skipped"][-1]["offset"] > 0

    stats = {}  # in pywb's example.warc a request's Content-Length is short: 7 bytes after it are no header
    got = docs(local(pywb_warcs / "example.warc", "warc", "w"), stats)
    assert [d["url"] for d in got] == ["http://example.com?example=1"] and "Example Domain" in got[0]["text"]
    assert stats["corrupt"] == 1 and stats["skipped"][0]["offset"] == 4764  # where the unreadable bytes start
    assert "Invalid WARC header" in stats["skipped"][0]["detail"]
    assert stats["lost_bytes"] == 7 and stats["not_text"] == 1  # reading resumed at the next record (a 302)


def test_warc_record_failing_its_digest_is_skipped(tmp_path: Path) -> None:
    from fastwarc.warc import WarcRecord, WarcRecordType

    page = lambda title: (b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n"  # noqa: E731
                          b"<html><head><title>" + title + b"</title></head><body><p>Body</p></body></html>")
    buf = io.BytesIO()
    for i, title in enumerate([b"First", b"Second", b"Third"]):
        r = WarcRecord()
        r.init_headers(record_type=WarcRecordType.response)
        r.headers["WARC-Target-URI"] = f"https://site.example/{i}"
        r.headers["Content-Type"] = "application/http; msgtype=response"
        r.set_bytes_content(page(title))
        r.write(buf, checksum_data=True)
    data = bytearray(buf.getvalue())
    data[data.index(b"Second")] = ord("Z")  # altered in transit: the block digest no longer matches
    (tmp_path / "site.warc").write_bytes(bytes(data))
    stats: dict = {}
    got = docs(local(tmp_path / "site.warc", "warc", "s"), stats)
    assert [d["url"] for d in got] == ["https://site.example/0", "https://site.example/2"]
    assert stats["corrupt"] == 1 and stats["skipped"][0]["reason"] == "corrupt" and stats["skipped"][0]["offset"] > 0
    with pytest.raises(SourceError, match=r"site\.warc at byte \d+: block digest mismatch"):
        docs(local(tmp_path / "site.warc", "warc", "s", on_bad_input="error"))


def write_wet(path: Path, records: list[tuple[str, bytes]]) -> Path:
    """A WET file (conversion records with digests) written with FastWARC's record writer."""
    from fastwarc.warc import WarcRecord, WarcRecordType

    with open(path, "wb") as f:
        for uri, body in records:
            r = WarcRecord()
            r.init_headers(record_type=WarcRecordType.conversion)
            r.headers["WARC-Target-URI"] = uri
            r.set_bytes_content(body)
            r.write(f, checksum_data=True)
    return path


def test_wet_records_with_bad_input(tmp_path: Path) -> None:
    write_wet(tmp_path / "crawl.warc.wet", [
        ("https://a.example/1", "First page text, caf\u00e9.\n".encode()),
        ("https://a.example/2", b"caf\xe9 latin-1 bytes"),  # invalid UTF-8
        ("https://a.example/3", b"x" * 5000),  # over max_record_bytes below
        ("https://a.example/4", b"\x89PNG\r\n\x1a\n\x00\x00binary"),
        ("https://a.example/5", b"Last page."),
    ])
    stats: dict = {}
    got = docs(local(tmp_path / "crawl.warc.wet", "wet", "cc", max_record_bytes=4096), stats)
    assert [(d["url"], d["text"], d["content_type"]) for d in got] == [
        ("https://a.example/1", "First page text, café.\n", "text/plain"), ("https://a.example/5", "Last page.")
        + ("text/plain",)]
    assert (stats["decode_errors"], stats["too_large"], stats["binary"]) == (1, 1, 1)
    assert [s["reason"] for s in stats["skipped"]] == ["decode_errors", "too_large", "binary"]
    assert all(s["file"] == "crawl.warc.wet" and s["offset"] > 0 for s in stats["skipped"])


def test_binary_empty_and_huge_line_inputs_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Plain words.", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"GIF89a\x00\x01\x02")
    (tmp_path / "c.txt").write_bytes(b"")
    stats: dict = {}
    assert [d["text"] for d in docs(local(tmp_path, "text"), stats)] == ["Plain words."]
    assert (stats["binary"], stats["empty"], stats["files"]) == (1, 1, 3)
    assert stats["skipped"][0] == {"file": "b.txt", "offset": 6, "reason": "binary",
                                   "detail": "NUL bytes: a binary file, not text"}

    huge = b'{"text": "' + b"a" * 300_000 + b'"}\n'
    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "one"}\n' + huge + b'{"text": "two"}\n')
    stats = {}
    got = docs(local(tmp_path / "rows.jsonl", "jsonl", max_record_bytes=1000), stats)
    assert [d["text"] for d in got] == ["one", "two"] and [d["id"] for d in got] == ["loc/rows.jsonl#1", "loc/rows.jsonl#3"]
    assert stats["too_large"] == 1 and stats["skipped"][0]["offset"] == 16


def test_parquet_and_fsspec_urls(tmp_path: Path) -> None:
    import fsspec
    import pyarrow as pa

    table = pa.table({"body": ["alpha text", None, "gamma text"], "link": ["https://x.example/a", None, None]})
    fs = fsspec.filesystem("memory")
    with fs.open("/kiln-test/part-0.parquet", "wb") as f:
        pq.write_table(table, f)
    spec = local("memory://kiln-test/*.parquet", "parquet", "pq", text_field="body", url_field="link")
    stats: dict = {}
    got = docs(spec, stats)
    assert [(d["id"], d["text"], d["url"]) for d in got] == [
        ("pq/part-0.parquet#1", "alpha text", "https://x.example/a"),
        ("pq/part-0.parquet#3", "gamma text", "memory:///kiln-test/part-0.parquet#3")]
    assert stats["empty"] == 1
    with pytest.raises(SourceError, match="no column 'text'"):
        docs(local("memory://kiln-test/*.parquet", "parquet", "pq"))
    fs.rm("/kiln-test", recursive=True)

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text('{"text": "from a file URL"}\n', encoding="utf-8")
    got = docs(local(f"file://{tmp_path / 'd'}", "jsonl", "u"))
    assert [(d["id"], d["text"]) for d in got] == [("u/x.jsonl#1", "from a file URL")]


def test_warc_streamed_from_s3(pywb_warcs: Path) -> None:
    """An s3:// source read through fsspec (s3fs) from a local S3 server (moto), never copied to disk."""
    moto_server = pytest.importorskip("moto.server")
    
    import boto3

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        creds = {"aws_access_key_id": "test", "aws_secret_access_key": "test", "region_name": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=endpoint, **creds)
        s3.create_bucket(Bucket="crawl")
        s3.upload_file(str(pywb_warcs / "iana.warc.gz"), "crawl", "2024/iana.warc.gz")
        spec = local("s3://crawl/2024/*.warc.gz", "warc", "cc", storage_options={
            "endpoint_url": endpoint, "key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}})
        stats: dict = {}
        got = docs(spec, stats)
        assert len(got) == 16 and got[0]["id"] == "cc/iana.warc.gz@334" and got[0]["url"] == "http://www.iana.org/"
        assert stats["files"] == 1 and stats["not_text"] == 32
    finally:
        server.stop()
