"""Tests of kiln/filters/fineweb.py: FineWeb's line rules with their exact reason and detail strings."""

from __future__ import annotations

from kiln.filters.fineweb import FineWebConfig, FineWebFilter
from tests.kiln.filters.filters_kit import SENTENCES, verdict
from textgen import prose


def test_fineweb_rules() -> None:
    f = FineWebFilter(FineWebConfig())
    assert verdict(f, prose(4)) == (None, "")
    no_punct = "\n".join(s.rstrip(".") for s in SENTENCES)
    assert verdict(f, no_punct) == ("fineweb:line_punct_ratio",
                                    "line_punct_fraction=0 < fineweb.min_line_punct_fraction=0.12")
    short = "\n".join(f"The {w} waits." for w in "boat cart mill lamp dog cat owl fox bee ant".split())
    assert verdict(f, short + "\n" + SENTENCES[0])[0] == "fineweb:short_line_ratio"
    repeated = "\n".join(SENTENCES[:8] + SENTENCES[:1])
    assert verdict(f, repeated)[0] == "fineweb:char_dup_ratio"
    listy = FineWebFilter(FineWebConfig(short_line_chars=5))
    assert verdict(listy, "\n".join(f"{w} waits." for w in "Boat Cart Mill Lamp Dog Cat".split()))[0] == \
        "fineweb:list_ratio"
