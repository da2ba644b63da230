"""Tests for the filters of kiln.filters: every rule's keep and drop case with its exact reason string, and per-source exemptions.

Run: python -m pytest tests/kiln/filters/test_filters.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.clean.config import CleanConfig, default_filters
from kiln.clean.run import clean
from kiln.common.config import ConfigError
from kiln.common.text import normalize_text
from kiln.filters.base import Doc
from kiln.filters.c4 import C4Config, C4Filter, C4LineCleaner
from kiln.filters.dirty_words import DirtyWordsConfig, DirtyWordsFilter
from kiln.filters.fineweb import FineWebConfig, FineWebFilter
from kiln.filters.gopher_repetition import GopherRepetition, RepetitionConfig
from kiln.filters.language import LanguageConfig, LanguageFilter
from kiln.filters.olmo2 import Olmo2Config, Olmo2Filter, longest_repeat_run
from kiln.filters.url import UrlFilter, UrlFilterConfig
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


def test_clean_prose_passes_every_default_rule() -> None:
    for seed in range(20):
        d = doc(prose(seed))
        assert [f.reason(d) for f in default_filters(CleanConfig())] == [None] * 8, seed


# ---------------------------------------------------------------- Gopher repetition


def test_gopher_repetition_rules() -> None:
    f = GopherRepetition(RepetitionConfig())
    good = prose(1, 10)
    assert verdict(f, good) == (None, "")
    paras = [prose(s, 2).replace("\n\n", " ") for s in range(10, 14)]
    reason, detail = verdict(f, "\n\n".join(paras + paras[:2]))  # 2 of 6 paragraphs repeat
    assert reason == "gopher:duplicate_paragraphs"
    assert detail == "duplicate_paragraph_fraction=0.3333 > repetition.max_duplicate_paragraph_fraction=0.3"
    long_para = prose(20, 8).replace("\n\n", " ")
    short = [f"Note {w} follows." for w in ("one", "two", "three", "four", "five", "six")]
    assert verdict(f, "\n\n".join([long_para, *short, long_para]))[0] == "gopher:duplicate_paragraph_chars"
    assert verdict(f, "\n".join([long_para, *short, long_para]))[0] == "gopher:duplicate_line_chars"
    words = prose(30, 12).split()
    assert verdict(f, " ".join(f"{w} river bank" for w in words[:40]))[0] == "gopher:top_2gram"
    copied = " ".join(SENTENCES[:9] + SENTENCES[2:4])  # two sentences appear twice: repeated 5- to 10-grams
    reason, detail = verdict(f, copied)
    assert reason == "gopher:dup_5gram" and detail.startswith("dup_5gram_char_fraction=")


# ---------------------------------------------------------------- C4


def test_c4_page_rules_and_line_removal() -> None:
    f = C4Filter(C4Config())
    assert verdict(f, prose(2)) == (None, "")
    assert verdict(f, prose(2) + " Lorem ipsum dolor sit amet.") == ("c4:lorem_ipsum", "contains 'lorem ipsum'")
    code = prose(2) + "\nif (x) { y(); }"
    assert verdict(f, code) == (None, "")  # off by default: it would drop every page with code
    assert verdict(C4Filter(C4Config(curly_bracket=True)), code) == ("c4:curly_bracket", "contains '{'")
    assert verdict(C4Filter(C4Config(min_sentences=20)), prose(2))[0] == "c4:too_few_sentences"

    lines = C4LineCleaner(C4Config())
    page = prose(3) + "\nPlease enable JavaScript to view this page.\nRead our privacy policy.\nThe end."
    text, edits = lines.clean(page)
    assert text == prose(3) + "\nThe end."
    assert edits == {"c4:javascript_line": [1, 44], "c4:policy_line": [1, 25]}
    assert lines.clean(prose(3)) == (prose(3), {})
    strict = C4LineCleaner(C4Config(min_words_per_line=3, terminal_punct_lines=True))
    assert strict.clean("A full sentence is here.\nMenu\nNo final mark here")[0] == "A full sentence is here."


# ---------------------------------------------------------------- FineWeb


def test_fineweb_rules() -> None:
    f = FineWebFilter(FineWebConfig())
    assert verdict(f, prose(4)) == (None, "")
    no_punct = "\n".join(s.rstrip(".") for s in SENTENCES)
    assert verdict(f, no_punct) == ("fineweb:line_punct_ratio",
                                    "line_punct_fraction=0 < fineweb.min_line_punct_fraction=0.12")
    short = "\n".join(f"The {w} waits." for w in "boat cart mill lamp dog cat owl fox bee ant".split())
    assert verdict(f, short + "\n" + SENTENCES[0])[0] == "fineweb:short_line_ratio"
    repeated = "\n".join(SENTENCES[:8] + SENTENCES[:1])
    assert verdict(f, repeated)[0] == "fineweb:char_dup_ratio"
    listy = FineWebFilter(FineWebConfig(short_line_chars=5))
    assert verdict(listy, "\n".join(f"{w} waits." for w in "Boat Cart Mill Lamp Dog Cat".split()))[0] == \
        "fineweb:list_ratio"


# ---------------------------------------------------------------- OLMo 2


def test_olmo2_rules() -> None:
    f = Olmo2Filter(Olmo2Config())
    base = prose(5)
    assert verdict(f, base) == (None, "")
    assert verdict(f, base + " " + " ".join(["buy now"] * 31)) == (None, "")  # 31 repeats: kept
    reason, detail = verdict(f, base + " " + " ".join(["buy now"] * 32))
    assert (reason, detail) == ("olmo2:repeated_ngram_run", "ngram_repeat_run=32 > olmo2.max_ngram_repeats=31")
    words = base.split()
    heavy = " ".join(w for pair in zip(words, ["data"] * len(words)) for w in pair)  # every second word: 50%
    assert verdict(f, heavy)[0] == "olmo2:top_word_fraction"
    import numpy as np

    h = np.array([1, 2, 3, 2, 3, 2, 3, 2, 3, 4], dtype=np.uint64)
    assert longest_repeat_run(h, 4) == (4, 2)  # (2, 3) four times in a row


# ---------------------------------------------------------------- dirty words, URLs, language


def test_dirty_word_ratio(tmp_path: Path) -> None:
    f = DirtyWordsFilter(DirtyWordsConfig())
    assert verdict(f, prose(6)) == (None, "")
    reason, detail = verdict(f, prose(6) + " What the fuck, shit.")
    assert reason == "dirty_words:ratio" and detail.startswith("dirty_word_fraction=0.0") and "max_fraction=0.01" in detail
    ordinary = prose(6) + " The gay rights group met the god of the sea; sex education was discussed."
    assert verdict(f, ordinary) == (None, "")  # identity, religion and medicine words are not counted
    words = tmp_path / "words.txt"
    words.write_text("harbour\nriver bank\n", encoding="utf-8")
    own = DirtyWordsFilter(DirtyWordsConfig(words_file=str(words), max_fraction=0.05))
    assert verdict(own, prose(6) + " harbour harbour harbour river bank river bank")[0] == "dirty_words:ratio"
    with pytest.raises(ConfigError, match="words_file: cannot read"):
        DirtyWordsFilter(DirtyWordsConfig(words_file=str(tmp_path / "none.txt")))


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


def test_language_identification() -> None:
    f = LanguageFilter(LanguageConfig())
    assert verdict(f, prose(8)) == (None, "")
    german = ("Der alte Leuchtturm stand auf einem felsigen Vorsprung am Rande des Hafens, und mehr als ein "
              "Jahrhundert lang stiegen seine Wärter jeden Abend die Wendeltreppe hinauf, um die Lampe anzuzünden.")
    reason, detail = verdict(f, german)
    assert reason == "lang:not_allowed" and detail.startswith("language=de (rank ")
    assert verdict(LanguageFilter(LanguageConfig(allowed=["en", "de"])), german) == (None, "")
    assert verdict(LanguageFilter(LanguageConfig(max_rank=100)), prose(8))[0] == "lang:low_confidence"


# ---------------------------------------------------------------- through the pipeline


def test_rules_run_in_the_pipeline_with_exemptions(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    no_punct = "\n".join(s.rstrip(".") for s in SENTENCES)
    rows = [{"id": f"d{i}", "source": src, "url": "", "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"}
            for i, (src, t) in enumerate([("web", prose(9)), ("web", no_punct), ("code", no_punct)])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "raw.parquet")
    cfg = CleanConfig.from_dict({"exempt": {"code": ["fineweb:*"]}})
    report = clean(tmp_path / "raw.parquet", tmp_path / "c.parquet", tmp_path / "r.parquet", cfg)
    kept = pq.read_table(tmp_path / "c.parquet").column("id").to_pylist()
    assert kept == ["d0", "d2"]  # the code source is exempt from FineWeb's rules
    assert report.reasons["fineweb:line_punct_ratio"]["docs"] == 1
    assert report.reasons["fineweb:line_punct_ratio"]["examples"][0]["lines"][0] == SENTENCES[0].rstrip(".")
    with pytest.raises(ConfigError, match="exempt must map"):
        CleanConfig.from_dict({"exempt": {"code": "fineweb:*"}})


def test_signals_do_not_depend_on_the_python_hash_seed() -> None:
    """Shards are cleaned in separate processes: every signal must be the same whatever PYTHONHASHSEED is."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys; sys.path.insert(0, 'tests'); from textgen import prose; "
            "from kiln.clean.config import CleanConfig, default_filters; from kiln.filters.base import Doc; "
            "d = Doc('d', 's', '', prose(3) + ' river bank river bank', 'text/plain', '', 0); "
            "[f.reason(d) for f in default_filters(CleanConfig())]; "
            "print(json.dumps({k: v for k, v in d.signals.items() if not k.startswith('_')}, sort_keys=True))")
    root = Path(__file__).resolve().parents[3]
    outs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and json.loads(outs[0])["top_2gram_char_fraction"] > 0
