"""Tests of kiln/filters/dirty_words.py: the dirty-word ratio rule and its config."""

from __future__ import annotations

from pathlib import Path
import pytest
from kiln.common.config import ConfigError
from kiln.filters.dirty_words import DirtyWordsConfig, DirtyWordsFilter
from tests.kiln.filters.filters_kit import verdict
from textgen import prose


def test_dirty_word_ratio(tmp_path: Path) -> None:
    f = DirtyWordsFilter(DirtyWordsConfig())
    assert verdict(f, prose(6)) == (None, "")
    reason, detail = verdict(f, prose(6) + " What the fuck, shit.")
    assert reason == "dirty_words:ratio" and detail.startswith("dirty_word_fraction=0.0") and "max_fraction=0.01" in detail
    ordinary = prose(6) + " The gay rights group met the god of the sea; sex education was discussed."
    assert verdict(f, ordinary) == (None, "")  # identity, religion and medicine words are not counted
    words = tmp_path / "words.txt"
    words.write_text("harbour\nriver bank\n", encoding="utf-8")
    own = DirtyWordsFilter(DirtyWordsConfig(words_file=str(words), max_fraction=0.05))
    assert verdict(own, prose(6) + " harbour harbour harbour river bank river bank")[0] == "dirty_words:ratio"
    with pytest.raises(ConfigError, match="words_file: cannot read"):
        DirtyWordsFilter(DirtyWordsConfig(words_file=str(tmp_path / "none.txt")))
