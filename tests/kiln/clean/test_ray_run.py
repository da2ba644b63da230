"""The clean step on a real Ray cluster (head + second worker node on 127.0.0.1: tests/ray_cluster.py): the same
outputs and report as the local executor (reading its raw corpus through an fsspec URL inside a zip), a memory://
URL refused, a worker killed mid-stage (retried, same result), a worker that dies on
every try (a clear error, earlier outputs untouched).

Run: python -m pytest tests/kiln/clean/test_ray_run.py -q (about a minute: the cluster starts once).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import faults
from kiln.clean.config import CleanConfig
from kiln.clean.ray_run import RayClusterError, clean_on_ray
from kiln.clean.run import clean
from tests.kiln.clean.test_run import write_raw
from textgen import prose

pytestmark = pytest.mark.ray
TIMINGS = ("seconds", "stage_seconds", "docs_per_s", "mb_per_s")
CFG = {"shard_docs": 12, "line_dedup": {"max_repeats": 3}, "quality_model": {"enabled": False}}


def corpus(tmp: Path) -> Path:
    """48 documents in 4 shards: exact copies, near copies (one word changed), a footer line on every page."""
    docs = []
    for i in range(48):
        text = prose(i % 20, 10)
        if i % 7 == 6:
            words = text.split(" ")
            words[4] = "lighthouse"
            text = " ".join(words)
        docs.append({"text": text + "\nShared navigation footer of the example site, on every page."})
    return write_raw(tmp / "raw.parquet", docs)


def outputs(folder: Path, report) -> tuple:
    rep = {k: v for k, v in report.to_dict().items() if k not in TIMINGS}
    return pq.read_table(folder / "c.parquet"), pq.read_table(folder / "r.parquet"), rep


def run_local(tmp: Path, raw: Path, **kw) -> tuple:
    (tmp / "local").mkdir()
    rep = clean(raw, tmp / "local/c.parquet", tmp / "local/r.parquet", CleanConfig.from_dict(CFG), work_dir=tmp, **kw)
    return outputs(tmp / "local", rep)


def run_ray(tmp: Path, raw: Path | str, cluster, say=None, **kw) -> tuple:
    (tmp / "ray").mkdir(exist_ok=True)
    rep = clean_on_ray(raw, tmp / "ray/c.parquet", tmp / "ray/r.parquet", CleanConfig.from_dict(CFG),
                       address=cluster.address, progress=say, work_dir=tmp, **kw)
    return outputs(tmp / "ray", rep)


def same(a: tuple, b: tuple) -> None:
    assert a[0].equals(b[0]) and a[1].equals(b[1])
    assert a[2] == b[2]


def test_ray_executor_writes_the_local_outputs_from_a_path_inside_an_fsspec_archive(tmp_path: Path, ray_cluster) -> None:
    raw = corpus(tmp_path)
    lines: list[str] = []
    local = run_local(tmp_path, raw)
    with zipfile.ZipFile(tmp_path / "raw.zip", "w") as z:
        z.write(raw, "corpus/raw.parquet")
    url = f"zip://corpus/raw.parquet::{(tmp_path / 'raw.zip').as_uri()}"  # the workers open it through fsspec
    on_ray = run_ray(tmp_path, url, ray_cluster, lines.append)
    same(local, on_ray)
    reasons = local[2]["reasons"]
    assert reasons["dedup:exact"]["docs"] > 0 and reasons["dedup:minhash"]["docs"] > 0
    assert local[2]["edits"]["dedup:line"]["items"] > 0
    assert any(f"on {ray_cluster.address}, 2 nodes, 2 CPUs" in m for m in lines)
    assert any(m.startswith("clean: dedup over 4 partitions") for m in lines), lines  # Ray tasks: 2 per CPU
    assert any(m.startswith("clean on ray: per-document stage: 48 of 48 docs") for m in lines), lines
    assert any("per-document stage done: 4 shards written (0 reused), 48 docs" in m for m in lines), lines


def test_worker_killed_mid_stage_is_retried_with_the_same_result(tmp_path: Path, ray_cluster) -> None:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(faults)  # the workers need not import the tests
    raw, marker = corpus(tmp_path), tmp_path / "killed"
    local = run_local(tmp_path, raw, filters=[])
    lines: list[str] = []
    on_ray = run_ray(tmp_path, raw, ray_cluster, lines.append, filters=[faults.KillWorkerOnce("d17", marker)])
    assert marker.is_file()  # the worker running shard 1 was SIGKILLed at its sixth document
    assert any("shard 1 (test) finished on attempt 2" in m for m in lines), lines
    same(local, on_ray)


def test_worker_dying_every_try_fails_clearly_and_leaves_outputs(tmp_path: Path, ray_cluster) -> None:
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(faults)
    raw = corpus(tmp_path)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray/c.parquet").write_bytes(b"earlier corpus")
    killer = faults.KillWorkerOnce("d30", tmp_path / "killed", every_time=True)
    with pytest.raises(RayClusterError, match=r"per-document stage task 2 of 4 failed after Ray's 1 retries"):
        run_ray(tmp_path, raw, ray_cluster, filters=[killer], max_retries=1)
    assert (tmp_path / "ray/c.parquet").read_bytes() == b"earlier corpus"
    assert not (tmp_path / "ray/r.parquet").exists()


def test_a_memory_url_the_workers_cannot_open_is_refused_before_joining_a_cluster(tmp_path: Path) -> None:
    import fsspec
    import ray

    raw = corpus(tmp_path)
    memory = fsspec.filesystem("memory")  # one store per process: a folder of this test's own, removed after
    memory.pipe("/kiln-ray-executor-test/raw.parquet", raw.read_bytes())
    try:  # nothing listens at the address: joining a cluster first would fail with RayClusterError instead
        with pytest.raises(ValueError, match="memory:// file lives in this process only"):
            clean_on_ray("memory://kiln-ray-executor-test/raw.parquet", tmp_path / "m.parquet", tmp_path / "mr.parquet",
                         CleanConfig.from_dict(CFG), address="127.0.0.1:9", work_dir=tmp_path)
    finally:
        memory.rm("/kiln-ray-executor-test", recursive=True)
    assert not ray.is_initialized()
