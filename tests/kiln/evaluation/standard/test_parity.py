"""Tests of kiln/evaluation/standard/parity.py: Kiln's adapter against lm-eval's own HFLM on a tiny random llama:
per-request log-likelihoods, accuracies, greedy generations and scores, at two batch sizes."""

from __future__ import annotations

import pytest

from tests.kiln.evaluation.standard.standard_kit import NAMES, ULP


def test_every_benchmark_scores_its_seeded_items_with_a_standard_error(parity):
    rows, _, _ = parity
    assert set(rows) == set(NAMES)
    for name, row in rows.items():
        assert row["items"] == {"mmlu": 114, "minerva_math": 14}.get(name, 5), name
        for side in ("hf", "kiln", "kiln1"):
            assert isinstance(row[f"{side}_score"], float) and isinstance(row[f"{side}_stderr"], float), (name, side)


def test_loglikelihoods_agree_with_hflm_per_request(parity):
    from kiln.evaluation.standard.parity import responses

    rows, outs, _ = parity
    checked = 0
    for name, out in outs.items():
        hf = responses(out["hf"])
        for side in ("kiln", "kiln1"):
            other = responses(out[side])
            assert set(other) == set(hf), (name, side)
            for key, a in hf.items():
                if isinstance(a, str):
                    continue
                b = other[key]
                # 1e-4, or float32's own spacing where a sum of ~100 token log-probs passes 512 (hellaswag's endings
                # in a 500-token vocabulary); is-greedy (LAMBADA's accuracy) identical
                assert abs(a[0] - b[0]) <= max(1e-4, 2 * ULP(a[0])), (name, side, key, a, b)
                assert bool(a[1]) == bool(b[1]), (name, side, key)
                checked += 1
    assert checked > 1000


def test_scores_and_generations_equal_hflms_at_both_batch_sizes(parity):
    rows, outs, _ = parity
    for name, row in rows.items():
        for side in ("kiln", "kiln1"):
            assert row[f"{side}_score"] == row["hf_score"], (name, side, row)
            assert row[f"generations_differ_{side}"] in (None, 0) and row[f"greedy_differ_{side}"] == 0, (name, row)
            hf, kl = (outs[name][s]["results"] for s in ("hf", side))
            for task, metrics in hf.items():
                for key, value in metrics.items():
                    if isinstance(value, float) and "perplexity" not in key and "stderr" not in key:
                        assert kl[task][key] == value, (name, task, key)
                    elif isinstance(value, float) and "stderr" not in key:
                        assert kl[task][key] == pytest.approx(value, rel=1e-4), (name, task, key)
    generated = [r for r in rows.values() if r["generations_differ_kiln"] is not None]
    assert {r["benchmark"] for r in generated} == {"gsm8k_cot", "minerva_math", "minerva_math500", "humaneval", "mbpp"}
