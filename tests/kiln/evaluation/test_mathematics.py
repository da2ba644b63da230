"""Tests for kiln.evaluation.mathematics: the package records read as questions with one canonical answer, and both
tasks scored through lm-eval's generate_until on KilnLM: a model that knows the answers scores 1 whatever trailing
zeros it writes, one that knows nothing scores its chance, 0.

Run: python -m pytest tests/kiln/evaluation/test_mathematics.py -q
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from kiln.evaluation import run_suite
from kiln.evaluation.mathematics import (MATH_EXPR, MATH_EXPR_TASK, MATH_WORD, MATH_WORD_TASK, MathFormatError,
                                         canonical, parse_record)
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.spec import write_task
from tests.kiln.evaluation.evaluation_kit import NGramLM, enc, tiny_gpt  # noqa: F401  (enc is a fixture)

class CachedNGramLM(NGramLM):
    """NGramLM that generates through a KV cache as Kiln's models do: it keeps the tokens it was fed by position."""

    def __init__(self, texts, n: int = 48, block_size: int = 256):
        super().__init__(texts, n, block_size)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the cache takes its device and dtype from a parameter
        self.seen: torch.Tensor | None = None

    def forward(self, idx, targets=None, cache=None, attn_mask=None):
        if cache is None:
            return super().forward(idx)
        B, T = idx.shape
        if cache.pos == 0:
            self.seen = torch.zeros(B, cache.max_len, dtype=torch.long)
        self.seen[:, cache.pos : cache.pos + T] = idx
        out = super().forward(self.seen[:, : cache.pos + T])[:, cache.pos :]
        cache.advance(T)
        return out


SYSTEM = {"role": "system", "content": "Answer in square brackets."}
WORD = [("What is the sum of the interior angles of a decagon?", "[1440]", "1440 degrees"),
        ("A box holds 7.2 kg. How much do two half boxes hold?", "[7.2]", "7.20 kg")]
EXPR = [("five thousand six hundred nineteen plus zero", ["[5619]", "[5619.0000]"], "5619.0000"),
        ("sixteen plus four hundred fifty-six divided by nine thousand, five hundred eighty-five", "[16.0476]",
         "16.0476 exactly")]


def test_records_read_as_one_canonical_answer() -> None:
    assert [canonical(a) for a in ("[1440]", "[5619.0000]", "[282.60]", "[-519]", "[0.0001]", "x = 12,345")] == [
        "1440", "5619", "282.6", "-519", "0.0001", "12345"]
    row = parse_record({"input": [SYSTEM, {"role": "user", "content": " Q? "}], "ideal": ["[4]", "[4.0000]"]}, "f:1")
    assert row == {"question": "Q?", "answer": "4"}
    with pytest.raises(MathFormatError, match=r"f:2: expected a user turn and one numeric answer"):
        parse_record({"input": [SYSTEM, {"role": "user", "content": "Q?"}], "ideal": ["[4]", "[5]"]}, "f:2")
    with pytest.raises(MathFormatError, match=r"f:3: .*ideal='\[four\]'"):
        parse_record({"input": [SYSTEM, {"role": "user", "content": "Q?"}], "ideal": "[four]"}, "f:3")
    assert REGISTRY.chance(MATH_WORD) == REGISTRY.chance(MATH_EXPR) == 0.0
    assert REGISTRY.suites()["math"] == [MATH_WORD, MATH_EXPR]


@pytest.mark.parametrize("spec, items", [(MATH_WORD_TASK, WORD), (MATH_EXPR_TASK, EXPR)], ids=["word", "expr"])
def test_each_task_scores_generated_answers_by_exact_match_beside_chance(tmp_path, enc, spec, items):  # noqa: F811
    rows = [{"id": i, **parse_record({"input": [SYSTEM, {"role": "user", "content": q}], "ideal": ideal}, f"r{i}")}
            for i, (q, ideal, _) in enumerate(items)]
    write_task(spec, rows, tmp_path, seed=0)
    # a model that memorised each prompt followed by its answer, written its own way (units, trailing zeros)
    texts = [f"Question: {q}\nAnswer: {said}\n" for q, _, said in items]
    cheat = run_suite(CachedNGramLM([enc.encode(t) for t in texts]), enc, tmp_path, [spec.name])
    assert cheat[spec.name]["exact_match"] == 1.0 and cheat[spec.name]["items"] == 2
    # one that memorised wrong answers scores 0; a random tiny model scores its chance, 0
    wrong = [f"Question: {q}\nAnswer: 3\n" for q, _, _ in items]
    assert run_suite(CachedNGramLM([enc.encode(t) for t in wrong]), enc, tmp_path,
                     [spec.name])[spec.name]["exact_match"] == 0.0
    guess = run_suite(tiny_gpt(block_size=128), enc, tmp_path, [spec.name])
    assert guess[spec.name]["exact_match"] == 0.0 and guess[spec.name]["chance"] == 0.0
