"""KilnStorageResource: a local root is its own cache; a URL root publishes there and serves verified local copies.

Run: python -m pytest tests/resources/test_storage.py -q
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.tokens.shards import ShardError, shard_paths, write_shards
from resources.storage import KilnStorageResource

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shards_in(tiny_tokenizer, docs):
    """Write the tiny corpus as shards into storage.path('token_shards', 'v1'); return a token_shards-like value."""
    enc, _ = tiny_tokenizer

    def make(storage: KilnStorageResource) -> dict:
        out = storage.path("token_shards", "v1")
        write_shards(enc, docs, out, 3000, 200, 1)
        return {"version": "v1", "dir": str(out)}

    return make


def test_local_root_is_its_own_cache(tmp_path: Path, shards_in) -> None:
    storage = KilnStorageResource(root=str(tmp_path / "root"), cache=str(tmp_path / "unused"))
    assert not storage.durable
    value = shards_in(storage)
    assert storage.path("token_shards", "v1") == tmp_path / "root" / "token_shards" / "v1"
    assert storage.url("token_shards", "v1") == str(tmp_path / "root" / "token_shards" / "v1")
    assert storage.publish(Path(value["dir"]), "token_shards", "v1").files == 0
    files = storage.local_shards(value)
    assert files["train"] == [str(p) for p in shard_paths(value["dir"], "train")] and files["val"]
    assert storage.cache_dir == tmp_path / "root" / "cache" / "sources"
    assert not (tmp_path / "unused").exists()
    Path(files["val"][0]).unlink()
    with pytest.raises(ShardError, match=r"val_000000\.bin named in .*manifest\.json is missing"):
        storage.local_shards(value)


def test_url_root_publishes_and_refetches_a_lost_cache(tmp_path: Path, shards_in) -> None:
    durable = (tmp_path / "bucket" / "kiln").as_uri()  # any fsspec URL; s3:// is tested in tests/kiln/tokens/test_store.py
    storage = KilnStorageResource(root=durable, cache=str(tmp_path / "cache"))
    assert storage.durable and storage.url("token_shards", "v1") == durable + "/token_shards/v1"
    value = shards_in(storage)
    assert value["dir"] == str(tmp_path / "cache" / "token_shards" / "v1")
    res = storage.publish(Path(value["dir"]), "token_shards", "v1")
    assert res.url == durable + "/token_shards/v1" and res.files == len(list(Path(value["dir"]).glob("[!.]*")))
    originals = {Path(p).name: Path(p).read_bytes() for p in storage.local_shards(value)["train"]}
    shutil.rmtree(tmp_path / "cache")  # another machine, or an evicted cache
    files = storage.local_shards(value)
    assert {Path(p).name: Path(p).read_bytes() for p in files["train"]} == originals
    assert all(Path(p).parent == tmp_path / "cache" / "token_shards" / "v1" for p in files["train"] + files["val"])
    assert storage.cache_dir == tmp_path / "cache" / "cache" / "sources"


def test_run_config_can_point_the_pipeline_at_a_url_root(tmp_path: Path) -> None:
    """What the README tells users to write: a resources section on top of a preset."""
    from dagster import validate_run_config

    from jobs.presets import load_preset
    from jobs.definitions import make_definitions

    job = make_definitions(tmp_path).resolve_job_def("kiln_pipeline_job")
    run_config = {**load_preset("smoke"), "resources": {"storage": {"config": {
        "root": "s3://my-bucket/kiln", "cache": str(tmp_path / "cache"),
        "storage_options": {"endpoint_url": "http://127.0.0.1:9000"}}}}}
    assert validate_run_config(job, run_config)["resources"]["storage"]["config"]["root"] == "s3://my-bucket/kiln"


KILLED_WHILE_STAGING = """
import os, signal, sys
from kiln.common.files import staging_dir
with staging_dir(sys.argv[1]) as stage:
    (stage / "half.parquet").write_bytes(b"half a file")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_starts_by_removing_the_staging_that_killed_runs_left(tmp_path: Path) -> None:
    import subprocess
    import sys

    from dagster import DagsterInstance, asset, materialize

    root = tmp_path / "root"
    for folder in (root / "raw_documents", root):
        proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_STAGING, str(folder)], env={"PYTHONPATH": str(ROOT)},
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == -9, proc.stderr
    left = sorted(root.glob(".stage.*")) + sorted((root / "raw_documents").glob(".stage.*"))
    assert len(left) == 2
    (root / "raw_documents" / ".partial-notes").mkdir()  # not a staging folder
    (root / "raw_documents" / "v1").mkdir()

    @asset
    def uses_storage(context, storage: KilnStorageResource) -> None:
        context.log.info(f"storage at {storage.root}")

    instance = DagsterInstance.ephemeral()
    result = materialize([uses_storage], resources={"storage": KilnStorageResource(root=str(root))}, instance=instance)
    assert result.success
    assert not any(p.exists() for p in left)
    assert sorted(p.name for p in (root / "raw_documents").iterdir()) == [".partial-notes", "v1"]
    logs = [e.user_message for e in instance.all_logs(result.run_id) if e.dagster_event is None]
    assert sum(f"removed {p}: a staging folder left by a run that was killed" in logs for p in left) == 2


def test_a_never_materialized_optional_asset_loads_as_none_and_any_other_missing_handle_fails(tmp_path):
    from dagster import DagsterInstance, asset, materialize

    from resources.storage import HandleIOManager

    @asset(name="pretrained_model")
    def pretrained() -> dict:
        return {"path": "/released"}

    @asset(name="clean_corpus")
    def corpus() -> dict:
        return {"rows": 3}

    @asset
    def tokenizer(clean_corpus: dict, pretrained_model: dict | None = None) -> dict:
        return {"from": pretrained_model, "rows": clean_corpus["rows"]}

    handles = HandleIOManager(base_dir=str(tmp_path / "handles"))
    instance = DagsterInstance.ephemeral()
    materialize([pretrained, corpus, tokenizer], selection=[corpus], resources={"io_manager": handles}, instance=instance)
    result = materialize([pretrained, corpus, tokenizer], selection=[tokenizer], resources={"io_manager": handles},
                         instance=instance)
    assert result.output_for_node("tokenizer") == {"from": None, "rows": 3}  # never imported: from scratch

    materialize([pretrained, corpus, tokenizer], selection=[pretrained], resources={"io_manager": handles}, instance=instance)
    result = materialize([pretrained, corpus, tokenizer], selection=[tokenizer], resources={"io_manager": handles},
                         instance=instance)
    assert result.output_for_node("tokenizer") == {"from": {"path": "/released"}, "rows": 3}

    (tmp_path / "handles" / "clean_corpus").unlink()
    failed = materialize([pretrained, corpus, tokenizer], selection=[tokenizer], resources={"io_manager": handles},
                         instance=instance, raise_on_error=False)
    assert not failed.success and not failed.get_asset_materialization_events()  # a required input is never None
