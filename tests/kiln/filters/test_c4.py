"""Tests of kiln/filters/c4.py: C4's page rules and line removal."""

from __future__ import annotations

from kiln.filters.c4 import C4Config, C4Filter, C4LineCleaner
from tests.kiln.filters.filters_kit import verdict
from textgen import prose


def test_c4_page_rules_and_line_removal() -> None:
    f = C4Filter(C4Config())
    assert verdict(f, prose(2)) == (None, "")
    assert verdict(f, prose(2) + " Lorem ipsum dolor sit amet.") == ("c4:lorem_ipsum", "contains 'lorem ipsum'")
    code = prose(2) + "\nif (x) { y(); }"
    assert verdict(f, code) == (None, "")  # off by default: it would drop every page with code
    assert verdict(C4Filter(C4Config(curly_bracket=True)), code) == ("c4:curly_bracket", "contains '{'")
    assert verdict(C4Filter(C4Config(min_sentences=20)), prose(2))[0] == "c4:too_few_sentences"

    lines = C4LineCleaner(C4Config())
    page = prose(3) + "\nPlease enable JavaScript to view this page.\nRead our privacy policy.\nThe end."
    text, edits = lines.clean(page)
    assert text == prose(3) + "\nThe end."
    assert edits == {"c4:javascript_line": [1, 44], "c4:policy_line": [1, 25]}
    assert lines.clean(prose(3)) == (prose(3), {})
    strict = C4LineCleaner(C4Config(min_words_per_line=3, terminal_punct_lines=True))
    assert strict.clean("A full sentence is here.\nMenu\nNo final mark here")[0] == "A full sentence is here."
