"""Cleaning benchmark on the demo corpus: throughput per core with each stage's share of the time, MinHash
signature rate against datasketch's own batch update in the same run, and peak memory when the input doubles;
the scaling table (``--scaling``, the same as ``--sections scaling``): MB/s of the whole clean step, of its
per-document stage (a Ray Data pipeline on Ray) and of MinHash alone, in-process and on a local Ray cluster of 1 and 2
one-CPU nodes (1 GiB of object store each), in one run, on the demo corpus replicated ``--copies`` times (default 8,
about a minute in-process; copy 1 as is, copy 2 with the words of every line reversed, later copies with them
shuffled: no copy near-duplicates another), with the map's CPU seconds per node of each Ray run (both workers busy or
not); and (``--sections datatrove``) MinHash removals on the 66,000-document schelling_point corpus of
evals 3.0.1.post1 (owt_5, wikipedia_5 and mix, every row flattened into its 11 variants), with and without
datatrove's text normalisation, the dedup passes (kiln.clean.dedup) in-process and as Ray tasks.

Run: ``python bench/bench_clean.py [--cache-dir DIR] [--repeats 5] [--sections demo,scaling,datatrove]`` (demo: about
a minute on 2 cores; ``--scaling``: about 10 minutes on a quiet 2-core machine, ``--scaling --copies 1 --minhash-docs
12000`` about 3; the demo sources are fetched by name on the first run and cached in
$KILN_SOURCE_CACHE or ~/.cache/kiln/sources).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import kiln.clean.run, kiln.clean.config, kiln.clean.quality, torch, ftfy, resiliparse.extract.html2text  # imports first: baseline memory
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cpu0, t0 = time.process_time(), time.perf_counter()
report = kiln.clean.run.clean({raw!r}, {out!r} + "/c.parquet", {out!r} + "/r.parquet", kiln.clean.config.CleanConfig(),
                           work_dir={out!r})
cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"base_kib": base, "peak_kib": peak, "cpu_s": cpu, "wall_s": wall, "report": report.to_dict()}}))
"""


def demo_raw(cache_dir: str, out: Path) -> Path:
    from kiln import sources

    sources.collect(sources.load_manifest(ROOT / "conf/sources/demo.yaml"), cache_dir, out)
    return out


def doubled(raw: Path, out: Path) -> Path:
    """The corpus plus a second copy with the words of every line reversed: twice the input, no duplicates."""
    t = pq.read_table(raw)
    rows = t.to_pylist()
    for r in t.to_pylist():
        r["id"] = "copy2/" + r["id"]
        r["url"] = r["url"] + "?copy=2"
        r["text"] = "\n".join(" ".join(reversed(line.split(" "))) for line in r["text"].split("\n"))
        r["bytes"] = len(r["text"].encode())
        rows.append(r)
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), out, row_group_size=2000)
    return out


def run_clean(raw: Path, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    code = CHILD.format(root=str(ROOT), raw=str(raw), out=str(work))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def minhash_rates(texts: list[str], repeats: int) -> dict:
    """Best-of-``repeats`` docs/s: datasketch's batch update on byte shingles against the pipeline from text."""
    import operator

    from datasketch import MinHash

    from kiln.clean.dedup import MinHashConfig, _hashed_shingle_sets, shingles, signatures

    cfg = MinHashConfig()
    byte_sets = [shingles(t, cfg.ngram) for t in texts]
    hashed_sets = _hashed_shingle_sets(texts, cfg.ngram)
    best = {"datasketch_bytes": 1e9, "pipeline": 1e9, "datasketch_inside_pipeline": 1e9}
    for _ in range(repeats):  # interleaved, so a busy moment of the machine hits both
        t = time.perf_counter()
        MinHash.bulk(byte_sets, num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=zlib.crc32)
        best["datasketch_bytes"] = min(best["datasketch_bytes"], time.perf_counter() - t)
        t = time.perf_counter()
        signatures(texts, cfg)
        best["pipeline"] = min(best["pipeline"], time.perf_counter() - t)
        t = time.perf_counter()
        MinHash.bulk(hashed_sets, num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=operator.index)
        best["datasketch_inside_pipeline"] = min(best["datasketch_inside_pipeline"], time.perf_counter() - t)
    return {k: len(texts) / v for k, v in best.items()}


def demo_section(raw: Path, tmp: Path, args: argparse.Namespace) -> None:
    """The demo corpus: throughput, stage shares, MinHash signature rates, memory when the input doubles."""
    one = run_clean(raw, tmp / "one")
    rep = one["report"]
    mb = rep["input_bytes"] / 1e6
    print(f"demo corpus: {rep['input_docs']:,} documents, {mb:.2f} MB in, {rep['kept_docs']:,} kept "
          f"({rep['kept_bytes'] / 1e6:.2f} MB), {rep['shards']} shards")
    print(f"throughput: {mb / one['cpu_s']:.3f} MB/s per core (CPU {one['cpu_s']:.1f} s, one process), "
          f"{mb / one['wall_s']:.3f} MB/s wall ({one['wall_s']:.1f} s)")
    stages = rep["stage_seconds"]
    total = sum(stages.values())
    print("share of time per stage:")
    for name, s in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {s:7.2f} s  {s / total:6.1%}")

    texts = pq.read_table(tmp / "one" / "c.parquet", columns=["text"]).column("text").to_pylist()
    rates = minhash_rates(texts, args.repeats)
    print(f"MinHash signatures, {len(texts):,} clean documents, best of {args.repeats} (docs/s):")
    print(f"  datasketch MinHash.bulk on byte shingles (crc32)  {rates['datasketch_bytes']:9.0f}")
    print(f"  kiln.clean.dedup.signatures from text (shingling incl.) {rates['pipeline']:9.0f}  "
          f"ratio {rates['pipeline'] / rates['datasketch_bytes']:.2f} (target >= 0.80)")
    print(f"  of which datasketch's update on hashed shingles   {rates['datasketch_inside_pipeline']:9.0f}")

    two = run_clean(doubled(raw, tmp / "raw2.parquet"), tmp / "two")
    peak1, peak2 = one["peak_kib"] / 1024, two["peak_kib"] / 1024
    grow1, grow2 = (one["peak_kib"] - one["base_kib"]) / 1024, (two["peak_kib"] - two["base_kib"]) / 1024
    print(f"memory: peak RSS {peak1:.0f} MiB on {mb:.1f} MB, {peak2:.0f} MiB on "
          f"{two['report']['input_bytes'] / 1e6:.1f} MB: ratio {peak2 / peak1:.2f} (target <= 1.20); "
          f"above the imports: {grow1:.0f} -> {grow2:.0f} MiB")


# ---------------------------------------------------------------------------------------------- scaling on Ray


def replicated(raw: Path, out: Path, copies: int = 4, docs: int = 0) -> Path:
    """The corpus ``copies`` times: as is, words of every line reversed, then shuffled (seeded per copy); ``docs``:
    only the first that many documents of the corpus (a quick check of the bench itself)."""
    import random

    t = pq.read_table(raw)
    t = t.slice(0, docs) if docs else t
    rows = t.to_pylist()
    for k in range(2, copies + 1):
        rng = random.Random(k)
        for r in t.to_pylist():
            r["id"], r["url"] = f"copy{k}/{r['id']}", f"{r['url']}?copy={k}"
            lines = []
            for line in r["text"].split("\n"):
                words = line.split(" ")
                if k == 2:
                    words.reverse()
                else:
                    rng.shuffle(words)
                lines.append(" ".join(words))
            r["text"] = "\n".join(lines)
            r["bytes"] = len(r["text"].encode())
            rows.append(r)
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), out, row_group_size=2000)
    return out


OBJECT_STORE = 1 << 30  # per node: the input's blocks fit (the tests' 80 MiB store would spill them to disk)
MINHASH_ONLY = {"url_dedup": False, "exact_dedup": False, "line_dedup": {"enabled": False}}


def local_pool(raw: Path, shards: list[dict], work: Path, cfg, n: int) -> float:
    """Seconds for the per-document stage in a pool of ``n`` fresh local processes (each starts, imports and
    builds its cleaner inside the timing, as Ray's actors do): 1 against 2 is what this machine gives two workers
    now, measured beside the Ray runs."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from kiln.clean.run import _clean_shard_job

    t = time.perf_counter()
    with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
        list(pool.map(_clean_shard_job, [(raw, s, work / f"s{s['index']:05d}", cfg, None) for s in shards]))
    return time.perf_counter() - t


def measure_local(raw: Path, work: Path, blocks: list[dict]) -> dict:
    """In this process: the per-document stage (one process), then the corpus stage; MinHash alone over the
    Parquet ``blocks`` (signatures and the dedup passes, one partition, ``LocalMap``)."""
    from kiln.clean.config import CleanConfig
    from kiln.clean.corpus import merge_shards
    from kiln.clean.dedup import LocalMap, dedup_decisions
    from kiln.clean.run import clean_shards
    from kiln.clean.shard import plan_shards

    cfg = CleanConfig()
    t0 = time.perf_counter()
    shards = plan_shards(raw, cfg.shard_docs)
    results = clean_shards(raw, shards, lambda s: work / f"s{s['index']:05d}", cfg, lambda m: None)
    t1 = time.perf_counter()
    rep = merge_shards(results, work / "c.parquet", work / "r.parquet", cfg, work_dir=work)
    t2 = time.perf_counter()
    pool_s = {n: local_pool(raw, shards, work / f"pool{n}", cfg, n) for n in (1, 2)}
    t3 = time.perf_counter()
    near = len(dedup_decisions(blocks, CleanConfig.from_dict(MINHASH_ONLY), LocalMap(), 1, sign=True).near)
    t4 = time.perf_counter()
    return {"step_s": t2 - t0, "doc_s": t1 - t0, "pool_s": pool_s, "minhash_s": t4 - t3, "near": near,
            "kept": rep.kept_docs, "in_mb": rep.input_bytes / 1e6, "ids": pq.read_table(work / "c.parquet", columns=["id"]).column("id").to_pylist()}


def _warm() -> float:
    """Start this job's workers (one per CPU, each importing the clean step) before anything is timed."""
    import ray

    @ray.remote(num_cpus=1)
    def ready() -> None:
        import datasketch  # noqa: F401  (MinHash's library, loaded by the dedup tasks at their first signature)
        import kiln.clean.dedup  # noqa: F401
        import kiln.clean.shard  # noqa: F401

        time.sleep(1.0)  # so each CPU's worker takes one

    t = time.perf_counter()
    ray.get([ready.remote() for _ in range(int(ray.cluster_resources().get("CPU", 1)))])
    return time.perf_counter() - t


def measure_ray(raw: Path, work: Path, address: str, blocks: list[dict]) -> dict:
    """On the cluster: the same two stages, then MinHash alone over the Parquet ``blocks`` (signatures computed in
    the map tasks); each a fresh Ray job whose workers are started (``_warm``) before the timing."""
    import ray

    from kiln.clean.config import CleanConfig
    from kiln.clean.corpus import merge_shards
    from kiln.clean.dedup import dedup_decisions
    from kiln.clean.ray_run import RayMap, clean_shards_on_ray, connect, ray_partitions
    from kiln.clean.shard import plan_shards

    cfg, lines = CleanConfig(executor="ray"), []
    say = lines.append
    connect(address)
    try:
        warm = _warm()
        t0 = time.perf_counter()
        shards = plan_shards(raw, cfg.shard_docs)
        mine = clean_shards_on_ray(raw, shards, lambda s: work / f"s{s['index']:05d}", cfg, say)
        t1 = time.perf_counter()
        rep = merge_shards(mine, work / "c.parquet", work / "r.parquet", cfg, say, work_dir=work,
                           fmap=RayMap(say), partitions=ray_partitions())
        t2 = time.perf_counter()
    finally:
        ray.shutdown()
    connect(address)
    try:
        warm += _warm()
        t3 = time.perf_counter()
        near = len(dedup_decisions(blocks, CleanConfig.from_dict(MINHASH_ONLY), RayMap(say), ray_partitions(),
                                   sign=True).near)
        t4 = time.perf_counter()
    finally:
        ray.shutdown()
    done = [m.split("done: ", 1)[1] for m in lines if "per-document stage done: " in m]
    return {"step_s": t2 - t0, "doc_s": t1 - t0, "minhash_s": t4 - t3, "near": near, "kept": rep.kept_docs,
            "warm_s": warm, "profile": done[0] if done else "", "ids": pq.read_table(work / "c.parquet", columns=["id"]).column("id").to_pylist()}


def scaling_section(raw: Path, tmp: Path, cache_dir: str, copies: int = 8, minhash_docs: int = 0, docs: int = 0):
    """The scaling table; returns the 2-node cluster (still running) for the next section."""
    sys.path.insert(0, str(ROOT / "tests"))
    from ray_cluster import RayCluster

    big = replicated(raw, tmp / "raw4.parquet", copies, docs)
    blocks, n_mh, text_mb = schelling_blocks(cache_dir, tmp / "schelling", limit=minhash_docs)
    runs = {}
    (tmp / "local").mkdir()
    runs["in-process"] = local = measure_local(big, tmp / "local", blocks)
    cluster = RayCluster(workers=0, object_store=OBJECT_STORE, dashboard=False).start()  # time the executor alone
    try:
        for n in (1, 2):
            if n == 2:
                cluster.add_worker()
            (tmp / f"ray{n}").mkdir()
            runs[f"Ray, {n} worker{'s' * (n > 1)}"] = measure_ray(big, tmp / f"ray{n}", cluster.address, blocks)
    except BaseException:
        cluster.stop()
        raise
    mb = local["in_mb"]
    print(f"scaling: clean step on the demo corpus x{copies} (copy 2 words reversed per line, later copies "
          f"shuffled), "
          f"{mb:.1f} MB raw, {len(local['ids']):,} kept; MinHash alone (signatures + dedup) on the {n_mh:,}-document "
          f"schelling_point corpus, {text_mb:.1f} MB; Ray workers started before each timing")
    print(f"  {'executor':16s} {'clean step MB/s':>15s} {'per-document MB/s':>17s} {'MinHash MB/s':>12s} "
          f"{'near dups':>9s} {'kept ids = in-process':>21s} {'worker start s':>14s}")
    for name, r in runs.items():
        print(f"  {name:16s} {mb / r['step_s']:15.3f} {mb / r['doc_s']:17.3f} {text_mb / r['minhash_s']:12.3f} "
              f"{r['near']:9,d} {str(r['ids'] == local['ids']):>21s} {r.get('warm_s', 0.0):14.1f}")
    one, two = runs["Ray, 1 worker"], runs["Ray, 2 workers"]
    print(f"  per-document stage, 2 workers / 1 worker: {one['doc_s'] / two['doc_s']:.2f}x (target >= 1.7); the same "
          f"stage in a pool of 2 fresh local processes / 1: {local['pool_s'][1] / local['pool_s'][2]:.2f}x (what this "
          f"machine gives two workers now: {local['pool_s'][2]:.1f} s against {local['pool_s'][1]:.1f} s); "
          f"MinHash on 1 Ray worker: {one['minhash_s'] / local['minhash_s']:.2f}x the in-process time "
          f"(target <= 1.5)")
    for name, r in runs.items():
        if r.get("profile"):
            print(f"  {name}: {r['profile']}")
    return cluster


def schelling_blocks(cache_dir: str, folder: Path, block: int = 6000, limit: int = 0) -> tuple[list[dict], int, float]:
    """The 66,000 documents of schelling_point (owt_5, wikipedia_5, mix; fields "0".."10" of every row) as
    Parquet blocks of ``block`` rows in file, row, field order: (fake shard results, documents, MB)."""
    base = next(Path(cache_dir).glob("evals-3.0.1.post1-*")) / "evals/registry/data/schelling_point"
    rows = []
    for name in ("owt_5", "wikipedia_5", "mix"):
        for i, line in enumerate((base / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()):
            rec = json.loads(line)
            rows += [{"id": f"{name}/{i}/{k}", "url": "", "text": rec[str(k)]} for k in range(11)]
    rows = rows[:limit] if limit else rows
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for j in range(0, len(rows), block):
        path = folder / f"b{j // block:03d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[j:j + block]), path)
        n = len(rows[j:j + block])
        results.append({"shard": {"index": j // block}, "kept": str(path), "report": {"input_docs": n, "dropped_docs": 0}})
    return results, len(rows), sum(len(r["text"].encode()) for r in rows) / 1e6


def datatrove_section(cache_dir: str, tmp: Path, cluster) -> None:
    """MinHash removals on the schelling_point corpus (FineWeb's 5-grams, 14 x 8), without and with datatrove's
    normalisation: the dedup passes in this process (``LocalMap``), and as tasks on the 2-node cluster when there
    is one (the caller stops it); the kept set must be the same."""
    import ray

    from kiln.clean.config import CleanConfig
    from kiln.clean.dedup import LocalMap, dedup_decisions
    from kiln.clean.ray_run import RayMap, connect

    results, n, mb = schelling_blocks(cache_dir, tmp / "schelling-dt")
    print(f"schelling_point corpus (evals 3.0.1.post1, owt_5 + wikipedia_5 + mix, 11 variants a row): "
          f"{n:,} documents, {mb:.1f} MB")
    for norm in ("none", "datatrove"):
        cfg = CleanConfig.from_dict({**MINHASH_ONLY, "minhash": {"normalise": norm}})
        t = time.perf_counter()
        local = dedup_decisions(results, cfg, LocalMap(), 1, sign=True).near
        dt = time.perf_counter() - t
        line = f"  normalise={norm:9s} in-process: {len(local):,} removed ({len(local) / n:.1%}), {mb / dt:.2f} MB/s"
        if cluster is not None:
            connect(cluster.address)
            try:
                t = time.perf_counter()
                sharded = dedup_decisions(results, cfg, RayMap(lambda m: None), 4, sign=True).near
                line += (f"; Ray, 2 workers: {len(sharded):,} removed (same: {sharded == local}), "
                         f"{mb / (time.perf_counter() - t):.2f} MB/s")
            finally:
                ray.shutdown()
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=os.environ.get("KILN_SOURCE_CACHE") or
                        os.path.expanduser("~/.cache/kiln/sources"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="demo", help="comma-separated: demo, scaling, datatrove")
    parser.add_argument("--scaling", action="store_true", help="the scaling table alone (--sections scaling)")
    parser.add_argument("--copies", type=int, default=8, help="scaling: copies of the demo corpus in the input")
    parser.add_argument("--minhash-docs", type=int, default=0, help="scaling: MinHash alone on the first N "
                        "schelling_point documents (0: all 66,000)")
    parser.add_argument("--docs", type=int, default=0, help="scaling: only the first N demo documents (a quick "
                        "check of the bench, not a measurement)")
    args = parser.parse_args()
    sections = {"scaling"} if args.scaling else set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="kiln-bench-clean-") as tmp:
        tmp = Path(tmp)
        raw = demo_raw(args.cache_dir, tmp / "raw.parquet")
        if "demo" in sections:
            demo_section(raw, tmp, args)
        cluster = None
        try:
            if "scaling" in sections:
                cluster = scaling_section(raw, tmp, args.cache_dir, args.copies, args.minhash_docs, args.docs)
            if "datatrove" in sections:
                datatrove_section(args.cache_dir, tmp, cluster)
        finally:
            if cluster is not None:
                cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
