"""Tests of kiln/evaluation/standard/code.py: the code metrics run programs in Kiln's sandbox."""

from __future__ import annotations

import pytest

from kiln.evaluation.standard.code import estimate_pass_at_k, pass_at_1, pass_at_k


def test_code_metrics_run_programs_in_the_sandbox():
    test = "def check(f):\n    assert f(2, 3) == 5\n\ncheck(add)"
    right, wrong, escape = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b", \
        "import os\nos.system('true')\ndef add(a, b):\n    return a + b"
    assert pass_at_k([test, test], [[right], [wrong]], [1]) == {"pass@1": 0.5}
    assert pass_at_k([test], [[right, wrong, wrong]], [1, 2]) == pytest.approx({"pass@1": 1 / 3, "pass@2": 2 / 3})
    # lm-eval calls mbpp's metric with references=[tests], predictions=[generation]
    assert pass_at_1(["assert add(1, 1) == 2"], [right]) == 1.0 and pass_at_1("assert add(1, 1) == 2", [wrong]) == 0.0
    assert pass_at_1(["assert add(1, 1) == 2"], [escape]) == 0.0  # a new process is refused by the sandbox
    assert estimate_pass_at_k(10, 3, 1) == pytest.approx(0.3) and estimate_pass_at_k(5, 4, 2) == 1.0
