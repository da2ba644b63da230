"""Tests of kiln/filters/olmo2.py: OLMo 2's repeated-run rule."""

from __future__ import annotations

from kiln.filters.olmo2 import Olmo2Config, Olmo2Filter, longest_repeat_run
from tests.kiln.filters.filters_kit import verdict
from textgen import prose


def test_olmo2_rules() -> None:
    f = Olmo2Filter(Olmo2Config())
    base = prose(5)
    assert verdict(f, base) == (None, "")
    assert verdict(f, base + " " + " ".join(["buy now"] * 31)) == (None, "")  # 31 repeats: kept
    reason, detail = verdict(f, base + " " + " ".join(["buy now"] * 32))
    assert (reason, detail) == ("olmo2:repeated_ngram_run", "ngram_repeat_run=32 > olmo2.max_ngram_repeats=31")
    words = base.split()
    heavy = " ".join(w for pair in zip(words, ["data"] * len(words)) for w in pair)  # every second word: 50%
    assert verdict(f, heavy)[0] == "olmo2:top_word_fraction"
    import numpy as np

    h = np.array([1, 2, 3, 2, 3, 2, 3, 2, 3, 4], dtype=np.uint64)
    assert longest_repeat_run(h, 4) == (4, 2)  # (2, 3) four times in a row
