"""Tests of kiln/filters/gopher_repetition.py: Gopher's repetition rules with their exact reason and detail strings."""

from __future__ import annotations

from kiln.filters.gopher_repetition import GopherRepetition, RepetitionConfig
from tests.kiln.filters.filters_kit import SENTENCES, verdict
from textgen import prose


def test_gopher_repetition_rules() -> None:
    f = GopherRepetition(RepetitionConfig())
    good = prose(1, 10)
    assert verdict(f, good) == (None, "")
    paras = [prose(s, 2).replace("\n\n", " ") for s in range(10, 14)]
    reason, detail = verdict(f, "\n\n".join(paras + paras[:2]))  # 2 of 6 paragraphs repeat
    assert reason == "gopher:duplicate_paragraphs"
    assert detail == "duplicate_paragraph_fraction=0.3333 > repetition.max_duplicate_paragraph_fraction=0.3"
    long_para = prose(20, 8).replace("\n\n", " ")
    short = [f"Note {w} follows." for w in ("one", "two", "three", "four", "five", "six")]
    assert verdict(f, "\n\n".join([long_para, *short, long_para]))[0] == "gopher:duplicate_paragraph_chars"
    assert verdict(f, "\n".join([long_para, *short, long_para]))[0] == "gopher:duplicate_line_chars"
    words = prose(30, 12).split()
    assert verdict(f, " ".join(f"{w} river bank" for w in words[:40]))[0] == "gopher:top_2gram"
    copied = " ".join(SENTENCES[:9] + SENTENCES[2:4])  # two sentences appear twice: repeated 5- to 10-grams
    reason, detail = verdict(f, copied)
    assert reason == "gopher:dup_5gram" and detail.startswith("dup_5gram_char_fraction=")
