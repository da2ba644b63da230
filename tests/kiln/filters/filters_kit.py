"""Helpers of the filter tests: sentences of prose, a normalized document and one filter's (reason, detail) on a text."""

from __future__ import annotations

from kiln.common.text import normalize_text
from kiln.filters.base import Doc
from textgen import prose


SENTENCES = [s + "." for s in prose(7, 12).replace("\n\n", " ").split(". ")]
SENTENCES[-1] = SENTENCES[-1].rstrip(".")


def doc(text: str, url: str = "", source: str = "test") -> Doc:
    text = normalize_text(text)
    return Doc("d", source, url, text, "text/plain", "CC0", len(text.encode()))


def verdict(f, text: str, url: str = "") -> tuple[str | None, str]:
    d = doc(text, url)
    reason = f.reason(d)
    return reason, (f.detail(d) if reason else "")
