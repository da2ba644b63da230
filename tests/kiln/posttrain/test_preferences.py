"""Tests for kiln.posttrain.preferences: the chosen response is the correct one, the rejected one is really wrong;
which pair files a preference stage trains on (feedback) and how it reads them (kiln.posttrain.common).

Run: python -m pytest tests/kiln/posttrain/test_preferences.py -q
"""

from __future__ import annotations

import random
import re

import pytest

from kiln.common.config import ConfigError
from kiln.posttrain.instructions import arithmetic, arithmetic_reward, build_pairs
from kiln.posttrain.preferences import (ERRORS, FEEDBACK, build_preferences, check_feedback, feedback_files,
                                        pairs_by_source, wrong_answer)

PAGE = """<html><body>
<h2>Rivers</h2><p>The river runs slowly through the valley, carrying silt from the mountains to the sea below.</p>
<h2>Roads</h2><p>The long road climbs over the pass and down into the quiet village where the market is held.</p>
</body></html>"""
OTHER = """<html><body>
<h2>Trees</h2><p>The tall tree by the farmer's house has stood there for a hundred years and shades the field.</p>
</body></html>"""


def test_arithmetic_preferences_pair_the_exact_answer_with_a_wrong_one() -> None:
    pairs = build_pairs([], n_arithmetic=400, seed=3, val_permille=200, max_doc_pairs=0)
    prefs = build_preferences(pairs, seed=0)
    assert len(prefs) == len(pairs)
    errors = set()
    for pref, pair in zip(prefs, pairs):
        assert pref["prompt"] == pair["prompt"] and pref["split"] == pair["split"] and pref["id"] == pair["id"]
        assert pref["chosen"] == pair["response"]
        assert arithmetic_reward(pref["chosen"], pair["answer"]) == 1.0
        assert arithmetic_reward(pref["rejected"], pair["answer"]) == 0.0  # checkably wrong
        assert pref["rejected_answer"] != pair["answer"]
        # the same sentence up to the answer: only the number differs
        assert pref["rejected"].rsplit("= ", 1)[0] == pref["chosen"].rsplit("= ", 1)[0]
        assert re.fullmatch(r"-?\d+ [+-] -?\d+ = -?\d+\.", pref["rejected"])
        errors.add(pref["error"])
    assert errors == set(ERRORS)
    assert prefs == build_preferences(pairs, seed=0)  # reproducible
    assert prefs != build_preferences(pairs, seed=1)


def test_wrong_answer_kinds() -> None:
    rng = random.Random(0)
    seen = {}
    for _ in range(200):
        wrong, kind = wrong_answer("What is 7 + 5?", 12, rng)
        assert wrong != 12
        seen[kind] = wrong
    assert seen["wrong_operator"] == 2 and seen["sign"] == -12 and abs(seen["off_by_ten"] - 12) == 10
    assert 1 <= abs(seen["off_by_small"] - 12) <= 2
    for _ in range(50):  # 5 - 5 = 0: a sign flip or a swapped operator of 0 + 0 would not be wrong
        assert wrong_answer("What is 0 + 0?", 0, rng)[0] != 0


def test_doc_sections_reject_another_documents_section_in_the_same_split() -> None:
    pairs = build_pairs([("a", PAGE), ("b", OTHER)], n_arithmetic=0, seed=0, val_permille=0, max_doc_pairs=10)
    prefs = build_preferences(pairs, seed=0)
    by_prompt = {p["prompt"]: p for p in pairs}
    assert {p["prompt"] for p in prefs} == set(by_prompt)
    for pref in prefs:
        own = by_prompt[pref["prompt"]]
        assert pref["chosen"] == own["response"] and pref["rejected"] != own["response"]
        donor = next(p for p in pairs if p["id"] == pref["rejected_from"])
        assert donor["source_id"] != own["source_id"] and donor["split"] == own["split"]
        assert pref["error"] == "other_section"
    # a section whose split holds no other document's section gets no pair (never paired across splits)
    lone = build_preferences([{**p, "split": "val" if p["source_id"] == "b" else "train"} for p in pairs], seed=0)
    assert lone == []


def test_arithmetic_stream_answers_match_the_reward() -> None:
    for item in arithmetic(50, seed=1):
        assert arithmetic_reward(item["response"], item["answer"]) == 1.0
        assert arithmetic_reward("I do not know.", item["answer"]) == 0.0


def test_feedback_choices_name_the_files_a_stage_trains_and_is_held_out_on() -> None:
    assert FEEDBACK == ("checkable", "judged", "mixed")
    assert feedback_files("checkable", "p.jsonl", None) == {"train_files": ["p.jsonl"]}  # as before: no val_files
    assert feedback_files("checkable", "p.jsonl", "j.jsonl") == {"train_files": ["p.jsonl"]}
    assert feedback_files("judged", "p.jsonl", "j.jsonl") == {"train_files": ["j.jsonl"], "val_files": ["p.jsonl"]}
    assert feedback_files("mixed", "p.jsonl", "j.jsonl") == {"train_files": ["p.jsonl", "j.jsonl"],
                                                             "val_files": ["p.jsonl"]}
    with pytest.raises(ConfigError, match=r"^dpo_model.feedback: 'rlaif' is not a feedback choice; choose one of "
                                          r"checkable, judged, mixed$"):
        check_feedback("rlaif", "dpo_model.feedback")
    with pytest.raises(ValueError, match="mixed needs judged preference pairs"):
        feedback_files("mixed", "p.jsonl", None)
    assert pairs_by_source("checkable", [835]) == {"checkable": 835, "judged": 0}
    assert pairs_by_source("judged", [31]) == {"checkable": 0, "judged": 31}
    assert pairs_by_source("mixed", [835, 31]) == {"checkable": 835, "judged": 31}
