"""Tests of kiln/sources/pipeline.py: collect writes the parquet (one source per row group), a failure leaves no file, and
the command line collects a manifest and names a bad one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kiln.common.files import sha256_file
from kiln.sources import SourceError, collect
from kiln.sources import pipeline
from tests.kiln.sources.test_packages import make_wheel, pip_spec, serve
from tests.kiln.sources.test_readers import REPO, local, tree  # noqa: F401  (tree is a fixture)


def test_collect_writes_parquet(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "ROW_GROUP_DOCS", 2)
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
        collect([local(tree, "html", "web"), local(tmp_path / "bad.jsonl", "jsonl", "bad", on_bad_input="error")],
                tmp_path / "c", out)
    assert out.read_bytes() == b"previous" and sorted(p.name for p in out.parent.iterdir()) == ["raw.parquet"]


def test_collect_keeps_each_row_group_to_one_source(tree: Path, tmp_path: Path) -> None:
    specs = [local(tree, "html", "web"), local(tree, "jsonl", "j"), local(tree, "text", "t")]
    out = tmp_path / "raw.parquet"
    collect(specs, tmp_path / "cache", out)
    pf = pq.ParquetFile(out)
    groups = [set(pf.read_row_group(i, columns=["source"]).column("source").to_pylist()) for i in range(pf.num_row_groups)]
    assert groups == [{"web"}, {"j"}, {"t"}]


def test_command_line_collects_a_manifest_and_names_a_bad_one(tree: Path, tmp_path: Path) -> None:
    import sys

    manifest = tmp_path / "sources.yaml"
    manifest.write_text(f"sources:\n  - {{name: t, kind: local, format: text, license: x, path: '{tree}'}}\n")
    out = tmp_path / "raw.parquet"
    proc = subprocess.run([sys.executable, "-m", "kiln.sources", str(manifest), str(out), "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["documents"] == 1 == pq.read_table(out).num_rows
    manifest.write_text("sources: []\nextra: 1\n")
    proc = subprocess.run([sys.executable, "-m", "kiln.sources", str(manifest), str(out)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 1 and "error:" in proc.stderr and "unknown top-level key 'extra'" in proc.stderr
