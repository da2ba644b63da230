"""RayResource: a clear error when no cluster answers, and clean_corpus materialized with ``clean.executor: ray``
on a real local cluster (tests/ray_cluster.py), against the local executor's corpus, report and data version.

Run: python -m pytest tests/resources/test_ray.py -q (about 40 s with the cluster's start).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, DagsterInstance, FilesystemIOManager, materialize

from assets.collect import clean_corpus, raw_documents
from ports import free_port
from kiln.clean.ray_run import RayClusterError
from resources.ray import RayResource
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
from test_collect import write_sources  # noqa: E402


def test_no_cluster_names_the_address_and_the_ways_out() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(RayClusterError) as e:
        RayResource(address=address).connect()
    msg = str(e.value)
    assert repr(address) in msg and "ray start --head" in msg and "clean.executor: local" in msg


def materialize_clean(home: Path, sources: list[dict], executor: str, address: str):
    resources = {
        "storage": KilnStorageResource(root=str(home / "storage"), source_cache=str(home / "cache")),
        "mlflow": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "art")),
        "io_manager": FilesystemIOManager(base_dir=str(home / "storage" / "handles")),
        "ray": RayResource(address=address, max_retries=1),
    }
    clean = {"executor": executor, "shard_docs": 10, "quality_model": {"enabled": False}}
    config = {"ops": {"raw_documents": {"config": {"manifest": "", "sources": sources}},
                      "clean_corpus": {"config": {"clean": clean}}}}
    instance = DagsterInstance.ephemeral()
    result = materialize([raw_documents, clean_corpus], resources=resources, run_config=config, instance=instance)
    event = instance.get_latest_materialization_event(AssetKey("clean_corpus")).asset_materialization
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    return result.output_for_node("clean_corpus"), event, logs


@pytest.mark.ray
def test_clean_corpus_on_ray_equals_local(tmp_path: Path, ray_cluster) -> None:
    sources = write_sources(tmp_path / "data")
    local, local_event, _ = materialize_clean(tmp_path / "local", sources, "local", "127.0.0.1:1")
    on_ray, event, logs = materialize_clean(tmp_path / "ray", sources, "ray", ray_cluster.address)
    sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert sha(on_ray["path"]) == sha(local["path"]) and sha(on_ray["removed"]) == sha(local["removed"])
    assert pq.read_table(on_ray["path"]).num_rows == on_ray["report"]["kept_docs"] > 40
    assert event.tags["dagster/data_version"] == local_event.tags["dagster/data_version"]
    assert on_ray["report"]["reasons"] == local["report"]["reasons"]  # counts and examples
    meta = event.metadata
    assert meta["executor"].value == "ray" and local_event.metadata["executor"].value == "local"
    assert meta["ray_job_id"].value and meta["ray_address"].value == ray_cluster.address
    assert meta["ray_cluster"].value == "2 nodes, 2 CPUs" and meta["shards"].value == 7
    assert meta["removed_examples"].value == local_event.metadata["removed_examples"].value
    assert any(f"clean_corpus on ray: job {meta['ray_job_id'].value}" in m for m in logs)
    assert any(m.startswith("clean: dedup over 4 partitions") for m in logs)
    assert re.fullmatch(r"[0-9a-f]{8}", meta["ray_job_id"].value), meta["ray_job_id"].value
    assert meta["shards_reused"].value == 0 and local_event.metadata["shards_reused"].value == 0
    # ray[default] is a dependency: the head runs its dashboard, the link answers, and it lists the step's job
    assert ray_cluster.dashboard_port, "the test cluster runs no dashboard: reinstall with `pip install -e .`"
    dashboard = meta["ray_dashboard"].value
    assert dashboard == f"http://127.0.0.1:{ray_cluster.dashboard_port}"
    with urllib.request.urlopen(dashboard, timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=10) as r:
        jobs = {j.get("job_id"): j for j in json.load(r)}
    assert meta["ray_job_id"].value in jobs, sorted(j for j in jobs if j)
    assert jobs[meta["ray_job_id"].value]["status"] == "SUCCEEDED"
    # the Ray Data pipeline's progress streams into the Dagster log as blocks finish
    assert any(re.match(r"clean on ray: per-document stage: \d+ of \d+ docs, \d+ docs/s", m) for m in logs), logs
    assert any(m.startswith("clean on ray: per-document stage done: 7 shards written") for m in logs)
