"""Tests for kiln.sources.listing: symlinked files (the Hugging Face cache layout), unreadable links, packages' links,
file names that are not UTF-8, files that change while they are read.

Run: python -m pytest tests/kiln/sources/test_listing.py -q
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.kiln.sources.sources_kit import docs, local, page, warc_file

from kiln.sources import SourceError, SourceSpec, collect, iter_documents, pipeline
from kiln.sources.listing import list_files


def hf_snapshot(tmp_path: Path) -> Path:
    """A Hugging Face hub cache entry: snapshots/<revision>/ holds relative symlinks into the repo's blobs/."""
    repo = tmp_path / "hub" / "datasets--org--corpus"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0a1b2c"
    blobs.mkdir(parents=True)
    (snap / "data").mkdir(parents=True)
    (blobs / "5d41402a").write_text('{"text": "first"}\n{"text": "second"}\n', encoding="utf-8")
    (blobs / "7d793037").write_text('{"text": "third"}\n', encoding="utf-8")
    (snap / "data" / "train-0.jsonl").symlink_to("../../../blobs/5d41402a")
    (snap / "data" / "train-1.jsonl").symlink_to("../../../blobs/7d793037")
    return snap


def test_symlinked_files_of_a_local_folder_are_read(tmp_path: Path) -> None:
    snap = hf_snapshot(tmp_path)
    stats: dict = {}
    got = docs(local(snap, "jsonl", "hf"), stats)
    assert [(d["id"], d["text"]) for d in got] == [
        ("hf/data/train-0.jsonl#1", "first"), ("hf/data/train-0.jsonl#2", "second"), ("hf/data/train-1.jsonl#1", "third")]
    assert got[0]["url"] == (snap.resolve() / "data" / "train-0.jsonl").as_uri() + "#1"  # the link's name, not the blob
    assert (stats["files"], stats["documents"], stats["bad_link"]) == (2, 3, 0)
    assert [d["text"] for d in docs(local(snap / "data" / "train-1.jsonl", "jsonl"))] == ["third"]  # a linked file path
    assert len(docs(local(f"{snap}/data/*.jsonl", "jsonl"))) == 3  # and a glob over links


def test_unreadable_links_are_counted_with_their_reason(tmp_path: Path) -> None:
    snap = hf_snapshot(tmp_path)
    data = snap / "data"
    (data / "gone.jsonl").symlink_to("../../../blobs/deleted")  # the blob was pruned
    (data / "loop-a.jsonl").symlink_to("loop-b.jsonl")
    (data / "loop-b.jsonl").symlink_to("loop-a.jsonl")
    (data / "z-copy.jsonl").symlink_to("../../../blobs/7d793037")  # a second name of train-1.jsonl's blob
    stats: dict = {}
    got = docs(local(snap, "jsonl", "hf"), stats)
    assert [d["text"] for d in got] == ["first", "second", "third"] and stats["files"] == 2
    assert (stats["bad_link"], stats["duplicate"]) == (3, 1)
    seen = {s["file"]: (s["reason"], s["detail"]) for s in stats["skipped"]}
    assert seen["data/gone.jsonl"] == ("bad_link", "dangling symlink to '../../../blobs/deleted'")
    assert seen["data/loop-a.jsonl"][0] == "bad_link" and seen["data/loop-a.jsonl"][1].startswith("symlink loop")
    assert seen["data/z-copy.jsonl"] == ("duplicate", "same file as data/train-1.jsonl, read once")
    with pytest.raises(SourceError, match=r"source 'hf': data/gone\.jsonl: dangling symlink.*Fix: fix or remove"):
        docs(local(snap, "jsonl", "hf", on_bad_input="fail"))


def test_a_package_link_leading_out_stays_refused_and_is_counted(tmp_path: Path) -> None:
    root = tmp_path / "unpacked"
    (root / "doc").mkdir(parents=True)
    (root / "doc" / "page.html").write_text("<p>inside</p>", encoding="utf-8")
    (tmp_path / "private.html").write_text("<p>outside</p>", encoding="utf-8")
    (root / "doc" / "leak.html").symlink_to(tmp_path / "private.html")
    (root / "doc" / "same.html").symlink_to("page.html")  # inside the package: followed, and read once
    spec = SourceSpec(name="p", kind="pip", format="html", license="MIT", package="x", version="1", sha256="0" * 64,
                      include=["doc/*.html"])
    stats: dict = {}
    got = list(iter_documents(spec, root, stats))
    assert [(d["id"], d["text"]) for d in got] == [("p/doc/page.html", "<p>inside</p>")]
    assert (stats["bad_link"], stats["duplicate"], stats["files"]) == (1, 1, 1)
    leak = next(s for s in stats["skipped"] if s["reason"] == "bad_link")
    assert leak["file"] == "doc/leak.html" and "leads out of the package" in leak["detail"]


def test_a_dangling_link_under_a_file_url_is_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("kept", encoding="utf-8")
    (tmp_path / "d" / "b.txt").symlink_to(tmp_path / "d" / "missing.txt")
    stats: dict = {}
    got = docs(local(f"file://{tmp_path / 'd'}", "text", "u"), stats)
    assert [d["text"] for d in got] == ["kept"]
    assert stats["bad_link"] == 1 and stats["skipped"][0]["file"] == "b.txt"
    assert stats["skipped"][0]["detail"].startswith("unreadable link")


def test_file_names_that_are_not_utf8_are_read_and_shown_escaped(tmp_path: Path) -> None:
    folder = os.fsencode(tmp_path / "d")
    os.mkdir(folder)
    for name, data in ((b"caf\xe9.txt", b"bonjour"), (b"b.txt", b"plain"), (b"\xff.txt", b"bin\x00ary")):
        try:
            fd = os.open(folder + b"/" + name, os.O_WRONLY | os.O_CREAT)
        except OSError:  # a file system that holds UTF-8 names only (e.g. APFS)
            pytest.skip("this file system refuses names that are not UTF-8")
        os.write(fd, data)
        os.close(fd)
    os.symlink(b"gon\xe9", folder + b"/link\xe9.txt")
    out = tmp_path / "raw.parquet"
    result = collect([local(tmp_path / "d", "text")], tmp_path / "cache", out)
    rows = pq.read_table(out).to_pylist()
    assert [(r["id"], r["text"]) for r in rows] == [("loc/b.txt", "plain"), ("loc/caf\\xe9.txt", "bonjour")]
    assert rows[0]["url"] == (tmp_path / "d" / "b.txt").resolve().as_uri()  # ordinary names as before
    assert rows[1]["url"] == (tmp_path / "d").resolve().as_uri() + "/caf%E9.txt"
    skipped = {s["file"]: (s["reason"], s["detail"]) for s in result["sources"]["loc"]["skipped"]}
    assert skipped == {"link\\xe9.txt": ("bad_link", "dangling symlink to 'gon\\udce9'"),
                       "\\xff.txt": ("binary", "NUL bytes: a binary file, not text")}
    assert [d["id"] for d in docs(local(f"file://{tmp_path / 'd'}", "text", "u"))] == ["u/b.txt", "u/caf\\xe9.txt"]


@pytest.mark.parametrize("on_bad_input", [None, "fail"])  # "fail": the line cut in two must not be reported instead
def test_a_file_cut_short_while_it_is_read_stops_the_source_and_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_bad_input: str | None) -> None:
    path = tmp_path / "d" / "big.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": f"record {i} " + "x" * 80}) + "\n" for i in range(2000)))
    size = path.stat().st_size
    spec = local(tmp_path / "d", "jsonl", on_bad_input=on_bad_input)
    stats: dict = {}
    assert len(docs(spec, stats)) == 2000 and stats["lost_bytes"] == 0  # unchanged, it reads to the end
    monkeypatch.setattr(pipeline, "PROGRESS_EVERY", 1)  # a progress line after every document

    def cut(msg: str) -> None:  # after the first document, the file is cut to 10,000 bytes
        if msg.startswith("1 documents so far"):
            os.truncate(path, 10_000)

    out = tmp_path / "raw.parquet"
    with pytest.raises(SourceError, match=rf"^source 'loc': file big\.jsonl changed while it was read \(size "
                       rf"{size:,} -> 10,000 bytes\)\. Fix: rerun once it stops changing"):
        collect([spec], tmp_path / "cache", out, progress=cut)
    assert not out.exists()


def one_doc_file(path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pq.write_table(pa.table({"text": [path.stem]}), path)
    elif fmt == "warc":
        path.write_bytes(warc_file([(f"http://x/{path.stem}", page(path.stem.encode()))])[0])
    else:
        path.write_text(json.dumps({"text": path.stem}) if fmt == "jsonl" else path.stem, encoding="utf-8")


@pytest.mark.parametrize("change", ["append", "touch"])
@pytest.mark.parametrize("fmt, ext", [("jsonl", "jsonl"), ("text", "txt"), ("parquet", "parquet"), ("warc", "warc")])
def test_every_format_stops_at_a_file_changed_after_it_was_listed(tmp_path: Path, fmt: str, ext: str,
                                                                  change: str) -> None:
    a, b = tmp_path / f"a.{ext}", tmp_path / f"b.{ext}"
    one_doc_file(a, fmt)
    one_doc_file(b, fmt)
    size, st = b.stat().st_size, b.stat()
    assert [d["text"] for d in docs(local(tmp_path, fmt))] == ["a", "b"]
    got = iter_documents(local(tmp_path, fmt), tmp_path)
    assert next(got)["text"] == "a"  # b is listed; now it changes
    if change == "append":
        with open(b, "ab") as f:
            f.write(b"\n")
        what = rf"size {size:,} -> {size + 1:,} bytes"
    else:
        os.utime(b, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        what = "modified: its mtime changed, its size did not"
    with pytest.raises(SourceError, match=rf"source 'loc': file b\.{ext} changed while it was read \({what}\)"):
        list(got)


@pytest.mark.parametrize("read", [lambda f: f.read(), lambda f: f.read(4096), lambda f: f.readlines()],
                         ids=["read_all", "read_n", "readlines"])
def test_a_read_that_ends_before_the_listed_size_is_a_change_though_size_and_mtime_come_back(tmp_path: Path,
                                                                                             read) -> None:
    path = tmp_path / "a.txt"
    path.write_bytes(b"line\n" * 200)
    st = path.stat()
    (file,) = list_files(local(tmp_path, "text"), tmp_path)
    with file.open() as f:
        read(f)
    assert file.change == ""  # read to its end, unchanged
    with file.open() as f:
        os.truncate(path, 500)
        read(f)  # the end comes at byte 500
        os.truncate(path, 1000)  # as long again, and as old: only the short read tells
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file.change == "reading ended at byte 500 of 1,000"
