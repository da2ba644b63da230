"""RLHF assets materialized with Dagster on tiny inputs: reward_model (held-out accuracy, margin, the Hugging Face
folder) and ppo_model (curves, before/after measures), and the choice of the released chain.

Run: python -m pytest tests/assets/test_rlhf.py -q
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from dagster import AssetKey, DagsterInstance, Failure, asset, materialize

from assets.alignment import instruction_data, preference_data
from assets.rlhf import ppo_model, reward_model
from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.measures import MEASURES
from kiln.train.checkpoint import save_checkpoint
from resources.storage import HandleIOManager, KilnStorageResource
from resources.torchrun import TorchrunResource
from resources.tracking import MlflowResource
from tests.assets.test_posttrain import doc_ids, page
from tests.conftest import make_docs


def stub(name: str, value: dict):
    """An upstream asset that returns ``value`` as it is."""
    @asset(name=name)
    def _stub() -> dict:
        return value
    return _stub


def sft_world(home, tiny_tokenizer, model_dict) -> tuple[dict, dict]:
    """(stand-ins for raw_documents, token_shards, eval_suite, sft_model, tokenizer and training_plan over a tiny
    random SFT model and three documentation pages in ``home``, the resources of a run there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.evaluation.tasks import build_tasks

    _, tok_path = tiny_tokenizer
    texts = [t for _, t in make_docs(60, seed=11)]
    build_tasks(texts[:30], home / "suite", 10, 0)
    pages = [(i, page(f"Section {n}", texts[40 + n])) for n, i in enumerate(doc_ids("train", 3))]
    pq.write_table(pa.table({"id": [i for i, _ in pages], "text": [h for _, h in pages],
                             "content_type": ["text/html"] * len(pages)}), home / "raw.parquet")
    model = {**model_dict, "dropout": 0.0}
    torch.manual_seed(0)
    cfg = ModelConfig(**model)
    sft_ckpt = save_checkpoint(home / "sft", 3, {"model": GPT(cfg).state_dict()}, {"model": asdict(cfg)},
                               {"tokenizer.json": tok_path})
    stubs = {"raw_documents": {"path": str(home / "raw.parquet"), "version": "raw0"},
             "token_shards": {"val_permille": 300, "version": "sh0"}, "eval_suite": {"dir": str(home / "suite"), "version": "s0"},
             "sft_model": {"checkpoint": str(sft_ckpt), "version": "sft0"}, "tokenizer": {"path": str(tok_path), "version": "tok0"},
             "training_plan": {"model": model, "seq_len": 31, "world_size": 1, "micro_batch": 4, "grad_accum": 1,
                               "hardware": {"device": "cpu", "nproc_per_node": 1}}}
    resources = {"storage": KilnStorageResource(root=str(home / "storage")),
                 "mlflow": MlflowResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "art")),
                 "torchrun": TorchrunResource(timeout_s=300, pg_timeout_s=120),
                 "io_manager": HandleIOManager(base_dir=str(home / "storage" / "handles"))}
    return stubs, resources


@pytest.fixture(scope="module")
def materialized(tmp_path_factory, tiny_tokenizer, model_dict):
    home = tmp_path_factory.mktemp("rlhf")
    stubs, resources = sft_world(home, tiny_tokenizer, model_dict)
    made = [stub(name, value) for name, value in stubs.items()]
    config = {"ops": {
        "instruction_data": {"config": {"n_arithmetic": 80, "max_doc_pairs": 6, "val_permille": 250, "eval_items": 6}},
        "reward_model": {"config": {"max_steps": 4, "micro_batch": 4, "eval_interval": 2, "eval_pairs": 8}},
        "ppo_model": {"config": {"max_steps": 2, "prompts_per_step": 2, "max_new_tokens": 6, "eval_items": 4,
                                 "eval_interval": 1}},
    }}
    made += [instruction_data, preference_data, reward_model, ppo_model]
    never = stub("judged_preferences", {})  # never materialized here: reward_model's optional input loads as None
    result = materialize([*made, never], selection=made, resources=resources, run_config=config,
                         instance=DagsterInstance.ephemeral(), raise_on_error=True)
    return home, result


def metadata(result, key: str) -> dict:
    mats = [e.event_specific_data.materialization for e in result.all_events if e.is_step_materialization]
    return next(m.metadata for m in mats if m.asset_key == AssetKey(key))


def test_reward_model_asset_reports_held_out_pairs_and_writes_a_loadable_hf_folder(materialized) -> None:
    import transformers

    home, result = materialized
    rm = result.output_for_node("reward_model")
    assert rm["task"] == "reward" and rm["steps"] == 4 and rm["pairs"]["val"] == 8
    assert [h["step"] for h in rm["history"]] == [0, 2, 4] and 0 <= rm["final_val"]["accuracy"] <= 1
    meta = metadata(result, "reward_model")
    assert meta["pairs_held_out"].value == 8 and meta["held_out_accuracy"].value == float(f"{rm['final_val']['accuracy']:.4g}")
    assert meta["held_out_margin"].value == float(f"{rm['final_val']['margin']:.4g}")  # rounded for people
    assert "data:image/png" in meta["accuracy_curve"].value and "data:image/png" in meta["margin_curve"].value
    assert "mlflow_run" in meta
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm["hf_dir"])
    assert type(hf).__name__ == "GPT2ForSequenceClassification" and hf.config.num_labels == 1
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(rm["mlflow_run_id"]).data.metrics
    assert metrics["val_accuracy"] == pytest.approx(rm["final_val"]["accuracy"])
    assert metrics["val_margin"] == pytest.approx(rm["final_val"]["margin"])


def test_ppo_model_asset_trains_against_the_reward_model_and_measures_before_and_after(materialized) -> None:
    _, result = materialized
    ppo, rm = result.output_for_node("ppo_model"), result.output_for_node("reward_model")
    assert ppo["task"] == "ppo" and ppo["steps"] == 2 and ppo["reward_model"] == rm["version"]
    assert set(ppo["before"]) == set(ppo["after"]) == set(MEASURES)
    assert ppo["init_from"] == result.output_for_node("sft_model")["checkpoint"]
    assert [h["step"] for h in ppo["history"]] == [0, 1, 2]
    assert all(h["value_loss"] >= 0 and "kl" in h and "clip_frac" in h for h in ppo["history"][1:])
    meta = metadata(result, "ppo_model")
    for plot in ("reward_curve", "kl_curve", "loss_curves"):
        assert "data:image/png" in meta[plot].value
    assert meta["before_after"].value.startswith("| measure | before | after |")


def test_release_bundle_ships_the_stage_its_config_names() -> None:
    from assets.publish import ReleaseBundleConfig, _released

    rl, ppo = {"checkpoint": "rl", "version": "r1"}, {"checkpoint": "ppo", "version": "p1", "reward_model": "rm1"}
    rm = {"checkpoint": "rm", "version": "rm1"}
    assert _released(ReleaseBundleConfig(), rl, None) == (rl, {})
    assert _released(ReleaseBundleConfig(stage="ppo_model"), rl, ppo, rm) == (ppo, {"reward_model": rm, "ppo_model": ppo})
    with pytest.raises(Failure, match="never materialized"):
        _released(ReleaseBundleConfig(stage="ppo_model"), rl, None)
    with pytest.raises(Failure, match="trained against reward_model version rm1, but this home's reward_model is "
                                      "version rm2: materialize ppo_model again"):
        _released(ReleaseBundleConfig(stage="ppo_model"), rl, ppo, {**rm, "version": "rm2"})
    with pytest.raises(Failure, match="choose one of rl_model, ppo_model"):
        _released(ReleaseBundleConfig(stage="dpo_model"), rl, ppo)


def test_a_ppo_release_describes_the_ppo_chain_in_its_card_lineage_logbook_and_cost(materialized) -> None:
    """The card, kiln.json sections and cost table of a PPO release, from the reward and PPO runs above and a smoke
    run's other upstream outputs: the weights are said to be PPO's, the reward model's held-out accuracy is given,
    the Evaluation section says it scores the base model, and the reward and PPO runs are in lineage and logbook."""
    import json
    import math
    from pathlib import Path

    from kiln.posttrain.measures import stage_rows
    from kiln.release.card import logbook_summary, model_card
    from kiln.release.lineage import release_sections

    _, result = materialized
    ppo, rm = result.output_for_node("ppo_model"), result.output_for_node("reward_model")
    up = json.loads((Path(__file__).resolve().parents[1] / "data" / "card_upstream.json").read_text())
    sft = {**up["sft_model"], "after": {**up["sft_model"]["after"], **ppo["before"]}}  # PPO started from this SFT model
    raw = {**up["raw_documents"], "sources": [{"name": n} for n in up["raw_documents"]["stats"]["sources"]]}
    up = {**up, "raw_documents": raw, "sft_model": sft, "reward_model": rm, "ppo_model": ppo}
    card = model_card("kiln-ppo", "Apache-2.0", up, stage_rows(sft, up["dpo_model"], up["rl_model"], ppo), None, None,
                      "ppo_model")
    assert "they are the PPO stage's: the base model after SFT, then PPO against a reward model" in card
    assert "the released weights are not these but the PPO model's (RLHF, below)" in card
    assert "these weights are the last stage's" not in card
    assert "These scores are the base model's, before post-training" in card
    rlhf = card.split("## RLHF (the released weights)", 1)[1].split("\n## ", 1)[0]
    acc, n = rm["final_val"]["accuracy"], rm["pairs"]["val"]
    assert f"held-out pair accuracy {acc:.3f} ± {math.sqrt(acc * (1 - acc) / n):.3f} on {n} pairs (chance 0.5)" in rlhf
    assert f"reward_model version `{rm['version']}`" in rlhf and f"ppo_model version `{ppo['version']}`" in rlhf
    assert "| measure | base | sft | dpo | rl | ppo |" in card and "| measure | sft | dpo | rl | ppo |" in card
    assert "are the ppo columns of the Post-training tables above" in rlhf  # not a second copy of them
    info = release_sections("kiln-ppo", "Apache-2.0", up, {}, {}, "ppo_model")
    assert info["released"] == {"asset": "ppo_model", "stage": "ppo",
                                "chain": ["base_model", "sft_model", "reward_model", "ppo_model"]}
    assert info["lineage"]["reward_model"] == rm["version"] and info["lineage"]["ppo_model"] == ppo["version"]
    assert info["mlflow_runs"]["ppo_model"] == ppo["mlflow_run_id"] and info["mlflow_runs"]["reward_model"] == rm["mlflow_run_id"]
    stages = {s["stage"]: s for s in info["post_training"]}
    assert list(stages) == ["sft", "dpo", "rl", "reward", "ppo"] and stages["ppo"]["checkpoint"] == ppo["checkpoint"]
    assert [r["stage"] for r in logbook_summary(up)][-2:] == ["reward", "ppo"]
    from kiln.train.logbook import run_folders

    bundle = Path(result.output_for_node("ppo_model")["out_dir"]).parent / "bundle-info"
    bundle.mkdir(exist_ok=True)
    (bundle / "kiln.json").write_text(json.dumps(info))
    folders = dict(run_folders(bundle))
    assert folders["ppo"] == Path(ppo["checkpoint"]).parents[1] and folders["reward"] == Path(rm["checkpoint"]).parents[1]
    assert release_sections("kiln-rl", "Apache-2.0", {k: v for k, v in up.items() if k not in ("reward_model", "ppo_model")},
                            {}, {})["released"]["chain"] == ["base_model", "sft_model", "dpo_model", "rl_model"]


def test_the_rlhf_preset_opts_in_to_the_rlhf_chain_and_the_demo_does_not(tmp_path) -> None:
    from jobs.presets import load_preset
    from jobs.definitions import OPT_IN

    assert OPT_IN == ("scaling_ladder", "judged_preferences", "reward_model", "ppo_model")
    assert "opt_in" not in load_preset("demo", keep_opt_in=True) and "opt_in" not in load_preset("rlhf")
    rlhf = load_preset("rlhf", keep_opt_in=True)
    assert rlhf["opt_in"] == ["judged_preferences", "reward_model", "ppo_model"]
    assert rlhf["ops"]["release_bundle"]["config"]["stage"] == "ppo_model"
    assert rlhf["ops"]["training_plan"] == load_preset("demo")["ops"]["training_plan"]  # the demo otherwise
    bad = tmp_path / "bad.yaml"
    bad.write_text("select: [ppo_model]\n")
    with pytest.raises(SystemExit, match="unknown top-level key"):
        load_preset(str(bad))
