"""Tests of kiln/filters/language.py: language identification."""

from __future__ import annotations

from kiln.filters.language import LanguageConfig, LanguageFilter
from tests.kiln.filters.filters_kit import verdict
from textgen import prose


def test_language_identification() -> None:
    f = LanguageFilter(LanguageConfig())
    assert verdict(f, prose(8)) == (None, "")
    german = ("Der alte Leuchtturm stand auf einem felsigen Vorsprung am Rande des Hafens, und mehr als ein "
              "Jahrhundert lang stiegen seine Wärter jeden Abend die Wendeltreppe hinauf, um die Lampe anzuzünden.")
    reason, detail = verdict(f, german)
    assert reason == "lang:not_allowed" and detail.startswith("language=de (rank ")
    assert verdict(LanguageFilter(LanguageConfig(allowed=["en", "de"])), german) == (None, "")
    assert verdict(LanguageFilter(LanguageConfig(max_rank=100)), prose(8))[0] == "lang:low_confidence"
