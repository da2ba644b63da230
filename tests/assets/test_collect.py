"""raw_documents and clean_corpus materialized with Dagster on small local sources: the output contract, the
removal report in metadata and MLflow, shards reused when a source is added, config errors.

Run: python -m pytest tests/assets/test_collect.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, DagsterInstance, DagsterInvalidConfigError, FilesystemIOManager, materialize

from assets.collect import clean_corpus, raw_documents
from resources.ray import RayResource
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from textgen import prose  # noqa: E402


def write_sources(root: Path) -> list[dict]:
    (root / "wiki").mkdir(parents=True)
    (root / "web").mkdir()
    for i in range(30):
        (root / "wiki" / f"a{i:02d}.txt").write_text(prose(i), encoding="utf-8")
    (root / "wiki" / "zz.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00 an image named .txt")  # skipped, counted
    rows = [{"text": prose(100 + i), "url": f"https://web.example/{i}"} for i in range(30)]
    rows += [{"text": "Buy now!", "url": "https://web.example/short"}, rows[3]]  # too short; a URL duplicate
    (root / "web" / "pages.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return [{"name": "wiki", "kind": "local", "path": str(root / "wiki"), "format": "text", "license": "CC0"},
            {"name": "web", "kind": "local", "path": str(root / "web" / "pages.jsonl"), "format": "jsonl",
             "url_field": "url", "license": "CC0"}]


def run(home: Path, sources: list[dict], clean: dict, instance: DagsterInstance, reuse: bool = True):
    resources = {
        "storage": KilnStorageResource(root=str(home / "storage"), source_cache=str(home / "cache")),
        "mlflow": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "art"),
                                 reuse_runs=reuse),
        "io_manager": FilesystemIOManager(base_dir=str(home / "storage" / "handles")),
        "ray": RayResource(),  # clean.executor local: not contacted
    }
    config = {"ops": {"raw_documents": {"config": {"manifest": "", "sources": sources}},
                      "clean_corpus": {"config": {"clean": clean}}}}
    return materialize([raw_documents, clean_corpus], resources=resources, run_config=config, instance=instance,
                       raise_on_error=False)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("collect")
    sources = write_sources(home / "data")
    instance = DagsterInstance.ephemeral()
    clean = {"shard_docs": 10, "quality_model": {"reference_sources": ["wiki"], "epochs": 3}}
    result = run(home, sources, clean, instance)
    return home, sources, clean, instance, result


def test_clean_corpus_contract_and_report(first_run) -> None:
    home, _, _, instance, result = first_run
    assert result.success
    value = result.output_for_node("clean_corpus")
    table = pq.read_table(value["path"])
    assert table.column_names[:7] == ["id", "source", "url", "text", "content_type", "bytes", "license"]
    assert {"words", "language", "quality_score", "token_kl"} <= set(table.column_names)
    assert table.num_rows == value["report"]["kept_docs"] > 40
    removed = pq.read_table(value["removed"]).to_pylist()
    reasons = {r["reason"] for r in removed}
    assert {"gopher:too_few_words", "dedup:url"} <= reasons
    raw_meta = instance.get_latest_materialization_event(AssetKey("raw_documents")).asset_materialization.metadata
    assert "| wiki | zz.txt | 8 | binary |" in raw_meta["skipped_input"].value and "1 binary" in raw_meta["sources"].value
    meta = instance.get_latest_materialization_event(AssetKey("clean_corpus")).asset_materialization.metadata
    assert "gopher:too_few_words" in meta["removed_by_rule"].value and "dedup:url" in meta["removed_by_rule"].value
    assert "web/pages.jsonl#31" in meta["removed_examples"].value and "Buy now!" in meta["removed_examples"].value
    assert meta["shards"].value == 7 and meta["shards_reused"].value == 0  # 3 + 4 of up to 10 docs, never mixed
    assert "filter:gopher_quality" in meta["stage_time"].value and meta["mb_per_s_per_core"].value > 0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run_id = meta["mlflow_run_id"].value
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"report.json", "removed_examples.md", "quality_model.pt"} <= names
    assert client.get_run(run_id).data.metrics["removed_docs.gopher:too_few_words"] == 1


def test_recomputing_the_same_corpus_gives_the_same_data_version(first_run) -> None:
    """Timings in report.json differ between runs; the data version (what downstream assets key on) must not."""
    home, sources, clean, instance, first = first_run
    again = run(home, sources, clean, instance, reuse=False)  # recomputed (every shard from its cache), not reused
    assert again.success
    a, b = first.output_for_node("clean_corpus"), again.output_for_node("clean_corpus")
    assert a["version"] == b["version"] and a["path"] == b["path"]
    assert b["report"]["stage_seconds"] != a["report"]["stage_seconds"]  # it really ran again
    meta = instance.get_latest_materialization_event(AssetKey("clean_corpus")).asset_materialization.metadata
    assert "reused_mlflow_run_id" not in meta


def test_adding_a_source_reuses_the_other_shards(first_run, tmp_path: Path) -> None:
    home, sources, clean, instance, _ = first_run
    extra = tmp_path / "more"
    extra.mkdir()
    for i in range(5):
        (extra / f"m{i}.txt").write_text(prose(300 + i), encoding="utf-8")
    more = sources + [{"name": "more", "kind": "local", "path": str(extra), "format": "text", "license": "CC0"}]
    result = run(home, more, clean, instance)
    assert result.success
    meta = instance.get_latest_materialization_event(AssetKey("clean_corpus")).asset_materialization.metadata
    assert meta["shards"].value == 8 and meta["shards_reused"].value == 7  # only the new source's shard ran
    kept = pq.read_table(result.output_for_node("clean_corpus")["path"], columns=["source"]).column("source")
    assert "more" in kept.to_pylist()


def test_config_errors_fail_the_step_with_the_key(first_run) -> None:
    home, sources, _, instance, _ = first_run
    with pytest.raises(DagsterInvalidConfigError, match=r'unexpected config entry "min_wrds" at path '
                                                         r'root:ops:clean_corpus:config:clean\. Expected: "\{.* min_words\?'):
        run(home, sources, {"min_wrds": 5}, instance)  # refused by Dagster before the run starts


def test_a_source_file_edited_in_place_at_equal_size_gives_a_new_corpus(tmp_path: Path) -> None:
    """The shard cache is keyed by content: an edit that keeps every size reruns that shard, and only that one."""
    notes = tmp_path / "data"
    notes.mkdir()
    for i in range(3):
        (notes / f"n{i}.txt").write_text(prose(400 + i), encoding="utf-8")
    sources = [{"name": "notes", "kind": "local", "path": str(notes), "format": "text", "license": "CC0"}]
    clean, instance = {"shard_docs": 1}, DagsterInstance.ephemeral()
    first = run(tmp_path, sources, clean, instance)
    assert first.success
    text = (notes / "n1.txt").read_text(encoding="utf-8")
    word = max(text.split(), key=len).strip(".,")
    edited = text.replace(word, word[::-1].upper())
    assert len(edited.encode()) == len(text.encode()) and edited != text
    (notes / "n1.txt").write_text(edited, encoding="utf-8")  # in place, same size
    again = run(tmp_path, sources, clean, instance)
    assert again.success
    a, b = first.output_for_node("clean_corpus"), again.output_for_node("clean_corpus")
    assert a["version"] != b["version"]
    old, new = ({r["id"]: r["text"] for r in pq.read_table(v["path"], columns=["id", "text"]).to_pylist()}
                for v in (a, b))
    assert old.keys() == new.keys() and len(new) == 3
    assert [i for i in new if new[i] != old[i]] == ["notes/n1.txt"] and word[::-1].upper() in new["notes/n1.txt"]
    meta = instance.get_latest_materialization_event(AssetKey("clean_corpus")).asset_materialization.metadata
    assert meta["shards"].value == 3 and meta["shards_reused"].value == 2


def test_ray_metadata_links_the_dashboard_or_says_there_is_none() -> None:
    from assets.collect import _executor_metadata
    from kiln.clean.config import CleanConfig

    info = {"job_id": "01000000", "address": "127.0.0.1:6379", "nodes": 2, "cpus": 2.0,
            "dashboard_url": "http://127.0.0.1:8265"}
    cfg = CleanConfig(executor="ray")
    meta = _executor_metadata(cfg, info)
    assert meta["ray_dashboard"].value == "http://127.0.0.1:8265" and meta["ray_cluster"] == "2 nodes, 2 CPUs"
    meta = _executor_metadata(cfg, {**info, "dashboard_url": ""})
    assert "runs without one" in meta["ray_dashboard"].value and "ray[default]" in meta["ray_dashboard"].value
    assert _executor_metadata(CleanConfig(), None) == {"executor": "local"}
