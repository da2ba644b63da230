"""OLMo 2's two repetition rules (OLMo et al. 2024, DCLM baseline pool): the longest run of one n-gram repeated back
to back, and the most frequent word's share of all words.

Try: ``python -c "import numpy as np; from kiln.filters.olmo2 import *; print(longest_repeat_run(np.array([1, 2] * 40), 13))"``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import numpy as np

from kiln.common.config import Domain
from kiln.common.text import word_hashes
from kiln.filters.base import Doc, ThresholdFilter


@dataclass
class Olmo2Config:
    """OLMo 2's two repetition rules (OLMo et al. 2024, DCLM baseline pool)."""

    enabled: bool = True  # apply the rules below
    max_ngram_repeats: Annotated[int, Domain(1)] = 31  # a run of more consecutive repeats of one n-gram than this drops the doc (32+)
    max_ngram: Annotated[int, Domain(1)] = 13  # n-gram lengths 1..max_ngram are checked for runs
    max_top_word_fraction: Annotated[float, Domain(0, 1)] = 0.3  # the most frequent word's share of all words above this drops the doc


def longest_repeat_run(h: np.ndarray, max_n: int) -> tuple[int, int]:
    """(repeats, n): the longest run of one n-gram repeated back to back, over n = 1..max_n.

    A run of k copies of a period-n n-gram is a stretch of (k - 1) * n positions where h[i] == h[i + n].
    """
    best, best_n = 1, 1
    for n in range(1, max_n + 1):
        if len(h) < 2 * n:
            break
        eq = np.concatenate(([False], h[n:] == h[:-n], [False]))
        edges = np.flatnonzero(eq[1:] != eq[:-1])  # starts and ends of runs of True, alternating
        if len(edges):
            longest = int((edges[1::2] - edges[::2]).max())
            repeats = longest // n + 1
            if repeats > best:
                best, best_n = repeats, n
    return best, best_n


class Olmo2Filter(ThresholdFilter):
    name = "olmo2"
    RULES = (
        ("olmo2:repeated_ngram_run", "ngram_repeat_run", "max_ngram_repeats"),
        ("olmo2:top_word_fraction", "top_word_fraction", "max_top_word_fraction"),
    )

    def __init__(self, cfg: Olmo2Config, prefix: str = "olmo2.") -> None:
        super().__init__(cfg, prefix)

    def signals(self, doc: Doc) -> dict[str, float]:
        repeats, _ = longest_repeat_run(doc.word_hashes, self.cfg.max_ngram)
        bare = doc.bare_words
        top = 0.0
        if bare:
            _, counts = np.unique(word_hashes(bare), return_counts=True)
            top = int(counts.max()) / len(bare)
        return {"ngram_repeat_run": repeats, "top_word_fraction": top}
