"""Tests for ``on_bad_input`` (default, skip, fail) and for the messages that name the real cause of bad input.

Run: python -m pytest tests/kiln/sources/test_bad_input.py -q   (one test reads the pinned pywb sdist from the cache)
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.kiln.sources.sources_kit import docs, local

from kiln.common.config import ConfigError
from kiln.sources import SourceError, collect, fetch, load_manifest, specs_from_dicts

REPO = Path(__file__).resolve().parents[3]


def test_a_record_without_the_text_field_stops_by_default_with_the_right_hint(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n{"text": "c"}\n', encoding="utf-8")
    with pytest.raises(SourceError) as err:  # default: as before, a record without the field stops the source
        docs(local(tmp_path / "rows.jsonl", "jsonl", "j"))
    msg = str(err.value)
    assert "source 'j': rows.jsonl at byte 14: line 2 has no field 'text' (found: body)" in msg
    assert "fix or remove line 2 (the 1 record(s) before it have a string 'text')" in msg
    assert "on_bad_input: skip" in msg and "set `text_field:`" not in msg  # the field name is right; the record is not

    stats: dict = {}
    got = docs(local(tmp_path / "rows.jsonl", "jsonl", "j", on_bad_input="skip"), stats)
    assert [d["text"] for d in got] == ["a", "c"] and stats["missing_field"] == 1
    assert stats["skipped"] == [{"file": "rows.jsonl", "offset": 14, "reason": "missing_field",
                                 "detail": "line 2 has no field 'text' (found: body)"}]
    with pytest.raises(SourceError, match="line 2 has no field"):
        docs(local(tmp_path / "rows.jsonl", "jsonl", "j", on_bad_input="fail"))


def test_a_wrong_text_field_names_the_field_to_use(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"id": 1, "body": "a"}\n{"id": 2, "body": "b"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"line 1 has no field 'text' \(found: id, body\)\. Fix: set `text_field:` "
                                          r"to the field that holds the text, e.g. `text_field: body`"):
        docs(local(tmp_path / "rows.jsonl", "jsonl", "j"))
    (tmp_path / "rows.jsonl").write_text('{"text": 7}\n[1, 2]\n', encoding="utf-8")
    stats: dict = {}
    assert docs(local(tmp_path / "rows.jsonl", "jsonl", "j", on_bad_input="skip"), stats) == []
    assert (stats["wrong_type"], stats["missing_field"]) == (1, 1)
    assert [s["detail"] for s in stats["skipped"]] == [
        "line 1: field 'text' holds a int, not a string", "line 2 is a JSON list, not an object with field 'text'"]


def test_parquet_without_the_column_stops_by_default_and_is_counted_by_rows_in_skip_mode(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["x", "y", "z"]}), tmp_path / "part.parquet")
    with pytest.raises(SourceError, match=r"part\.parquet: no column 'text' \(columns: body\)\. Fix: set `text_field:`"):
        docs(local(tmp_path, "parquet", "p"))
    stats: dict = {}
    assert docs(local(tmp_path, "parquet", "p", on_bad_input="skip"), stats) == []
    assert stats["missing_field"] == 3 and stats["skipped"][0]["reason"] == "missing_field"


def test_fail_mode_stops_at_bad_input_but_not_at_what_is_skipped_by_design(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")
    with pytest.raises(SourceError, match=r"a\.txt at byte 3: not valid utf-8"):
        docs(local(tmp_path, "text", on_bad_input="fail"))
    with pytest.raises(SourceError, match=r"a\.txt at byte 3"):  # "error", the older spelling, still works
        docs(local(tmp_path, "text", on_bad_input="error"))
    warc = load_manifest(REPO / "conf/sources/warc.yaml")[0]
    cache = os.environ.get("KILN_SOURCE_CACHE") or os.path.expanduser("~/.cache/kiln/sources")
    iana = fetch(warc, cache) / "pywb-2.10.0" / "sample_archive" / "warcs" / "iana.warc.gz"
    stats: dict = {}
    assert len(docs(local(iana, "warc", "w", on_bad_input="fail"), stats)) == 16  # images, redirects: not bad input
    assert stats["not_text"] == 32


def test_on_bad_input_values(tmp_path: Path) -> None:
    good = {"name": "j", "kind": "local", "format": "jsonl", "path": "x", "license": "PD"}
    assert [specs_from_dicts([{**good, **extra}])[0].on_bad_input for extra in (
        {}, {"on_bad_input": "skip"}, {"on_bad_input": "fail"}, {"on_bad_input": "error"})] == [None, "skip", "fail",
                                                                                                "fail"]
    with pytest.raises(ConfigError, match="'on_bad_input' must be 'skip' or 'fail'"):
        specs_from_dicts([{**good, "on_bad_input": "ignore"}])
    with pytest.raises(ConfigError, match="'encoding' 'rot13' is not a known Python text codec"):
        specs_from_dicts([{**good, "encoding": "rot13"}])  # a bytes-to-bytes codec that bytes.decode refuses


def test_no_documents_names_the_real_cause(tmp_path: Path) -> None:
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "a.txt").write_bytes(b"d\xe9j\xe0 vu")
    (tmp_path / "latin" / "b.txt").write_bytes(b"na\xefve")
    (tmp_path / "latin" / "c.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    out = tmp_path / "raw.parquet"
    with pytest.raises(SourceError) as err:
        collect([local(tmp_path / "latin", "text", "t")], tmp_path / "cache", out)
    msg = str(err.value)
    assert "t in " in msg and "3 file(s), nothing kept: invalid UTF-8 2, binary 1" in msg
    assert "first: a.txt at byte 1: not valid utf-8 (byte 0xe9)" in msg and "Fix: set `encoding:`" in msg
    assert "include patterns" not in msg and not out.exists()

    (tmp_path / "rows.jsonl").write_text('{"body": "a"}\n', encoding="utf-8")
    with pytest.raises(SourceError, match=r"no text field 1; first: rows\.jsonl at byte 0: line 1 has no field 'text'"
                                          r".*Fix: set `text_field:`"):
        collect([local(tmp_path / "rows.jsonl", "jsonl", "j", on_bad_input="skip")], tmp_path / "cache", out)
    with pytest.raises(SourceError, match=r"no documents from any source: m in .*include \['\*\*/\*\.md'\]: no file "
                                          r"matched; check the include patterns"):
        collect([local(tmp_path / "latin", "text", "m", include=["**/*.md"])], tmp_path / "cache", out)
