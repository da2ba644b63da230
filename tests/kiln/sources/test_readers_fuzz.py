"""Fuzz tests for every reader (JSONL, text, HTML, Parquet, WARC, WET) and for unpacking package archives.

Run: python -m pytest tests/kiln/sources/test_readers_fuzz.py -q   (seeded; ``KILN_FUZZ_CASES=1000`` per format and
``KILN_FUZZ_SEED=N`` for a longer or different run; hypothesis is not installed, so this is a seeded random loop)

Each case mutates a valid seed file of the format (random bytes, truncation, bit flips, inserted, deleted or repeated
runs, NUL bytes, a huge field, deep nesting, a wrong or odd encoding) and reads it in each ``on_bad_input`` mode:

- no crash: "skip" never raises; "fail" raises SourceError exactly when "skip" counted bad input (any skip reason
  but not_text and duplicate), the default exactly when "skip" counted missing_field or wrong_type; nothing else
  is ever raised, and where nothing raises every mode yields the same documents;
- no hang: every read of a case ends within CASE_SECONDS of wall-clock time (SIGALRM interrupts one stuck in Python);
- every document is usable: non-blank text that UTF-8 can store (collect writes it to Parquet), unique ids;
- every input byte is accounted for as a document or a counted skip. Per format, "accounted for" means:
  * jsonl: the file is split into lines at b"\\n" (the last one may lack it). A blank line (whitespace only,
    within max_record_bytes) is no record; every other line is exactly one record, and
    documents + empty + (sum of the skip counts) == that number of records. The reader read every line:
    input_bytes == file size and lost_bytes == 0 (bytes of documents' lines + bytes of skipped lines + bytes of blank
    lines == file size).
  * text, html: the file is one record: it gives one or more documents or empty chunks and no skip, or exactly one
    counted skip and nothing else; input_bytes == file size, lost_bytes == 0.
  * parquet: accounted in rows. If the footer does not read, the file is one counted 'corrupt' skip and nothing
    else; otherwise documents + empty + (sum of the skip counts) == the footer's row count (a file without the
    text column, or with a non-string one, counts its rows, at least 1); the footer's row count is the sum of its
    row groups' counts (a damaged footer may state a different total); input_bytes == file size.
  * warc, wet: bytes of records read (documents, counted skips and records of other WARC types, which the format
    ignores by design) + lost_bytes (stretches that read as no record: each one 'corrupt' skip whose detail names
    its size) == file size; and the sizes named in those details add up to lost_bytes.
  * archives (wheel, sdist, deb): unpacking succeeds with every file inside the destination, or raises SourceError.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
import signal
import time
import zipfile
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.kiln.sources.sources_kit import local, page, warc_file

from kiln.sources import SourceError, SourceSpec, packages
from kiln.sources.listing import list_files
from kiln.sources.readers import file_documents
from kiln.sources.tally import EXPECTED, SCHEMA, SKIP_LOG_MAX, SKIP_REASONS, Tally

CASES = int(os.environ.get("KILN_FUZZ_CASES", "60"))  # per format and mutation family, below
SEED = int(os.environ.get("KILN_FUZZ_SEED", "17"))
CASE_SECONDS = 10.0  # per read; generous for a loaded 2-core machine (a case takes milliseconds)
LIMIT = 20_000  # max_record_bytes for the fuzzed sources, so a "huge" field is cheap to make
NAMES = {"jsonl": "f.jsonl", "text": "f.txt", "html": "f.html", "parquet": "f.parquet", "warc": "f.warc.gz",
         "wet": "f.warc.wet"}
WORDS = ["caf\u00e9", "na\u00efve", "\u65e5\u672c\u8a9e", "stra\u00dfe", "\U0001f600", "plain", "words", "here"]


class Hang(Exception):
    pass


def _alarm(_sig, _frame):
    raise Hang(f"a read ran past {CASE_SECONDS}s")


# ------------------------------------------------------------------------------------------------- seeds


def sentence(rng: random.Random, n: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def seed_file(fmt: str, rng: random.Random) -> bytes:
    """A valid file of the format, a few records long."""
    if fmt == "jsonl":
        rows = [{"text": sentence(rng), "url": f"https://x.example/{i}"} for i in range(5)] + [{"text": None}]
        return ("\n".join(json.dumps(r, ensure_ascii=rng.random() < 0.5) for r in rows) + "\n\n").encode()
    if fmt == "text":
        return "\n%\n".join(sentence(rng) for _ in range(4)).encode()
    if fmt == "html":
        return f"<html><head><meta charset='utf-8'><title>{sentence(rng, 2)}</title></head><body><p>" \
               f"{sentence(rng, 30)}</p></body></html>".encode()
    if fmt == "parquet":
        texts = [sentence(rng) if i % 5 else None for i in range(12)]
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": texts, "url": [f"u{i}" for i in range(12)]}), buf, row_group_size=4,
                       compression=rng.choice(["snappy", "zstd", "none"]))
        return buf.getvalue()
    if fmt == "wet":
        return warc_file([(f"https://x.example/{i}", sentence(rng, 20).encode()) for i in range(4)],
                         record_type="conversion", digests=rng.random() < 0.5)[0]
    pages = [page(f"<p>{sentence(rng, 20)}</p>".encode()), page(b"\x89PNG\r\n", b"Content-Type: image/png\r\n"),
             page(gzip.compress(f"<p>{sentence(rng)}</p>".encode()),
                  b"Content-Type: text/html\r\nContent-Encoding: gzip\r\n")]
    return warc_file([(f"https://x.example/{i}", rng.choice(pages)) for i in range(4)], gz=rng.random() < 0.7,
                     digests=rng.random() < 0.5)[0]


# ------------------------------------------------------------------------------------------------- mutations


def flip(rng: random.Random, data: bytes, fmt: str) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def splice(rng: random.Random, data: bytes, fmt: str) -> bytes:
    """Insert random bytes, delete a run, or repeat a run, at a random place."""
    i, j = sorted(rng.randrange(len(data) + 1) for _ in range(2))
    choice = rng.randrange(3)
    if choice == 0:
        return data[:i] + rng.randbytes(rng.randint(1, 64)) + data[i:]
    return data[:i] + data[j:] if choice == 1 else data[:j] + data[i:j] + data[j:]


def truncate(rng: random.Random, data: bytes, fmt: str) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def noise(rng: random.Random, data: bytes, fmt: str) -> bytes:
    """Random bytes, NUL bytes or plain ASCII junk instead of the file, or NULs put into it."""
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randint(1, 3000))
    if choice == 1:
        return bytes(rng.randint(32, 126) for _ in range(rng.randint(1, 3000)))
    i = rng.randrange(len(data) + 1)
    return data[:i] + b"\x00" * rng.randint(1, 16) + data[i:] if choice == 2 else b"\x00" * rng.randint(1, 100)


def huge(rng: random.Random, data: bytes, fmt: str) -> bytes:
    """A record or field over max_record_bytes (or just under it), or deep nesting."""
    big = "x" * rng.choice([LIMIT - 20, LIMIT, LIMIT + 1, 5 * LIMIT])
    depth = rng.choice([100, 5_000, 200_000])
    if fmt == "jsonl":
        return rng.choice([json.dumps({"text": big}).encode(), b"[" * depth + b"]" * depth,
                           b'{"text": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}",
                           b'{"text": "ok", "n": ' + b"9" * 5000 + b"}"]) + b"\n" + data
    if fmt in ("text", "html"):
        return rng.choice([big.encode(), b"<div>" * depth + b"deep" + b"</div>" * depth])
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": [big, "small", None]}), buf)
        return buf.getvalue()
    if fmt == "wet":
        return warc_file([("https://x.example/big", big.encode()), ("https://x.example/s", b"small")],
                         record_type="conversion")[0]
    return warc_file([("https://x.example/big", page(big.encode())), ("https://x.example/s", page(b"<p>s</p>"))],
                     gz=rng.random() < 0.5)[0]


def encoding(rng: random.Random, data: bytes, fmt: str) -> bytes:
    """Text in another encoding, an odd declared charset, a BOM, a lone surrogate or a Parquet non-string column."""
    text = sentence(rng, 12)
    if fmt == "parquet":
        buf = io.BytesIO()
        column = rng.choice([pa.array([text.encode("latin-1", "replace"), b"\xff\xfe"]), pa.array([1, 2]),
                             pa.array([[text], []])])
        pq.write_table(pa.table({"text": column}), buf)
        return buf.getvalue()
    charset = rng.choice(["utf-16", "latin-1", "cp1252", "utf-7", "rot13", "hex", "x-unknown", "utf-32"])
    body = text.encode(charset if charset not in ("rot13", "hex", "x-unknown") else "utf-8", "replace")
    if fmt == "jsonl":
        line = rng.choice([json.dumps({"text": text}).encode("utf-16"), b'{"text": "a\\ud800b"}',
                           b'\xef\xbb\xbf{"text": "bom"}', json.dumps({"text": text}, ensure_ascii=False).encode(
                               "latin-1", "replace")])
        return data + line + b"\n"
    html = f"<html><head><meta charset='{charset}'></head><body>".encode() + body + b"</body></html>"
    if fmt in ("text", "html"):
        return rng.choice([html, body, b"\xef\xbb\xbf" + body, b"+2AA-"])
    if fmt == "wet":
        return warc_file([("https://x.example/e", body), ("https://x.example/ok", b"fine")],
                         record_type="conversion")[0]
    headers = f"Content-Type: text/html; charset={charset}\r\n".encode()
    return warc_file([("https://x.example/e", page(html, headers)), ("https://x.example/7", page(b"+2AA-", headers))],
                     gz=rng.random() < 0.5)[0]


MUTATIONS: list[Callable[[random.Random, bytes, str], bytes]] = [flip, splice, truncate, noise, huge, encoding]


# ------------------------------------------------------------------------------------------------- reading and checks


def read(spec: SourceSpec, path: Path) -> tuple[list[dict], dict, int]:
    """(documents, stats, input bytes read) of one file, within CASE_SECONDS."""
    stats: dict = {}
    tally = Tally(spec, stats)
    files = list_files(spec, path.parent)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        got = [d for f in files if f.size for d in file_documents(spec, f, tally)]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    assert time.monotonic() - start < CASE_SECONDS
    return got, stats, tally.input_bytes


def units_of_jsonl(data: bytes) -> int:
    lines = io.BytesIO(data).readlines()
    return sum(1 for line in lines if line.strip() or len(line) - line.endswith(b"\n") > LIMIT)


def parquet_rows(data: bytes, spec: SourceSpec) -> int | None:
    """The row groups' row counts in the footer, summed (at least 1 without a string text column), or None if the
    footer does not read."""
    try:
        pf = pq.ParquetFile(io.BytesIO(data))
        schema = pf.schema_arrow
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups))
    except Exception:  # noqa: BLE001 - any failure here means the reader must count the file as corrupt
        return None
    kind = schema.field(spec.text_field).type if spec.text_field in schema.names else None
    text_column = kind is not None and (pa.types.is_string(kind) or pa.types.is_large_string(kind) or
                                        pa.types.is_null(kind))
    return rows if text_column else max(rows, 1)


def check_accounting(fmt: str, data: bytes, spec: SourceSpec, got: list[dict], stats: dict, read_bytes: int) -> None:
    skips = sum(stats[r] for r in SKIP_REASONS)
    if not data:
        assert (got, skips, stats["lost_bytes"], read_bytes) == ([], 0, 0, 0)
        return
    if fmt in ("warc", "wet"):
        assert read_bytes + stats["lost_bytes"] == len(data)
        if len(stats["skipped"]) < SKIP_LOG_MAX:
            named = [int(m) for s in stats["skipped"] for m in re.findall(r": (\d+) bytes lost", s["detail"])]
            assert sum(named) == stats["lost_bytes"]
        assert all(0 <= int(d["id"].rsplit("@", 1)[1].split(".")[0]) < len(data) for d in got)
        return
    assert (read_bytes, stats["lost_bytes"]) == (len(data), 0)
    if fmt == "jsonl":
        assert len(got) + stats["empty"] + skips == units_of_jsonl(data)
    elif fmt == "parquet":
        rows = parquet_rows(data, spec)
        if rows is None:
            assert (got, stats["empty"], skips, stats["corrupt"]) == ([], 0, 1, 1)
        else:
            assert len(got) + stats["empty"] + skips == rows
    else:
        assert (skips == 1 and not got and not stats["empty"]) or (skips == 0 and len(got) + stats["empty"] >= 1)


def check_case(fmt: str, data: bytes, tmp: Path, extra: dict) -> None:
    path = tmp / NAMES[fmt]
    path.write_bytes(data)
    spec = local(path, fmt, "z", on_bad_input="skip", max_record_bytes=LIMIT, **extra)
    got, stats, read_bytes = read(spec, path)
    texts = [d["text"] for d in got]
    assert all(t.strip() for t in texts) and len({d["id"] for d in got}) == len(got)
    assert [len(t.encode("utf-8")) for t in texts] == [d["bytes"] for d in got]  # strict: Parquet-writable
    check_accounting(fmt, data, spec, got, stats, read_bytes)
    bad = sum(stats[r] for r in SKIP_REASONS if r not in EXPECTED)
    for mode, stops in (("fail", bad > 0), (None, sum(stats[r] for r in SCHEMA) > 0)):
        other = local(path, fmt, "z", on_bad_input=mode, max_record_bytes=LIMIT, **extra)
        try:
            again = read(other, path)[0]
        except SourceError as e:
            assert stops, f"mode {mode} raised though skip mode counted no such input: {e}"
            assert "source 'z': f." in str(e) and "Fix:" in str(e)
        else:
            assert not stops and again == got, f"mode {mode} did not stop at bad input (or read differently)"


@pytest.mark.parametrize("fmt", ["jsonl", "text", "html", "parquet", "warc", "wet"])
def test_fuzz_reader(fmt: str, tmp_path: Path) -> None:
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        rng = random.Random(f"{SEED}-{fmt}")
        check_case(fmt, seed_file(fmt, rng), tmp_path, {})  # the unmutated seed reads cleanly
        for case in range(CASES):
            for mutate in MUTATIONS:
                data = mutate(rng, seed_file(fmt, rng), fmt)
                extra = {"separator": "^%$"} if fmt == "text" and rng.random() < 0.5 else {}
                try:
                    check_case(fmt, data, tmp_path, extra)
                except (AssertionError, Hang) as e:
                    raise AssertionError(f"{fmt} case {case} ({mutate.__name__}, {len(data)} bytes, seed {SEED}): "
                                         f"{e}; input starts {data[:120]!r}") from e
    finally:
        signal.signal(signal.SIGALRM, old)


def test_the_unmutated_seeds_read_without_skips(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    for fmt, documents in (("jsonl", 5), ("html", 1), ("parquet", 9), ("wet", 4)):
        path = tmp_path / NAMES[fmt]
        path.write_bytes(seed_file(fmt, rng))
        got, stats, _ = read(local(path, fmt, "z", on_bad_input="fail"), path)
        assert len(got) == documents and sum(stats[r] for r in SKIP_REASONS) == stats["lost_bytes"] == 0


# ------------------------------------------------------------------------------------------------- archives


def seed_archive(kind: str, rng: random.Random) -> bytes:
    files = {f"pkg/data/{i}.jsonl": json.dumps({"text": sentence(rng)}).encode() for i in range(3)}
    buf = io.BytesIO()
    if kind == "wheel":
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for name, data in files.items():
                z.writestr(name, data)
        return buf.getvalue()
    import tarfile

    with tarfile.open(fileobj=buf, mode="w:gz" if kind == "sdist" else "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    if kind == "sdist":
        return buf.getvalue()
    members = [("debian-binary", b"2.0\n"), ("data.tar.xz", buf.getvalue())]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    return out


@pytest.mark.parametrize("kind", ["wheel", "sdist", "deb"])
def test_fuzz_archive_unpacking(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packages.shutil, "which", lambda _name: None)  # the .deb goes through the Python unpacker
    name = {"wheel": "p-1.0-py3-none-any.whl", "sdist": "p-1.0.tar.gz", "deb": "p_1.0_all.deb"}[kind]
    spec = SourceSpec(name="p", kind="apt" if kind == "deb" else "pip", format="jsonl", license="MIT", package="p",
                      version="1.0", sha256="0" * 64, archive="deb" if kind == "deb" else kind, include=["**/*"])
    rng = random.Random(f"{SEED}-{kind}")
    for case in range(CASES):
        for mutate in (flip, splice, truncate, noise):
            data = mutate(rng, seed_archive(kind, rng), kind)
            (tmp_path / name).write_bytes(data)
            dest = tmp_path / f"out-{case}-{mutate.__name__}"
            dest.mkdir()
            start = time.monotonic()
            try:
                packages._unpack(spec, tmp_path / name, dest)
            except SourceError as e:
                assert name in str(e) and packages.pin(spec) in str(e)
            assert time.monotonic() - start < CASE_SECONDS
            assert all(p.resolve().is_relative_to(dest.resolve()) for p in dest.rglob("*"))
