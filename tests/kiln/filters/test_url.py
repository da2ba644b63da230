"""Tests of kiln/filters/url.py: the URL blocklist."""

from __future__ import annotations

from pathlib import Path
from kiln.filters.url import UrlFilter, UrlFilterConfig
from tests.kiln.filters.filters_kit import verdict
from textgen import prose


def test_url_blocklist(tmp_path: Path) -> None:
    listed = tmp_path / "adult.txt"
    listed.write_text("# UT1 style\nbad.example\n", encoding="utf-8")
    f = UrlFilter(UrlFilterConfig(blocked_domains=["spam.example"], blocklist_files=[str(listed)],
                                  banned_url_words=["casino"]))
    assert verdict(f, prose(1), "https://news.example/a") == (None, "")
    assert verdict(f, prose(1), "https://www.spam.example/page") == ("url:blocked_domain",
                                                                     "domain spam.example is blocked")
    assert verdict(f, prose(1), "http://cdn.bad.example/x")[0] == "url:blocked_domain"
    assert verdict(f, prose(1), "https://notbad.example/")[0] is None  # a suffix is not a subdomain
    assert verdict(f, prose(1), "https://site.example/Casino-bonus") == ("url:banned_word",
                                                                         "URL contains banned word 'casino'")
    assert verdict(f, prose(1), "") == (None, "")
