"""URL and domain blocklist (FineWeb used the UT1 lists plus banned words in the URL): a blocked domain drops its
pages and its subdomains' pages; a banned word anywhere in the lower-cased URL drops the page.

Try: ``python -c "from kiln.filters.url import *; print(UrlFilter(UrlFilterConfig(blocked_domains=['.Example.org'])).domains)"``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kiln.common.config import ConfigError
from kiln.filters.base import Doc, Filter


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
