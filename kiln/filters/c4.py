"""C4's rules (Raffel et al. 2020, section 2.2): lines removed from a page (JavaScript notices, policy lines, very
long words, short or unterminated lines), then pages dropped (lorem ipsum, curly brackets, too few sentences).

Try: ``python -c "from kiln.filters.c4 import *; print(C4LineCleaner(C4Config()).clean('Hi.\\nEnable JavaScript.'))"``
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from kiln.common.config import Domain
from kiln.filters.base import END_PUNCTUATION, Doc, Filter


@dataclass
class C4Config:
    """C4's rules (Raffel et al. 2020, section 2.2): lines removed from a page, then pages dropped."""

    enabled: bool = True  # apply the rules below
    lorem_ipsum: bool = True  # drop pages containing "lorem ipsum" (placeholder text)
    curly_bracket: bool = False  # drop pages containing "{": C4 did, but it drops every page with code
    min_sentences: Annotated[int, Domain(0)] = 0  # pages with fewer sentences are dropped (C4: 5; 0 disables, as fits short docs)
    # line removal, before the page rules: the lines go, the page stays
    javascript_lines: bool = True  # remove lines mentioning "javascript" ("please enable JavaScript")
    policy_lines: bool = True  # remove lines about terms of use, privacy or cookie policies
    max_word_chars: Annotated[int, Domain(1)] = 1000  # remove lines with a "word" longer than this (minified code, base64)
    min_words_per_line: Annotated[int, Domain(0)] = 0  # remove lines with fewer words (C4: 3; 0 keeps them, as headings and code need)
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
