"""The document filters, one line each in ``FILTERS``: name, clean-config section, config class, filter class, run
order, the signals it writes (with their Arrow type when the kept corpus stores them) and fixed-rule config keys.

Add a filter: write ``kiln/filters/NAME.py`` (a config dataclass and a Filter) and add its line below; the clean
config section, the kept columns, the rule keys and the run order follow from it. The lines are checked when this
module loads (an error names the filter and what to add). ``python -m kiln.filters.registry`` prints the table.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import pyarrow as pa

from kiln.filters.base import Filter, ThresholdFilter
from kiln.filters.c4 import C4Config, C4Filter
from kiln.filters.dirty_words import DirtyWordsConfig, DirtyWordsFilter
from kiln.filters.fineweb import FineWebConfig, FineWebFilter
from kiln.filters.gopher_quality import GopherQuality, GopherQualityConfig
from kiln.filters.gopher_repetition import DUP_NGRAMS, TOP_NGRAMS, GopherRepetition, RepetitionConfig
from kiln.filters.language import LanguageConfig, LanguageFilter
from kiln.filters.olmo2 import Olmo2Config, Olmo2Filter
from kiln.filters.url import UrlFilter, UrlFilterConfig

F64, I64, STR = pa.float64(), pa.int64(), pa.string()


class RegistryError(ValueError):
    """A registry line is incomplete or clashes with another; the message names the filter and what to add."""


@dataclass(frozen=True)
class FilterSpec:
    """One registered filter; ``FILTERS`` below holds one per line."""

    name: str  # the filter's name, equal to its class's ``name`` (stage timings, the CLI)
    section: str  # its key in the clean config; "" puts its fields at the top level (CleanConfig inherits config)
    config: type  # the section's config dataclass, a default for every field
    filter: type[Filter]  # built as filter(section config), a ThresholdFilter as filter(section config, prefix)
    run: int  # run order, lower first; the first filter that drops a document names the drop
    signals: Mapping[str, pa.DataType | None] | None = None  # every doc.signals key it writes -> kept column type,
    # or None for a signal the rules and the CLI read but the kept corpus leaves out ({} when it writes none)
    fixed_rules: Mapping[str, str | None] = field(default_factory=dict)  # reason not from RULES -> its config field
    doc: str = ""  # one line on the section: the description of its clean config field

    @property
    def prefix(self) -> str:
        """The dotted path of the section's keys from the clean config root ("" for the top level)."""
        return f"{self.section}." if self.section else ""

    def build(self, cfg: Any) -> Filter:
        """The filter, configured by its section ``cfg``."""
        if issubclass(self.filter, ThresholdFilter):
            return self.filter(cfg, self.prefix)  # type: ignore[call-arg]
        return self.filter(cfg)  # type: ignore[call-arg]

    def rule_keys(self) -> dict[str, str | None]:
        """Every reason this filter can drop with -> the config key that controls it (dotted from the root)."""
        keys = {r: (self.prefix + k if k else None) for r, k in self.fixed_rules.items()}
        if issubclass(self.filter, ThresholdFilter):
            keys.update({reason: self.prefix + key for reason, _, key in self.filter.RULES})
        return keys


def not_stored(*names: str) -> dict[str, None]:
    """Signals a filter writes for its rules and the CLI that the kept corpus leaves out."""
    return dict.fromkeys(names)


FILTERS: tuple[FilterSpec, ...] = (
    FilterSpec("url", "urls", UrlFilterConfig, UrlFilter, run=10,
               signals={},
               fixed_rules={"url:blocked_domain": "blocked_domains", "url:banned_word": "banned_url_words"},
               doc="URL and domain blocklist"),
    FilterSpec("gopher_quality", "", GopherQualityConfig, GopherQuality, run=20,
               signals={"words": I64, "mean_word_length": F64, "symbol_ratio": F64, "alpha_word_fraction": F64,
                        "duplicate_line_fraction": F64, "bullet_lines_fraction": F64, "ellipsis_lines_fraction": F64,
                        "stop_words": I64}),
    FilterSpec("language", "language", LanguageConfig, LanguageFilter, run=30,
               signals={"language": STR, "language_rank": I64},
               fixed_rules={"lang:not_allowed": "allowed", "lang:low_confidence": "max_rank"},
               doc="language identification"),
    FilterSpec("gopher_repetition", "repetition", RepetitionConfig, GopherRepetition, run=40,
               signals={"duplicate_paragraph_fraction": F64,
                        **not_stored("duplicate_paragraph_char_fraction", "duplicate_line_char_fraction",
                                     *(f"top_{n}gram_char_fraction" for n in TOP_NGRAMS),
                                     *(f"dup_{n}gram_char_fraction" for n in DUP_NGRAMS))},
               doc="Gopher repetition rules"),
    FilterSpec("c4", "c4", C4Config, C4Filter, run=50,
               signals=not_stored("sentences"),
               fixed_rules={"c4:lorem_ipsum": "lorem_ipsum", "c4:curly_bracket": "curly_bracket",
                            "c4:too_few_sentences": "min_sentences"},
               doc="C4 line and page rules"),
    FilterSpec("fineweb", "fineweb", FineWebConfig, FineWebFilter, run=60,
               signals={"line_punct_fraction": F64, "short_line_fraction": F64,
                        **not_stored("fineweb_dup_line_char_fraction", "newline_word_ratio")},
               doc="FineWeb's own rules"),
    FilterSpec("olmo2", "olmo2", Olmo2Config, Olmo2Filter, run=70,
               signals={"ngram_repeat_run": I64, "top_word_fraction": F64},
               doc="OLMo 2's repetition rules"),
    FilterSpec("dirty_words", "dirty_words", DirtyWordsConfig, DirtyWordsFilter, run=80,
               signals={"dirty_word_fraction": F64},
               doc="obscene-word ratio"),
)

# The kept Parquet's filter columns in the order they had before this registry (the corpus bytes and the shard
# caches are frozen on it: ngram_repeat_run sits after dirty_word_fraction); later columns follow in run order.
FROZEN_COLUMN_ORDER = (
    "words", "mean_word_length", "symbol_ratio", "alpha_word_fraction", "duplicate_line_fraction",
    "bullet_lines_fraction", "ellipsis_lines_fraction", "stop_words", "language", "language_rank",
    "duplicate_paragraph_fraction", "line_punct_fraction", "short_line_fraction", "top_word_fraction",
    "dirty_word_fraction", "ngram_repeat_run",
)


def filters() -> tuple[FilterSpec, ...]:
    """The registered filters in run order."""
    return tuple(_registry)


def register(spec: FilterSpec) -> FilterSpec:
    """Check ``spec`` against itself and the filters registered already, then add it (RegistryError if wrong)."""
    _check(spec, _registry)
    _registry.append(spec)
    _registry.sort(key=lambda s: s.run)
    return spec


def build_filters(section_of: Callable[[FilterSpec], Any]) -> list[Filter]:
    """The registered filters in run order, each built from its section ``section_of(spec)``; a section whose
    ``enabled`` is False is left out."""
    out = []
    for spec in _registry:
        cfg = section_of(spec)
        if getattr(cfg, "enabled", True):
            out.append(spec.build(cfg))
    return out


def signal_types() -> dict[str, pa.DataType]:
    """The signals the kept corpus stores, as {column: Arrow type}, in column order."""
    columns = {k: t for spec in _registry for k, t in (spec.signals or {}).items() if t is not None}
    frozen = [k for k in FROZEN_COLUMN_ORDER if k in columns]
    return {k: columns[k] for k in frozen + [k for k in columns if k not in FROZEN_COLUMN_ORDER]}


def declared_signals() -> frozenset[str]:
    """Every signal some registered filter declares, stored or not."""
    return frozenset(k for spec in _registry for k in (spec.signals or {}))


def fixed_rules() -> dict[str, str | None]:
    """Reason -> config key of the registered filters' rules that are not thresholds, in run order."""
    return {r: (spec.prefix + k if k else None) for spec in _registry for r, k in spec.fixed_rules.items()}


# ---------------------------------------------------------------------------------------------- checks


def _fail(spec: FilterSpec, problem: str) -> None:
    cls = getattr(spec.filter, "__name__", repr(spec.filter))
    raise RegistryError(f"kiln.filters.registry: filter {spec.name!r} ({cls}): {problem}")


def _check(spec: FilterSpec, others: list[FilterSpec]) -> None:
    _check_types(spec)
    _check_rules(spec)
    for other in others:
        if spec.name == other.name:
            _fail(spec, "is registered already: give the new filter (and its class's name) another name.")
        if spec.section and spec.section == other.section:
            _fail(spec, f"section {spec.section!r} belongs to filter {other.name!r} already: choose another.")
        if spec.run == other.run:
            _fail(spec, f"run={spec.run} is taken by filter {other.name!r}: choose a free number between neighbours.")
        if clash := sorted(set(spec.signals or {}) & set(other.signals or {})):
            _fail(spec, f"signals {clash} are declared by filter {other.name!r}: give them names of their own.")
        if clash := sorted(set(spec.rule_keys()) & set(other.rule_keys())):
            _fail(spec, f"reasons {clash} belong to filter {other.name!r}: prefix them with {spec.name + ':'!r}.")


def _check_types(spec: FilterSpec) -> None:
    if not dataclasses.is_dataclass(spec.config) or not isinstance(spec.config, type):
        _fail(spec, f"config={spec.config!r} is not a config dataclass: pass its @dataclass class.")
    no_default = [f.name for f in dataclasses.fields(spec.config)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if no_default:
        _fail(spec, f"config fields {no_default} of {spec.config.__name__} need defaults (the clean config's).")
    if not (isinstance(spec.filter, type) and issubclass(spec.filter, Filter)):
        _fail(spec, f"filter={spec.filter!r} is not a Filter subclass.")
    if spec.filter.name != spec.name:
        _fail(spec, f"its class says name = {spec.filter.name!r}: set name = {spec.name!r} on the class.")
    if spec.signals is None:
        _fail(spec, "has no signals declaration: add signals={name: pa.float64(), ...} for what it writes to "
                    "doc.signals (None for a signal the kept corpus leaves out; {} when it writes none).")
    bad = {k: t for k, t in spec.signals.items() if not (t is None or isinstance(t, pa.DataType))}
    if bad:
        _fail(spec, f"signals {bad} need an Arrow type (pa.float64(), pa.int64(), pa.string()) or None.")
    if spec.section != spec.section.strip() or "." in spec.section:
        _fail(spec, f"section {spec.section!r} must be a plain identifier (or '' for the top level).")


def _check_rules(spec: FilterSpec) -> None:
    fields = {f.name for f in dataclasses.fields(spec.config)}
    unknown = {r: k for r, k in spec.fixed_rules.items() if k is not None and k not in fields}
    if unknown:
        _fail(spec, f"fixed_rules {unknown} name no field of {spec.config.__name__}: use its field names.")
    if issubclass(spec.filter, ThresholdFilter):
        if not spec.filter.RULES:
            _fail(spec, "is a ThresholdFilter without RULES: list (reason, signal, config field) on the class.")
        for reason, signal, key in spec.filter.RULES:
            if key not in fields:
                _fail(spec, f"rule {reason!r} reads config field {key!r}, which {spec.config.__name__} lacks.")
            if signal not in spec.signals:
                _fail(spec, f"rule {reason!r} reads signal {signal!r}, which its line does not declare: add "
                            f"{signal!r}: pa.float64() (or its type) to signals= to keep it as a column, or "
                            f"{signal!r}: None to leave it out of the kept corpus.")
        return
    if not spec.filter.reasons:
        _fail(spec, "declares no reasons: set reasons = ('name:why', ...) on the class.")
    missing = [r for r in spec.filter.reasons if r not in spec.fixed_rules]
    if missing:
        _fail(spec, f"reasons {missing} have no config key: add them to fixed_rules={{reason: config field}} "
                    f"(None when no key controls the rule).")
    extra = [r for r in spec.fixed_rules if r not in spec.filter.reasons]
    if extra:
        _fail(spec, f"fixed_rules {extra} are not among the class's reasons {spec.filter.reasons}.")


def _checked(specs: tuple[FilterSpec, ...]) -> list[FilterSpec]:
    out: list[FilterSpec] = []
    for spec in specs:
        _check(spec, out)
        out.append(spec)
    return sorted(out, key=lambda s: s.run)


_registry: list[FilterSpec] = _checked(FILTERS)  # checked as the module loads: a wrong line fails definitions load


def main() -> int:
    for spec in _registry:
        stored = [k for k, t in (spec.signals or {}).items() if t is not None]
        print(f"{spec.run:4d}  {spec.name:18s} clean.{spec.section or '(top level)':14s} {spec.config.__name__:20s} "
              f"{spec.filter.__name__:18s} columns: {', '.join(stored) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
