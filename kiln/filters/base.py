"""What every document filter is made of: the document (``Doc``), a filter that keeps or drops it with a reason
(``Filter``), thresholds on named signals (``Rule``, ``ThresholdFilter``) and the helpers the signals share.

One filter family per module beside this one; ``kiln.filters.registry`` lists them. Try every rule on one file:
``python -m kiln.filters page.txt`` prints every signal and the first rule that drops it.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from kiln.common.text import word_hashes

_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~«»“”‘’„…–—·•"
_PARAGRAPHS = re.compile(r"\n\s*\n")
END_PUNCTUATION = (".", "'", '"', "!", "?", ":", ";", "…", "”", "’", ")", "»")  # FineWeb's terminal marks


@dataclass
class Doc:
    """One document moving through the cleaning steps; the tokenisations below are computed once, on demand."""

    id: str
    source: str
    url: str
    text: str  # clean text once extracted and normalised
    content_type: str
    license: str
    input_bytes: int  # size of the raw record, for the byte accounting
    title: str = ""
    signals: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget the cached tokenisations after ``text`` changed."""
        for name in ("words", "lines", "paragraphs", "bare_words", "word_hashes", "word_lengths"):
            self.__dict__.pop(name, None)

    @cached_property
    def words(self) -> list[str]:
        return self.text.split()

    @cached_property
    def lines(self) -> list[str]:
        """Non-empty lines, stripped."""
        return [s for s in (line.strip() for line in self.text.split("\n")) if s]

    @cached_property
    def paragraphs(self) -> list[str]:
        return [s for s in (p.strip() for p in _PARAGRAPHS.split(self.text)) if s]

    @cached_property
    def bare_words(self) -> list[str]:
        """Lower-cased words with surrounding punctuation stripped; words of punctuation only are left out."""
        return [w for w in (w.strip(_PUNCT).lower() for w in self.words) if w]

    @cached_property
    def word_hashes(self) -> np.ndarray:
        """(n_words,) uint64: a 64-bit hash per word (crc32 and adler32 of its UTF-8, the same in every process,
        unlike Python's salted ``hash``), for vectorised n-gram statistics within this document."""
        return word_hashes(self.words)

    @cached_property
    def word_lengths(self) -> np.ndarray:
        """(n_words,) int64 characters per word."""
        return np.fromiter(map(len, self.words), dtype=np.int64, count=len(self.words))


def duplicate_chars(items: list[str]) -> tuple[int, int]:
    """(number, characters) of items equal to an earlier item."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def matches_any(name: str, patterns: list[str]) -> bool:
    """Whether ``name`` matches one of the shell-style globs (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ---------------------------------------------------------------------------------------------- base classes


class Filter:
    """One rule, datatrove-style: ``reason`` returns None to keep a document, else a short drop reason.

    The runner counts drops per reason and keeps examples, so a filter only decides. ``detail`` says why in a
    few words for removed.parquet; ``reasons`` lists every reason the filter can return (for the report).
    """

    name: str = "filter"
    reasons: tuple[str, ...] = ()

    def reason(self, doc: Doc) -> str | None:
        raise NotImplementedError

    def detail(self, doc: Doc) -> str:
        return ""


@dataclass
class Rule:
    """A threshold on one signal: drop when it is below ``limit`` (a min_* key) or above it (a max_* key)."""

    reason: str
    signal: str
    key: str  # config key, dotted from the clean config root
    limit: float

    def fails(self, value: float) -> bool:
        return value < self.limit if self.key.rsplit(".", 1)[-1].startswith("min_") else value > self.limit

    def describe(self, value: float) -> str:
        op = "<" if self.key.rsplit(".", 1)[-1].startswith("min_") else ">"
        return f"{self.signal}={value:.4g} {op} {self.key}={self.limit}"


class ThresholdFilter(Filter):
    """A filter that computes signals, then applies its rules in order; the first one broken drops the doc.

    ``RULES`` lists (reason, signal, config field) in the order they are checked; the limit of each is that field
    of the filter's config and its key ``prefix + field`` (the section, dotted from the clean config root).
    """

    RULES: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    rules: list[Rule]

    def __init__(self, cfg: Any, prefix: str = "") -> None:
        self.cfg = cfg
        self.rules = [Rule(reason, signal, prefix + key, getattr(cfg, key)) for reason, signal, key in self.RULES]

    def signals(self, doc: Doc) -> dict[str, float]:
        raise NotImplementedError

    @property
    def reasons(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(r.reason for r in self.rules)

    def reason(self, doc: Doc) -> str | None:
        values = self.signals(doc)
        doc.signals.update(values)
        for rule in self.rules:
            value = values.get(rule.signal)
            if value is not None and rule.fails(value):
                doc.signals["_failed"] = rule
                return rule.reason
        return None

    def detail(self, doc: Doc) -> str:
        rule = doc.signals.get("_failed")
        return rule.describe(doc.signals[rule.signal]) if isinstance(rule, Rule) else ""
