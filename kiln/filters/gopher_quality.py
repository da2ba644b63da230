"""Gopher quality rules (Rae et al. 2021, appendix A, datatrove's defaults): document length, word length, symbols,
alphabetic words, duplicate, bullet and ellipsis lines, stop words. Their keys sit at the top of the clean config.

Try: ``python -c "from kiln.filters.gopher_quality import *; print(text_signals('The cat sat on the mat.'))"``
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from kiln.common.config import Domain
from kiln.filters.base import Doc, ThresholdFilter

_LETTER = re.compile(r"[^\W\d_]")
BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "·", "▪", "●", "○", "■", "□", "➢", "►")
STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))  # Gopher's required stop words


@dataclass
class GopherQualityConfig:
    """Gopher quality rules (Rae et al. 2021, appendix A), datatrove's defaults; the keys sit at the top of
    the clean config (clean.min_words, ...)."""

    min_words: Annotated[int, Domain(0)] = 50  # fewer whitespace-separated words than this: too short to be prose
    max_words: Annotated[int, Domain(1)] = 100_000  # more words than this: dumps, logs, concatenated pages
    min_mean_word_length: Annotated[float, Domain(0)] = 3.0  # mean word length (punctuation stripped) below this: lists of tokens
    max_mean_word_length: Annotated[float, Domain(0, low_open=True)] = 10.0  # ... above this: URLs, hashes, base64
    max_symbol_to_word_ratio: Annotated[float, Domain(0)] = 0.1  # max of '#' count and '...'/'…' count, per word
    min_alpha_word_fraction: Annotated[float, Domain(0, 1)] = 0.8  # share of words with at least one letter
    max_duplicate_line_fraction: Annotated[float, Domain(0, 1)] = 0.3  # share of non-empty lines that repeat an earlier line
    max_bullet_lines_fraction: Annotated[float, Domain(0, 1)] = 0.9  # share of lines starting with a bullet (•, -, *, ...)
    max_ellipsis_lines_fraction: Annotated[float, Domain(0, 1)] = 0.3  # share of lines ending in '...' or '…' (C4's truncated teasers)
    min_stop_words: Annotated[int, Domain(0)] = 2  # fewer of "the, be, to, of, and, that, have, with" than this: not running English


class GopherQuality(ThresholdFilter):
    name = "gopher_quality"
    RULES = (
        ("gopher:too_few_words", "words", "min_words"),
        ("gopher:too_many_words", "words", "max_words"),
        ("gopher:short_mean_word_length", "mean_word_length", "min_mean_word_length"),
        ("gopher:long_mean_word_length", "mean_word_length", "max_mean_word_length"),
        ("gopher:symbol_to_word_ratio", "symbol_ratio", "max_symbol_to_word_ratio"),
        ("gopher:few_alpha_words", "alpha_word_fraction", "min_alpha_word_fraction"),
        ("gopher:duplicate_lines", "duplicate_line_fraction", "max_duplicate_line_fraction"),
        ("gopher:bullet_lines", "bullet_lines_fraction", "max_bullet_lines_fraction"),
        ("c4:ellipsis_lines", "ellipsis_lines_fraction", "max_ellipsis_lines_fraction"),
        ("gopher:few_stop_words", "stop_words", "min_stop_words"),
    )

    def __init__(self, cfg: GopherQualityConfig, prefix: str = "") -> None:
        super().__init__(cfg, prefix)

    def signals(self, doc: Doc) -> dict[str, float]:
        text, words = doc.text, doc.words
        n = len(words)
        if not self.rules[0].limit <= n <= self.rules[1].limit:
            return {"words": n}  # dropped on length: the other signals are not needed
        lines = doc.lines
        n_lines = max(len(lines), 1)
        bare = doc.bare_words
        ellipses = text.count("...") + text.count("…")
        return {
            "words": n,
            "mean_word_length": sum(map(len, bare)) / len(bare) if bare else 0.0,
            "symbol_ratio": max(text.count("#"), ellipses) / n if n else 0.0,
            "alpha_word_fraction": sum(1 for w in words if _LETTER.search(w)) / n if n else 0.0,
            "duplicate_line_fraction": (len(lines) - len(set(lines))) / n_lines,
            "bullet_lines_fraction": sum(line.startswith(BULLETS) for line in lines) / n_lines,
            "ellipsis_lines_fraction": sum(line.endswith(("...", "…")) for line in lines) / n_lines,
            "stop_words": sum(1 for w in bare if w in STOP_WORDS),
        }


def text_signals(text: str) -> dict[str, float]:
    """The Gopher quality signals of ``text``; also written as columns of the kept Parquet."""
    everything = GopherQualityConfig(min_words=0, max_words=2**62)
    return GopherQuality(everything).signals(Doc("", "", "", text, "text/plain", "", 0))
