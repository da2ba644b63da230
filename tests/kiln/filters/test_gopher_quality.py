"""Tests of kiln/filters/gopher_quality.py: the text signals of good prose, which passes every default rule."""

from __future__ import annotations

from kiln.clean.config import CleanConfig, default_filters
from kiln.common.text import normalize_text
from kiln.filters.base import Doc
from kiln.filters.gopher_quality import text_signals
from tests.kiln.clean.test_run import PROSE  # the same page as the clean tests


def test_good_prose_passes_every_rule() -> None:
    text = normalize_text(PROSE)
    doc = Doc("good", "test", "", text, "text/plain", "CC0", len(text), signals=text_signals(text))
    assert doc.signals["words"] > 50 and doc.signals["alpha_word_fraction"] == 1.0
    filters = default_filters(CleanConfig())
    assert [f.name for f in filters] == ["url", "gopher_quality", "language", "gopher_repetition", "c4", "fineweb",
                                         "olmo2", "dirty_words"]
    assert [f.reason(doc) for f in filters] == [None] * len(filters)
    assert doc.signals["language"] == "en" and doc.signals["stop_words"] >= 2
