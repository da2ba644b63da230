"""The evaluation assets materialized with Dagster: suite, contamination report and its blocking check, final scores,
and per-checkpoint scores as dynamic partitions with MLflow runs nested under the training run.

Run: python -m pytest tests/assets/test_evaluation_assets.py -q   (tiny models and tasks; well under a minute)
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dagster import AssetKey, DagsterInstance, FilesystemIOManager, asset, materialize

from assets.evals import (
    CHECKPOINTS,
    checkpoint_evals,
    contamination_below_threshold,
    contamination_report,
    eval_scores,
    eval_suite,
)
from kiln.train.checkpoint import save_checkpoint
from kiln.evaluation.checkpoints import checkpoint_key
from kiln.model.config import ModelConfig
from kiln.model.config import padded_vocab
from kiln.model.gpt2.model import GPT
from kiln.tokens.shards import split_of
from resources.storage import KilnStorageResource
from resources.tracking import MlflowResource
from tests.kiln.evaluation.evaluation_kit import make_docs

VAL_PERMILLE = 300
SUITE_CONFIG = {"n_items": 12, "min_items": 5, "per_doc": 2, "mmlu_items": 0, "math_word_items": 0, "math_expr_items": 0,
                "humaneval_items": 0, "benchmarks": [],  # the standard benchmarks: tests/assets/test_benchmark_assets.py
                "held_out_tasks": ["kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"]}
SCORES_CONFIG = {"max_new_tokens": 4, "batch_size": 8}


def fixture_assets(values: dict[str, dict]) -> list:
    """Stand-ins for the upstream pipeline: assets of the same keys returning prepared outputs."""
    def make(name: str):
        @asset(name=name)
        def _value() -> dict:
            return values[name]
        return _value
    return [make(n) for n in values]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer):
    """A corpus whose training split repeats 12 held-out documents, instruction pairs, a training run with 2 checkpoints."""
    root = tmp_path_factory.mktemp("eval-home")
    enc, tok_path = tiny_tokenizer
    texts = make_docs(150, seed=11)
    ids = [f"doc{i:04d}" for i in range(len(texts))]
    val = [t for d, t in zip(ids, texts) if split_of(d, VAL_PERMILLE) == "val"]
    leak_ids = [f"mirror{i}" for i in range(200) if split_of(f"mirror{i}", VAL_PERMILLE) == "train"][:12]
    leaked = val[::4][:12]  # near-duplicates that survived cleaning: same text under a training-split id
    corpus = root / "corpus.parquet"
    pq.write_table(pa.table({"id": ids + leak_ids, "text": texts + leaked}), corpus)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "response": f"{a} + 1 = {a + 1}.", "split": "train"}) + "\n"
                             for a in range(5)))

    storage = KilnStorageResource(root=str(root / "storage"))
    mlflow = MlflowResource(tracking_uri=f"sqlite:///{root / 'mlflow.db'}", artifact_root=str(root / "art"))
    client = mlflow.client()
    train_run = client.create_run(mlflow.experiment_id(client), tags={"mlflow.runName": "base_model"}).info.run_id
    run_dir = storage.path("base_model", "run0001")
    (run_dir / "job.json").write_text(json.dumps({"mlflow_run_id": train_run}))
    cfg = ModelConfig(vocab_size=padded_vocab(enc.n_vocab), block_size=64, n_layer=1, n_head=2, n_embd=32)
    ckpts = {}
    for step in (10, 20):
        torch.manual_seed(step)
        ckpts[step] = save_checkpoint(run_dir / "checkpoints", step, {"model": GPT(cfg).state_dict()},
                                      {"model": asdict(cfg), "val_loss": 6.0 - step / 10, "task": "pretrain"},
                                      {"tokenizer.json": tok_path}, keep_last=0)
    values = {
        "clean_corpus": {"path": str(corpus), "version": "corpus1"},
        "token_shards": {"val_permille": VAL_PERMILLE, "version": "shards1"},
        "instruction_data": {"path": str(pairs), "version": "pairs1"},
        "base_model": {"checkpoint": str(ckpts[20]), "final_val_loss": 4.0, "version": "base1",
                       "mlflow_run_id": train_run, "out_dir": str(run_dir)},
    }
    resources = {"storage": storage, "mlflow": mlflow, "io_manager": FilesystemIOManager(base_dir=str(root / "handles"))}
    return {"root": root, "values": values, "resources": resources, "leaked": set(leaked), "val": val,
            "instance": DagsterInstance.ephemeral(), "train_run": train_run, "client": client, "ckpts": ckpts}


def run_pipeline(world, max_share: float):
    assets = [*fixture_assets(world["values"]), eval_suite, contamination_report, contamination_below_threshold, eval_scores]
    config = {"ops": {"eval_suite": {"config": SUITE_CONFIG}, "eval_scores": {"config": SCORES_CONFIG},
                      "contamination_report": {"config": {"max_share": max_share}}}}
    return materialize(assets, resources=world["resources"], instance=world["instance"], run_config=config,
                       raise_on_error=False)


@pytest.fixture(scope="module")
def scored(world):
    result = run_pipeline(world, max_share=0.8)
    assert result.success
    return result


def test_contamination_report_finds_exactly_the_leaked_items(world, scored):
    report = scored.output_for_node("contamination_report")
    suite = scored.output_for_node("eval_suite")
    assert set(suite["tasks"]) == {"kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"}
    total = 0
    for task, info in suite["tasks"].items():
        rows = [json.loads(line) for line in Path(info["data"]).read_text().splitlines()]
        expected = [i for i, r in enumerate(rows) if world["val"][r["doc_index"]] in world["leaked"]]
        assert report["tasks"][task]["contaminated_lines"] == expected, task
        assert report["tasks"][task]["clean_items"] == len(rows) - len(expected)
        total += len(expected)
    assert total >= 3  # the planted documents reach the items
    evals = scored.get_asset_check_evaluations()  # the check ran in the same run and passed under max_share 0.8
    assert [(e.check_name, e.passed) for e in evals] == [("contamination_below_threshold", True)]


def test_eval_scores_full_and_clean_beside_chance(world, scored):
    scores = scored.output_for_node("eval_scores")
    report = scored.output_for_node("contamination_report")["tasks"]
    assert scores["val_loss"] == 4.0 and scores["val_bits_per_byte"] > 0
    cont, clean = scores["tasks"]["kiln_continuation"], scores["tasks_clean"]["kiln_continuation"]
    assert cont["chance"] == clean["chance"] == 0.25 and 0 <= cont["acc"] <= 1
    for task, row in scores["tasks"].items():
        assert row["contaminated"] == report[task]["contaminated"]
        assert scores["tasks_clean"][task]["items"] == row["items"] - row["contaminated"]
    assert [g["prompt"] for g in scores["generations"]][:2] == ["The", "In this chapter, we"]
    meta = world["instance"].get_latest_materialization_event(AssetKey("eval_scores")).asset_materialization.metadata
    assert "clean score" in meta["scores"].value and "kiln_continuation" in meta["scores"].value


def test_contamination_over_threshold_blocks_downstream(world, scored):
    before = world["instance"].get_latest_materialization_event(AssetKey("eval_scores"))
    result = run_pipeline(world, max_share=0.0)
    assert not result.success
    (check,) = result.get_asset_check_evaluations()
    assert not check.passed and "over the 0% limit" in check.description
    after = world["instance"].get_latest_materialization_event(AssetKey("eval_scores"))
    assert after.run_id == before.run_id  # eval_scores (and release below it) did not run


def test_checkpoint_partitions_score_each_checkpoint_into_mlflow(world, scored):
    instance, client, train_run = world["instance"], world["client"], world["train_run"]
    keys = [checkpoint_key("run0001", s) for s in (10, 20)]
    instance.add_dynamic_partitions(CHECKPOINTS, keys + [checkpoint_key("run0001", 30)])
    suites = {"ppl": ["kiln_heldout_ppl"], "choice": ["kiln_continuation", "kiln_lastword"], "mmlu": ["kiln_mmlu"]}
    config = {"ops": {"checkpoint_evals": {"config": {"suites": suites, "limit": 6, "max_new_tokens": 4}}}}
    assets = [*fixture_assets(world["values"]), eval_suite, contamination_report, checkpoint_evals]
    outs = {}
    for key in keys:
        result = materialize(assets, selection=[checkpoint_evals], partition_key=key, resources=world["resources"],
                             instance=instance, run_config=config)
        outs[key] = result.output_for_node("checkpoint_evals")
    first, second = outs[keys[0]], outs[keys[1]]
    assert (first["step"], second["step"]) == (10, 20) and first["val_loss"] == pytest.approx(5.0)
    assert set(second["mlflow_runs"]) == {"ppl", "choice"}  # kiln_mmlu is not in this suite: that suite is skipped
    assert second["tasks"]["kiln_lastword"]["items"] == 6 and "kiln_lastword" in second["tasks_clean"]

    runs = client.search_runs([client.get_run(train_run).info.experiment_id], "tags.`kiln.kind` = 'checkpoint_eval'")
    assert len(runs) == 4  # 2 checkpoints x 2 suites
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {train_run}
    assert {(r.data.tags["kiln.suite"], int(r.data.tags["kiln.step"])) for r in runs} == {
        (s, st) for s in ("ppl", "choice") for st in (10, 20)}
    ppl_run = client.get_run(second["mlflow_runs"]["ppl"])
    assert ppl_run.data.metrics["kiln_heldout_ppl.bits_per_byte"] == second["tasks"]["kiln_heldout_ppl"]["bits_per_byte"]
    history = client.get_metric_history(train_run, "eval.kiln_continuation.acc_norm")
    assert sorted(m.step for m in history) == [10, 20]  # score against step, in the training run itself
    assert {a.path for a in client.list_artifacts(train_run, "eval")} == {"eval/accuracy_vs_step.png", "eval/bits_per_byte_vs_step.png"}

    meta = instance.get_latest_materialization_event(AssetKey("checkpoint_evals")).asset_materialization.metadata
    assert meta["accuracy_vs_step"].value.startswith("![accuracy") and meta["step"].value == 20
    assert "The" in meta["samples"].value

    gone = materialize(assets, selection=[checkpoint_evals], partition_key=checkpoint_key("run0001", 30),
                       resources=world["resources"], instance=instance, run_config=config, raise_on_error=False)
    assert not gone.success
    err = next(e for e in gone.all_events if e.is_step_failure).event_specific_data.error.to_string()
    assert "run0001-step0000030" in err and "keep_last" in err
