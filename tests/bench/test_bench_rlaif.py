"""bench/bench_rlaif.py: the presets it runs, the judge's checkable label accuracy, and its tables."""

import math

import pytest
from bench_module import load_bench

from jobs.presets import load_preset
from kiln.posttrain.instructions import write_jsonl


def test_each_preset_is_rlhf_with_the_feedback_and_the_seed_only_when_given(tmp_path):
    bench = load_bench("bench_rlaif")
    ops = load_preset(str(bench.preset_file(tmp_path, 64, None, "mixed")))["ops"]
    assert ops["release_bundle"]["config"]["stage"] == "ppo_model"  # the rlhf preset underneath
    assert ops["judged_preferences"]["config"]["prompts"] == 64 and "seed" not in ops["judged_preferences"]["config"]
    assert ops["dpo_model"]["config"] == {"feedback": "mixed"} and ops["reward_model"]["config"]["feedback"] == "mixed"
    seeded = load_preset(str(bench.preset_file(tmp_path, 64, 2, "judged")))["ops"]
    assert seeded["dpo_model"]["config"] == {"feedback": "judged", "seed": 2}
    assert seeded["judged_preferences"]["config"]["seed"] == seeded["reward_model"]["config"]["seed"] == 2


def test_the_judges_labels_are_checked_on_arithmetic_pairs_with_one_right_answer(tmp_path):
    bench = load_bench("bench_rlaif")
    write_jsonl([{"prompt": "What is 2 + 3?", "kind": "arithmetic", "answer": "5", "split": "train"},
                 {"prompt": "What is 4 - 1?", "kind": "arithmetic", "answer": "3", "split": "train"}],
                tmp_path / "pairs.jsonl")
    row = {"kind": "arithmetic", "split": "train"}
    write_jsonl([{**row, "prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},  # right
                 {**row, "prompt": "What is 4 - 1?", "chosen": "4 - 1 = 5.", "rejected": "3"},  # wrong
                 {**row, "prompt": "What is 2 + 3?", "chosen": "7", "rejected": "8"},  # both wrong
                 {**row, "kind": "doc_section", "prompt": "Explain x.", "chosen": "a", "rejected": "b"}],
                tmp_path / "judged.jsonl")
    got = bench.judged_label_accuracy({"path": str(tmp_path / "judged.jsonl")}, {"path": str(tmp_path / "pairs.jsonl")})
    assert got.pop("stderr") == pytest.approx(math.sqrt(0.5 * 0.5 / 2))
    assert got == {"arithmetic_pairs": 3, "one_answer_right": 2, "judge_right": 1, "accuracy": 0.5, "both_right": 0,
                   "both_wrong": 1}


def test_the_tables_show_each_feedback_with_its_pairs_and_held_out_measures():
    bench = load_bench("bench_rlaif")
    judge = {"agreement": {"agreement": 0.6, "stderr": 0.035, "n": 200, "ties": 3}, "position_bias": {"checkable": 0.1},
             "pairs_labelled": 240, "pairs_judged": 250, "identical_skipped": 6, "rule": "yes_no"}
    label = {"arithmetic_pairs": 200, "one_answer_right": 40, "judge_right": 30, "accuracy": 0.75, "stderr": 0.068,
             "both_right": 1, "both_wrong": 159}
    move = {"before": 0.789, "after": 0.811, "change": 0.022, "stderr": 0.02}
    dpo = {"pairs": {"checkable": 835, "judged": 240}, "held_out_pairs": 175, "preference_accuracy": move,
           "preference_margin": {**move, "before": 9.6, "after": 11.7}, "dpo_reward_accuracy": 0.71, "train_wall_s": 55.0,
           "call_s": 80.0, "reused": False}
    reward = {"pairs": {"checkable": 702, "judged": 0}, "held_out_pairs": 167, "accuracy": {"before": 0.5, "after": 0.9},
              "margin": {"before": 0.0, "after": 2.5}, "train_wall_s": 20.0, "call_s": 40.0, "reused": True}
    out = {"home": "/h", "prompts": 256, "seed": None, "judge_call_s": 61.0, "judge": judge, "judged_label_accuracy": label,
           "dpo": [{**dpo, "feedback": "mixed"}], "reward": [{**reward, "feedback": "checkable"}], "wall_s": 300.0}
    text = bench.report(out)
    assert "| agreement with the checkable labels (held-out preference_data pairs) | 0.600 ± 0.035 (n=200, 3 ties) |" in text
    assert "| its labels on its own arithmetic pairs with one right answer | 30 of 40 right (0.750 ± 0.068)" in text
    assert "| mixed | 835 | 240 | 0.789 -> 0.811 (+0.022 ± 0.020) | 9.60 -> 11.70 (+0.02 ± 0.02) | 0.710 | 55 s | 80 s |" in text
    assert "| checkable | 702 | 0 | 0.500 -> 0.900 ± 0.023 (n=167) | 0.000 -> 2.500 | 20 s (reused) | 40 s |" in text
