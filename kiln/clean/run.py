"""The clean step's local executor: ``clean_shards`` runs the per-document stage over the shards in this process or
in ``cfg.workers`` processes (the clean_corpus asset calls it); ``clean()`` is the whole step in one call, for
scripts, tests and benchmarks: ``clean_shards``, then the corpus stage. kiln.clean.ray_run is the Ray executor.

``python -c "from kiln.clean.run import clean; print(clean('raw.parquet', 'clean.parquet', 'removed.parquet').kept_docs)"``
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterable

from kiln.clean.config import CleanConfig, CleanSettings, rule_keys
from kiln.clean.corpus import merge_shards
from kiln.clean.report import CleanReport, EmptyCorpusError
from kiln.clean.shard import Progress, clean_shard, open_raw, plan_shards
from kiln.filters.base import Filter


def _clean_shard_job(args: tuple) -> dict[str, Any]:
    return clean_shard(*args)


def _progress(results: Iterable[dict[str, Any]], cfg: CleanSettings, say: Progress,
              t0: float) -> list[dict[str, Any]]:
    """The shard results as they come, with a progress message about every ``cfg.progress_every`` documents."""
    done, done_docs, next_progress = [], 0, cfg.progress_every
    for r in results:
        done.append(r)
        done_docs += r["report"]["input_docs"]
        if done_docs >= next_progress:
            while next_progress <= done_docs:
                next_progress += cfg.progress_every
            dt = max(time.perf_counter() - t0, 1e-9)
            nbytes = sum(x["report"]["input_bytes"] for x in done)
            say(f"clean: {done_docs} docs read, {done_docs - sum(x['report']['dropped_docs'] for x in done)} "
                f"passed the document rules, {done_docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s")
    return done


def clean_shards(in_path: str | Path, shards: list[dict[str, Any]], out_dir: Callable[[dict], Path],
                 cfg: CleanSettings, say: Progress, filters: list[Filter] | None = None) -> list[dict[str, Any]]:
    """The per-document stage over ``shards``, each written into ``out_dir(shard)`` (reused when complete there, not
    with ``filters``): in ``cfg.workers`` spawned processes when more than one shard is to run and ``filters`` is
    None (custom filters need not pickle), else in this process. The results in shard order, each with ``cached``
    (reused); progress lines about every ``cfg.progress_every`` documents and one at the end."""
    t0 = time.perf_counter()
    cached = {s["index"] for s in shards if filters is None and (Path(out_dir(s)) / "report.json").is_file()}
    jobs = [(in_path, s, out_dir(s), cfg, filters) for s in shards]
    if filters is None and cfg.workers > 1 and len(jobs) - len(cached) > 1:
        with ProcessPoolExecutor(min(cfg.workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            results = _progress(pool.map(_clean_shard_job, jobs), cfg, say, t0)
    else:
        results = _progress((clean_shard(*job) for job in jobs), cfg, say, t0)
    docs = sum(r["report"]["input_docs"] for r in results)
    passed = docs - sum(r["report"]["dropped_docs"] for r in results)
    dt = max(time.perf_counter() - t0, 1e-9)
    say(f"clean: per-document stage done: {len(results)} shards ({len(cached)} reused), {docs} docs, {passed} "
        f"passed the document rules, {docs / dt:.0f} docs/s")
    return [{**r, "cached": r["shard"]["index"] in cached} for r in results]


def clean(
    in_path: str | Path,
    out_path: str | Path,
    removed_path: str | Path,
    cfg: CleanSettings | None = None,
    progress: Progress | None = None,
    filters: list[Filter] | None = None,
    work_dir: str | Path | None = None,
    artifacts_dir: str | Path | None = None,
    ray_address: str = "127.0.0.1:6379",
) -> CleanReport:
    """Clean ``in_path`` in one call: every shard through ``clean_shards`` (``cfg.workers`` processes), then
    ``merge_shards``. Writes kept docs (input order, clean text, signal columns) to ``out_path`` and dropped ones
    (id, source, url, reason, bytes, detail, duplicate_of) to ``removed_path``, both atomically. Raises
    EmptyCorpusError, writing neither file, when no document is kept. ``filters`` replaces the document rules.
    With ``cfg.executor == "ray"`` both stages run on the Ray cluster at ``ray_address`` (kiln.clean.ray_run).
    """
    cfg = cfg or CleanConfig()
    if cfg.executor == "ray":  # the raw corpus may be an fsspec URL there
        from kiln.clean.ray_run import clean_on_ray

        return clean_on_ray(in_path, out_path, removed_path, cfg, ray_address, progress, filters, work_dir,
                            artifacts_dir)
    in_path = Path(in_path)
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    shards = plan_shards(in_path, cfg.shard_docs)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-shards-", dir=work_dir))
    try:
        results = clean_shards(in_path, shards, lambda s: tmp / f"shard-{s['index']:05d}", cfg, say, filters)
        if not shards:
            with open_raw(in_path):
                pass
        if not results:
            raise EmptyCorpusError(CleanReport(config=dataclasses.asdict(cfg)), in_path, rule_keys(cfg))
        report = merge_shards(results, out_path, removed_path, cfg, progress, work_dir, artifacts_dir)
    except EmptyCorpusError as e:
        raise EmptyCorpusError(e.report, in_path, rule_keys(cfg)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dt = max(time.perf_counter() - t0, 1e-9)
    report.seconds = round(dt, 3)
    report.docs_per_s = round(report.input_docs / dt, 1)
    report.mb_per_s = round(report.input_bytes / dt / 1e6, 3)
    say(f"clean: done, {report.input_docs} docs read, {report.kept_docs} kept, "
        f"{report.docs_per_s:.0f} docs/s, {report.mb_per_s:.2f} MB/s")
    return report
