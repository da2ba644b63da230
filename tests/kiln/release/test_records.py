"""kiln.release.records: the card's typed records, read from a smoke run's asset outputs (tests/data/card_upstream.json)
and from made-up red-team and ladder outputs; a key the card needs and an output lacks is named."""

import json
from pathlib import Path

import pytest

from kiln.common.config import RecordError
from kiln.release.records import BaseRun, CardPlan, EvalScores, LossHistory, RedTeam

UPSTREAM = Path(__file__).resolve().parents[2] / "data" / "card_upstream.json"


@pytest.fixture(scope="module")
def up() -> dict:
    return json.loads(UPSTREAM.read_text())


def test_the_plan_base_run_and_scores_read_a_smoke_runs_outputs(up):
    plan = CardPlan.from_dict(up["training_plan"])
    assert plan.params == up["training_plan"]["params"] and plan.hardware == up["training_plan"]["hardware"]
    assert plan.scaling is None and plan.sizing is None  # no ladder, preset sizing
    base = BaseRun.from_dict(up["base_model"])
    assert (base.steps, base.final_val_loss, base.checkpoint) == (up["base_model"]["steps"], up["base_model"]["final_val_loss"],
                                                                  up["base_model"]["checkpoint"])
    assert LossHistory.from_dict(up["base_model"]).curve == up["base_model"]["curve"]
    scores = EvalScores.from_dict(up["eval_scores"])
    assert set(scores.tasks) == set(up["eval_scores"]["tasks"]) and scores.tasks_clean == up["eval_scores"]["tasks_clean"]


def test_the_plans_ladder_prediction_is_a_record_too(up):
    sc = {"ladder": "l1", "params": 10, "tokens": 200, "predicted_val_loss": 3.0, "interval": [2.9, 3.1],
          "law": {"E": 1.0}, "rungs": [], "optimal": {"error": "x"}, "sizing": "preset"}
    plan = CardPlan.from_dict({**up["training_plan"], "scaling": sc, "sizing": "law: ..."})
    assert plan.scaling.ladder == "l1" and plan.scaling.intervals is None and plan.sizing == "law: ..."
    with pytest.raises(RecordError, match=r"training_plan.scaling: no 'predicted_val_loss'"):
        CardPlan.from_dict({**up["training_plan"], "scaling": {k: v for k, v in sc.items() if k != "predicted_val_loss"}})


def test_a_missing_key_names_it_and_the_output(up):
    with pytest.raises(RecordError, match=r"base_model: no 'final_val_loss'"):
        BaseRun.from_dict({k: v for k, v in up["base_model"].items() if k != "final_val_loss"})
    with pytest.raises(RecordError, match=r"training_plan: no 'world_size'"):
        CardPlan.from_dict({k: v for k, v in up["training_plan"].items() if k != "world_size"})


REPORT = {"version": "rt1", "judge": {"family": "llama", "kind": "checkpoint", "path": "/x/j", "params": 10},
          "probes": {"intended_use": "docs", "excluded_uses": ["medical advice"], "n": 5, "sha256": "ab" * 32, "source": "blns"},
          "stages": {s: {"summary": {"kinds": {"injection": {"rules": {"rate": r}, "judge": {"rate": r / 2},
                                                              "judge_agrees_with_rules": 0.9}}}}
                     for s, r in (("sft", 0.1), ("rl", 0.3))}}
GATE = {"stage": "rl", "gate_on": "judge", "reasons": [], "limits": {"injection": 0.25},
        "summary": {"kinds": {"injection": {"n": 5, "gated": {"rate": 0.15, "stderr": 0.05}}}}}


def test_the_red_team_record_joins_the_report_and_the_gate():
    rt = RedTeam.from_dict(REPORT, GATE)
    (k,) = rt.kinds
    assert (k.kind, k.n, k.gated_rate, k.limit, k.judge_rate) == ("injection", 5, 0.15, 0.25, 0.15)
    assert k.rules_rate == {"sft": 0.1, "rl": 0.3} and k.judge_orders_references is None
    assert (rt.stage, rt.probes, rt.override, rt.judge_skipped) == ("rl", 5, "", None)


def test_a_red_team_stage_without_the_gates_kind_is_named():
    report = {**REPORT, "stages": {**REPORT["stages"], "sft": {"summary": {"kinds": {}}}}}
    with pytest.raises(RecordError, match=r"red_team_report.stages.sft: no 'summary.kinds.injection'"):
        RedTeam.from_dict(report, GATE)
    with pytest.raises(RecordError, match=r"red-team gate: no 'stage'"):
        RedTeam.from_dict(REPORT, {k: v for k, v in GATE.items() if k != "stage"})


def test_the_data_and_post_training_records_read_a_smoke_runs_outputs(up):
    from kiln.release.records import (CleanCorpus, DpoRun, InstructionData, RawDocuments, RlRun, SftRun, TokenizerInfo,
                                      TokenShards)

    raw = RawDocuments.from_dict(up["raw_documents"])
    assert raw.documents == up["raw_documents"]["stats"]["totals"]["documents"]
    assert [s.name for s in raw.sources] == list(up["raw_documents"]["stats"]["sources"])
    clean = CleanCorpus.from_dict(up["clean_corpus"])
    assert clean.kept_docs == up["clean_corpus"]["report"]["kept_docs"] and clean.version == up["clean_corpus"]["version"]
    shards = TokenShards.from_dict(up["token_shards"])
    assert shards.train_tokens == up["token_shards"]["totals"]["train"]["tokens"]
    assert TokenizerInfo.from_dict(up["tokenizer"]).n_vocab == up["tokenizer"]["n_vocab"]
    instr = InstructionData.from_dict(up["instruction_data"])
    assert instr.ngram_words == up["instruction_data"]["decontamination"]["ngram_words"]
    assert SftRun.from_dict(up["sft_model"]).before_after == up["sft_model"]["before_after"]
    assert DpoRun.from_dict(up["dpo_model"]).lora == up["dpo_model"]["lora"]["enabled"]
    rl = RlRun.from_dict(up["rl_model"])
    assert (rl.group_size, rl.final_val_reward) == (up["rl_model"]["group_size"], up["rl_model"]["final_val_reward"])


def test_a_missing_nested_key_names_its_path(up):
    from kiln.release.records import JudgedPreferences, RawDocuments, TokenShards

    with pytest.raises(RecordError, match=r"token_shards: no 'totals.val'"):
        TokenShards.from_dict({**up["token_shards"], "totals": {"train": {"tokens": 1}}})
    with pytest.raises(RecordError, match=r"raw_documents.stats.sources.[\w-]+: no 'license'"):
        raw = up["raw_documents"]
        name = next(iter(raw["stats"]["sources"]))
        sources = {name: {k: v for k, v in raw["stats"]["sources"][name].items() if k != "license"}}
        RawDocuments.from_dict({**raw, "stats": {**raw["stats"], "sources": sources}})
    with pytest.raises(RecordError, match=r"judged_preferences.summary: no 'position_bias'"):
        JudgedPreferences.from_dict({"version": "j", "rule": "r", "judge": {}, "principles": {},
                                     "summary": {"agreement": {}, "pairs_labelled": 1, "ties": 0}})


def test_the_card_names_the_asset_output_that_lacks_a_key(up):
    from kiln.release.card import card_inputs

    assert card_inputs(up).ppo is None and card_inputs(up).red_team is None
    with pytest.raises(RecordError, match=r"rl_model: no 'kl_coef'"):
        card_inputs({**up, "rl_model": {k: v for k, v in up["rl_model"].items() if k != "kl_coef"}})
