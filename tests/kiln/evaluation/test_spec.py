"""Tests of kiln/evaluation/spec.py: a half-defined task spec is an error naming it and what is missing, and inconsistent
specs are errors naming the problem."""

from __future__ import annotations

import pytest

from kiln.evaluation import TaskSpec, TaskSpecError
from tests.kiln.evaluation.test_registry import DEMO, order_items


def spec_fields(**overrides) -> dict:
    fields = {k: getattr(DEMO, k) for k in ("name", "chance", "primary", "items", "lm_eval", "item_text", "suite")}
    return {**fields, **overrides}


@pytest.mark.parametrize("missing, says", [
    ("chance", "missing chance="), ("primary", "missing primary="), ("items", "missing items=FromDocuments"),
    ("lm_eval", "missing lm_eval="), ("item_text", "missing item_text="), ("suite", "missing suite="),
])
def test_a_half_defined_task_is_an_error_naming_it_and_what_is_missing(missing, says):
    fields = spec_fields(name="kiln_half")
    del fields[missing]
    with pytest.raises(TaskSpecError, match=rf"eval task 'kiln_half': .*{says}"):
        TaskSpec(**fields)


def test_inconsistent_specs_are_errors_naming_the_problem():
    mc = {k: v for k, v in DEMO.lm_eval.items() if k != "doc_to_choice"}
    cases = [
        (dict(lm_eval=mc), "lacks 'doc_to_choice'"),
        (dict(lm_eval={"output_type": "loglikelihood", "doc_to_text": "context"}), "lm_eval lacks 'doc_to_target'"),
        (dict(primary="acc_norm"), r"primary metric 'acc_norm' is not in its metric_list \['acc'\]"),
        (dict(name="demo_order"), "must start with 'kiln_'"),
        (dict(name="kiln_demo_clean"), "not end in '_clean'"),
        (dict(chance=4), "between 0 and 1"),
        (dict(items=order_items), "items must be FromDocuments or FromPackage"),
        (dict(lm_eval={**DEMO.lm_eval, "task": "other"}), r"must not set \['task'\]"),
    ]
    for overrides, says in cases:
        with pytest.raises(TaskSpecError, match=says):
            TaskSpec(**spec_fields(**overrides))
