"""FineWeb's own rules (Penedo et al. 2024, datatrove's FineWebQualityFilter defaults): share of lines ending in
punctuation, share of short lines, characters in repeated lines, newlines per word.

Try: ``python -m kiln.filters page.txt`` prints these signals of one file with every other filter's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from kiln.common.config import Domain
from kiln.filters.base import END_PUNCTUATION, Doc, ThresholdFilter, duplicate_chars


@dataclass
class FineWebConfig:
    """FineWeb's own rules (Penedo et al. 2024), datatrove's FineWebQualityFilter defaults."""

    enabled: bool = True  # apply the rules below
    min_line_punct_fraction: Annotated[float, Domain(0, 1)] = 0.12  # share of lines ending in terminal punctuation below this: menus, lists
    max_short_line_fraction: Annotated[float, Domain(0, 1)] = 0.67  # share of lines of at most short_line_chars characters above this
    short_line_chars: Annotated[int, Domain(0)] = 30  # what a short line is
    max_duplicate_line_char_fraction: Annotated[float, Domain(0, 1)] = 0.01  # characters in repeated lines over all non-newline characters
    max_newline_word_ratio: Annotated[float, Domain(0)] = 0.3  # newlines per word above this: one-word-per-line lists


class FineWebFilter(ThresholdFilter):
    name = "fineweb"
    RULES = (
        ("fineweb:line_punct_ratio", "line_punct_fraction", "min_line_punct_fraction"),
        ("fineweb:short_line_ratio", "short_line_fraction", "max_short_line_fraction"),
        ("fineweb:char_dup_ratio", "fineweb_dup_line_char_fraction", "max_duplicate_line_char_fraction"),
        ("fineweb:list_ratio", "newline_word_ratio", "max_newline_word_ratio"),
    )

    def __init__(self, cfg: FineWebConfig, prefix: str = "fineweb.") -> None:
        super().__init__(cfg, prefix)

    def signals(self, doc: Doc) -> dict[str, float]:
        lines = [line for line in doc.text.split("\n") if line.strip()]
        n = max(len(lines), 1)
        _, dup_chars = duplicate_chars(lines)
        return {
            "line_punct_fraction": sum(line.endswith(END_PUNCTUATION) for line in lines) / n,
            "short_line_fraction": sum(len(line) <= self.cfg.short_line_chars for line in lines) / n,
            "fineweb_dup_line_char_fraction": dup_chars / max(len(doc.text) - doc.text.count("\n"), 1),
            "newline_word_ratio": doc.text.count("\n") / max(len(doc.words), 1),
        }
