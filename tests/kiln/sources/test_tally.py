"""Tests for kiln.sources.tally: which bad input stops a source in each ``on_bad_input`` mode, the Tally's counts,
lost bytes and capped list of skipped items, the one-line error naming the source, file, byte and fix, and
why_no_documents's reasons (nothing matched, blank files, or the commonest skip with its first item and its fix).
"""

from __future__ import annotations

import pytest

from kiln.sources.manifest import SourceError, SourceSpec
from kiln.sources.tally import COUNTERS, FIXES, SKIP_LOG_MAX, SKIP_REASONS, Tally, label, stops, why_no_documents


def spec(on_bad_input: str | None = None, encoding: str | None = None) -> SourceSpec:
    return SourceSpec(name="docs", kind="local", format="text", license="test-licence", path="docs",
                      on_bad_input=on_bad_input, encoding=encoding)


def test_what_stops_a_source_in_each_mode():
    default, skip, fail = spec(), spec("skip"), spec("fail")
    assert [r for r in SKIP_REASONS if stops(default, r)] == ["missing_field", "wrong_type"]
    assert [r for r in SKIP_REASONS if stops(skip, r)] == []
    assert [r for r in SKIP_REASONS if stops(fail, r)] == [r for r in SKIP_REASONS
                                                           if r not in ("not_text", "duplicate")]  # skipped by design
    assert Tally(fail, {}).stops("binary") and not Tally(default, {}).stops("binary")
    assert spec("error").on_bad_input == "fail" and stops(spec("error"), "corrupt")  # the older spelling


def test_a_tally_counts_every_skip_and_lists_the_first_ones():
    stats: dict = {"documents": 4}
    tally = Tally(spec("skip"), stats)
    assert {k: stats[k] for k in COUNTERS} == {**{k: 0 for k in COUNTERS}, "documents": 4} and stats["skipped"] == []
    tally("binary", "img/a.txt", 6, "NUL bytes")
    tally("missing_field", "rows.jsonl", 14, "no field 'text'", record="line 2", lost=3)
    tally("too_large", "big.jsonl", None, "x" * 300, count=5, lost=100)
    tally.read(40)
    tally.read(2)
    assert (stats["binary"], stats["missing_field"], stats["too_large"], stats["lost_bytes"]) == (1, 1, 5, 103)
    assert tally.input_bytes == 42
    assert stats["skipped"] == [
        {"file": "img/a.txt", "offset": 6, "reason": "binary", "detail": "NUL bytes"},
        {"file": "rows.jsonl", "offset": 14, "reason": "missing_field", "detail": "line 2: no field 'text'"},
        {"file": "big.jsonl", "offset": None, "reason": "too_large", "detail": "x" * 200},  # detail cut to 200
    ]
    for i in range(SKIP_LOG_MAX + 10):
        tally("decode_errors", f"f{i}.txt", 0, "not valid utf-8")
    assert stats["decode_errors"] == SKIP_LOG_MAX + 10 and len(stats["skipped"]) == SKIP_LOG_MAX  # all counted


def test_a_tally_on_an_existing_stats_dict_adds_to_its_counts():
    stats = {"binary": 2, "skipped": [{"file": "old.txt", "offset": 0, "reason": "binary", "detail": "NUL bytes"}]}
    tally = Tally(spec(), stats)
    tally("binary", "new.txt", 1, "NUL bytes")
    assert stats["binary"] == 3 and [s["file"] for s in stats["skipped"]] == ["old.txt", "new.txt"]


def test_input_that_stops_is_one_error_naming_the_source_file_byte_and_fix():
    stats: dict = {}
    tally = Tally(spec(), stats)
    with pytest.raises(SourceError) as e:
        tally("missing_field", "rows.jsonl", 14, "line 2 has no field 'text'", record="rows")
    assert str(e.value) == ("source 'docs': rows.jsonl rows at byte 14: line 2 has no field 'text'. Fix: set "
                            "`text_field:` to the field (column) that holds the text; or set `on_bad_input: skip` "
                            "to skip and count such input.")
    assert stats["missing_field"] == 0 and stats["skipped"] == []  # a stop is not counted as a skip
    with pytest.raises(SourceError) as e:
        Tally(spec("fail"), {})("corrupt", "a.warc.gz", None, "truncated gzip", "copy it again")
    assert str(e.value) == ("source 'docs': a.warc.gz: truncated gzip. Fix: copy it again; or set `on_bad_input: skip` "
                            "to skip and count such input.")


def test_labels_name_the_encoding_the_source_reads():
    assert label(spec(), "decode_errors") == "invalid UTF-8"
    assert label(spec(encoding="latin-1"), "decode_errors") == "invalid latin-1"
    assert label(spec(), "not_text") == "not HTTP 200 text/HTML"
    assert set(FIXES) == set(SKIP_REASONS)


def test_no_documents_because_no_file_matched_or_all_were_blank():
    assert why_no_documents(spec(), {}) == "no file matched; check the include patterns, `exclude:` and `format:`"
    assert why_no_documents(spec(), {"files": 0, "empty": 0}).startswith("no file matched")
    assert why_no_documents(spec(), {"files": 2, "empty": 2}) == ("2 file(s), nothing kept: empty 2; the files hold "
                                                                  "only blank text")


def test_no_documents_names_the_commonest_bad_input_its_first_item_and_its_fix():
    stats: dict = {}
    tally = Tally(spec("skip", encoding="cp1252"), stats)
    tally("duplicate", "b.txt", None, "same file as a.txt")
    tally("binary", "c.bin", 0, "NUL bytes")
    tally("decode_errors", "d.txt", 3, "not valid cp1252 (byte 0x81)")
    tally("decode_errors", "e.txt", 9, "not valid cp1252 (byte 0x8d)")
    stats.update(files=5, empty=1)
    assert why_no_documents(spec("skip", encoding="cp1252"), stats) == (
        "5 file(s), nothing kept: empty 1, invalid cp1252 2, binary 1, second name of a file 1; first: c.bin at byte "
        "0: NUL bytes. Fix: set `encoding:` on the source to the files' real encoding, or exclude the files")


def test_no_documents_skipped_by_design_still_says_what_was_skipped():
    stats: dict = {}
    tally = Tally(spec("fail"), stats)  # not_text never stops, even in fail mode
    tally("not_text", "crawl.warc.gz", 512, "image/png", count=3)
    stats["files"] = 1
    assert why_no_documents(spec("fail"), stats) == (
        "1 file(s), nothing kept: not HTTP 200 text/HTML 3; first: crawl.warc.gz at byte 512: image/png. Fix: point "
        "the source at archives of HTML or text pages (images, scripts and redirects are skipped)")
