"""Gopher repetition rules (Rae et al. 2021, table A1, datatrove's defaults): repeated paragraphs, lines and n-grams,
computed vectorised over 64-bit word hashes.

Try: ``python -m kiln.filters page.txt`` prints these signals of one file with every other filter's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from kiln.common.config import Domain
from kiln.common.text import ngram_hashes
from kiln.filters.base import Doc, ThresholdFilter, duplicate_chars

TOP_NGRAMS = (2, 3, 4)  # the most frequent n-gram's share, for these n
DUP_NGRAMS = tuple(range(5, 11))  # the share covered by repeated n-grams, for these n


@dataclass
class RepetitionConfig:
    """Gopher repetition rules (Rae et al. 2021, table A1), datatrove's defaults; duplicate lines are
    clean.max_duplicate_line_fraction."""

    enabled: bool = True  # apply the rules below
    max_duplicate_paragraph_fraction: Annotated[float, Domain(0, 1)] = 0.3  # share of paragraphs that repeat an earlier one
    max_duplicate_line_char_fraction: Annotated[float, Domain(0, 1)] = 0.2  # share of characters in lines that repeat an earlier line
    max_duplicate_paragraph_char_fraction: Annotated[float, Domain(0, 1)] = 0.2  # share of characters in repeated paragraphs
    # most frequent n-gram (n=2, 3, 4): its characters times its count, over all characters
    max_top_2gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.20
    max_top_3gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.18
    max_top_4gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.16
    # characters covered by repeated occurrences of any n-gram (n=5..10), over all word characters
    max_dup_5gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.15
    max_dup_6gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.14
    max_dup_7gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.13
    max_dup_8gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.12
    max_dup_9gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.11
    max_dup_10gram_char_fraction: Annotated[float, Domain(0, 1)] = 0.10


class GopherRepetition(ThresholdFilter):
    """Repeated paragraphs, lines and n-grams; n-gram statistics run vectorised over 64-bit word hashes
    (exact up to hash collisions) because datatrove's per-n-gram Python loop dominates cleaning time."""

    name = "gopher_repetition"
    RULES = (
        ("gopher:duplicate_paragraphs", "duplicate_paragraph_fraction", "max_duplicate_paragraph_fraction"),
        ("gopher:duplicate_paragraph_chars", "duplicate_paragraph_char_fraction",
         "max_duplicate_paragraph_char_fraction"),
        ("gopher:duplicate_line_chars", "duplicate_line_char_fraction", "max_duplicate_line_char_fraction"),
        *((f"gopher:top_{n}gram", f"top_{n}gram_char_fraction", f"max_top_{n}gram_char_fraction") for n in TOP_NGRAMS),
        *((f"gopher:dup_{n}gram", f"dup_{n}gram_char_fraction", f"max_dup_{n}gram_char_fraction") for n in DUP_NGRAMS),
    )

    def __init__(self, cfg: RepetitionConfig, prefix: str = "repetition.") -> None:
        super().__init__(cfg, prefix)

    def signals(self, doc: Doc) -> dict[str, float]:
        text = doc.text
        chars = max(len(text), 1)
        paragraphs, lines = doc.paragraphs, doc.lines
        para_dups, para_chars = duplicate_chars(paragraphs)
        _, line_chars = duplicate_chars(lines)
        out = {
            "duplicate_paragraph_fraction": para_dups / max(len(paragraphs), 1),
            "duplicate_paragraph_char_fraction": para_chars / chars,
            "duplicate_line_char_fraction": line_chars / chars,
        }
        h, lengths = doc.word_hashes, doc.word_lengths
        out.update(_top_ngram_fractions(h, lengths, chars))
        out.update(_dup_ngram_fractions(h, lengths))
        return out


def _top_ngram_fractions(h: np.ndarray, lengths: np.ndarray, chars: int) -> dict[str, float]:
    """The most frequent n-gram's characters times its count, over ``chars``, for n in TOP_NGRAMS."""
    out = {}
    csum = np.concatenate(([0], np.cumsum(lengths)))
    for n in TOP_NGRAMS:
        if len(h) < n:
            out[f"top_{n}gram_char_fraction"] = 0.0
            continue
        _, first, counts = np.unique(ngram_hashes(h, n), return_index=True, return_counts=True)
        top = counts == counts.max()  # every most frequent n-gram; the longest of them counts (no tie order)
        ngram_chars = (csum[first[top] + n] - csum[first[top]]).max() + n - 1  # words joined by one space
        out[f"top_{n}gram_char_fraction"] = int(ngram_chars) * int(counts.max()) / chars
    return out


def _dup_ngram_fractions(h: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """Word characters covered by repeated occurrences of any n-gram, over all word characters, for n in DUP_NGRAMS."""
    out = {}
    word_chars = max(int(lengths.sum()), 1)
    none_repeat = False  # no repeated n-gram means no repeated longer n-gram either
    for n in DUP_NGRAMS:
        if none_repeat or len(h) < n:
            out[f"dup_{n}gram_char_fraction"] = 0.0
            continue
        g = ngram_hashes(h, n)
        _, first, inverse = np.unique(g, return_index=True, return_inverse=True)
        starts = np.nonzero(first[inverse] != np.arange(len(g)))[0]  # every occurrence after the first
        if len(starts) == 0:
            out[f"dup_{n}gram_char_fraction"] = 0.0
            none_repeat = True
            continue
        cover = np.zeros(len(h) + 1, dtype=np.int64)  # words covered by a repeated n-gram (union)
        np.add.at(cover, starts, 1)
        np.add.at(cover, starts + n, -1)
        covered = np.cumsum(cover[:-1]) > 0
        out[f"dup_{n}gram_char_fraction"] = float(lengths[covered].sum()) / word_chars
    return out
