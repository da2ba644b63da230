"""The per-document stage as a Ray Data pipeline: the raw Parquet (a path or an fsspec URL) read with
``ray.data.read_parquet`` as blocks of Arrow rows, the stage as ``Dataset.map_batches`` over pyarrow batches, each
batch's rows written as pieces per shard; a writer (``kiln.clean.ray_run.ShardWriters``) joins each shard's
pieces, once all are back, into the shard's ``kept.parquet``, ``removed.parquet`` and report (what
``kiln.clean.shard.clean_shard`` writes, byte for byte in content), which the corpus stage reads.

Every row carries its row number in the file (recovered from Ray's ``row_hash`` column, checked against Ray's own
hash), so which shard a row belongs to and the order of a shard's pieces never depend on block order, block size
or the number of workers. Run through ``kiln.clean.ray_run.clean_on_ray``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kiln.clean.config import CleanSettings
from kiln.clean.report import CleanReport
from kiln.clean.schema import INPUT_COLUMNS, REMOVED_SCHEMA, shard_schema
from kiln.clean.shard import Progress, ShardCleaner, Timer, _to_doc
from kiln.common.files import atomic_path, atomic_write_json, stable_hash
from kiln.filters.base import Filter

M64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers (Ray's row_hash)
_CLEANERS: dict[str, ShardCleaner] = {}  # per worker process: one cleaner per stage config (filters load once)
PIECES = "pieces"  # sub-folder of the work folder holding every batch's rows per shard


def is_url(path: str | Path) -> bool:
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def raw_source(uri: str | Path) -> tuple[str, Any]:
    """(path, pyarrow filesystem or None) for ``ray.data.read_parquet``: a local path as is, ``file://`` as its
    local path, any other fsspec URL (memory://, s3://, gcs://...) through pyarrow's wrapper of the fsspec
    filesystem."""
    text = str(uri)
    if text.startswith("file://"):
        return text.removeprefix("file://"), None
    if not is_url(text):
        return str(Path(text).resolve()), None
    import fsspec
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, path = fsspec.core.url_to_fs(text)
    if "memory" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        raise ValueError(f"{text}: a memory:// file lives in this process only, so Ray's workers cannot read it; "
                         f"write the raw corpus to a file:// path, a zip:// or tar:// archive, or an object store.")
    return path, PyFileSystem(FSSpecHandler(fs))


def _unmix(h: np.ndarray) -> np.ndarray:
    """The inverse of splitmix64's finalizer (uint64, vectorised)."""
    x = h.astype(np.uint64)
    x ^= (x >> np.uint64(31)) ^ (x >> np.uint64(62))
    x *= np.uint64(pow(_C2, -1, 1 << 64))
    x ^= (x >> np.uint64(27)) ^ (x >> np.uint64(54))
    x *= np.uint64(pow(_C1, -1, 1 << 64))
    x ^= (x >> np.uint64(30)) ^ (x >> np.uint64(60))
    return x


def file_rows(batch: pa.Table) -> np.ndarray:
    """Row numbers in the file of a batch read with ``include_paths`` and ``include_row_hash``: Ray's row hash is
    splitmix64(md5(path) + row), which is invertible; the result is checked by hashing it again with Ray's own
    function, so a change of Ray's hash fails loudly instead of misplacing rows."""
    from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

    paths = batch.column("path").unique().to_pylist()
    hashes = batch.column("row_hash").to_numpy(zero_copy_only=False).astype(np.uint64)
    out = np.empty(len(hashes), np.int64)
    for p in paths:
        sel = np.flatnonzero(np.asarray(batch.column("path").to_pylist()) == p) if len(paths) > 1 else slice(None)
        seed = np.uint64(int.from_bytes(hashlib.md5(p.encode()).digest()[:8], "little"))
        with np.errstate(over="ignore"):
            rows = (_unmix(hashes[sel]) - seed).astype(np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= 1 << 48 or not np.array_equal(
                np.concatenate([_compute_row_hashes(p, int(r), 1) for r in rows[[0, -1]]]), hashes[sel][[0, -1]])):
            raise RuntimeError(f"{p}: Ray's row_hash is no longer splitmix64(md5(path) + row); kiln.clean.ray_data "
                               f"cannot place rows in their shards with this Ray version: pin the one in pyproject.toml.")
        out[sel] = rows
    return out


def shard_starts(raw: pq.ParquetFile, shards: list[dict[str, Any]]) -> np.ndarray:
    """First file row of every shard (shards are consecutive runs of rows in file order)."""
    first = np.concatenate(([0], np.cumsum([raw.metadata.row_group(i).num_rows
                                            for i in range(raw.metadata.num_row_groups)])))
    return np.array([first[s["segments"][0][0]] + s["segments"][0][1] for s in shards], np.int64)


class Plan:
    """What every map task needs, put in the object store once: the shards, their first rows, which to skip
    (already in the shard cache), the stage config and the folder of the pieces."""

    def __init__(self, uri: str, shards: list[dict[str, Any]], starts: np.ndarray, skip: set[int],
                 cfg: CleanSettings, filters: list[Filter] | None, work: str) -> None:
        self.uri, self.shards, self.starts, self.skip = uri, shards, starts, skip
        self.cfg, self.filters, self.work = cfg, filters, work


def _cleaner(plan: Plan) -> ShardCleaner:
    if plan.filters is not None:
        return ShardCleaner(plan.cfg, plan.filters)
    key = plan.cfg.shard_stage_hash()
    if key not in _CLEANERS:
        _CLEANERS[key] = ShardCleaner(plan.cfg)
    return _CLEANERS[key]


def _bump(marker: Path) -> int:
    attempt = int(marker.read_text() or 0) + 1 if marker.is_file() else 1
    marker.write_text(str(attempt))
    return attempt


def clean_piece(plan: Plan, shard: int, rows: np.ndarray, table: pa.Table) -> dict[str, Any]:
    """The per-document stage over one shard's rows of a batch: kept and removed rows into the piece's two
    Parquet files (named by shard and first row, so a retried task rewrites the same ones), its report back."""
    name = Path(plan.work) / PIECES / f"s{shard:05d}-r{int(rows[0]):012d}"
    cpu0 = time.process_time()
    attempt = _bump(name.with_suffix(".attempts"))
    report, timer, cleaner = CleanReport(), Timer(), _cleaner(plan)
    kept, removed, done = [], [], 0
    for batch in table.to_batches(max_chunksize=plan.cfg.batch_size):
        docs = [_to_doc(row, f"{plan.uri}: row {int(r)}") for row, r in zip(batch.to_pylist(), rows[done:])]
        done += len(docs)
        timer.lap("read")
        k, r = cleaner.run(docs, report, timer)
        kept += k
        removed += r
    with atomic_path(name.with_suffix(".kept.parquet")) as kt, atomic_path(name.with_suffix(".removed.parquet")) as rt:
        pq.write_table(pa.Table.from_pylist(kept, schema=shard_schema()), kt)
        pq.write_table(pa.Table.from_pylist(removed, schema=REMOVED_SCHEMA), rt)
    timer.lap("write")
    report.stage_seconds = dict(timer.seconds)
    return {"shard": shard, "first": int(rows[0]), "docs": len(rows), "path": str(name),
            "report": json.dumps(report.to_dict()), "attempt": attempt, "cpu_s": time.process_time() - cpu0,
            "node": _node()}


def _node() -> str:
    """The Ray node this runs on ("local" outside Ray: asking then would start a Ray instance)."""
    import ray

    return ray.get_runtime_context().get_node_id()[:8] if ray.is_initialized() else "local"


def doc_stage(batch: pa.Table, plan: Plan) -> pa.Table:
    """``map_batches``'s function: the batch's rows split by shard (by row number), each piece cleaned."""
    rows = file_rows(batch)
    order = np.argsort(rows, kind="stable")
    rows, table = rows[order], batch.take(pa.array(order)).select(INPUT_COLUMNS)
    shard_of = np.searchsorted(plan.starts, rows, side="right") - 1
    out = []
    for s in np.unique(shard_of):
        sel = np.flatnonzero(shard_of == s)
        if int(s) not in plan.skip:
            out.append(clean_piece(plan, int(s), rows[sel], table.take(pa.array(sel))))
    return pa.Table.from_pylist(out, schema=PIECE_SCHEMA)


class DocStage:
    """``map_batches``'s callable on an actor pool: one per worker, its cleaner built once at start."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        _cleaner(plan)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return doc_stage(batch, self.plan)


PIECE_SCHEMA = pa.schema([("shard", pa.int64()), ("first", pa.int64()), ("docs", pa.int64()), ("path", pa.string()),
                          ("report", pa.string()), ("attempt", pa.int64()), ("cpu_s", pa.float64()),
                          ("node", pa.string())])


def assemble_shard(shard: dict[str, Any], pieces: list[dict[str, Any]], out_dir: str, cfg: CleanSettings,
                   cache: bool) -> dict[str, Any]:
    """One shard's pieces (in row order) joined into ``out_dir``: kept.parquet, removed.parquet and (``cache``)
    report.json, the result ``clean_shard`` returns for the shard."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pieces = sorted(pieces, key=lambda p: p["first"])
    report = CleanReport()
    for p in pieces:
        report.merge(json.loads(p["report"]), cfg.examples_per_reason)
    for kind, schema in (("kept", shard_schema()), ("removed", REMOVED_SCHEMA)):
        tables = [pq.read_table(p["path"] + f".{kind}.parquet", schema=schema) for p in pieces]
        with atomic_path(out / f"{kind}.parquet") as tmp:
            pq.write_table(pa.concat_tables(tables) if tables else schema.empty_table(), tmp)
    report.stage_seconds = {k: round(v, 4) for k, v in report.stage_seconds.items()}
    result = {"shard": dict(shard), "dir": str(out), "kept": str(out / "kept.parquet"),
              "removed": str(out / "removed.parquet"), "report": report.to_dict()}
    if cache:
        atomic_write_json(out / "report.json", result)
    return result


def pieces_of(ds: Any, say: Progress, total: int) -> Iterator[dict[str, Any]]:
    """The pieces as the pipeline finishes them, with a progress line about every few seconds."""
    t0 = last = time.perf_counter()
    docs = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        for p in batch.to_pylist():
            docs += p["docs"]
            yield p
        now = time.perf_counter()
        if now - last > 5.0 or docs >= total:
            last = now
            say(f"clean on ray: per-document stage: {docs} of {total} docs, {docs / max(now - t0, 1e-9):.0f} docs/s")


def stage_key(plan: Plan) -> str:
    return stable_hash([plan.uri, plan.cfg.shard_stage_hash()])[:12]
