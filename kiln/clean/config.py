"""The clean config: the cleaning step's own keys (``CleanSettings``) plus one section per filter registered in
kiln.filters.registry (``CleanConfig``, made from the registry), and the rules' config keys derived from both.

``CleanConfig.from_dict({"min_words": 80, "c4": {"min_sentences": 3}})`` builds one strictly (unknown keys are
errors); ``python -c "from kiln.clean.config import CleanConfig; print(CleanConfig())"`` prints the defaults.
"""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import dataclass, field
from typing import Annotated, Any

from kiln.clean.dedup import LineDedupConfig, MinHashConfig
from kiln.clean.mixing import MixConfig
from kiln.clean.pii import PiiConfig
from kiln.clean.quality import QualityModelConfig, TokenOutlierConfig
from kiln.clean.schema import DOC_COLUMNS, STAGE_SIGNALS
from kiln.common.config import ConfigError, Domain, check_domains, check_types, from_dict
from kiln.common.files import stable_hash
from kiln.filters import registry
from kiln.filters.base import Filter
from kiln.filters.gopher_quality import GopherQualityConfig
from kiln.filters.registry import FilterSpec, RegistryError

EXECUTORS = ("local", "ray")  # where the clean step runs (clean.executor)
CODE_VERSION = "3"  # bump when a change alters what the per-document stage writes (invalidates shard caches)

# reason -> config key of the rules the cleaning stages apply themselves (not a registered filter)
EXTRACT_RULES: dict[str, str | None] = {
    "extract:empty": None,
    "extract:too_large": "max_input_bytes",
    "extract:too_deep": "max_html_depth",
}
CORPUS_RULES: dict[str, str | None] = {
    "dedup:url": "url_dedup",
    "dedup:exact": "exact_dedup",
    "dedup:minhash": "minhash.enabled",
    "dedup:lines": "line_dedup.max_repeats",
    "outlier:token_kl": "token_outliers.max_mad",
    "quality:low_score": "quality_model.min_score",
    "mix:downsampled": "mix.weights",
}


@dataclass
class CleanSettings(GopherQualityConfig):
    """The clean config's own keys. The Gopher quality keys (min_words, max_words, ...) are inherited and sit at
    the top level; ``CleanConfig`` adds one section per other registered filter (repetition, language, c4, ...)."""

    fix_unicode: bool = True  # repair mojibake and odd Unicode with ftfy before anything else
    max_input_bytes: Annotated[int, Domain(1)] = 8 << 20  # a larger raw document is skipped as extract:too_large before any work on it
    max_html_depth: Annotated[int, Domain(1)] = 512  # an HTML page nesting deeper (a tag scan before parsing) is skipped as extract:too_deep
    exempt: dict[str, list[str]] = field(default_factory=dict)  # source glob -> globs of rules not applied to it
    pii: PiiConfig = field(default_factory=PiiConfig)  # e-mail, IP and phone placeholders
    url_dedup: bool = True  # drop documents whose normalised http(s) URL an earlier kept document had
    exact_dedup: bool = True  # drop documents whose clean text is identical to an earlier kept one
    minhash: MinHashConfig = field(default_factory=MinHashConfig)  # near-duplicate removal
    line_dedup: LineDedupConfig = field(default_factory=LineDedupConfig)  # lines repeated across the corpus
    token_outliers: TokenOutlierConfig = field(default_factory=TokenOutlierConfig)  # token-distribution outliers
    quality_model: QualityModelConfig = field(default_factory=QualityModelConfig)  # corpus-trained classifier
    mix: MixConfig = field(default_factory=MixConfig)  # target shares per group of sources
    shard_docs: Annotated[int, Domain(1)] = 4000  # documents per shard of the per-document stage (the unit run in parallel and cached)
    executor: str = "local"  # "local": this process (and cfg.workers); "ray": a Ray cluster (kiln.clean.ray_run)
    workers: Annotated[int, Domain(1)] = 1  # processes for the per-document stage on the local executor (1: in this process)
    batch_size: Annotated[int, Domain(1)] = 1024  # documents read from Parquet per batch
    progress_every: Annotated[int, Domain(1)] = 2000  # call the progress callback about every this many documents
    progress_seconds: Annotated[float, Domain(0, low_open=True)] = 60.0  # a shard also calls the progress callback at least this often when docs are slow
    examples_per_reason: Annotated[int, Domain(0)] = 3  # removed documents sampled per reason for the report (a few lines each)

    def __post_init__(self) -> None:
        nested = {f.name: f.default_factory for f in dataclasses.fields(self)
                  if dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING}
        for name, cls in nested.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, from_dict(cls, value, f"clean.{name}"))
            elif not isinstance(value, cls):
                raise ConfigError(f"clean.{name} must be a mapping of {cls.__name__} fields, got {value!r}.")
            check_types(getattr(self, name), f"clean.{name}")
        check_types(self, "clean")
        check_domains(self, "clean")  # every number in its Domain, for a config made in code as from_dict checks it
        if not isinstance(self.exempt, dict) or not all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
                for k, v in self.exempt.items()):
            raise ConfigError(f"clean.exempt must map a source glob to a list of rule globs, got {self.exempt!r}.")
        if self.min_words > self.max_words:
            raise ConfigError(f"clean.min_words={self.min_words} exceeds clean.max_words={self.max_words}: lower "
                              f"clean.min_words or raise clean.max_words.")
        if self.min_mean_word_length > self.max_mean_word_length:
            raise ConfigError("clean: min_mean_word_length exceeds max_mean_word_length.")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"clean.executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}.")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, where: str = "clean") -> Any:
        """Strict build: unknown keys raise ConfigError naming the key."""
        return from_dict(cls, data, where)

    def shard_stage_hash(self) -> str:
        """Hash of what the per-document stage depends on (shard caches are keyed by it)."""
        d = dataclasses.asdict(self)
        for k in ("url_dedup", "exact_dedup", "line_dedup", "token_outliers", "quality_model", "mix", "workers",
                  "batch_size", "progress_every", "progress_seconds", "examples_per_reason", "shard_docs", "executor"):
            d.pop(k)
        keys = ("enabled", "ngram", "num_perm", "seed") + (("normalise",) if self.minhash.normalise != "none" else ())
        d["minhash"] = {k: v for k, v in d["minhash"].items() if k in keys}
        return stable_hash([CODE_VERSION, d])


def make_clean_config() -> type[CleanSettings]:
    """CleanSettings plus one section field per registered filter, in run order (a filter of section "" has its
    keys at the top level, so CleanSettings must inherit its config). RegistryError names a clashing section."""
    own = {f.name for f in dataclasses.fields(CleanSettings)}
    sections = []
    for spec in registry.filters():
        if not spec.section:
            _check_columns(spec)
            if not issubclass(CleanSettings, spec.config):
                raise RegistryError(f"kiln.filters.registry: filter {spec.name!r} has section '' (the top level), but "
                                    f"CleanSettings does not inherit {spec.config.__name__}: give it a section name.")
            continue
        if spec.section in own or not spec.section.isidentifier() or keyword.iskeyword(spec.section):
            raise RegistryError(f"kiln.filters.registry: filter {spec.name!r}: section {spec.section!r} is a clean "
                                f"config key already or not a Python name: choose another section name.")
        _check_columns(spec)
        doc = spec.doc or f"the {spec.name} filter's rules"
        sections.append((spec.section, spec.config, field(default_factory=spec.config, metadata={"doc": doc})))
    cls = dataclasses.make_dataclass("CleanConfig", sections, bases=(CleanSettings,))
    cls.__module__ = __name__
    cls.__doc__ = ("Every tunable of the cleaning step: CleanSettings' keys, the Gopher quality keys at the top level, "
                   "and one section per registered filter (kiln.filters.registry).")
    return cls


def _check_columns(spec: FilterSpec) -> None:
    taken = {name for name, _ in DOC_COLUMNS} | set(STAGE_SIGNALS) | {"input_bytes", "minhash"}
    if clash := sorted(taken & set(spec.signals or {})):
        raise RegistryError(f"kiln.filters.registry: filter {spec.name!r}: signals {clash} are columns the cleaning "
                            f"stages write themselves (kiln.clean.schema): give them names of their own.")


CleanConfig = make_clean_config()  # made as the module loads, so a registry line that clashes fails definitions load


def section(cfg: CleanSettings, spec: FilterSpec) -> Any:
    """The config section of filter ``spec`` in the clean config ``cfg`` (the top level for section "")."""
    if not spec.section:
        return cfg
    try:
        return getattr(cfg, spec.section)
    except AttributeError:
        raise ConfigError(f"clean config {type(cfg).__name__} has no section {spec.section!r} for the registered "
                          f"filter {spec.name!r}: make the config class after registering it "
                          f"(kiln.clean.config.make_clean_config()).") from None


def default_filters(cfg: CleanSettings) -> list[Filter]:
    """The registered filters in run order (first failing rule names the drop): URLs, Gopher quality, language,
    Gopher repetition, C4, FineWeb, OLMo 2, dirty words; disabled sections are left out."""
    return registry.build_filters(lambda spec: section(cfg, spec))


def fixed_rules() -> dict[str, str | None]:
    """Reason -> config key of every rule that is not a filter's threshold (extraction, fixed filter rules, corpus)."""
    return {**EXTRACT_RULES, **registry.fixed_rules(), **CORPUS_RULES}


def rule_keys(cfg: CleanSettings | None = None) -> dict[str, str | None]:
    """Every drop reason -> the config key that controls it (read by EmptyCorpusError and the report); the
    thresholds of disabled filters are left out."""
    cfg = cfg if cfg is not None else CleanConfig()
    keys = fixed_rules()
    for spec in registry.filters():
        if getattr(section(cfg, spec), "enabled", True):
            keys.update(spec.rule_keys())
    return keys
