"""Tests of kiln/clean/text.py: only texts that show what ftfy repairs are passed to it, and its repair keeps
typographic quotes.

Run: python -m pytest tests/kiln/clean/test_text.py -q
"""

from __future__ import annotations

import pytest

from kiln.clean.text import fix_unicode, needs_fix


@pytest.mark.parametrize("text", ["plain ascii", "café au lait", "“quoted” – dash", "naïve résumé"])
def test_clean_text_is_not_sent_to_ftfy_and_comes_back_unchanged(text: str) -> None:
    assert not needs_fix(text)
    assert fix_unicode(text) is text


@pytest.mark.parametrize("broken, fixed", [
    ("cafÃ© â€™", "café ’"),  # UTF-8 read as cp1252: repaired, the curly quote kept
    ("the ﬁsh", "the fish"),  # a ligature
    ("café \x1b[31mrouge\x1b[0m", "café rouge"),  # terminal escapes in a non-ASCII text
    ("plain \x1b[31mred\x1b[0m text", "plain red text"),  # and in an ASCII one (ESC is ASCII)
])
def test_mojibake_ligatures_and_escapes_are_repaired(broken: str, fixed: str) -> None:
    assert needs_fix(broken)
    assert fix_unicode(broken) == fixed
