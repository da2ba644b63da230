"""Tests of kiln/evaluation/scores.py: the flat metric names MLflow accepts."""

from __future__ import annotations


def test_pass_at_k_reaches_mlflow_under_a_name_it_accepts():
    from kiln.evaluation.scores import flat_metrics

    got = flat_metrics({"kiln_humaneval": {"pass@1": 0.25, "pass@5": 0.5, "items": 10}}, {"kiln_humaneval": {"pass@1": 0.2}})
    assert got == {"kiln_humaneval.pass_at_1": 0.25, "kiln_humaneval.pass_at_5": 0.5, "kiln_humaneval.clean.pass_at_1": 0.2}
