"""The clean step on a Ray cluster (``clean.executor: ray``): the per-document stage as one Ray task per shard
(``kiln.clean.shard.clean_shard`` itself), the corpus stage's dedup as the sharded passes of
``kiln.clean.ray_dedup`` (Ray tasks, hash-partitioned), then the corpus stage's later passes in this process.

Start a cluster with ``ray start --head --port=6379 --num-cpus=2``, then
``python -c "from kiln.clean.ray_run import clean_on_ray; print(clean_on_ray('raw.parquet', 'c.parquet', 'r.parquet', address='127.0.0.1:6379').kept_docs)"``.
Shard outputs go to ``work_dir``, which every node must see (one machine, or a shared file system).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.clean.config import CleanConfig, CleanSettings, rule_keys
from kiln.clean.corpus import merge_shards, write_clean_corpus
from kiln.clean.ray_dedup import dedup_decisions, decided_stage
from kiln.clean.report import CleanReport, EmptyCorpusError
from kiln.clean.shard import Progress, clean_shard, open_raw, plan_shards
from kiln.filters.base import Filter

PROJECT = Path(__file__).resolve().parent.parent.parent  # put on the workers' PYTHONPATH
DEFAULT_ADDRESS = "127.0.0.1:6379"


class RayClusterError(RuntimeError):
    """No cluster at the address, or a task that still failed after Ray's retries."""


@dataclasses.dataclass
class RayInfo:
    address: str
    job_id: str
    dashboard_url: str  # empty when the cluster runs no dashboard
    nodes: int
    cpus: float


def _no_cluster(address: str, why: object) -> RayClusterError:
    port = address.rsplit(":", 1)[-1] if ":" in address else "6379"
    return RayClusterError(
        f"clean.executor is ray, but no Ray cluster answers at {address!r} ({why}). Start one on this machine with "
        f"`ray start --head --port={port}` (and `ray start --address=<head>:{port}` on each other node), point "
        f"the ray resource's address at a running cluster, or set clean.executor: local.")


def connect(address: str = DEFAULT_ADDRESS) -> RayInfo:
    """Connect this process to the cluster at ``address`` (host:port of its head, or "auto"); RayClusterError
    naming the address and how to start one when nothing answers there."""
    import ray

    if ":" in address and not address.startswith("ray://"):
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise _no_cluster(address, e) from None
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        ctx = ray.init(address=address, namespace="kiln", log_to_driver=False, ignore_reinit_error=True,
                       runtime_env={"env_vars": env})
    except (ConnectionError, RuntimeError) as e:
        raise _no_cluster(address, e) from None
    res = ray.cluster_resources()
    url = getattr(ctx, "dashboard_url", "") or ""
    return RayInfo(address, ray.get_runtime_context().get_job_id(), f"http://{url}" if url else "",
                   sum(1 for n in ray.nodes() if n.get("Alive")), res.get("CPU", 0.0))


def _call(fn: Callable, shape: list[int], *flat: Any) -> Any:
    """Runs in a task: rebuild ``fn``'s arguments (-1: one argument; n: a list of the next n values) and call it."""
    args, i = [], 0
    for n in shape:
        args.append(flat[i] if n < 0 else list(flat[i:i + n]))
        i += 1 if n < 0 else n
    return fn(*args)


class RayMap:
    """``kiln.clean.ray_dedup.Map`` on the cluster: one task per job (retried ``max_retries`` times when its worker
    dies), list arguments passed as separate objects so results of earlier tasks stay in the object store;
    progress and failures go to ``say``. Results with one return come back as values, others as object refs."""

    def __init__(self, say: Progress, max_retries: int = 3) -> None:
        self.say, self.max_retries = say, max_retries

    def __call__(self, fn: Callable, jobs: list[tuple], num_returns: int = 1, label: str = "") -> list[Any]:
        import ray

        task = ray.remote(num_cpus=1, max_retries=self.max_retries, retry_exceptions=False,
                          num_returns=num_returns)(_call).options(name=f"kiln.clean:{label or fn.__name__}")
        shared: dict[int, Any] = {}
        refs = []
        for job in jobs:
            flat, shape = [], []
            for a in job:
                if isinstance(a, list):
                    flat.extend(a)
                    shape.append(len(a))
                else:  # one copy in the object store per distinct argument (the config, a set of positions)
                    flat.append(a if isinstance(a, (int, str, ray.ObjectRef)) else
                                shared.setdefault(id(a), ray.put(a)))
                    shape.append(-1)
            refs.append(task.remote(fn, shape, *flat))
        if num_returns > 1:
            list(self.wait([r[0] for r in refs], label))
            return refs
        out: dict[int, Any] = dict(self.wait(refs, label))
        return [out[i] for i in range(len(refs))]

    def wait(self, refs: list, label: str) -> Iterator[tuple[int, Any]]:
        """(job index, result) as tasks finish; RayClusterError naming the job when one failed for good."""
        import ray

        index = {r: i for i, r in enumerate(refs)}
        pending, t0 = list(refs), time.perf_counter()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=30.0)
            if not done:
                self.say(f"clean on ray: {label}: {len(refs) - len(pending)} of {len(refs)} tasks done, "
                         f"{time.perf_counter() - t0:.0f} s")
                continue
            try:
                value = ray.get(done[0])
            except ray.exceptions.RayError as e:
                for r in pending:
                    ray.cancel(r, force=True)
                raise RayClusterError(
                    f"clean on ray: {label} task {index[done[0]]} of {len(refs)} failed after Ray's "
                    f"{self.max_retries} retries ({type(e).__name__}: {str(e).splitlines()[0][:300]}); nothing "
                    f"was written to the outputs. Rerun (finished shards are reused), or set clean.executor: local."
                ) from None
            yield index[done[0]], value


def _shard_task(in_path: str, shard: dict[str, Any], out_dir: str, cfg: CleanSettings,
                filters: list[Filter] | None) -> dict[str, Any]:
    """``clean_shard`` in a task; counts its attempts in ``out_dir/.attempts`` so retries can be reported."""
    marker = Path(out_dir) / ".attempts"
    marker.parent.mkdir(parents=True, exist_ok=True)
    attempt = int(marker.read_text() or 0) + 1 if marker.is_file() else 1
    marker.write_text(str(attempt))
    return {**clean_shard(in_path, shard, out_dir, cfg, filters), "attempt": attempt}


def clean_shards_on_ray(in_path: str | Path, shards: list[dict[str, Any]], out_dir: Callable[[dict], Path],
                        cfg: CleanSettings, say: Progress, filters: list[Filter] | None = None,
                        max_retries: int = 3) -> list[dict[str, Any]]:
    """The per-document stage, one task per shard, into ``out_dir(shard)``; a progress line as each shard
    finishes, and one for each shard that a dead worker made Ray run again."""
    import ray

    rmap, t0 = RayMap(say, max_retries), time.perf_counter()
    task = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(_shard_task)
    cfg_ref = ray.put(cfg)
    refs = [task.options(name=f"kiln.clean:shard {s['index']}").remote(str(in_path), s, str(out_dir(s)), cfg_ref,
                                                                        filters) for s in shards]
    done: list[dict[str, Any]] = []
    docs = passed = nbytes = 0
    for _, r in rmap.wait(refs, "per-document stage"):
        rep, shard = r["report"], r["shard"]
        if r["attempt"] > 1:
            say(f"clean on ray: shard {shard['index']} ({shard['source']}) finished on attempt {r['attempt']}: "
                f"Ray reran it after its worker died")
        done.append(r)
        docs, passed = docs + rep["input_docs"], passed + rep["input_docs"] - rep["dropped_docs"]
        nbytes += rep["input_bytes"]
        dt = max(time.perf_counter() - t0, 1e-9)
        say(f"clean on ray: {len(done)} of {len(shards)} shards, {docs} docs read, {passed} passed the document "
            f"rules, {docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s")
    return sorted(done, key=lambda r: r["shard"]["index"])


def corpus_stage_on_ray(results: list[dict[str, Any]], cfg: CleanSettings, say: Progress, max_retries: int = 3,
                        partitions: int | None = None) -> type:
    """The sharded dedup passes on the cluster; returns the corpus stage class that applies their decisions."""
    import ray

    parts = partitions or max(2, int(ray.cluster_resources().get("CPU", 1)) * 2)
    t0 = time.perf_counter()
    decisions = dedup_decisions(results, cfg, RayMap(say, max_retries), parts)
    say(f"clean on ray: sharded dedup over {parts} partitions in {time.perf_counter() - t0:.1f} s: "
        f"{len(decisions.url)} URL, {len(decisions.exact)} exact, {len(decisions.near)} near duplicates, "
        f"{len(decisions.over_lines)} over-repeated lines")
    return decided_stage(decisions)


def clean_on_ray(in_path: str | Path, out_path: str | Path, removed_path: str | Path,
                 cfg: CleanSettings | None = None, address: str = DEFAULT_ADDRESS, progress: Progress | None = None,
                 filters: list[Filter] | None = None, work_dir: str | Path | None = None,
                 artifacts_dir: str | Path | None = None, max_retries: int = 3,
                 partitions: int | None = None) -> CleanReport:
    """``kiln.clean.run.clean`` on the cluster at ``address``: the same outputs and report (but its timings)."""
    import ray

    in_path, cfg, say = Path(in_path), cfg or CleanConfig(), progress or (lambda _m: None)
    t0 = time.perf_counter()
    info = connect(address)
    say(f"clean on ray: job {info.job_id} on {info.address}, {info.nodes} nodes, {info.cpus:g} CPUs"
        + (f", dashboard {info.dashboard_url}" if info.dashboard_url else ""))
    shards = plan_shards(in_path, cfg.shard_docs)
    tmp = Path(tempfile.mkdtemp(prefix="kiln-shards-", dir=work_dir))
    try:
        if not shards:
            with open_raw(in_path):
                pass
            raise EmptyCorpusError(CleanReport(config=dataclasses.asdict(cfg)), in_path, rule_keys(cfg))
        results = clean_shards_on_ray(in_path, shards, lambda s: tmp / f"shard-{s['index']:05d}", cfg, say,
                                      filters, max_retries)
        stage = corpus_stage_on_ray(results, cfg, say, max_retries, partitions)
        report = merge_shards(results, out_path, removed_path, cfg, progress, work_dir, artifacts_dir, stage=stage)
    except EmptyCorpusError as e:
        raise EmptyCorpusError(e.report, in_path, rule_keys(cfg)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        ray.shutdown()
    dt = max(time.perf_counter() - t0, 1e-9)
    report.seconds, report.docs_per_s = round(dt, 3), round(report.input_docs / dt, 1)
    report.mb_per_s = round(report.input_bytes / dt / 1e6, 3)
    say(f"clean on ray: done, {report.input_docs} docs read, {report.kept_docs} kept, {report.mb_per_s:.2f} MB/s")
    return report


def write_clean_corpus_on_ray(results: list[dict[str, Any]], folder: Path, cfg: CleanSettings,
                              raw_path: str | Path, say: Progress, max_retries: int = 3,
                              partitions: int | None = None) -> CleanReport:
    """``kiln.clean.corpus.write_clean_corpus`` with pass A's dedup on the connected cluster."""
    stage = corpus_stage_on_ray(results, cfg, say, max_retries, partitions)
    return write_clean_corpus(results, folder, cfg, raw_path, say, stage=stage)
