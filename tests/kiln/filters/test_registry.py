"""Tests for kiln.filters.registry and what the clean config, the kept schema and the rule keys derive from it: a new
filter is one module and one registry line, and an incomplete or clashing line fails when the definitions load.

Run: python -m pytest tests/kiln/filters/test_registry.py -q
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.clean.config import CleanConfig, CleanSettings, default_filters, make_clean_config, rule_keys
from kiln.clean.report import EmptyCorpusError
from kiln.clean.run import clean
from kiln.clean.schema import STAGE_SIGNALS, kept_schema
from kiln.common.config import ConfigError, field_docs
from kiln.filters import registry
from kiln.filters.base import Doc, Filter, ThresholdFilter
from kiln.filters.gopher_repetition import RepetitionConfig
from kiln.filters.registry import FROZEN_COLUMN_ORDER, FilterSpec, RegistryError
from textgen import prose

REPO = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------- the demonstration filter: one module's worth


@dataclass
class ExclaimConfig:
    """Pages that shout: exclamation marks per word."""

    enabled: bool = True  # apply the rule
    max_exclamations_per_word: float = 0.05  # more '!' per word than this drops the page


class ExclaimFilter(ThresholdFilter):
    name = "exclaim"
    RULES = (("exclaim:too_many", "exclamations_per_word", "max_exclamations_per_word"),)

    def signals(self, doc: Doc) -> dict[str, float]:
        return {"exclamations_per_word": doc.text.count("!") / max(len(doc.words), 1)}


# ... and its registry line
EXCLAIM = FilterSpec("exclaim", "exclaim", ExclaimConfig, ExclaimFilter, run=45,
                     signals={"exclamations_per_word": pa.float64()}, doc="exclamation marks per word")


@contextlib.contextmanager
def registered(*specs: FilterSpec):
    """``specs`` registered for the duration of a ``with`` block, then the registry as it was."""
    saved = list(registry._registry)
    try:
        yield tuple(registry.register(s) for s in specs)
    finally:
        registry._registry[:] = saved


@pytest.fixture
def exclaim_config():
    """The clean config class with the exclaim filter registered; the registry is restored afterwards."""
    before = registry.filters()
    with registered(EXCLAIM):
        yield make_clean_config()
    assert registry.filters() == before and "exclaim" not in {f.name for f in default_filters(CleanConfig())}


def write_raw(path: Path, texts: list[str]) -> Path:
    rows = [{"id": f"d{i}", "source": "web", "url": f"https://example.org/{i}", "text": t, "content_type": "text/plain",
             "bytes": len(t.encode()), "license": "CC0"} for i, t in enumerate(texts)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_new_filter_is_one_module_and_one_registry_line(exclaim_config, tmp_path: Path) -> None:
    Clean = exclaim_config
    # the clean config has its section, validated like every other one
    cfg = Clean.from_dict({"min_words": 40, "exclaim": {"max_exclamations_per_word": 0.05}})
    assert cfg.exclaim == ExclaimConfig() and cfg.min_words == 40
    with pytest.raises(ConfigError, match=r"clean\.exclaim: unknown key 'max_exclamation_per_word'\. "
                                          r"Did you mean 'max_exclamations_per_word'\?"):
        Clean.from_dict({"exclaim": {"max_exclamation_per_word": 0.1}})
    with pytest.raises(ConfigError, match=r"clean\.exclaim\.max_exclamations_per_word must be float, got 'high'"):
        Clean.from_dict({"exclaim": {"max_exclamations_per_word": "high"}})
    assert field_docs(Clean)["exclaim"] == "exclamation marks per word"
    assert Clean().shard_stage_hash() != Clean.from_dict({"exclaim": {"enabled": False}}).shard_stage_hash()
    # it runs in its place, its drops are reported with their reason and key, its signal is a kept column
    assert [f.name for f in default_filters(cfg)] == ["url", "gopher_quality", "language", "gopher_repetition",
                                                      "exclaim", "c4", "fineweb", "olmo2", "dirty_words"]
    assert rule_keys(cfg)["exclaim:too_many"] == "exclaim.max_exclamations_per_word"
    loud = prose(2).replace(".", "!")
    raw = write_raw(tmp_path / "raw.parquet", [prose(1), loud])
    report = clean(raw, tmp_path / "kept.parquet", tmp_path / "removed.parquet", cfg)
    assert report.reasons["exclaim:too_many"]["docs"] == 1
    assert report.reasons["exclaim:too_many"]["examples"][0]["id"] == "d1"
    assert report.stage_seconds["filter:exclaim"] >= 0.0
    removed = pq.read_table(tmp_path / "removed.parquet").to_pylist()
    assert [(r["id"], r["reason"]) for r in removed] == [("d1", "exclaim:too_many")]
    assert re.fullmatch(r"exclamations_per_word=0\.0\d+ > exclaim\.max_exclamations_per_word=0\.05", removed[0]["detail"])
    kept = pq.read_table(tmp_path / "kept.parquet")
    names = kept.schema.names
    assert kept.column("id").to_pylist() == ["d0"] and kept.column("exclamations_per_word").to_pylist() == [0.0]
    assert kept.schema.field("exclamations_per_word").type == pa.float64()
    assert names.index("dirty_word_fraction") < names.index("ngram_repeat_run") < names.index("exclamations_per_word") \
        < names.index("pii_replacements")  # after the frozen filter columns, before the stages' own
    # disabled, it keeps everything; when it drops everything, the error names its key
    off = clean(raw, tmp_path / "k2.parquet", tmp_path / "r2.parquet", Clean.from_dict({"exclaim": {"enabled": False}}))
    assert off.kept_docs == 2
    with pytest.raises(EmptyCorpusError, match=r"'exclaim:too_many' \(config key clean\.exclaim\.max_exclamations_per_word\)"):
        clean(write_raw(tmp_path / "loud.parquet", [loud]), tmp_path / "k3.parquet", tmp_path / "r3.parquet", cfg)


# ---------------------------------------------------------------- what the registry derives


def test_the_registry_derives_sections_columns_keys_and_order() -> None:
    specs = registry.filters()
    assert [s.name for s in specs] == ["url", "gopher_quality", "language", "gopher_repetition", "c4", "fineweb",
                                       "olmo2", "dirty_words"]
    own = {f.name for f in dataclasses.fields(CleanSettings)}
    sections = {f.name: f.type for f in dataclasses.fields(CleanConfig) if f.name not in own}
    assert sections == {s.section: s.config for s in specs if s.section}
    assert "min_words" in own and specs[1].section == ""  # Gopher quality keys stay at the top level
    assert list(registry.signal_types()) == list(FROZEN_COLUMN_ORDER)
    assert kept_schema().names[8:] == list(FROZEN_COLUMN_ORDER) + list(STAGE_SIGNALS)
    keys = rule_keys()
    assert keys["url:banned_word"] == "urls.banned_url_words" and keys["gopher:too_few_words"] == "min_words"
    assert keys["gopher:top_3gram"] == "repetition.max_top_3gram_char_fraction"
    assert keys["dedup:minhash"] == "minhash.enabled" and keys["extract:empty"] is None
    for spec in specs:  # every drop reason a filter can return has its key
        built = spec.build(spec.config())
        assert set(built.reasons) <= set(keys), spec.name
    docs = field_docs(CleanConfig)  # a description per field: a hand-written field's comment, a generated one's doc
    assert all(docs.values()) and docs["repetition"] == "Gopher repetition rules"
    assert docs["min_words"] == "fewer whitespace-separated words than this: too short to be prose"
    assert docs["fix_unicode"] == "repair mojibake and odd Unicode with ftfy before anything else"
    assert field_docs(RepetitionConfig)["max_top_3gram_char_fraction"].startswith("most frequent n-gram (n=2, 3, 4)")


def test_the_filters_cli_runs_every_registered_filter(tmp_path: Path) -> None:
    page = tmp_path / "page.txt"
    page.write_text(prose(4), encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "kiln.filters", str(page)], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[-1] == "kept"
    signals = dict(line.split(None, 1) for line in out[:-1])
    assert signals["language"] == "en" and signals["ngram_repeat_run"] == "1" and "top_2gram_char_fraction" in signals


# ---------------------------------------------------------------- lines that fail at definitions load


class _Quiet(Filter):
    name = "quiet"
    reasons = ("quiet:silent",)

    def __init__(self, cfg: ExclaimConfig) -> None:
        self.cfg = cfg

    def reason(self, doc: Doc) -> str | None:
        doc.signals["volume"] = 0
        return None


def _line(**kw) -> FilterSpec:
    base = dict(name="quiet", section="quiet", config=ExclaimConfig, filter=_Quiet, run=46,
                signals={"volume": pa.int64()}, fixed_rules={"quiet:silent": None})
    return FilterSpec(**{**base, **kw})


@pytest.mark.parametrize("line, message", [
    (_line(signals=None), r"'quiet'.*has no signals declaration: add signals="),
    (_line(fixed_rules={}), r"'quiet'.*reasons \['quiet:silent'\] have no config key: add them to fixed_rules="),
    (_line(fixed_rules={"quiet:silent": "loudness"}), r"fixed_rules \{'quiet:silent': 'loudness'\} name no field"),
    (_line(config=dict), r"config=<class 'dict'> is not a config dataclass"),
    (_line(name="silence"), r"'silence'.*its class says name = 'quiet': set name = 'silence' on the class"),
    (_line(name="c4", filter=type("C4Again", (_Quiet,), {"name": "c4"})), r"'c4'.*is registered already"),
    (_line(run=50), r"run=50 is taken by filter 'c4'"),
    (_line(section="c4"), r"section 'c4' belongs to filter 'c4' already"),
    (_line(signals={"words": pa.int64()}), r"signals \['words'\] are declared by filter 'gopher_quality'"),
    (_line(signals={"volume": "int"}), r"signals \{'volume': 'int'\} need an Arrow type"),
    (_line(filter=type("Lorem", (_Quiet,), {"reasons": ("c4:lorem_ipsum",)}), fixed_rules={"c4:lorem_ipsum": None}),
     r"reasons \['c4:lorem_ipsum'\] belong to filter 'c4': prefix them with 'quiet:'"),
    (FilterSpec("exclaim", "exclaim", ExclaimConfig, type("Typo", (ExclaimFilter,), {"RULES": (
        ("exclaim:too_many", "exclamations_per_word", "max_exclamation"),)}), run=45,
        signals={"exclamations_per_word": pa.float64()}),
     r"rule 'exclaim:too_many' reads config field 'max_exclamation', which ExclaimConfig lacks"),
    (FilterSpec("exclaim", "exclaim", ExclaimConfig, ExclaimFilter, run=45, signals={}),
     r"rule 'exclaim:too_many' reads signal 'exclamations_per_word', which its line does not declare: add "
     r"'exclamations_per_word': pa.float64\(\)"),
])
def test_an_incomplete_or_clashing_line_is_an_error_naming_the_filter(line: FilterSpec, message: str) -> None:
    before = registry.filters()
    with pytest.raises(RegistryError, match=message):
        with registered(line):
            pass
    assert registry.filters() == before


@pytest.mark.parametrize("section, message", [
    ("pii", r"section 'pii' is a clean config key already"),
    ("", r"section '' \(the top level\), but CleanSettings does not inherit ExclaimConfig"),
])
def test_a_section_the_clean_config_cannot_take_fails_when_it_is_made(section: str, message: str) -> None:
    line = FilterSpec("exclaim", section, ExclaimConfig, ExclaimFilter, run=45,
                      signals={"exclamations_per_word": pa.float64()})
    with registered(line), pytest.raises(RegistryError, match=message):
        make_clean_config()


def test_a_signal_named_like_a_stage_column_fails_when_the_config_is_made() -> None:
    line = _line(signals={"token_kl": pa.float64()})
    with registered(line), pytest.raises(RegistryError, match=r"signals \['token_kl'\] are columns the "):
        make_clean_config()


def test_a_signal_written_but_not_declared_is_an_error_not_a_lost_column(tmp_path: Path) -> None:
    class Loud(_Quiet):
        name = "loud"

        def reason(self, doc: Doc) -> str | None:
            doc.signals["volume"], doc.signals["pitch"], doc.signals["_scratch"] = 11, 3, "private"
            return None

    line = _line(name="loud", section="loud", filter=Loud)
    with registered(line):
        raw = write_raw(tmp_path / "raw.parquet", [prose(1)])
        with pytest.raises(RegistryError, match=r"filter 'loud' wrote signal\(s\) \['pitch'\] \(document 'd0'\) that "
                                                r"no line of kiln.filters.registry declares"):
            clean(raw, tmp_path / "k.parquet", tmp_path / "r.parquet", make_clean_config()())
