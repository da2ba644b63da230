"""dpo_model and reward_model trained on AI-judged pairs (feedback: judged or mixed), materialized with Dagster on
tiny inputs: which files each job read, how many pairs came from each source, held-out measures on preference_data's
pairs, the judged pairs' version in the run's inputs, and the failures of an unknown choice or a judge never run.

Run: python -m pytest tests/assets/test_alignment_feedback.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import DagsterInstance, Failure, asset, materialize

from assets.alignment import DpoModelConfig, Feedback, dpo_model, instruction_data, preference_data
from assets.rlhf import RewardModelConfig, reward_model
from kiln.posttrain.instructions import write_jsonl
from kiln.posttrain.measures import heldout_suite, suite_key
from kiln.posttrain.sft import read_pairs
from tests.assets.test_rlhf import metadata, sft_world, stub

JUDGED_TRAIN = 12  # training pairs the stand-in judge labels (every third one the wrong way round)


def judged_rows(prefs_path: str) -> list[dict]:
    """What judged_preferences writes (kiln.posttrain.judge.labelled_rows: preference_data's format, error "judge"),
    from preference_data's training pairs, plus one held-out row that no stage may train or be measured on."""
    train = read_pairs(prefs_path, "train")[:JUDGED_TRAIN]
    rows = [{**r, "id": f"j{i}", "error": "judge", "judge_margin": 0.5,
             **({"chosen": r["rejected"], "rejected": r["chosen"]} if i % 3 == 2 else {})} for i, r in enumerate(train)]
    held = read_pairs(prefs_path, "val")[0]
    return rows + [{**held, "id": "jval", "error": "judge", "chosen": held["rejected"], "rejected": held["chosen"]}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_tokenizer, model_dict):
    """(home, the failed run without judged_preferences, the run with it): dpo_model mixed, reward_model judged."""
    home = tmp_path_factory.mktemp("feedback")
    stubs, resources = sft_world(home, tiny_tokenizer, model_dict)

    @asset(name="judged_preferences")
    def judged(preference_data: dict) -> dict:
        path = home / "judged" / "preferences.jsonl"
        path.parent.mkdir(exist_ok=True)
        write_jsonl(judged_rows(preference_data["path"]), path)
        return {"path": str(path), "version": "judged0"}

    made = [stub(name, value) for name, value in stubs.items()] + [instruction_data, preference_data]
    small = {"max_steps": 4, "micro_batch": 4, "eval_interval": 2, "eval_pairs": 8}
    config = {"ops": {
        "instruction_data": {"config": {"n_arithmetic": 80, "max_doc_pairs": 6, "val_permille": 250, "eval_items": 6}},
        "dpo_model": {"config": {**small, "feedback": "mixed"}},
        "reward_model": {"config": {**small, "feedback": "judged"}},
    }}
    # judged_preferences never materialized in this home: its handle is missing, so the stages get None
    missing = materialize([*made, judged, dpo_model], selection=[*made, dpo_model], resources=resources,
                          run_config={"ops": {k: config["ops"][k] for k in ("instruction_data", "dpo_model")}},
                          instance=DagsterInstance.ephemeral(), raise_on_error=False)
    result = materialize([*made, judged, dpo_model, reward_model], resources=resources, run_config=config,
                         instance=DagsterInstance.ephemeral(), raise_on_error=True)
    return home, missing, result


def job_file(value: dict) -> dict:
    return json.loads((Path(value["out_dir"]) / "job.json").read_text())


def test_feedback_defaults_to_checkable_and_an_unknown_choice_names_the_field_and_the_choices() -> None:
    assert DpoModelConfig().feedback == RewardModelConfig().feedback == "checkable"
    prefs = {"path": "/p/preferences.jsonl", "version": "p1"}
    checkable = Feedback("dpo_model", "checkable", prefs, {"path": "/j.jsonl", "version": "j1"})
    assert checkable.files == {"train_files": ["/p/preferences.jsonl"]} and checkable.inputs == {}  # the key as before
    with pytest.raises(Failure, match=r"dpo_model.feedback: 'rlaif' is not a feedback choice; choose one of "
                                      r"checkable, judged, mixed") as e:
        Feedback("dpo_model", "rlaif", prefs, None)
    assert not e.value.allow_retries
    with pytest.raises(Failure, match=r"reward_model.feedback is judged, but judged_preferences was never materialized "
                                      r"in this home: materialize it first, e.g. kiln run --preset rlhf --select "
                                      r"judged_preferences,reward_model"):
        Feedback("reward_model", "judged", prefs, None)


def test_judged_or_mixed_without_judged_preferences_fails_saying_how_to_make_them(trained) -> None:
    _, missing, _ = trained
    assert not missing.success
    failures = [ev for ev in missing.all_events if ev.is_step_failure]
    assert [ev.step_key for ev in failures] == ["dpo_model"]
    text = failures[0].event_specific_data.error.to_string()
    assert ("dpo_model.feedback is mixed, but judged_preferences was never materialized in this home: materialize it "
            "first, e.g. kiln run --preset rlhf --select judged_preferences,dpo_model") in text


def test_mixed_dpo_trains_on_both_files_and_is_held_out_on_the_checkable_pairs(trained) -> None:
    from mlflow.tracking import MlflowClient

    home, _, result = trained
    dpo, prefs, judged = (result.output_for_node(k) for k in ("dpo_model", "preference_data", "judged_preferences"))
    checkable_train = len(read_pairs(prefs["path"], "train"))
    assert dpo["feedback"] == {"choice": "mixed", "pairs": {"checkable": checkable_train, "judged": JUDGED_TRAIN},
                               "held_out_pairs": 8, "judged_preferences": "judged0"}
    assert dpo["pairs"] == {"train": checkable_train + JUDGED_TRAIN, "val": 8, "train_by_file": [checkable_train, JUDGED_TRAIN]}
    job = job_file(dpo)
    assert job["train_files"] == [prefs["path"], judged["path"]] and job["val_files"] == [prefs["path"]]
    assert dpo["suite_key"] == suite_key(heldout_suite(result.output_for_node("instruction_data"), prefs))
    assert dpo["initial_val"]["reward_margin"] == 0.0 and "reward_accuracy" in dpo["final_val"]
    meta = metadata(result, "dpo_model")
    assert meta["feedback"].value == "mixed" and meta["pairs_checkable"].value == checkable_train
    assert meta["pairs_judged"].value == JUDGED_TRAIN and meta["judged_preferences_version"].value == "judged0"
    run = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").get_run(dpo["mlflow_run_id"])
    assert run.data.tags["input.judged_preferences"] == "judged0"  # in the run key: another judge trains again


def test_a_judged_reward_model_trains_on_the_judged_pairs_alone(trained) -> None:
    _, _, result = trained
    rm, prefs, judged = (result.output_for_node(k) for k in ("reward_model", "preference_data", "judged_preferences"))
    arithmetic = [r for r in read_pairs(judged["path"], "train") if r["kind"] == "arithmetic"]  # pair_kinds' default
    assert 0 < len(arithmetic) <= JUDGED_TRAIN
    assert rm["feedback"] == {"choice": "judged", "pairs": {"checkable": 0, "judged": len(arithmetic)},
                              "held_out_pairs": 8, "judged_preferences": "judged0"}
    job = job_file(rm)
    assert job["train_files"] == [judged["path"]] and job["val_files"] == [prefs["path"]]
    assert rm["pairs"]["val"] == 8 and 0.0 <= rm["final_val"]["accuracy"] <= 1.0
    meta = metadata(result, "reward_model")
    assert meta["feedback"].value == "judged" and meta["pairs_checkable"].value == 0
    assert meta["pairs_judged"].value == len(arithmetic)
