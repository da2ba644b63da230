"""The clean step on a Ray cluster (``clean.executor: ray``): the per-document stage as a Ray Data pipeline
(``kiln.clean.ray_data``: the raw Parquet, a path or an fsspec URL, read with ``ray.data.read_parquet``, the stage
mapped over Arrow blocks with ``map_batches``), the corpus stage's dedup passes (``kiln.clean.dedup``, the local
executor's code) as Ray tasks through ``RayMap``, then the corpus stage's later passes in this process.

Start a cluster with ``ray start --head --port=6379 --num-cpus=2``, then
``python -c "from kiln.clean.ray_run import clean_on_ray; print(clean_on_ray('raw.parquet', 'c.parquet', 'r.parquet', address='127.0.0.1:6379').kept_docs)"``.
Shard outputs go to ``work_dir``, which every node must see (one machine, or a shared file system)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from kiln.clean.config import CleanConfig, CleanSettings, rule_keys
from kiln.clean.corpus import merge_shards, write_clean_corpus
from kiln.clean.ray_data import DocStage, PIECES, Plan, assemble_shard, pieces_of, raw_source, shard_starts
from kiln.clean.report import CleanReport, EmptyCorpusError
from kiln.clean.schema import INPUT_COLUMNS
from kiln.clean.shard import Progress, open_raw, plan_shards
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
    """``kiln.clean.dedup.Map`` on the cluster: one task per job (retried ``max_retries`` times when its worker
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


def _block_rows(total: int, cpus: int, cfg: CleanSettings) -> int:
    """Rows per Ray Data block: at most ``cfg.batch_size``, and small enough that every CPU gets about four
    blocks, so no worker waits while another runs the last big one."""
    return max(1, min(cfg.batch_size, -(-total // (4 * max(cpus, 1)))))


def _doc_dataset(in_path: str | Path, plan: Plan, cpus: int, max_retries: int, total: int) -> Any:
    """The raw Parquet as a Ray Data Dataset of Arrow blocks, the per-document stage mapped over it on a pool of
    one actor per CPU (each builds its cleaner once; blocks queue at the actors, so no CPU waits for the next task
    to be scheduled, which with one task per block left a quarter to a half of two CPUs idle).

    Read with Ray Data's first Parquet datasource: the second (Ray 2.60's default) lists files through a pool of
    32 footer-reading actors, which on a small cluster costs 7-14 s before the first row, and reads a file as one
    block that must then be repartitioned by another operator competing for the same CPUs. The first reader
    splits its output into ``override_num_blocks`` blocks itself; its task takes no CPU slot (reading is about 2%
    of the work), so every slot runs the per-document stage. A dead actor is restarted and its block retried up to
    ``max_retries`` times.
    """
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # progress goes to ``say`` (the Dagster log)
    ctx.use_datasource_v2 = False
    path, fs = raw_source(in_path)
    blocks = max(1, -(-total // _block_rows(total, cpus, plan.cfg)))
    with warnings.catch_warnings():  # deprecated in Ray 2.60 without a named replacement (ray is pinned)
        warnings.filterwarnings("ignore", message=".*(columns=. on .read_parquet|ray_remote_args. is deprecated)")
        ds = ray.data.read_parquet(path, filesystem=fs, columns=list(INPUT_COLUMNS), include_paths=True,
                                   include_row_hash=True, file_extensions=None, override_num_blocks=blocks, num_cpus=0)
        # max_restarts / max_task_retries: Ray Data's actors are otherwise restarted and retried forever
        return ds.map_batches(DocStage, batch_size=None, batch_format="pyarrow", fn_constructor_kwargs={"plan": plan},
                              compute=ray.data.ActorPoolStrategy(size=max(cpus, 1)), num_cpus=1,
                              max_restarts=max_retries, max_task_retries=max_retries)


def _failed_pieces(plan: Plan, max_retries: int) -> list[int]:
    """Shards whose piece was started more than ``max_retries`` + 1 times and never written (its worker died)."""
    out = set()
    for m in (Path(plan.work) / PIECES).glob("*.attempts"):
        if int(m.read_text() or 0) > max_retries and not m.with_suffix(".kept.parquet").is_file():
            out.add(int(m.name[1:6]))
    return sorted(out)


class ShardWriter:
    """A long-lived writer (a Ray actor asking for no CPU): joins a shard's pieces into its outputs."""

    def write(self, *args: Any) -> dict[str, Any]:
        return assemble_shard(*args)


class ShardWriters:
    """The shards' outputs written while the map still runs: each shard goes to a writer as soon as the pipeline
    has returned all its rows (``assemble_shard`` joins its pieces).

    Writers are actors that ask for no CPU, one per 8 CPUs: the map's actor pool holds every CPU slot until it
    ends, and writing is about 4% of the stage's work. Tasks would do the same work, but an idle task worker past
    a node's worker limit is stopped after a second, so nearly every shard would pay a fresh worker's start (2-4 s
    on a small node). A dead writer is restarted and its shard retried ``max_retries`` times; one that fails every
    try raises RayClusterError naming its shard.
    """

    def __init__(self, label: str, cpus: int, max_retries: int) -> None:
        import ray

        self.cls = ray.remote(num_cpus=0, max_restarts=max_retries, max_task_retries=max_retries)(ShardWriter)
        self.count = max(1, cpus // 8)
        self.writers: list[Any] = []  # started with the first finished shard, not beside the map's actor pool
        self.label, self.max_retries = label, max_retries
        self.waiting: list[tuple[int, tuple]] = []
        self.running: dict[Any, tuple[int, Any]] = {}  # ref -> (shard, writer)
        self.results: dict[int, dict[str, Any]] = {}

    def put(self, index: int, *args: Any) -> None:
        if not self.writers:
            self.writers = [self.cls.remote() for _ in range(self.count)]
        self.waiting.append((index, args))
        self.poll()

    def poll(self, block: bool = False) -> None:
        """Collect finished writes (wait for one when ``block``), then give waiting shards to free writers (two
        queued per writer, so none waits for the next)."""
        import ray

        if self.running:
            refs = list(self.running)
            done, _ = ray.wait(refs, num_returns=1 if block else len(refs), timeout=None if block else 0)
            for ref in done:
                index, _ = self.running.pop(ref)
                try:
                    self.results[index] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    self.settle()
                    raise RayClusterError(
                        f"clean on ray: {self.label} for shard {index} failed after Ray's {self.max_retries} "
                        f"retries ({type(e).__name__}: {str(e).splitlines()[0][:300]}); the corpus was not written. "
                        f"Rerun (finished shards are reused), or set clean.executor: local.") from None
        while self.waiting and self.writers:
            load = {id(w): 0 for w in self.writers}
            for _, w in self.running.values():
                load[id(w)] += 1
            writer = min(self.writers, key=lambda w: load[id(w)])
            if load[id(writer)] >= 2:
                break
            index, args = self.waiting.pop(0)
            self.running[writer.write.remote(*args)] = (index, writer)

    def finish(self) -> dict[int, dict[str, Any]]:
        while self.waiting or self.running:
            self.poll(block=True)
        self.close()
        return self.results

    def settle(self) -> None:
        """After a failure: start nothing more and let the running writes end (each is atomic), so none is left
        reading pieces that are about to be removed."""
        import ray

        self.waiting.clear()
        if self.running:
            ray.wait(list(self.running), num_returns=len(self.running), timeout=120)
        self.close()

    def close(self) -> None:
        import ray

        for w in self.writers:
            ray.kill(w)
        self.writers = []


def _run_doc_stage(ds: Any, plan: Plan, say: Progress, total: int, max_retries: int,
                   on_complete: Callable[[int, list], None]) -> dict[int, list]:
    """The pieces per shard as the pipeline finishes them, ``on_complete(shard, pieces)`` as soon as a shard has
    all its rows; a line for each piece a dead worker made Ray rerun; RayClusterError naming the shard when one
    failed for good."""
    import ray

    by_shard: dict[int, list[dict[str, Any]]] = {}
    try:
        for p in pieces_of(ds, say, total):
            if p["attempt"] > 1:
                s = plan.shards[p["shard"]]
                say(f"clean on ray: shard {s['index']} ({s['source']}) finished on attempt {p['attempt']}: Ray "
                    f"reran its rows {p['first']}.. after their worker died")
            pieces = by_shard.setdefault(p["shard"], [])
            pieces.append(p)
            if sum(q["docs"] for q in pieces) == plan.shards[p["shard"]]["docs"] and \
                    len({q["first"] for q in pieces}) == len(pieces):
                on_complete(p["shard"], pieces)
    except (ray.exceptions.RayError, RuntimeError) as e:
        failed = _failed_pieces(plan, max_retries)
        if not failed:
            raise
        first = str(e).strip().splitlines()[0][:300]
        raise RayClusterError(
            f"clean on ray: per-document stage task {failed[0]} of {len(plan.shards)} failed after Ray's "
            f"{max_retries} retries (shard {failed[0]}: {plan.shards[failed[0]]['source']}; {type(e).__name__}: "
            f"{first}); the corpus was not written. Rerun (finished shards are reused), or set "
            f"clean.executor: local.") from None
    return by_shard


def _check_complete(todo: list[dict[str, Any]], by_shard: dict[int, list]) -> None:
    """Every row of every shard came back from the pipeline exactly once; never a silent partial corpus."""
    for s in todo:
        firsts = [p["first"] for p in by_shard.get(s["index"], [])]
        got = sum(p["docs"] for p in by_shard.get(s["index"], []))
        if got != s["docs"] or len(set(firsts)) != len(firsts):
            raise RayClusterError(
                f"clean on ray: shard {s['index']} ({s['source']}): the per-document stage returned {got} rows in "
                f"{len(firsts)} pieces for its {s['docs']} rows; the corpus was not written. Rerun, or set "
                f"clean.executor: local.")


def clean_shards_on_ray(in_path: str | Path, shards: list[dict[str, Any]], out_dir: Callable[[dict], Path],
                        cfg: CleanSettings, say: Progress, filters: list[Filter] | None = None,
                        max_retries: int = 3, work_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The per-document stage on the cluster as a Ray Data pipeline (kiln.clean.ray_data), each shard's outputs
    written into ``out_dir(shard)`` by a writer actor (``ShardWriters``) as soon as the pipeline has returned the
    shard's rows; shards already there are reused (not with ``filters``). The results in shard order, each with
    ``cached`` (reused), as ``kiln.clean.run.clean_shards`` returns them. Progress lines as blocks finish, and one
    for each rerun after a dead worker."""
    import ray

    cache = filters is None
    done = {s["index"]: {**json.loads((out_dir(s) / "report.json").read_text()), "cached": True} for s in shards
            if cache and (out_dir(s) / "report.json").is_file()}
    todo = [s for s in shards if s["index"] not in done]
    if not todo:
        return [done[s["index"]] for s in shards]
    cpus = int(ray.cluster_resources().get("CPU", 1))
    work = Path(tempfile.mkdtemp(prefix="kiln-ray-", dir=work_dir))
    try:
        (work / PIECES).mkdir()
        with open_raw(in_path) as pf:
            plan = Plan(str(in_path), shards, shard_starts(pf, shards), set(done), cfg, filters, str(work))
        total = sum(s["docs"] for s in todo)
        t0 = time.perf_counter()
        writers = ShardWriters("shard outputs", cpus, max_retries)
        try:
            by_shard = _run_doc_stage(
                _doc_dataset(in_path, plan, cpus, max_retries, total), plan, say, total, max_retries,
                lambda i, pieces: writers.put(i, shards[i], list(pieces), str(out_dir(shards[i])), cfg, cache))
            _check_complete(todo, by_shard)
            written = writers.finish()
        except BaseException:
            writers.settle()
            raise
        made = [written[s["index"]] for s in todo]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    docs = sum(r["report"]["input_docs"] for r in made)
    nbytes = sum(r["report"]["input_bytes"] for r in made)
    dt = max(time.perf_counter() - t0, 1e-9)
    cpu: dict[str, float] = {}
    for p in (p for ps in by_shard.values() for p in ps):
        cpu[p["node"]] = cpu.get(p["node"], 0.0) + p["cpu_s"]
    say(f"clean on ray: per-document stage done: {len(made)} shards written ({len(done)} reused), {docs} docs, "
        f"{docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s; map CPU seconds per node "
        f"{', '.join(f'{n} {s:.1f}' for n, s in sorted(cpu.items()))} in {dt:.1f} s")
    done.update({r["shard"]["index"]: {**r, "cached": False} for r in made})
    return [done[s["index"]] for s in shards]


def ray_partitions(partitions: int | None = None) -> int:
    """Partitions of the dedup reduces on the connected cluster: ``partitions``, or two per CPU."""
    import ray

    return partitions or max(2, int(ray.cluster_resources().get("CPU", 1)) * 2)


def clean_on_ray(in_path: str | Path, out_path: str | Path, removed_path: str | Path,
                 cfg: CleanSettings | None = None, address: str = DEFAULT_ADDRESS, progress: Progress | None = None,
                 filters: list[Filter] | None = None, work_dir: str | Path | None = None,
                 artifacts_dir: str | Path | None = None, max_retries: int = 3,
                 partitions: int | None = None) -> CleanReport:
    """``kiln.clean.run.clean`` on the cluster at ``address``: the same outputs and report (but its timings)."""
    import ray

    in_path = in_path if "://" in str(in_path) else Path(in_path)  # a path or an fsspec URL
    cfg, say = cfg or CleanConfig(), progress or (lambda _m: None)
    t0 = time.perf_counter()
    raw_source(in_path)  # a source the workers cannot open is refused before this process joins the cluster
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
                                      filters, max_retries, work_dir)
        report = merge_shards(results, out_path, removed_path, cfg, say, work_dir, artifacts_dir,
                              RayMap(say, max_retries), ray_partitions(partitions))
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
    """``kiln.clean.corpus.write_clean_corpus`` with the dedup passes as tasks on the connected cluster."""
    return write_clean_corpus(results, folder, cfg, raw_path, say, RayMap(say, max_retries), ray_partitions(partitions))
