"""HumanEval's and MBPP's metrics with the same contract as lm-eval's (Hugging Face ``code_eval``), each candidate run
in Kiln's sandbox (kiln.evaluation.sandbox.run_many) instead of ``exec`` in the evaluating process, and judged by its
reference tests in the sandbox's checker process: the functions the tests call are the candidate's, reached with plain
data, so the candidate cannot make its tests pass other than by returning the right values.

The utils.py written beside those tasks imports ``pass_at_k`` (humaneval) and ``pass_at_1`` (mbpp) from here.
"""

from __future__ import annotations

import math
from typing import Sequence

from kiln.evaluation.sandbox import Limits, Test, run_many

# code_eval gives each program 3 s of wall clock; the sandbox's wall clock also covers its interpreter's start
CODE_LIMITS = Limits(timeout_s=3.0, cpu_s=3)
CODE_WORKERS: int | None = None  # sandboxes at once; None: one per CPU
CODE_ALLOW_GUARD_ONLY = False  # score where only the sandbox's in-process guard isolates programs (mode none)


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of n samples with c correct (code_eval's estimator): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def run_programs(references: Sequence[str], predictions: Sequence[Sequence[str]]) -> list[list[bool]]:
    """Whether each candidate passes its reference tests (code_eval runs ``candidate + "\\n" + test`` as one program;
    here the test runs in the checker, calling the candidate's functions), one sandbox each."""
    programs = [cand for cands in predictions for cand in cands]
    tests = [Test(test) for test, cands in zip(references, predictions) for _ in cands]
    results = iter(run_many(programs, CODE_LIMITS, workers=CODE_WORKERS, tests=tests,
                            allow_guard_only=CODE_ALLOW_GUARD_ONLY))
    return [[next(results).passed for _ in cands] for cands in predictions]


def pass_at_k(references: list[str], predictions: list[list[str]],
              k: list[int] | int | None = None) -> dict[str, float]:
    """lm-eval humaneval's metric: {"pass@k": mean over problems} for each k."""
    ks = [1] if k is None else [k] if isinstance(k, int) else list(k)
    passed = run_programs(references, predictions)
    return {f"pass@{kk}": sum(estimate_pass_at_k(len(p), sum(p), kk) for p in passed) / len(passed)
            for kk in ks if all(len(p) >= kk for p in passed)}


def pass_at_1(references: str | list[str], predictions: str | list[str] | list[list[str]]) -> float:
    """lm-eval mbpp's metric: pass@1 of one problem's completion(s)."""
    if isinstance(references, str):
        references = [references]
    if isinstance(predictions[0], str):
        predictions = [[p] for p in predictions]  # type: ignore[union-attr]
    return pass_at_k(references, predictions, [1])["pass@1"]  # type: ignore[arg-type]
