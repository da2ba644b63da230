"""Document quality rules as small datatrove-style filters: URL blocklist, Gopher quality and repetition, language,
C4, FineWeb, OLMo 2 and a dirty-word ratio. Each filter keeps a document (None) or drops it with a reason string.

Try the rules on one file: ``python -m kiln.filters page.txt`` prints every signal and the first rule that drops it.
The published thresholds are the defaults (Gopher: Rae et al. 2021; C4: Raffel et al. 2020; FineWeb: Penedo et al.
2024, as in datatrove; OLMo 2: OLMo et al. 2024); each is a typed config field.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import sys
import unicodedata
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from kiln.common.config import ConfigError

_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_types(cfg: Any, where: str) -> None:
    """ConfigError naming the key when a scalar field has the wrong type (e.g. a quoted number in YAML)."""
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), _TYPES.get(str(f.type))
        if allowed and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            raise ConfigError(f"{where}.{f.name} must be {f.type}, got {value!r}.")
        if str(f.type) == "list[str]" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{where}.{f.name} must be a list of strings, got {value!r}.")


# ---------------------------------------------------------------------------------------------- documents


_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~«»“”‘’„…–—·•"
_LETTER = re.compile(r"[^\W\d_]")
_PARAGRAPHS = re.compile(r"\n\s*\n")
BULLETS = ("•", "-", "*", "‣", "◦", "⁃", "·", "▪", "●", "○", "■", "□", "➢", "►")
STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))  # Gopher's required stop words
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


def word_hashes(words: list[str]) -> np.ndarray:
    """(len(words),) uint64: crc32 in the high and adler32 in the low 32 bits of each word's UTF-8."""
    data = [w.encode("utf-8", "surrogatepass") for w in words]
    high = np.fromiter(map(zlib.crc32, data), dtype=np.uint64, count=len(data))
    low = np.fromiter(map(zlib.adler32, data), dtype=np.uint64, count=len(data))
    return (high << np.uint64(32)) | low


def text_signals(text: str) -> dict[str, float]:
    """The Gopher quality signals of ``text``; also written as columns of the kept Parquet."""
    everything = GopherQualityConfig(min_words=0, max_words=2**62)
    return GopherQuality(everything).signals(Doc("", "", "", text, "text/plain", "", 0))


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
    """A filter that computes signals, then applies its rules in order; the first one broken drops the doc."""

    rules: list[Rule]

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


# ---------------------------------------------------------------------------------------------- Gopher quality


@dataclass
class GopherQualityConfig:
    """Gopher quality rules (Rae et al. 2021, appendix A), datatrove's defaults; the keys sit at the top of
    the clean config (clean.min_words, ...)."""

    min_words: int = 50  # fewer whitespace-separated words than this: too short to be prose
    max_words: int = 100_000  # more words than this: dumps, logs, concatenated pages
    min_mean_word_length: float = 3.0  # mean word length (punctuation stripped) below this: lists of tokens
    max_mean_word_length: float = 10.0  # ... above this: URLs, hashes, base64
    max_symbol_to_word_ratio: float = 0.1  # max of '#' count and '...'/'…' count, per word
    min_alpha_word_fraction: float = 0.8  # share of words with at least one letter
    max_duplicate_line_fraction: float = 0.3  # share of non-empty lines that repeat an earlier line
    max_bullet_lines_fraction: float = 0.9  # share of lines starting with a bullet (•, -, *, ...)
    max_ellipsis_lines_fraction: float = 0.3  # share of lines ending in '...' or '…' (C4's truncated teasers)
    min_stop_words: int = 2  # fewer of "the, be, to, of, and, that, have, with" than this: not running English


class GopherQuality(ThresholdFilter):
    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig, prefix: str = "") -> None:
        k = lambda key: prefix + key  # noqa: E731
        self.rules = [
            Rule("gopher:too_few_words", "words", k("min_words"), cfg.min_words),
            Rule("gopher:too_many_words", "words", k("max_words"), cfg.max_words),
            Rule("gopher:short_mean_word_length", "mean_word_length", k("min_mean_word_length"), cfg.min_mean_word_length),
            Rule("gopher:long_mean_word_length", "mean_word_length", k("max_mean_word_length"), cfg.max_mean_word_length),
            Rule("gopher:symbol_to_word_ratio", "symbol_ratio", k("max_symbol_to_word_ratio"), cfg.max_symbol_to_word_ratio),
            Rule("gopher:few_alpha_words", "alpha_word_fraction", k("min_alpha_word_fraction"), cfg.min_alpha_word_fraction),
            Rule("gopher:duplicate_lines", "duplicate_line_fraction", k("max_duplicate_line_fraction"),
                 cfg.max_duplicate_line_fraction),
            Rule("gopher:bullet_lines", "bullet_lines_fraction", k("max_bullet_lines_fraction"), cfg.max_bullet_lines_fraction),
            Rule("c4:ellipsis_lines", "ellipsis_lines_fraction", k("max_ellipsis_lines_fraction"),
                 cfg.max_ellipsis_lines_fraction),
            Rule("gopher:few_stop_words", "stop_words", k("min_stop_words"), cfg.min_stop_words),
        ]

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


# ---------------------------------------------------------------------------------------------- Gopher repetition


@dataclass
class RepetitionConfig:
    """Gopher repetition rules (Rae et al. 2021, table A1), datatrove's defaults; duplicate lines are
    clean.max_duplicate_line_fraction."""

    enabled: bool = True  # apply the rules below
    max_duplicate_paragraph_fraction: float = 0.3  # share of paragraphs that repeat an earlier one
    max_duplicate_line_char_fraction: float = 0.2  # share of characters in lines that repeat an earlier line
    max_duplicate_paragraph_char_fraction: float = 0.2  # share of characters in repeated paragraphs
    # most frequent n-gram (n=2, 3, 4): its characters times its count, over all characters
    max_top_2gram_char_fraction: float = 0.20
    max_top_3gram_char_fraction: float = 0.18
    max_top_4gram_char_fraction: float = 0.16
    # characters covered by repeated occurrences of any n-gram (n=5..10), over all word characters
    max_dup_5gram_char_fraction: float = 0.15
    max_dup_6gram_char_fraction: float = 0.14
    max_dup_7gram_char_fraction: float = 0.13
    max_dup_8gram_char_fraction: float = 0.12
    max_dup_9gram_char_fraction: float = 0.11
    max_dup_10gram_char_fraction: float = 0.10


def ngram_hashes(h: np.ndarray, n: int) -> np.ndarray:
    """(len(h) - n + 1,) uint64 rolling hashes of the n-grams of the word hashes ``h`` (wrapping arithmetic)."""
    m = len(h) - n + 1
    out = np.zeros(m, dtype=np.uint64)
    mult = np.uint64(0x100000001B3)  # FNV-64 prime: mixes the word hashes order-dependently
    for k in range(n):
        out = out * mult + h[k : k + m]
    return out


def _duplicate_chars(items: list[str]) -> tuple[int, int]:
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


class GopherRepetition(ThresholdFilter):
    """Repeated paragraphs, lines and n-grams; n-gram statistics run vectorised over 64-bit word hashes
    (exact up to hash collisions) because datatrove's per-n-gram Python loop dominates cleaning time."""

    name = "gopher_repetition"

    def __init__(self, cfg: RepetitionConfig, prefix: str = "repetition.") -> None:
        self.rules = [
            Rule("gopher:duplicate_paragraphs", "duplicate_paragraph_fraction",
                 prefix + "max_duplicate_paragraph_fraction", cfg.max_duplicate_paragraph_fraction),
            Rule("gopher:duplicate_paragraph_chars", "duplicate_paragraph_char_fraction",
                 prefix + "max_duplicate_paragraph_char_fraction", cfg.max_duplicate_paragraph_char_fraction),
            Rule("gopher:duplicate_line_chars", "duplicate_line_char_fraction",
                 prefix + "max_duplicate_line_char_fraction", cfg.max_duplicate_line_char_fraction),
        ]
        self.top = [(n, getattr(cfg, f"max_top_{n}gram_char_fraction")) for n in (2, 3, 4)]
        self.dup = [(n, getattr(cfg, f"max_dup_{n}gram_char_fraction")) for n in range(5, 11)]
        self.rules += [Rule(f"gopher:top_{n}gram", f"top_{n}gram_char_fraction",
                            f"{prefix}max_top_{n}gram_char_fraction", v) for n, v in self.top]
        self.rules += [Rule(f"gopher:dup_{n}gram", f"dup_{n}gram_char_fraction",
                            f"{prefix}max_dup_{n}gram_char_fraction", v) for n, v in self.dup]

    def signals(self, doc: Doc) -> dict[str, float]:
        text = doc.text
        chars = max(len(text), 1)
        paragraphs, lines = doc.paragraphs, doc.lines
        para_dups, para_chars = _duplicate_chars(paragraphs)
        _, line_chars = _duplicate_chars(lines)
        out = {
            "duplicate_paragraph_fraction": para_dups / max(len(paragraphs), 1),
            "duplicate_paragraph_char_fraction": para_chars / chars,
            "duplicate_line_char_fraction": line_chars / chars,
        }
        h, lengths = doc.word_hashes, doc.word_lengths
        word_chars = max(int(lengths.sum()), 1)
        csum = np.concatenate(([0], np.cumsum(lengths)))
        for n, _ in self.top:
            if len(h) < n:
                out[f"top_{n}gram_char_fraction"] = 0.0
                continue
            _, first, counts = np.unique(ngram_hashes(h, n), return_index=True, return_counts=True)
            top = counts == counts.max()  # every most frequent n-gram; the longest of them counts (no tie order)
            ngram_chars = (csum[first[top] + n] - csum[first[top]]).max() + n - 1  # words joined by one space
            out[f"top_{n}gram_char_fraction"] = int(ngram_chars) * int(counts.max()) / chars
        none_repeat = False  # no repeated n-gram means no repeated longer n-gram either
        for n, _ in self.dup:
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


# ---------------------------------------------------------------------------------------------- C4


@dataclass
class C4Config:
    """C4's rules (Raffel et al. 2020, section 2.2): lines removed from a page, then pages dropped."""

    enabled: bool = True  # apply the rules below
    lorem_ipsum: bool = True  # drop pages containing "lorem ipsum" (placeholder text)
    curly_bracket: bool = False  # drop pages containing "{": C4 did, but it drops every page with code
    min_sentences: int = 0  # pages with fewer sentences are dropped (C4: 5; 0 disables, as fits short docs)
    # line removal, before the page rules: the lines go, the page stays
    javascript_lines: bool = True  # remove lines mentioning "javascript" ("please enable JavaScript")
    policy_lines: bool = True  # remove lines about terms of use, privacy or cookie policies
    max_word_chars: int = 1000  # remove lines with a "word" longer than this (minified code, base64)
    min_words_per_line: int = 0  # remove lines with fewer words (C4: 3; 0 keeps them, as headings and code need)
    terminal_punct_lines: bool = False  # remove lines not ending in terminal punctuation (C4 did; FineWeb did not)


_SENTENCE_END = re.compile(r"[.!?…]+(?=\s|$)")


_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


class C4LineCleaner:
    """C4's line removal; ``clean(text)`` returns (text, {rule: [lines, bytes]}) for the lines it removed."""

    RULES = ("c4:javascript_line", "c4:policy_line", "c4:long_word_line", "c4:short_line", "c4:no_terminal_punct_line")

    def __init__(self, cfg: C4Config) -> None:
        self.cfg = cfg

    def _rule(self, line: str) -> str | None:
        s = line.strip()
        if not s:
            return None
        low = s.lower()
        cfg = self.cfg
        if cfg.javascript_lines and "javascript" in low:
            return "c4:javascript_line"
        if cfg.policy_lines and any(p in low for p in _POLICY):
            return "c4:policy_line"
        if len(s) > cfg.max_word_chars and any(len(w) > cfg.max_word_chars for w in s.split()):
            return "c4:long_word_line"
        if cfg.min_words_per_line and len(s.split()) < cfg.min_words_per_line:
            return "c4:short_line"
        if cfg.terminal_punct_lines and not s.endswith(END_PUNCTUATION):
            return "c4:no_terminal_punct_line"
        return None

    def clean(self, text: str) -> tuple[str, dict[str, list[int]]]:
        cfg = self.cfg
        if not cfg.enabled:
            return text, {}
        low = text.lower()
        if not (cfg.min_words_per_line or cfg.terminal_punct_lines or "javascript" in low or "cookie" in low
                or "policy" in low or "terms of use" in low or len(text) > cfg.max_word_chars):
            return text, {}  # the common case: no line can match
        kept, edits = [], {}
        for line in text.split("\n"):
            rule = self._rule(line)
            if rule is None:
                kept.append(line)
            else:
                e = edits.setdefault(rule, [0, 0])
                e[0] += 1
                e[1] += len(line.encode()) + 1
        return ("\n".join(kept).strip() if edits else text), edits


class C4Filter(Filter):
    name = "c4"
    reasons = ("c4:lorem_ipsum", "c4:curly_bracket", "c4:too_few_sentences")

    def __init__(self, cfg: C4Config) -> None:
        self.cfg = cfg

    def reason(self, doc: Doc) -> str | None:
        low = doc.text.lower()
        if self.cfg.lorem_ipsum and "lorem ipsum" in low:
            return "c4:lorem_ipsum"
        if self.cfg.curly_bracket and "{" in doc.text:
            return "c4:curly_bracket"
        if self.cfg.min_sentences:
            doc.signals["sentences"] = len(_SENTENCE_END.findall(doc.text))
            if doc.signals["sentences"] < self.cfg.min_sentences:
                return "c4:too_few_sentences"
        return None

    def detail(self, doc: Doc) -> str:
        if "sentences" in doc.signals and doc.signals["sentences"] < self.cfg.min_sentences:
            return f"sentences={doc.signals['sentences']} < c4.min_sentences={self.cfg.min_sentences}"
        return "contains 'lorem ipsum'" if "lorem ipsum" in doc.text.lower() else "contains '{'"


# ---------------------------------------------------------------------------------------------- FineWeb


@dataclass
class FineWebConfig:
    """FineWeb's own rules (Penedo et al. 2024), datatrove's FineWebQualityFilter defaults."""

    enabled: bool = True  # apply the rules below
    min_line_punct_fraction: float = 0.12  # share of lines ending in terminal punctuation below this: menus, lists
    max_short_line_fraction: float = 0.67  # share of lines of at most short_line_chars characters above this
    short_line_chars: int = 30  # what a short line is
    max_duplicate_line_char_fraction: float = 0.01  # characters in repeated lines over all non-newline characters
    max_newline_word_ratio: float = 0.3  # newlines per word above this: one-word-per-line lists


class FineWebFilter(ThresholdFilter):
    name = "fineweb"

    def __init__(self, cfg: FineWebConfig, prefix: str = "fineweb.") -> None:
        self.cfg = cfg
        self.rules = [
            Rule("fineweb:line_punct_ratio", "line_punct_fraction", prefix + "min_line_punct_fraction",
                 cfg.min_line_punct_fraction),
            Rule("fineweb:short_line_ratio", "short_line_fraction", prefix + "max_short_line_fraction",
                 cfg.max_short_line_fraction),
            Rule("fineweb:char_dup_ratio", "fineweb_dup_line_char_fraction", prefix + "max_duplicate_line_char_fraction",
                 cfg.max_duplicate_line_char_fraction),
            Rule("fineweb:list_ratio", "newline_word_ratio", prefix + "max_newline_word_ratio", cfg.max_newline_word_ratio),
        ]

    def signals(self, doc: Doc) -> dict[str, float]:
        lines = [line for line in doc.text.split("\n") if line.strip()]
        n = max(len(lines), 1)
        _, dup_chars = _duplicate_chars(lines)
        return {
            "line_punct_fraction": sum(line.endswith(END_PUNCTUATION) for line in lines) / n,
            "short_line_fraction": sum(len(line) <= self.cfg.short_line_chars for line in lines) / n,
            "fineweb_dup_line_char_fraction": dup_chars / max(len(doc.text) - doc.text.count("\n"), 1),
            "newline_word_ratio": doc.text.count("\n") / max(len(doc.words), 1),
        }


# ---------------------------------------------------------------------------------------------- OLMo 2


@dataclass
class Olmo2Config:
    """OLMo 2's two repetition rules (OLMo et al. 2024, DCLM baseline pool)."""

    enabled: bool = True  # apply the rules below
    max_ngram_repeats: int = 31  # a run of more consecutive repeats of one n-gram than this drops the doc (32+)
    max_ngram: int = 13  # n-gram lengths 1..max_ngram are checked for runs
    max_top_word_fraction: float = 0.3  # the most frequent word's share of all words above this drops the doc


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

    def __init__(self, cfg: Olmo2Config, prefix: str = "olmo2.") -> None:
        self.cfg = cfg
        self.rules = [
            Rule("olmo2:repeated_ngram_run", "ngram_repeat_run", prefix + "max_ngram_repeats", cfg.max_ngram_repeats),
            Rule("olmo2:top_word_fraction", "top_word_fraction", prefix + "max_top_word_fraction", cfg.max_top_word_fraction),
        ]

    def signals(self, doc: Doc) -> dict[str, float]:
        repeats, _ = longest_repeat_run(doc.word_hashes, self.cfg.max_ngram)
        bare = doc.bare_words
        top = 0.0
        if bare:
            _, counts = np.unique(word_hashes(bare), return_counts=True)
            top = int(counts.max()) / len(bare)
        return {"ngram_repeat_run": repeats, "top_word_fraction": top}


# ---------------------------------------------------------------------------------------------- dirty words


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
    max_fraction: float = 0.01  # dirty words per word above this drops the document
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

    def __init__(self, cfg: DirtyWordsConfig) -> None:
        words, self.phrases = load_word_list(cfg.words_file)
        self.words = words - {w.lower() for w in cfg.ignore_words}
        self.rules = [Rule("dirty_words:ratio", "dirty_word_fraction", "dirty_words.max_fraction", cfg.max_fraction)]

    def signals(self, doc: Doc) -> dict[str, float]:
        bare = doc.bare_words
        hits = sum(1 for w in bare if w in self.words)
        if self.phrases:
            low = " ".join(bare)
            hits += sum(low.count(p) * len(p.split()) for p in self.phrases if p in low)
        return {"dirty_word_fraction": hits / max(len(bare), 1)}


# ---------------------------------------------------------------------------------------------- URLs


@dataclass
class UrlFilterConfig:
    """URL and domain blocklist (FineWeb used the UT1 lists plus banned words in the URL)."""

    enabled: bool = True  # apply the rules below
    blocked_domains: list[str] = field(default_factory=list)  # a domain blocks itself and its subdomains
    blocklist_files: list[str] = field(default_factory=list)  # files of domains, one a line (UT1 format), '#' comments
    banned_url_words: list[str] = field(default_factory=list)  # substrings of the lower-cased URL that drop the doc


class UrlFilter(Filter):
    name = "url"
    reasons = ("url:blocked_domain", "url:banned_word")

    def __init__(self, cfg: UrlFilterConfig) -> None:
        domains = {d.strip().lower().lstrip(".") for d in cfg.blocked_domains if d.strip()}
        for path in cfg.blocklist_files:
            try:
                lines = Path(path).expanduser().read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError as e:
                raise ConfigError(f"clean.urls.blocklist_files: cannot read {path}: {e}") from None
            domains |= {s.strip().lower() for s in lines if s.strip() and not s.lstrip().startswith("#")}
        self.domains = frozenset(domains)
        self.words = tuple(w.lower() for w in cfg.banned_url_words if w)
        self.cfg = cfg

    def reason(self, doc: Doc) -> str | None:
        if not doc.url or not (self.domains or self.words):
            return None
        host = (urlsplit(doc.url).hostname or "").lower().rstrip(".")
        parts = host.split(".")
        for i in range(len(parts)):
            if ".".join(parts[i:]) in self.domains:
                doc.signals["_url"] = f"domain {'.'.join(parts[i:])} is blocked"
                return "url:blocked_domain"
        low = doc.url.lower()
        for w in self.words:
            if w in low:
                doc.signals["_url"] = f"URL contains banned word {w!r}"
                return "url:banned_word"
        return None

    def detail(self, doc: Doc) -> str:
        return doc.signals.get("_url", "")


# ---------------------------------------------------------------------------------------------- language


@dataclass
class LanguageConfig:
    """Language identification with resiliparse's detector, whose profiles ship inside the package."""

    enabled: bool = True  # apply the rules below
    allowed: list[str] = field(default_factory=lambda: ["en"])  # ISO 639-1 codes kept; empty keeps every language
    max_rank: int = 1200  # out-of-place rank above this (a distance; resiliparse: >1200 is usually wrong) drops
    sample_chars: int = 5000  # characters of the document read by the detector (speed; the start is enough)


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


def matches_any(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def main(argv: list[str] | None = None) -> int:
    from kiln.clean.pipeline import CleanConfig, default_filters, normalize_text

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kiln.filters FILE", file=sys.stderr)
        return 2
    text = normalize_text(Path(args[0]).read_text(encoding="utf-8", errors="replace"))
    doc = Doc(args[0], "cli", Path(args[0]).resolve().as_uri(), text, "text/plain", "", len(text.encode()))
    verdict = None
    for f in default_filters(CleanConfig()):
        reason = f.reason(doc)
        if reason and verdict is None:
            verdict = (reason, f.detail(doc))
    for k, v in sorted(doc.signals.items()):
        if not k.startswith("_"):
            print(f"{k:36s} {v:.4g}" if isinstance(v, float) else f"{k:36s} {v}")
    print("kept" if verdict is None else f"dropped: {verdict[0]} ({verdict[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
