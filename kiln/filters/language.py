"""Language identification with resiliparse's detector (its 101 language profiles ship inside the wheel): drops
documents in languages not allowed, or whose best profile is too far away to trust.

Try: ``python -c "from kiln.filters.language import *; print(LanguageFilter(LanguageConfig()).detect('Der Hund schläft im Garten, die Katze auf dem Dach.'))"``
"""

from __future__ import annotations

from typing import Annotated
import unicodedata
from dataclasses import dataclass, field

from kiln.common.config import Domain
from kiln.filters.base import Doc, Filter


@dataclass
class LanguageConfig:
    """Language identification with resiliparse's detector, whose profiles ship inside the package."""

    enabled: bool = True  # apply the rules below
    allowed: list[str] = field(default_factory=lambda: ["en"])  # ISO 639-1 codes kept; empty keeps every language
    max_rank: Annotated[int, Domain(1)] = 1200  # out-of-place rank above this (a distance; resiliparse: >1200 is usually wrong) drops
    sample_chars: Annotated[int, Domain(1)] = 5000  # characters of the document read by the detector (speed; the start is enough)


class LanguageFilter(Filter):
    """Why resiliparse.parse.lang.detect_fast: it ships its 101 language profiles in the wheel we already use
    for extraction (no model download), and runs at ~70 MB/s on one core."""

    name = "language"
    reasons = ("lang:not_allowed", "lang:low_confidence")

    def __init__(self, cfg: LanguageConfig) -> None:
        from resiliparse.parse.lang import detect_fast

        self.cfg, self.detect = cfg, detect_fast
        self.allowed = frozenset(cfg.allowed)

    def reason(self, doc: Doc) -> str | None:
        lang, rank = self.detect(unicodedata.normalize("NFC", doc.text[: self.cfg.sample_chars]))
        doc.signals["language"], doc.signals["language_rank"] = lang, int(rank)
        if self.allowed and lang not in self.allowed:
            return "lang:not_allowed"
        if rank > self.cfg.max_rank:
            return "lang:low_confidence"
        return None

    def detail(self, doc: Doc) -> str:
        lang, rank = doc.signals.get("language"), doc.signals.get("language_rank")
        if self.allowed and lang not in self.allowed:
            return f"language={lang} (rank {rank}) not in language.allowed={sorted(self.allowed)}"
        return f"language_rank={rank} > language.max_rank={self.cfg.max_rank} (detected {lang})"
