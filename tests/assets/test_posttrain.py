"""Post-training assets materialized with Dagster on tiny inputs: decontaminated instruction data, preference pairs,
and the DPO and RL torchrun jobs, each measured before and after on the same held-out items (metadata and MLflow).

Run: python -m pytest tests/assets/test_posttrain.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dagster import AssetKey, DagsterInstance, asset, materialize

from assets.alignment import dpo_model, instruction_data, preference_data, rl_model
from kiln.train.checkpoint import save_checkpoint
from kiln.evaluation.tasks import build_tasks
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.measures import MEASURES, heldout_suite, stage_rows
from kiln.tokens.shards import split_of
from resources.storage import HandleIOManager, KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource
from tests.conftest import make_docs

VAL_PERMILLE = 300


def page(title: str, body: str) -> str:
    return f"<html><body><h2>{title}</h2><p>{body}</p></body></html>"


def doc_ids(split: str, n: int) -> list[str]:
    return [i for i in (f"docs/page{k}.html" for k in range(200)) if split_of(i, VAL_PERMILLE) == split][:n]


@pytest.fixture(scope="module")
def materialized(tmp_path_factory, tiny_tokenizer, model_dict):
    home = tmp_path_factory.mktemp("posttrain")
    enc, tok_path = tiny_tokenizer
    texts = [t for _, t in make_docs(80, seed=11)]
    suite_dir = home / "suite"
    build_tasks(texts[:40], suite_dir, 10, 0)  # eval items come from the first 40 texts
    train_ids, val_ids = doc_ids("train", 4), doc_ids("val", 1)
    pages = [(train_ids[0], page("Leaked section", texts[0])), (val_ids[0], page("Held out page", texts[60]))]
    pages += [(i, page(f"Section {n}", texts[50 + n])) for n, i in enumerate(train_ids[1:])]
    raw_path = home / "raw.parquet"
    pq.write_table(pa.table({"id": [i for i, _ in pages], "text": [h for _, h in pages],
                             "content_type": ["text/html"] * len(pages)}), raw_path)
    model = {**model_dict, "dropout": 0.0}
    torch.manual_seed(0)
    cfg = ModelConfig(**model)
    sft_ckpt = save_checkpoint(home / "sft", 3, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg)},
                               {"tokenizer.json": tok_path})

    @asset(name="raw_documents")
    def raw_stub() -> dict:
        return {"path": str(raw_path), "version": "raw0"}

    @asset(name="token_shards")
    def shards_stub() -> dict:
        return {"val_permille": VAL_PERMILLE, "version": "sh0"}

    @asset(name="eval_suite")
    def suite_stub() -> dict:
        return {"dir": str(suite_dir), "version": "suite0"}

    @asset(name="sft_model")
    def sft_stub() -> dict:
        return {"checkpoint": str(sft_ckpt), "version": "sft0"}

    @asset(name="training_plan")
    def plan_stub() -> dict:
        return {"model": model, "seq_len": 31, "world_size": 1, "micro_batch": 4, "grad_accum": 1,
                "hardware": {"device": "cpu", "nproc_per_node": 1}}

    @asset(name="tokenizer")
    def tok_stub() -> dict:
        return {"path": str(tok_path), "version": "tok0"}

    @asset(name="judged_preferences")
    def judged_stub() -> dict:  # never materialized here: dpo_model's optional input loads as None
        raise AssertionError("not selected")

    mlflow = MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "art"))
    resources = {"storage": KilnStorageResource(root=str(home / "storage")), "mlflow": mlflow,
                 "torchrun": TorchrunResource(timeout_s=300, pg_timeout_s=120),
                 "io_manager": HandleIOManager(base_dir=str(home / "storage" / "handles"))}
    config = {"ops": {
        "instruction_data": {"config": {"n_arithmetic": 80, "max_doc_pairs": 10, "val_permille": 250, "eval_items": 6}},
        "dpo_model": {"config": {"max_steps": 4, "micro_batch": 4, "eval_interval": 2, "eval_pairs": 8,
                                 "lora": {"enabled": True, "rank": 2}}},
        "rl_model": {"config": {"max_steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6,
                                "eval_items": 4, "eval_interval": 1}},
    }}
    made = [raw_stub, shards_stub, suite_stub, sft_stub, plan_stub, tok_stub, instruction_data, preference_data,
            dpo_model, rl_model]
    result = materialize([*made, judged_stub], selection=made, resources=resources, run_config=config,
                         instance=DagsterInstance.ephemeral(), raise_on_error=True)
    return home, result, texts


def metadata(result, key: str) -> dict:
    mats = [e.event_specific_data.materialization for e in result.all_events if e.is_step_materialization]
    return next(m.metadata for m in mats if m.asset_key == AssetKey(key))


def test_instruction_data_skips_held_out_pages_and_pairs_sharing_eval_text(materialized) -> None:
    _, result, texts = materialized
    instr = result.output_for_node("instruction_data")
    rows = [json.loads(line) for line in Path(instr["path"]).read_text().splitlines()]
    prompts = {r["prompt"] for r in rows}
    assert "Explain Leaked section." not in prompts  # its text is an eval item's source
    assert "Explain Held out page." not in prompts  # a held-out page is evaluation material
    assert {"Explain Section 0.", "Explain Section 1.", "Explain Section 2."} <= prompts
    d = instr["decontamination"]
    assert d["held_out_pages_skipped"] == 1 and d["pairs_sharing_eval_ngrams"] >= 1 and d["ngram_words"] == 13
    assert d["eval_items_checked"] == 30
    assert "Leaked section" in metadata(result, "instruction_data")["dropped_examples"].value


def test_preference_data_pairs_every_instruction_with_a_wrong_answer(materialized) -> None:
    _, result, _ = materialized
    instr, prefs = result.output_for_node("instruction_data"), result.output_for_node("preference_data")
    rows = [json.loads(line) for line in Path(prefs["path"]).read_text().splitlines()]
    pairs = [json.loads(line) for line in Path(instr["path"]).read_text().splitlines()]
    assert len(rows) == sum(sum(v.values()) for v in prefs["counts"].values())
    arith = [p for p in pairs if p["kind"] == "arithmetic"]
    assert sorted(r["id"] for r in rows if r["kind"] == "arithmetic") == sorted(p["id"] for p in arith)
    # a section needs another document's section in its split to be rejected against
    sections = [p for p in pairs if p["kind"] == "doc_section" and p["split"] == "train"]
    assert len([r for r in rows if r["error"] == "other_section" and r["split"] == "train"]) == len(sections) >= 2
    assert all(r["chosen"] != r["rejected"] for r in rows)


def test_dpo_and_rl_assets_measure_before_and_after_on_the_same_items(materialized) -> None:
    home, result, _ = materialized
    dpo, rl = result.output_for_node("dpo_model"), result.output_for_node("rl_model")
    suite = heldout_suite(result.output_for_node("instruction_data"), result.output_for_node("preference_data"))
    assert len(suite["arithmetic"]) == len(suite["preferences"]) == len(suite["instructions"]) == 6
    assert dpo["suite_key"] == rl["suite_key"]
    assert rl["before"] == dpo["after"]  # the RL stage starts where DPO ended, on the same items
    assert set(dpo["before"]) == set(MEASURES)
    assert dpo["lora"]["enabled"] and not rl["lora"]["enabled"]
    assert dpo["steps"] == 4 and rl["steps"] == 2 and rl["init_from"] == dpo["checkpoint"]
    table = metadata(result, "dpo_model")["before_after"].value
    assert table.startswith("| measure | before | after | change | stderr | z | beyond_noise | items | what |")
    assert "preference_accuracy" in table
    assert rl["after_scores"]["arithmetic_exact_match"]["denom"] == 6  # item by item: the next stage reuses them
    by = {r["measure"]: r for r in rl["before_after"]}
    assert by["preference_margin"]["items"] == 6 and by["preference_margin"]["stderr"] is not None
    assert by["preference_margin"]["change"] == pytest.approx(rl["after"]["preference_margin"] - rl["before"]["preference_margin"])
    rl_meta = metadata(result, "rl_model")
    assert "data:image/png" in rl_meta["reward_curve"].value and "held_out_reward" in rl_meta
    assert "data:image/png" in metadata(result, "dpo_model")["reward_margin_curve"].value
    rows = stage_rows({"before": dpo["before"], "after": dpo["before"]}, dpo, rl)
    assert [r["measure"] for r in rows] == list(MEASURES) and rows[0]["rl"] == rl["after"][rows[0]["measure"]]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    run = client.get_run(dpo["mlflow_run_id"])
    assert run.data.metrics["before.preference_accuracy"] == dpo["before"]["preference_accuracy"]
    assert run.data.metrics["after.response_loss"] == pytest.approx(dpo["after"]["response_loss"])
    assert run.data.metrics["stderr.preference_margin"] == pytest.approx(
        next(r["stderr"] for r in dpo["before_after"] if r["measure"] == "preference_margin"))
    assert "val_reward_margin" in run.data.metrics  # streamed from rank 0 of the torchrun job
    assert {a.path for a in client.list_artifacts(dpo["mlflow_run_id"])} >= {"before_after.json", "margins.png"}
    assert "val_reward" in client.get_run(rl["mlflow_run_id"]).data.metrics
    # the default replays DPO's loss on preference_data's training pairs beside the policy term
    replayed = [h["preference_loss"] for h in rl["history"] if "preference_loss" in h]
    assert rl["preference_coef"] == 0.1 and replayed and all(0 < v < 5 for v in replayed), rl["history"]


def test_a_checkable_dpo_run_keeps_the_run_key_it_had_before_feedback_was_a_choice(materialized) -> None:
    """feedback: checkable (the default) trains on preference_data's pairs alone with exactly the job fields and
    inputs dpo_model gave before judged pairs could train it, so the runs of homes made then are reused (the run
    folder's name hashes that key with the asset's code version)."""
    from assets.alignment import DpoModelConfig, dpo_model
    from kiln.train.launch import RunSpec
    from resources.torchrun import run_folder_name

    home, result, _ = materialized
    dpo, prefs = result.output_for_node("dpo_model"), result.output_for_node("preference_data")
    assert dpo["feedback"]["choice"] == "checkable" and dpo["feedback"]["judged_preferences"] is None
    assert dpo["feedback"]["pairs"] == {"checkable": dpo["pairs"]["train"], "judged": 0}
    job = json.loads((Path(dpo["out_dir"]) / "job.json").read_text())
    assert job["train_files"] == [prefs["path"]] and job["val_files"] == [] and "feedback" not in job  # held out: train_files[0]
    config = DpoModelConfig(max_steps=4, micro_batch=4, eval_interval=2, eval_pairs=8, lora={"enabled": True, "rank": 2})
    fields = {**config.job_fields(), "train_files": [prefs["path"]], "ckpt_interval": 4, "keep_last": 1, "log_interval": 25}
    del fields["init_from"], fields["feedback"]  # the fields dpo_model set before feedback existed
    plan = {**result.output_for_node("training_plan"), "micro_batch": 4}
    before = RunSpec("dpo", fields, plan, {"sft_model": "sft0", "preference_data": prefs["version"]}, "",
                     root=str(KilnStorageResource(root=str(home / "storage")).local_base()))
    code_version = dpo_model.specs_by_key[dpo_model.key].code_version  # the run folder hashes it with the key
    assert Path(dpo["out_dir"]).name == run_folder_name(before.key, code_version)
