"""Tests of kiln/common/text.py: text normalisation."""

from __future__ import annotations

from kiln.common.text import normalize_text


def test_normalisation() -> None:
    raw = "caf\u0065\u0301\u00a0au\u200blait\r\n\r\n\r\n\r\n    indented code   \n\x00end\u2028"
    assert normalize_text(raw) == "caf\u00e9 aulait\n\n    indented code\nend"
