"""Share of a document's words on a list of obscene words (C4 dropped any page with one such word; a ratio is
gentler), with ordinary words of news and encyclopedic text left off the list by default.

Try: ``python -c "from kiln.filters.dirty_words import *; print(len(load_word_list()[0]), ORDINARY_WORDS[:5])"``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated

from kiln.common.config import ConfigError, Domain
from kiln.filters.base import Doc, ThresholdFilter

# Entries of better-profanity's list that are ordinary words in news and encyclopedic text (identity, religion,
# anatomy and medicine, crime and history, drugs, everyday words). Word lists like it made C4's bad-words filter
# remove LGBTQ+ and medical text disproportionately (Dodge et al. 2021), so they are not counted by default.
ORDINARY_WORDS = tuple(sorted(set("""
god hell damn kill murder rape raped raping rapist sniper uzi nazi hitler reich klan kkk slave thug
gay gays lesbian lesbians queer queers homo homosexual bisexual transsexual transgender
sex sexual sexy naked nude nudes erotic pornography playboy lust lusty lusting seduce kinky bondage perversion
penis vagina breasts nipple nipples erect erection penetrate penetration anus rectum scrotum testes testis gonads
semen sperm womb urine urinal vomit pee poop fart oral facial hiv incest pedophile pedophilia masochist sadist
drunk stoned pot weed hemp heroin cocaine opium meth valium reefer ganja toke hootch hookah vodka rum
stupid ugly fat dummy moron jerk weirdo doofus dopey tawdry sleaze floozy prig souse unwed vulgar
screw screwed screwing strip stroke organ woody willy wang knob thrust wad slope snatch pawn hump dong whiz snuff
seaman pollock hoare yury foobar xx guido gringo dinks arian virgin prostitute
""".split())))


@dataclass
class DirtyWordsConfig:
    """Share of words on a list of obscene words (C4 dropped any page with one; a ratio is gentler)."""

    enabled: bool = True  # apply the rule
    max_fraction: Annotated[float, Domain(0, 1)] = 0.01  # dirty words per word above this drops the document
    words_file: str = ""  # one word or phrase per line; empty: the list shipped in better-profanity 0.7.0
    ignore_words: list[str] = field(default_factory=lambda: list(ORDINARY_WORDS))  # list entries not counted


def load_word_list(path: str = "") -> tuple[frozenset[str], tuple[str, ...]]:
    """(single words, multi-word phrases), lower-cased, from ``path`` or better-profanity's shipped list."""
    if path:
        try:
            raw = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"clean.dirty_words.words_file: cannot read {path}: {e}") from None
    else:
        raw = resources.files("better_profanity").joinpath("profanity_wordlist.txt").read_text(encoding="utf-8")
    entries = {line.strip().lower() for line in raw.splitlines() if line.strip() and not line.startswith("#")}
    return frozenset(e for e in entries if " " not in e), tuple(sorted(e for e in entries if " " in e))


class DirtyWordsFilter(ThresholdFilter):
    name = "dirty_words"
    RULES = (("dirty_words:ratio", "dirty_word_fraction", "max_fraction"),)

    def __init__(self, cfg: DirtyWordsConfig, prefix: str = "dirty_words.") -> None:
        words, self.phrases = load_word_list(cfg.words_file)
        self.words = words - {w.lower() for w in cfg.ignore_words}
        super().__init__(cfg, prefix)

    def signals(self, doc: Doc) -> dict[str, float]:
        bare = doc.bare_words
        hits = sum(1 for w in bare if w in self.words)
        if self.phrases:
            low = " ".join(bare)
            hits += sum(low.count(p) * len(p.split()) for p in self.phrases if p in low)
        return {"dirty_word_fraction": hits / max(len(bare), 1)}
