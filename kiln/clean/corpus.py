"""The corpus-wide stage of cleaning, after the shards: URL, exact and MinHash dedup, line dedup, token-distribution
outliers, the corpus-trained quality classifier and the source mix, as named passes; and reading a clean corpus.
The dedup decisions come from ``kiln.clean.dedup.dedup_decisions`` through the caller's map (this process, or Ray).

``merge_shards(results, "corpus.parquet", "removed.parquet", CleanConfig())`` over ``clean_shard`` results (what
``kiln.clean.run.clean`` does); ``corpus_texts("corpus.parquet")`` yields (id, text) of a clean corpus.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.clean.config import CleanSettings, rule_keys
from kiln.clean.dedup import Decisions, LineDeduper, LocalMap, Map, dedup_decisions
from kiln.clean.mixing import keep_sample, plan_mix
from kiln.clean.quality import Reservoir, TokenDistribution, mad_limit, train_classifier
from kiln.clean.report import CleanReport, EmptyCorpusError, examples_markdown
from kiln.clean.schema import REMOVED_SCHEMA, kept_schema, shard_schema
from kiln.clean.shard import Progress, Timer, removed_row
from kiln.common.files import atomic_path, atomic_write_json
from kiln.filters.base import matches_any


def iter_rows(paths: list[str], batch_size: int, columns: list[str] | None = None) -> Iterator[list[dict]]:
    """The rows of Parquet files in order, ``batch_size`` at a time, as dicts."""
    for p in paths:
        with pq.ParquetFile(p) as pf:
            for batch in pf.iter_batches(batch_size=batch_size, columns=columns):
                yield batch.to_pylist()


def corpus_texts(path: str, columns=("id", "text")):
    """Yield (id, text) from a clean corpus Parquet file, one row group at a time."""
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        t = pf.read_row_group(i, columns=list(columns))
        yield from zip(t.column("id").to_pylist(), t.column("text").to_pylist())


class CorpusStage:
    """The passes of ``merge_shards`` in the order they run; each writes a Parquet file the next one reads.

    ``dedup`` (pass A) drops the URL, exact and near duplicates of ``decisions`` and gathers what later passes
    need: the corpus word distribution, samples for the classifier. ``train_quality_model`` fits the classifier.
    ``edit_and_score`` (pass B) removes corpus-repeated lines and scores every document; ``limits`` sets the KL
    threshold and plans the mix; ``write_kept`` (pass C) applies both and writes the kept corpus.
    """

    def __init__(self, cfg: CleanSettings, report: CleanReport, removed: pq.ParquetWriter, tmp: Path,
                 say: Progress, decisions: Decisions) -> None:
        self.cfg, self.report, self.removed, self.tmp, self.say = cfg, report, removed, tmp, say
        self.timer = Timer()
        self.schema = shard_schema()
        self.quality_passed = 0  # documents that passed the per-document stage
        qm = cfg.quality_model
        self.decisions = decisions
        self.priors = set(decisions.url.values()) | set(decisions.exact.values()) | set(decisions.near.values())
        self.ids: dict[int, str] = {}  # corpus position -> id of each prior, for the "duplicate of" details
        self.lines = LineDeduper(cfg.line_dedup, decisions.over_lines)
        self.dist = TokenDistribution(cfg.token_outliers)
        self.pos, self.neg = Reservoir(qm.max_train_docs, qm.seed), Reservoir(qm.max_train_docs, qm.seed + 1)
        self.kl_values: list[float] = []  # per document of pass B, in order: token KL, score, source, bytes
        self.scores: list[float] = []
        self.sources: list[str] = []
        self.sizes: list[int] = []

    def drop(self, row: dict, reason: str, detail: str, dup: str | None, removed: list) -> None:
        self.report.drop(row["id"], row["source"], row["input_bytes"], reason, row["text"],
                         self.cfg.examples_per_reason)
        removed.append(removed_row(row, reason, detail, dup))

    def write_removed(self, rows: list[dict]) -> None:
        self.removed.write_table(pa.Table.from_pylist(rows, schema=REMOVED_SCHEMA))

    def copy_shard_removed(self, paths: list[str]) -> None:
        """What the per-document stage removed, first, in shard order."""
        for batch in iter_rows(paths, self.cfg.batch_size):
            self.write_removed(batch)

    # ---------------------------------------------------------------- pass A

    def dedup(self, kept_paths: list[str]) -> Path:
        """Pass A, in input order: the URL, exact and near duplicates dropped; word counts and classifier samples."""
        cfg, timer = self.cfg, self.timer
        path = self.tmp / "a.parquet"
        with pq.ParquetWriter(path, self.schema) as w:
            for batch in iter_rows(kept_paths, cfg.batch_size):
                first = self.quality_passed
                self.quality_passed += len(batch)
                timer.lap("read")
                removed: list[dict] = []
                survivors = self._drop_duplicates(batch, first, removed)
                timer.lap("dedup")
                self._count(survivors)
                w.write_table(pa.Table.from_pylist(survivors, schema=self.schema))
                self.write_removed(removed)
        self.say(f"clean: dedup done, {self.report.input_docs - self.report.dropped_docs} documents left")
        return path

    def _drop_duplicates(self, batch: list[dict], first: int, removed: list) -> list[dict]:
        """The batch (corpus positions ``first``...) without its duplicates: URL and exact drops in row order, then
        the near duplicates among what is left."""
        d, survivors = self.decisions, []
        for pos, row in enumerate(batch, first):
            if pos in self.priors:
                self.ids[pos] = row["id"]
            if pos in d.url:
                prior = self.ids[d.url[pos]]
                self.drop(row, "dedup:url", f"same URL as {prior}", prior, removed)
            elif pos in d.exact:
                prior = self.ids[d.exact[pos]]
                self.drop(row, "dedup:exact", f"duplicate of {prior}", prior, removed)
            else:
                survivors.append((pos, row))
        kept = []
        for pos, row in survivors:
            if pos in d.near:
                prior = self.ids[d.near[pos]]
                self.drop(row, "dedup:minhash", f"duplicate of {prior}", prior, removed)
            else:
                kept.append(row)
        return kept

    def _count(self, rows: list[dict]) -> None:
        cfg = self.cfg
        if cfg.token_outliers.enabled:
            for row in rows:
                self.dist.add(row["text"])
        self.timer.lap("corpus_counts")
        qm = cfg.quality_model
        if qm.enabled:
            for row in rows:
                (self.pos if matches_any(row["source"], qm.reference_sources) else self.neg).add(row["text"])
        self.timer.lap("quality_model")

    # ---------------------------------------------------------------- the classifier

    def train_quality_model(self, artifacts_dir: str | Path | None) -> Any:
        """The classifier, trained on reference sources against random text from the rest (None when off or too
        little of either); saved as quality_model.pt in ``artifacts_dir``."""
        qm, report, model = self.cfg.quality_model, self.report, None
        pos, neg = self.pos.items, self.neg.items
        if qm.enabled and len(pos) >= 2 and len(neg) >= 2:
            n = min(len(pos), len(neg))
            model, metrics = train_classifier(pos[:n], neg[:n], qm)
            report.quality_model = {"trained": True, "min_score": qm.min_score,
                                    "reference_sources": qm.reference_sources, **metrics}
            if artifacts_dir is not None:
                import torch

                torch.save(model.state_dict(), Path(artifacts_dir) / "quality_model.pt")
        elif qm.enabled:
            report.quality_model = {
                "trained": False, "reference_sources": qm.reference_sources,
                "why": f"{len(pos)} reference and {len(neg)} other documents; at least 2 of each "
                       f"are needed (clean.quality_model.reference_sources)"}
            self.say(f"clean: quality classifier skipped: {report.quality_model['why']}")
        self.pos = self.neg = None  # type: ignore[assignment]
        self.timer.lap("quality_model")
        if self.cfg.token_outliers.enabled:
            self.dist.freeze()
        return model

    # ---------------------------------------------------------------- pass B

    def edit_and_score(self, path_a: Path, model: Any) -> Path:
        """Pass B: line dedup (edits text, may drop what is left too short), token KL and classifier score."""
        cfg, timer = self.cfg, self.timer
        path = self.tmp / "b.parquet"
        with pq.ParquetWriter(path, self.schema) as w:
            for batch in iter_rows([str(path_a)], cfg.batch_size):
                removed: list[dict] = []
                out = self._dedup_lines(batch, removed) if cfg.line_dedup.enabled else batch
                timer.lap("dedup_lines")
                if cfg.token_outliers.enabled:
                    for row in out:
                        row["token_kl"] = self.dist.kl(row["text"])
                timer.lap("token_outliers")
                if model is not None:
                    for row, s in zip(out, model.score([r["text"] for r in out])):
                        row["quality_score"] = float(s)
                timer.lap("quality_model")
                for row in out:
                    self.kl_values.append(row["token_kl"] if row.get("token_kl") is not None else 0.0)
                    self.scores.append(row["quality_score"] if row.get("quality_score") is not None else 1.0)
                    self.sources.append(row["source"])
                    self.sizes.append(row["bytes"])
                w.write_table(pa.Table.from_pylist(out, schema=self.schema))
                self.write_removed(removed)
        self.lines = None  # type: ignore[assignment]
        return path

    def _dedup_lines(self, batch: list[dict], removed: list) -> list[dict]:
        out, min_words = [], self.cfg.min_words
        for row in batch:
            text, n_lines, n_bytes = self.lines.apply(row["text"])
            row["lines_removed"] = n_lines
            if n_lines:
                self.report.edit("dedup:line", n_lines, n_bytes)
                if len(text.split()) < max(min_words, 1):
                    self.drop(row, "dedup:lines", f"{n_lines} lines repeated across the corpus removed; "
                              f"{len(text.split())} words left < min_words={min_words}", None, removed)
                    continue
                row["text"], row["bytes"] = text, len(text.encode())
            out.append(row)
        return out

    # ---------------------------------------------------------------- thresholds over the whole corpus

    def limits(self, model: Any) -> tuple[float, float, dict[str, Any]]:
        """(KL limit, min score, mix plan): KL outliers by median + k * MAD, then the mix over what is left."""
        cfg, report, to = self.cfg, self.report, self.cfg.token_outliers
        kl_limit = math.inf
        if to.enabled and len(self.kl_values) >= to.min_docs:
            med, mad, kl_limit = mad_limit(self.kl_values, to.max_mad)
            report.token_outliers = {"median_kl": round(med, 4), "mad_kl": round(mad, 4),
                                     "limit_kl": round(kl_limit, 4) if math.isfinite(kl_limit) else None}
        elif to.enabled:
            report.token_outliers = {"skipped": f"{len(self.kl_values)} documents < token_outliers.min_docs="
                                                f"{to.min_docs}"}
        min_score = cfg.quality_model.min_score if model is not None else -1.0
        available: dict[str, int] = {}
        for kl, sc, src, size in zip(self.kl_values, self.scores, self.sources, self.sizes):
            if kl <= kl_limit and sc >= min_score:
                available[src] = available.get(src, 0) + size
        mix = plan_mix(available, cfg.mix)
        self.timer.lap("mix")
        return kl_limit, min_score, mix

    # ---------------------------------------------------------------- pass C

    def write_kept(self, path_b: Path, out_path: str | Path, kl_limit: float, min_score: float,
                   mix: dict[str, Any], t0: float, where: Path) -> None:
        """Pass C: the corpus thresholds and the mix, then the kept corpus written atomically (not at all, raising
        EmptyCorpusError that names ``where``, when nothing is kept)."""
        kept_by_source: dict[str, int] = {}
        schema = kept_schema()
        with atomic_path(out_path) as kept_tmp, pq.ParquetWriter(kept_tmp, schema) as kept_w:
            for batch in iter_rows([str(path_b)], self.cfg.batch_size):
                kept, removed = [], []
                for row in batch:
                    if self._passes(row, kl_limit, min_score, mix, removed):
                        self.report.keep(row["source"], row["input_bytes"], row["bytes"])
                        kept_by_source[row["source"]] = kept_by_source.get(row["source"], 0) + row["bytes"]
                        kept.append({k: row.get(k) for k in schema.names})
                kept_w.write_table(pa.Table.from_pylist(kept, schema=schema))
                self.write_removed(removed)
            self.timer.lap("write")
            self._finish(mix, kept_by_source, t0)
            if self.report.kept_docs == 0:
                raise EmptyCorpusError(self.report, where, rule_keys(self.cfg))

    def _passes(self, row: dict, kl_limit: float, min_score: float, mix: dict[str, Any], removed: list) -> bool:
        kl, score = row.get("token_kl"), row.get("quality_score")
        if kl is not None and kl > kl_limit:
            self.drop(row, "outlier:token_kl", f"token_kl={kl:.4g} > limit {kl_limit:.4g} (median "
                      f"{self.report.token_outliers['median_kl']} + token_outliers.max_mad="
                      f"{self.cfg.token_outliers.max_mad} x MAD)", None, removed)
        elif score is not None and score < min_score:
            self.drop(row, "quality:low_score", f"quality_score={score:.4g} < quality_model.min_score="
                      f"{min_score}", None, removed)
        elif not keep_sample(row["id"], mix["rates"].get(row["source"], 1.0), self.cfg.mix.seed):
            self.drop(row, "mix:downsampled", f"source {row['source']} sampled at rate "
                      f"{mix['rates'][row['source']]:.4g} by clean.mix.weights", None, removed)
        else:
            return True
        return False

    def _finish(self, mix: dict[str, Any], kept_by_source: dict[str, int], t0: float) -> None:
        """The report's corpus-wide figures: final mix shares, reasons by count, dedup rate, stage times."""
        report = self.report
        total = sum(kept_by_source.values()) or 1
        for g in mix["groups"].values():
            g["final_share"] = round(sum(kept_by_source.get(s, 0) for s in g["sources"]) / total, 4)
        report.mix = {**mix, "rates": {s: round(r, 6) for s, r in mix["rates"].items()}, "final_bytes": kept_by_source}
        report.reasons = dict(sorted(report.reasons.items(), key=lambda kv: (-kv[1]["docs"], kv[0])))
        dups = sum(report.reasons.get(r, {"docs": 0})["docs"] for r in ("dedup:url", "dedup:exact", "dedup:minhash"))
        report.dedup_rate = round(dups / self.quality_passed, 4) if self.quality_passed else 0.0
        for k, v in self.timer.seconds.items():
            report.stage_seconds[k] = round(report.stage_seconds.get(k, 0.0) + v, 4)
        report.seconds = round(max(time.perf_counter() - t0, 1e-9), 3)


def merge_shards(results: list[dict[str, Any]], out_path: str | Path, removed_path: str | Path,
                 cfg: CleanSettings, progress: Progress | None = None, work_dir: str | Path | None = None,
                 artifacts_dir: str | Path | None = None, fmap: Map | None = None, partitions: int = 1) -> CleanReport:
    """The corpus stage over the shards (in shard order): URL, exact and MinHash dedup; line dedup; token
    outliers; the quality classifier; mixing. Writes the kept corpus and every removed row atomically. The dedup
    passes run through ``fmap`` over ``partitions`` (``LocalMap()``: this process; kiln.clean.ray_run's RayMap:
    Ray tasks); the outputs do not depend on either."""
    t0 = time.perf_counter()
    say = progress or (lambda _m: None)
    results = sorted(results, key=lambda r: r["shard"]["index"])
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "executor"}  # the same report either way
    report = CleanReport(config=config, shards=len(results))
    for r in results:
        report.merge(r["report"], cfg.examples_per_reason)
    where = Path(results[0]["kept"]).parent if results else Path(".")
    t = time.perf_counter()
    decisions = dedup_decisions(results, cfg, fmap or LocalMap(), partitions)
    report.stage_seconds["dedup"] = report.stage_seconds.get("dedup", 0.0) + time.perf_counter() - t
    say(f"clean: dedup over {partitions} partition{'s' * (partitions > 1)} in {time.perf_counter() - t:.1f} s: "
        f"{len(decisions.url)} URL, {len(decisions.exact)} exact, {len(decisions.near)} near duplicates, "
        f"{len(decisions.over_lines)} over-repeated lines")
    tmp_root = Path(tempfile.mkdtemp(prefix="kiln-clean-", dir=work_dir))
    try:
        with atomic_path(removed_path) as rm_tmp, pq.ParquetWriter(rm_tmp, REMOVED_SCHEMA) as rm_w:
            passes = CorpusStage(cfg, report, rm_w, tmp_root, say, decisions)
            passes.copy_shard_removed([r["removed"] for r in results])
            path_a = passes.dedup([r["kept"] for r in results])
            model = passes.train_quality_model(artifacts_dir)
            path_b = passes.edit_and_score(path_a, model)
            kl_limit, min_score, mix = passes.limits(model)
            passes.write_kept(path_b, out_path, kl_limit, min_score, mix, t0, where)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return report


def write_clean_corpus(results: list[dict[str, Any]], folder: Path, cfg: CleanSettings, raw_path: str | Path,
                       progress: Progress | None = None, fmap: Map | None = None, partitions: int = 1) -> CleanReport:
    """``merge_shards`` into ``folder`` (corpus.parquet, removed.parquet, quality_model.pt) with report.json and
    removed_examples.md beside them; EmptyCorpusError names the raw corpus ``raw_path``."""
    try:
        report = merge_shards(results, folder / "corpus.parquet", folder / "removed.parquet", cfg,
                              progress=progress, artifacts_dir=folder, fmap=fmap, partitions=partitions)
    except EmptyCorpusError as e:
        raise EmptyCorpusError(e.report, Path(raw_path), rule_keys(cfg)) from None
    rep = report.to_dict()
    atomic_write_json(folder / "report.json", rep)
    (folder / "removed_examples.md").write_text(examples_markdown(rep["reasons"]), encoding="utf-8")
    return report
