"""Data ablations: a rule about text tested as FineWeb tested its rules, by small proxy models trained on the corpus
with and without it, every one for the same tokens and seeds, scored on one evaluation set fixed before the sweep.

The data fields a point may change (``data_kind``):

- ``clean.<key>``: any key of the clean config that decides what is kept (``clean.olmo2.enabled``,
  ``clean.min_words``, ``clean.c4.min_sentences``, ``clean.minhash.enabled``, ``clean.quality_model.min_score``);
- ``mix.<glob>``: the weight of a group of sources in the mixture (``mix.wikipedia*``), as ``clean.mix.weights``;
- ``tokenizer.vocab_size``: the point trains its own BPE of that size on its clean corpus.

``expand_data(fields, "one_at_a_time")`` gives the baseline and one point per value (``grid`` and ``random`` as in
kiln.scaling.sweep); ``point_clean(base, point, sources)`` is its clean config, refused with one line when a change
does nothing (a key of a rule switched off), drops what another rule needs, or gives a mix no weight. Running a
point (``run_point``) cleans the raw documents with its config (the per-document shard cache shared), keys its clean
corpus by content, removes the evaluation set's documents and their near-duplicates, writes token shards, and trains
the proxy once per seed; every stage is keyed by content and reused. ``compare`` gives a point's difference from the
baseline in bits per byte with its 95% interval over seeds and the verdict. Nothing here imports Dagster.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import shutil
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kiln.common.config import ConfigError, domains
from kiln.common.files import (atomic_write_json, check_witness, commit_dir, sha256_file, stable_hash, staging_dir,
                               witness)
from kiln.scaling.sweep import Point, Swept, expand, short_names, show, typed

BASELINE = "baseline"  # the key of the point that changes nothing
DATA_BLOCKS = ("clean", "mix", "tokenizer")
# clean keys that change how the step runs, not what it keeps: not a data field
RUN_ONLY = ("executor", "workers", "batch_size", "progress_every", "progress_seconds", "examples_per_reason",
            "shard_docs")
NOT_SWEPT = ("mix", "exempt")  # sweep mix.<glob> for the mix; exempt is a mapping of globs
STAGE_VERSION = "1"  # bump when a stage's output changes for the same inputs (the content-keyed folders)
Say = Callable[[str], None]


# -- the fields a point may change

def _clean_leaf(path: str, where: str) -> tuple[type, str, type]:
    """(the dataclass holding the leaf, the leaf's name, its python type) of ``clean.<a>.<b>...``."""
    from kiln.clean.config import CleanConfig

    cls, parts = CleanConfig, path.split(".")[1:]
    for i, part in enumerate(parts):
        known = {f.name: f for f in dataclasses.fields(cls)}
        at = "clean." + ".".join(parts[:i]) if i else "clean"
        if part not in known or (i == 0 and part in RUN_ONLY):
            fields = sorted(n for n in known if not (i == 0 and n in RUN_ONLY + NOT_SWEPT))
            raise ConfigError(f"{where}: {path!r}: {at} has no data field {part!r}; choose one of {', '.join(fields)}"
                              + (" (mixture weights: mix.<source glob>)" if i == 0 else ""))
        if i == 0 and part in NOT_SWEPT:
            raise ConfigError(f"{where}: {path!r} cannot be swept: " + (
                "give each group's weight as its own field, mix.<source glob> (e.g. mix.wikipedia*)" if part == "mix"
                else "exempt maps source globs to rule globs; set it in the base clean config"))
        hint = typing.get_type_hints(cls)[part]
        if dataclasses.is_dataclass(hint):
            if i == len(parts) - 1:
                inner = sorted(f.name for f in dataclasses.fields(hint))
                raise ConfigError(f"{where}: {path!r} is a section; name one of its keys: "
                                  + ", ".join(f"{path}.{n}" for n in inner))
            cls = hint
            continue
        if i != len(parts) - 1:
            raise ConfigError(f"{where}: {path!r}: {at}.{part} is a value, not a section")
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is typing.Annotated:
            hint = args[0]
        elif len(args) == 1:
            hint = args[0]
        if hint not in (bool, int, float, str):
            raise ConfigError(f"{where}: {path!r} is a {hint}, which an ablation cannot vary; vary numbers, "
                              "strings or flags")
        return cls, part, hint
    raise ConfigError(f"{where}: {path!r}: name a key of the clean config after clean. (e.g. clean.min_words)")


def data_kind(path: str, where: str = "ablation") -> type:
    """The python type of data field ``path``; an unknown block or key is a ConfigError naming the valid ones."""
    block, _, rest = path.partition(".")
    if block not in DATA_BLOCKS or not rest:
        raise ConfigError(f"{where}: {path!r} is not a data field; write clean.<key> (a key of the clean config, "
                          "e.g. clean.olmo2.enabled), mix.<source glob> (a weight) or tokenizer.vocab_size")
    if block == "clean":
        return _clean_leaf(path, where)[2]
    if block == "mix":
        return float
    if rest != "vocab_size":
        raise ConfigError(f"{where}: {path!r}: the tokenizer's data field is tokenizer.vocab_size")
    return int


def data_domain(path: str, values: list[Any], where: str) -> list[Any]:
    """``values`` of data field ``path``, each inside the domain its config declares (weights >= 0, a vocabulary
    of at least 259 tokens): a ConfigError naming the field and the legal values."""
    block = path.partition(".")[0]
    if block == "clean":
        cls, name, _ = _clean_leaf(path, where)
        declared = domains(cls).get(name)
    else:
        from kiln.common.config import Domain

        declared = (float, Domain(0)) if block == "mix" else (int, Domain(259))
    if declared is not None:
        kind, domain = declared
        for v in values:
            domain.check(v, kind, where)
    return values


def expand_data(swept: list[Swept], mode: str = "one_at_a_time", samples: int = 8, seed: int = 0,
                where: str = "ablation") -> list[Point]:
    """The baseline (key ``baseline``, no change) and the points: ``one_at_a_time`` gives one point per value of
    each field, everything else as the baseline has it (the ablation's usual form); ``grid`` and ``random`` combine
    the fields as a hyper-parameter sweep does (kiln.scaling.sweep.expand)."""
    if mode != "one_at_a_time":
        points = expand(swept, mode, samples, seed, where, kind_of=data_kind, check=data_domain)
        return [Point(BASELINE, {})] + [p for p in points if p.key != BASELINE]
    if not swept:
        raise ConfigError(f"{where}.fields is empty: name at least one data field (e.g. clean.olmo2.enabled with "
                          "choices [false])")
    paths = [s.field for s in swept]
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{where}.fields: {sorted({p for p in paths if paths.count(p) > 1})} listed more than once")
    names = short_names(paths)
    points, seen = [Point(BASELINE, {})], {BASELINE}
    for i, s in enumerate(swept):
        at = f"{where}.fields[{i}] ({s.field})"
        kind = data_kind(s.field, f"{where}.fields[{i}].field")
        if s.low is not None or s.high is not None:
            raise ConfigError(f"{at}: low/high are a random search's range; one_at_a_time takes values or choices")
        given = list(s.values) + list(s.choices)
        if not given:
            raise ConfigError(f"{at}: no values: give values (numbers) or choices (flags as true/false, strings)")
        for v in data_domain(s.field, [typed(v, kind, f"{at} value") for v in given], f"{at} value"):
            key = f"{names[s.field]}={show(v)}"
            if key not in seen:
                seen.add(key)
                points.append(Point(key, {s.field: v}))
    return points


# -- a point's clean config, checked

def _set(d: dict[str, Any], parts: list[str], value: Any) -> None:
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def point_clean(base: dict[str, Any], values: dict[str, Any], sources: list[str], where: str):
    """The clean config of a point: ``base`` (the clean config's fields as a mapping, only those that differ from
    the defaults) with the point's ``clean.*`` and ``mix.*`` values. Refused with a ConfigError naming the point:
    a change to a key of a rule the point has switched off (it would change nothing), a value equal to the base's
    (the point would be the baseline), a mix weight whose glob matches none of ``sources``, weights that are all 0,
    and a quality classifier left on when the point's mix drops every reference source it trains on."""
    import fnmatch

    from kiln.clean.config import CleanConfig
    from kiln.clean.mixing import group_of

    merged = copy.deepcopy(base)
    base_cfg = CleanConfig.from_dict(base, f"{where}: clean")
    for path, v in values.items():
        block, _, rest = path.partition(".")
        if block == "mix":
            unmatched = not any(fnmatch.fnmatchcase(s, rest) for s in sources)
            if unmatched:
                raise ConfigError(f"{where}: {path}: the glob {rest!r} matches none of the sources "
                                  f"({', '.join(sources)}); name a source or a glob that matches one")
            merged.setdefault("mix", {}).setdefault("weights", {})[rest] = v
        elif block == "clean":
            parts = rest.split(".")
            if len(values) == 1 and functools.reduce(getattr, parts, base_cfg) == v:
                raise ConfigError(f"{where}: {path} is {show(v)} in the base clean config already: the point would "
                                  "be the baseline; give a value that differs")
            _set(merged, parts, v)
    try:
        cfg = CleanConfig.from_dict(merged, f"{where}: clean")
    except ConfigError as e:
        raise (e if str(e).startswith(where) else ConfigError(f"{where}: {e}")) from None
    for path in values:
        parts = path.split(".")[1:]
        if path.startswith("clean.") and len(parts) > 1 and parts[-1] != "enabled":
            section = getattr(cfg, parts[0])
            if getattr(section, "enabled", True) is False:
                raise ConfigError(f"{where}: {path} is set but clean.{parts[0]}.enabled is false in this point: the "
                                  f"rule is off, so the change does nothing; switch clean.{parts[0]} on in the base "
                                  "clean config or drop the field")
    weights = cfg.mix.weights
    if weights:
        if not any(v > 0 for v in weights.values()):
            raise ConfigError(f"{where}: every mix weight is 0; nothing would be kept")
        qm = cfg.quality_model
        if qm.enabled:
            refs = [s for s in sources if any(fnmatch.fnmatchcase(s, g) for g in qm.reference_sources)]
            if refs and all((g := group_of(s, cfg.mix)) is not None and weights[g] == 0 for s in refs):
                raise ConfigError(f"{where}: the quality classifier trains on the reference sources {refs} "
                                  f"(clean.quality_model.reference_sources), which this point's mix gives weight 0; "
                                  "keep a weight on them or set clean.quality_model.enabled false in the point")
        missing = [s for s in sources if group_of(s, cfg.mix) is None]
        if missing:
            raise ConfigError(f"{where}: sources {missing} match no mix weight (groups {sorted(weights)}); give them "
                              "a weight (0 drops a source) or add a catch-all mix.* field")
    return cfg


# -- the evaluation set, fixed before any point trains

@dataclass
class EvalSet:
    """The documents every point is scored on (never trained on): their ids, and the keys by which a training
    document is found to be one of them: the exact text's hash and the MinHash band keys (near-duplicates, FineWeb's
    5-gram shingles, 14 bands of 8)."""

    ids: set[str]
    hashes: set[bytes]
    bands: set[tuple[int, bytes]]

    @classmethod
    def of(cls, docs: list[tuple[str, str]]) -> "EvalSet":
        from kiln.clean.dedup import content_hash

        return cls({i for i, _ in docs}, {content_hash(t) for _, t in docs}, set(_band_keys([t for _, t in docs])))

    def overlaps(self, docs: list[tuple[str, str]]) -> list[bool]:
        """For each (id, text): is it an evaluation document, an exact copy of one, or a near-duplicate of one."""
        from kiln.clean.dedup import content_hash

        keys = _band_keys([t for _, t in docs], per_doc=True)
        return [i in self.ids or content_hash(t) in self.hashes or any(k in self.bands for k in ks)
                for (i, t), ks in zip(docs, keys)]


def _band_keys(texts: list[str], per_doc: bool = False):
    from kiln.clean.dedup import MinHashConfig, signatures

    mh = MinHashConfig()
    sigs = np.array(signatures(texts, mh), dtype=np.uint32).reshape(len(texts), mh.bands, mh.rows) if texts else \
        np.zeros((0, mh.bands, mh.rows), np.uint32)
    keys = [[(b, sig[b].tobytes()) for b in range(mh.bands)] for sig in sigs]
    return keys if per_doc else [k for ks in keys for k in ks]


def choose_eval_docs(corpus: str, permille: int, max_mb: float) -> list[tuple[str, str]]:
    """The evaluation documents: those of the baseline's clean corpus whose id hashes into the first ``permille``
    per thousand (kiln.tokens.shards.split_of, the rule behind every validation split, so the shared tokenizer's held-out
    documents include them), in corpus order, up to ``max_mb`` MB."""
    from kiln.clean.corpus import corpus_texts
    from kiln.tokens.shards import split_of

    out, size = [], 0
    for doc_id, text in corpus_texts(corpus):
        if split_of(doc_id, permille) == "val":
            out.append((doc_id, text))
            size += len(text.encode("utf-8"))
            if size >= max_mb * 1e6:
                break
    if not out:
        raise ConfigError(f"ablation: the baseline's clean corpus {corpus} has no document in the evaluation split "
                          f"(eval_permille={permille}); raise eval_permille")
    return out


def write_eval_docs(docs: list[tuple[str, str]], path: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.common.files import atomic_path

    with atomic_path(path) as tmp:
        pq.write_table(pa.table({"id": [i for i, _ in docs], "text": [t for _, t in docs]}), tmp)
    return {"path": str(path), "documents": len(docs), "bytes": sum(len(t.encode("utf-8")) for _, t in docs),
            "sha256": sha256_file(path)}


def read_eval_docs(info: dict[str, Any]) -> list[tuple[str, str]]:
    """The evaluation documents, checked against the sha256 recorded when they were chosen."""
    from kiln.clean.corpus import corpus_texts

    path = Path(info["path"])
    if not path.is_file() or sha256_file(path) != info["sha256"]:
        raise ConfigError(f"ablation: the evaluation set {path} is missing or changed since ablation_grid chose it; "
                          "rematerialize ablation_grid")
    return list(corpus_texts(str(path)))


# -- comparing a point with the baseline

def compare(base: dict[int, float], point: dict[int, float]) -> dict[str, Any]:
    """The point's bits per byte minus the baseline's, paired by seed (the same initialisation; the data order
    follows the data): the mean, its 95% Student-t interval over the seeds both ran, the seed-to-seed spread
    (standard deviation) of each, and the verdict: ``helps`` (the whole interval below 0), ``hurts`` (above 0) or
    ``within noise``; fewer than two shared seeds give no interval and the verdict ``one seed``."""
    from scipy import stats

    seeds = sorted(set(base) & set(point))
    diffs = np.array([point[s] - base[s] for s in seeds], dtype=float)
    out: dict[str, Any] = {"seeds": seeds, "diff": float(diffs.mean()) if len(diffs) else float("nan"),
                           "base_sd": _sd([base[s] for s in seeds]), "point_sd": _sd([point[s] for s in seeds])}
    if len(diffs) < 2:
        return {**out, "low": None, "high": None, "verdict": "one seed"}
    half = float(stats.t.ppf(0.975, len(diffs) - 1) * diffs.std(ddof=1) / math.sqrt(len(diffs)))
    low, high = out["diff"] - half, out["diff"] + half
    verdict = "helps" if high < 0 else "hurts" if low > 0 else "within noise"
    return {**out, "low": low, "high": high, "verdict": verdict}


def _sd(xs: list[float]) -> float | None:
    return float(np.std(xs, ddof=1)) if len(xs) > 1 else None


def bits_per_byte(val_loss: float, tokens: int, nbytes: int) -> float:
    """Mean nats per token over the evaluation set as bits per byte of its text (a tokenizer change compares)."""
    return val_loss / math.log(2) * tokens / nbytes


# -- running a point: clean, tokens, proxies; every stage keyed by content and reused

def corpus_content(path: str) -> str:
    """sha256 of the clean corpus's (id, text) rows in order: two points with equal outputs share one key."""
    from kiln.clean.corpus import corpus_texts

    h = hashlib.sha256()
    for doc_id, text in corpus_texts(path):
        h.update(doc_id.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return h.hexdigest()


def _done(folder: Path) -> dict[str, Any] | None:
    """A stage folder's record (done.json) when every file its witness lists is still whole
    (kiln.common.files.check_witness: a changed file is hashed and compared), else None."""
    try:
        rec = json.loads((folder / "done.json").read_text())
    except (OSError, ValueError):
        return None
    return rec if "witness" in rec and check_witness(folder, rec["witness"]) is None else None


def _commit(stage: Path, final: Path, record: dict[str, Any]) -> dict[str, Any]:
    record = {**record, "witness": witness(stage)}  # a rename keeps each file's time: the witness holds at ``final``
    atomic_write_json(stage / "done.json", record)
    if final.exists() and _done(final) is None:
        shutil.rmtree(final)  # a folder left incomplete or damaged: replaced whole
    commit_dir(stage, final)
    return record


def clean_point(raw: dict[str, Any], cfg, root: Path, shard_cache: Path, say: Say) -> dict[str, Any]:
    """The point's clean corpus under ``root/clean/<config key>`` (reused when whole), with its content key; a
    config that keeps no document gives ``{"empty": reason}`` instead of an error (the point is marked)."""
    from kiln.clean import corpus as kcorpus
    from kiln.clean import run as krun
    from kiln.clean import shard as kshard
    from kiln.clean.report import EmptyCorpusError

    conf = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUN_ONLY}
    folder = root / "clean" / stable_hash([STAGE_VERSION, raw["version"], conf])[:16]
    if (rec := _done(folder)) is None:
        shards, out_dir = kshard.cached_shards(raw["path"], cfg, shard_cache)
        with staging_dir(folder.parent) as stage:
            try:
                results = krun.clean_shards(raw["path"], shards, out_dir, cfg, say)
                rep = kcorpus.write_clean_corpus(results, stage, cfg, raw["path"], progress=say).to_dict()
                record = {"content": corpus_content(str(stage / "corpus.parquet")), "kept_docs": rep["kept_docs"],
                          "kept_bytes": rep["kept_bytes"], "dropped_docs": rep["dropped_docs"],
                          "removed_by_rule": {r: v["docs"] for r, v in rep["reasons"].items()}}
            except EmptyCorpusError as e:  # kept as an outcome: a rerun reuses it too
                for f in stage.iterdir():
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
                record = {"empty": str(e).splitlines()[0]}
            rec = {**_commit(stage, folder, record), "reused": False}
    else:
        rec = {**rec, "reused": True}
    if "empty" in rec:
        return {"empty": rec["empty"], "reused": rec["reused"]}
    return {**rec, "path": str(folder / "corpus.parquet"), "removed": str(folder / "removed.parquet")}


def point_tokenizer(clean: dict[str, Any], vocab_size: int, settings: dict[str, Any], root: Path,
                    say: Say) -> dict[str, Any]:
    """A BPE of ``vocab_size`` trained on the point's clean corpus (the tokenizer asset's rule: held-out documents
    never trained on), under ``root/tokenizer/<key>``, reused when whole."""
    from kiln.tokens import tokenizer as ktok
    from kiln.clean.corpus import corpus_texts
    from kiln.tokens.shards import split_of

    folder = root / "tokenizer" / stable_hash([STAGE_VERSION, clean["content"], vocab_size, settings])[:16]
    if (rec := _done(folder)) is None:
        say(f"ablation: training a BPE of {vocab_size:,} tokens on the point's corpus")
        with staging_dir(folder.parent) as stage:
            built = ktok.build_tokenizer(corpus_texts(clean["path"]), lambda i: split_of(i, settings["holdout_permille"]) == "val",
                                         kind="bpe", vocab_size=vocab_size, train_mb=settings["train_mb"],
                                         heldout_mb=settings["heldout_mb"], compare=False,
                                         split_digits=settings["split_digits"], load_gpt2=lambda: None, warn=say)
            ktok.save_encoding(built.encoding, stage / "tokenizer.json")
            rec = _commit(stage, folder, {"n_vocab": built.encoding.n_vocab, "bytes_per_token": built.bytes_per_token})
    return {"path": str(folder / "tokenizer.json"), "n_vocab": rec["n_vocab"]}


def eval_shards(eval_info: dict[str, Any], tok: dict[str, Any], root: Path, num_workers: int) -> dict[str, Any]:
    """The evaluation documents as validation shards in the tokenizer ``tok``: files, tokens and bytes."""
    from kiln.tokens import shards as kshards
    from kiln.tokens import tokenizer as ktok

    enc = ktok.load_encoding(tok["path"])
    fp = ktok.encoding_fingerprint(enc)
    folder = root / "eval" / stable_hash([STAGE_VERSION, eval_info["sha256"], fp])[:16]
    if (rec := _done(folder)) is None:
        with staging_dir(folder.parent) as stage:
            manifest = kshards.write_shards(enc, read_eval_docs(eval_info), stage, 10_000_000, 1000, num_workers)
            rec = _commit(stage, folder, {"tokens": manifest["splits"]["val"]["tokens"], "bytes": eval_info["bytes"]})
    return {"val": [str(p) for p in kshards.shard_paths(folder, "val")], "tokens": rec["tokens"], "bytes": rec["bytes"],
            "key": folder.name}


def point_tokens(clean: dict[str, Any], tok: dict[str, Any], eval_info: dict[str, Any], evalset: Callable[[], EvalSet],
                 root: Path, num_workers: int, say: Say) -> dict[str, Any]:
    """The point's training shards: its clean corpus less the evaluation documents, their exact copies and their
    near-duplicates (counted: ``eval_overlap_removed``), under ``root/tokens/<key>``, reused when whole."""
    from kiln.tokens import shards as kshards
    from kiln.tokens import tokenizer as ktok
    from kiln.clean.corpus import corpus_texts

    enc = ktok.load_encoding(tok["path"])
    folder = root / "tokens" / stable_hash([STAGE_VERSION, clean["content"], ktok.encoding_fingerprint(enc),
                                            eval_info["sha256"]])[:16]
    if (rec := _done(folder)) is None:
        index, removed = evalset(), [0]

        def kept() -> Iterator[tuple[str, str]]:  # the corpus streamed 512 documents at a time
            docs = corpus_texts(clean["path"])
            for batch in iter(lambda: list(itertools.islice(docs, 512)), []):
                hits = index.overlaps(batch)
                removed[0] += sum(hits)
                yield from (d for d, hit in zip(batch, hits) if not hit)

        with staging_dir(folder.parent) as stage:
            manifest = kshards.write_shards(enc, kept(), stage, 10_000_000, 0, num_workers)
            train = manifest["splits"]["train"]
            rec = _commit(stage, folder, {"tokens": train["tokens"], "documents": train["documents"],
                                          "eval_overlap_removed": removed[0]})
        say(f"ablation: {rec['documents']:,} training documents, {rec['tokens']:,} tokens "
            f"({rec['eval_overlap_removed']} removed as evaluation documents or their near-duplicates)")
    return {**rec, "train": [str(p) for p in kshards.shard_paths(folder, "train")], "key": folder.name}


@dataclass
class Proxy:
    """The proxy every point trains: its plan (kiln.plan, for the point's vocabulary), the optimizer, the token
    budget and the seeds."""

    plan: Callable[[int], dict[str, Any]]  # n_vocab -> the training plan (model, seq_len, micro_batch, hardware ...)
    optim: dict[str, Any]
    tokens: int  # every point trains this many tokens (repeating its data where it has fewer)
    seeds: list[int]
    benchmarks: list[str] = field(default_factory=list)  # standard benchmarks each proxy is also scored on
    benchmark_items: int = 200  # a seeded sample of this many items per benchmark
    cache_dir: str = ""  # where the benchmarks' data packages are cached

    def steps(self, plan: dict[str, Any]) -> int:
        return max(1, math.ceil(self.tokens / plan["tokens_per_step"]))


Launch = Callable[[dict[str, Any], Path, str], dict[str, Any]]  # (job fields, run folder, run name) -> result.json


def train_seeds(tokens: dict[str, Any], ev: dict[str, Any], tok: dict[str, Any], proxy: Proxy, seeds: list[int],
                root: Path, launch: Launch, say: Say, label: str) -> list[dict[str, Any]]:
    """One proxy run per seed on the point's shards, scored on the evaluation shards (every window of them): its
    bits per byte, epochs over the point's data, and the run folder (reused when it finished)."""
    from kiln.train.launch import RunSpec, finished

    plan = proxy.plan(tok["n_vocab"])
    steps = proxy.steps(plan)
    windows = ev["tokens"] // (plan["seq_len"] + 1)
    rows = []
    for seed in seeds:
        fields = {"optim": proxy.optim, "train_files": tokens["train"], "val_files": ev["val"], "max_steps": steps,
                  "eval_interval": max(1, steps // 4), "eval_batches": max(1, -(-windows // plan["micro_batch"])),
                  "ckpt_interval": steps, "keep_last": 1, "seed": seed}
        spec = RunSpec("pretrain", fields, plan, {"ablation_tokens": tokens["key"], "eval": ev["key"]}, tok["path"])
        run_dir = root / "runs" / spec.key
        result = finished(run_dir, steps)
        reused = result is not None
        if result is None:
            say(f"ablation: {label} seed {seed}: {steps} steps of {plan['tokens_per_step']:,} tokens "
                f"({proxy.tokens / max(tokens['tokens'], 1):.2f} epochs of its data)")
            result = launch(spec.job(run_dir, "", ""), run_dir, f"{label} seed {seed}")
        rows.append({"seed": seed, "val_loss": result["final_val_loss"],
                     "bpb": bits_per_byte(result["final_val_loss"], ev["tokens"], ev["bytes"]),
                     "wall_s": round(result["wall_s"], 1), "reused": reused, "run_dir": str(run_dir),
                     "curve": [(h["step"], h["val_loss"]) for h in result.get("history", [])
                               if h.get("val_loss") is not None],
                     **({"benchmarks": benchmark_scores(run_dir, result["checkpoint"], proxy, say)}
                        if proxy.benchmarks else {})})
    return rows


BENCHMARK_SEED = 1234  # the items drawn from each benchmark: the same sample for every point and seed


def benchmark_scores(run_dir: Path, checkpoint: str, proxy: Proxy, say: Say) -> dict[str, dict[str, float]]:
    """The proxy's primary score on each of ``proxy.benchmarks`` (lm-eval's definition, through Kiln's adapter, on
    a seeded sample of ``benchmark_items`` items), with its chance level; kept beside the run and reused while the
    benchmarks and the sample are the same."""
    import tempfile

    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.standard import prepare
    from kiln.evaluation.standard.suite import score_benchmarks
    from kiln.train.checkpoint import load_for_inference

    key = {"benchmarks": list(proxy.benchmarks), "items": proxy.benchmark_items, "seed": BENCHMARK_SEED}
    kept = run_dir / "benchmarks.json"
    try:
        found = json.loads(kept.read_text())
        if found.get("key") == key:
            return found["scores"]
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory(prefix="kiln-ablation-bench-") as tmp:
        prepared = prepare(list(proxy.benchmarks), proxy.cache_dir, tmp, proxy.benchmark_items, BENCHMARK_SEED)
        model, enc, _ = load_for_inference(checkpoint)
        full, _ = score_benchmarks(model, enc, prepared, None, seed=BENCHMARK_SEED, progress=say)
    scores = {}
    for name, row in full.items():
        metric = REGISTRY.benchmark(name).primary.split(",", 1)[0]
        scores[name] = {"score": row[metric], "chance": row["chance"], "items": row["items"], "metric": metric}
    atomic_write_json(kept, {"key": key, "scores": scores})
    return scores


@dataclass
class PointPlan:
    """What one point runs: its key, its changed fields, its clean config and its tokenizer (None: the shared one)."""

    key: str
    values: dict[str, Any]
    clean: Any  # kiln.clean.config.CleanConfig
    vocab_size: int | None = None
    seeds: list[int] = field(default_factory=list)


def run_point(point: PointPlan, raw: dict[str, Any], shared_tok: dict[str, Any], tok_settings: dict[str, Any],
              eval_info: dict[str, Any], proxy: Proxy, root: Path, shard_cache: Path, launch: Launch,
              say: Say, num_workers: int = 2) -> dict[str, Any]:
    """Every stage of one point, each reused when its inputs' content is unchanged; the point's record: documents
    and tokens kept, epochs, each seed's bits per byte, seconds, and what was reused. A point whose corpus is empty
    is recorded with ``empty`` (and no runs) instead of failing the sweep."""
    start = time.perf_counter()
    cached: list[EvalSet] = []

    def evalset() -> EvalSet:  # built once, and only when a point's tokens are written
        if not cached:
            cached.append(EvalSet.of(read_eval_docs(eval_info)))
        return cached[0]

    clean = clean_point(raw, point.clean, root, shard_cache, say)
    record: dict[str, Any] = {"key": point.key, "values": point.values, "clean_reused": clean["reused"]}
    if "empty" in clean:
        return {**record, "empty": clean["empty"], "runs": [], "wall_s": round(time.perf_counter() - start, 1),
                "reused": clean["reused"]}
    tok = shared_tok if point.vocab_size is None else point_tokenizer(clean, point.vocab_size, tok_settings, root, say)
    tokens = point_tokens(clean, tok, eval_info, evalset, root, num_workers, say)
    if tokens["tokens"] == 0:
        return {**record, "empty": "no training tokens left once the evaluation documents were removed", "runs": [],
                "wall_s": round(time.perf_counter() - start, 1)}
    ev = eval_shards(eval_info, tok, root, num_workers)
    runs = train_seeds(tokens, ev, tok, proxy, point.seeds or proxy.seeds, root, launch, say, point.key)
    return {**record, "content": clean["content"], "clean": clean["path"], "removed": clean["removed"],
            "kept_docs": clean["kept_docs"], "kept_bytes": clean["kept_bytes"],
            "removed_by_rule": clean["removed_by_rule"], "n_vocab": tok["n_vocab"], "train_tokens": tokens["tokens"],
            "train_documents": tokens["documents"], "eval_overlap_removed": tokens["eval_overlap_removed"],
            "epochs": round(proxy.tokens / tokens["tokens"], 3), "eval_tokens": ev["tokens"],
            "runs": runs, "wall_s": round(time.perf_counter() - start, 1),
            "reused": clean["reused"] and all(r["reused"] for r in runs)}


# -- the report

def changes(base: dict[str, Any], point: dict[str, Any], n: int = 3, chars: int = 300) -> dict[str, list[dict]]:
    """What the point's change removed (documents the baseline kept and the point did not, with the rule that
    dropped each in the point) and let in (kept by the point, dropped by the baseline, with the baseline's rule):
    counts and ``n`` samples of each (a seeded draw), their openings ``chars`` long."""
    import pyarrow.parquet as pq

    def ids(path: str) -> list[str]:
        return pq.read_table(path, columns=["id"]).column("id").to_pylist()

    def rows(path: str, wanted: list[str], column: str) -> dict[str, str]:  # only the sampled rows are read whole
        if not wanted:
            return {}
        t = pq.read_table(path, columns=["id", column], filters=[("id", "in", wanted)])
        return dict(zip(t.column("id").to_pylist(), t.column(column).to_pylist()))

    b, p = set(ids(base["clean"])), set(ids(point["clean"]))
    gone, new = sorted(b - p), sorted(p - b)

    def sample(picked: list[str], corpus: str, removed: str) -> list[dict[str, str]]:
        texts, why = rows(corpus, picked, "text"), rows(removed, picked, "reason")
        return [{"id": i, "reason": why.get(i, "-"), "text": " ".join(texts.get(i, "").split())[:chars]} for i in picked]

    import random

    pick = lambda ids: sorted(random.Random(0).sample(ids, min(n, len(ids))))  # noqa: E731 (seeded: the same each time)
    return {"removed": sample(pick(gone), base["clean"], point["removed"]),
            "let_in": sample(pick(new), point["clean"], base["removed"]),
            "removed_count": len(gone), "let_in_count": len(new)}


def benchmark_rows(base: list[dict[str, Any]], point: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per benchmark both runs were scored on: the point's mean score, its chance level, and its difference from
    the baseline paired by seed (``compare``: here a positive difference helps)."""
    names = [n for n in (base[0].get("benchmarks") or {}) if all(n in (r.get("benchmarks") or {}) for r in point)] \
        if base else []
    out = {}
    for n in names:
        b = {r["seed"]: r["benchmarks"][n]["score"] for r in base}
        p = {r["seed"]: r["benchmarks"][n]["score"] for r in point}
        c = compare(b, p)
        verdict = {"helps": "hurts", "hurts": "helps"}.get(c["verdict"], c["verdict"])  # higher is better here
        out[n] = {**c, "verdict": verdict, "score": float(np.mean(list(p.values()))),
                  "chance": point[0]["benchmarks"][n]["chance"]}
    return out


def shares_runs(point: dict[str, Any], base: dict[str, Any]) -> bool:
    """Whether ``point`` trained nothing of its own: its clean corpus is the baseline's and so are its runs (a point
    with its own vocabulary keeps the baseline's corpus but trains on other tokens)."""
    return point.get("content") == base.get("content") and \
        sorted(r.get("run_dir", "") for r in point["runs"]) == sorted(r.get("run_dir", "") for r in base["runs"])


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point: documents and tokens kept, epochs, mean bits per byte, and its comparison with the
    baseline (``compare``); an empty point is marked, never scored, and a point that shares the baseline's corpus
    and runs (its change touched no document) says so instead of a difference."""
    base = next((r for r in records if r["key"] == BASELINE), None)
    if base is None or base.get("empty"):
        raise ConfigError("ablation: the baseline point " + ("has not run" if base is None else
                                                               f"kept no document ({base['empty']})"))
    base_bpb = {r["seed"]: r["bpb"] for r in base["runs"]}
    rows = []
    for rec in records:
        row = {"point": rec["key"], "values": rec["values"]}
        if rec.get("empty"):
            rows.append({**row, "verdict": "empty corpus", "note": rec["empty"]})
            continue
        bpb = {r["seed"]: r["bpb"] for r in rec["runs"]}
        row.update({"kept_docs": rec["kept_docs"], "train_tokens": rec["train_tokens"], "epochs": rec["epochs"],
                    "bpb": float(np.mean(list(bpb.values()))), "seeds": len(bpb),
                    "eval_overlap_removed": rec["eval_overlap_removed"]})
        if rec["key"] != BASELINE and shares_runs(rec, base):
            row.update({"diff": 0.0, "verdict": "same corpus", "note": "the change removes or lets in nothing: the "
                        "point shares the baseline's corpus, tokens and runs"})
        elif rec["key"] != BASELINE:
            row.update({**compare(base_bpb, bpb), "seeds": len(bpb)})  # the count; compare's list is the paired seeds
            if bench := benchmark_rows(base["runs"], rec["runs"]):
                row["benchmarks"] = bench
        else:
            row.update({"diff": 0.0, "verdict": "baseline", "base_sd": _sd(list(bpb.values())),
                        "point_sd": _sd(list(bpb.values()))})
        rows.append(row)
    return rows
