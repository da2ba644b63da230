"""Tests for kiln.posttrain.measures: item-by-item scores, their means, and paired standard errors of a change.

Run: python -m pytest tests/kiln/posttrain/test_measures.py -q
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt2.model import GPT
from kiln.posttrain.logprobs import encode_rows, token_logps
from kiln.posttrain.measures import (MEASURES, answer_logprobs, answer_rows, change_cell, change_rows,
                                     comparison_rows, means, measure_items, paired_stderr)
from kiln.posttrain.sft import IGNORE, chat_prompt_ids


def scores(**items: list[float]) -> dict:
    return {m: {"items": v, "denom": len(v)} for m, v in items.items()}


def test_paired_stderr_is_the_std_of_item_differences() -> None:
    before = {"items": [0, 0, 1, 0], "denom": 4}
    after = {"items": [1, 0, 1, 1], "denom": 4}
    # differences 1, 0, 0, 1: sample std 0.57735, times sqrt(4), over 4
    assert paired_stderr(before, after) == pytest.approx(math.sqrt(4) * np.std([1, 0, 0, 1], ddof=1) / 4)
    assert paired_stderr(before, after) == pytest.approx(0.288675, abs=1e-6)
    assert paired_stderr(before, {"items": [1, 0, 1], "denom": 3}) is None  # other items: no paired error
    assert paired_stderr({"items": [1], "denom": 1}, {"items": [0], "denom": 1}) is None


def test_a_token_weighted_measure_pairs_per_item_sums() -> None:
    # response_loss: per-item summed NLL over a shared token count; the change is sum(after - before) / tokens
    before = {"items": [4.0, 2.0, 6.0], "denom": 6}
    after = {"items": [3.0, 2.0, 4.0], "denom": 6}
    (row,) = comparison_rows({"response_loss": before}, {"response_loss": after})
    assert row["before"] == pytest.approx(2.0) and row["after"] == pytest.approx(1.5)
    assert row["change"] == pytest.approx(-0.5)
    assert row["stderr"] == pytest.approx(math.sqrt(3) * np.std([-1, 0, -2], ddof=1) / 6)


def test_comparison_rows_mark_only_changes_two_errors_from_zero() -> None:
    n = 100
    before = scores(arithmetic_exact_match=[0.0] * n, preference_accuracy=[1.0] * 50 + [0.0] * 50)
    # 20 of 100 newly right: change 0.20, stderr sqrt(100) * std(20 ones, 80 zeros) / 100 = 0.0402 -> z about 5
    # preference: 3 items flip right, 1 flips wrong: change 0.02, well within noise
    pref_after = [1.0] * 49 + [0.0] + [1.0] * 3 + [0.0] * 47
    after = scores(arithmetic_exact_match=[1.0] * 20 + [0.0] * 80, preference_accuracy=pref_after)
    rows = {r["measure"]: r for r in comparison_rows(before, after)}
    a, p = rows["arithmetic_exact_match"], rows["preference_accuracy"]
    assert a["change"] == pytest.approx(0.20) and a["stderr"] == pytest.approx(0.040201, abs=1e-6)
    assert a["z"] == pytest.approx(4.975, abs=1e-3) and a["beyond_noise"] and a["items"] == n
    assert p["change"] == pytest.approx(0.02) and not p["beyond_noise"]
    assert list(rows) == [m for m in MEASURES if m in rows]  # MEASURES order
    same = comparison_rows(before, before)
    assert all(r["change"] == 0 and r["z"] == 0 and not r["beyond_noise"] for r in same)
    assert change_cell(a) == "+0.200 ± 0.040 *" and change_cell(p) == "+0.020 ± 0.020"


def test_change_rows_give_each_stage_a_column() -> None:
    sft = {"before_after": comparison_rows(scores(arithmetic_exact_match=[0.0] * 4),
                                           scores(arithmetic_exact_match=[1.0, 1.0, 0.0, 0.0]))}
    rl = {"before_after": [{"measure": "arithmetic_exact_match", "change": 0.25, "stderr": None}]}  # an older value
    assert change_rows({"sft": sft, "rl": rl}) == [
        {"measure": "arithmetic_exact_match", "sft": "+0.500 ± 0.289", "rl": "+0.250"}]


def test_measure_items_means_equal_the_token_weighted_measures(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    arith = [{"prompt": f"What is {a} + 1?", "response": f"{a} + 1 = {a + 1}.", "answer": str(a + 1)} for a in range(3)]
    prefs = [{"prompt": "Explain the river.", "chosen": "The river runs.", "rejected": "A dog sees the cat."},
             {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 7."}]
    instr = [{"prompt": "Explain the cat.", "response": "The cat sees the river today."},
             {"prompt": "What is 4 + 4?", "response": "4 + 4 = 8."}]
    items = measure_items(model, enc, arith, prefs, instr)
    assert set(items) == set(MEASURES)
    assert len(items["arithmetic_exact_match"]["items"]) == 3 and len(items["preference_margin"]["items"]) == 2
    x, y = encode_rows(enc, [i["prompt"] for i in instr], [i["response"] for i in instr], model.config.block_size - 1)
    with torch.no_grad():
        logits = model(x)
    keep = y != IGNORE
    got = means(items)
    assert got["response_loss"] == pytest.approx(float(-token_logps(logits, y)[keep].mean()), rel=1e-5)
    assert got["response_token_accuracy"] == pytest.approx(float((logits.argmax(-1) == y)[keep].float().mean()))
    assert items["response_loss"]["denom"] == int(keep.sum())
    assert got["preference_accuracy"] == np.mean(np.array(items["preference_margin"]["items"]) > 0)


def test_answer_logprob_scores_only_the_answer_of_the_whole_response(tiny_tokenizer, one_thread) -> None:
    enc, _ = tiny_tokenizer
    torch.manual_seed(1)
    model = GPT(ModelConfig(vocab_size=320, block_size=48, n_layer=2, n_head=2, n_embd=32)).eval()
    items = [{"prompt": "What is 3 + 18?", "response": "3 + 18 = 21.", "answer": "21"},
             {"prompt": "What is 2 - 9?", "response": "2 - 9 = -7.", "answer": "-7"},
             {"prompt": "What is 21 - 0?", "response": "21 - 0 = 21.", "answer": "21"}]  # the last 21 is the answer
    got = answer_logprobs(model, enc, items, model.config.block_size - 1, batch_size=2)
    for item, lp in zip(items, got):
        ids, mask = answer_rows(enc, item)
        whole = chat_prompt_ids(enc, item["prompt"]) + enc.encode_ordinary(item["response"]) + [enc.eot_token]
        assert ids == whole  # the cut falls on a token boundary: the row is the response as it always tokenizes
        answer = [*enc.encode_ordinary(" " + item["answer"] + "."), enc.eot_token]
        assert sum(mask) == len(answer) and ids[-len(answer):] == answer
        with torch.no_grad():  # the same sum taken by hand: log p of each answer token after its prefix
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), -1)
        want = sum(float(logp[t - 1, ids[t]]) for t in range(len(ids) - len(answer), len(ids)))
        assert lp == pytest.approx(want, abs=1e-4)
    assert got[0] != got[2]
