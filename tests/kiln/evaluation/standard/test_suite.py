"""Tests for kiln.evaluation.standard.suite: score_benchmarks's full and clean rows in the shape of Kiln's own task rows
(the primary metric under its own name, its stderr, chance, items, task and version), the contamination counts added,
a benchmark with no contaminated item clean as it is, a contaminated one rescored on its clean items only, one with no
clean score left without one, and the model's training mode restored. lm-eval's evaluation and Kiln's adapter are
stand-ins that score a sample by its size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.evaluation.standard import suite
from kiln.evaluation.standard.catalog import Benchmark
from kiln.evaluation.standard.run import Prepared
from kiln.evaluation.standard.suite import score_benchmarks


def benchmark(name: str, primary: str, chance: float, version: float = 1.0) -> Benchmark:
    return Benchmark(name=name, yaml=f"{name}.yaml", version=version, chance=chance, primary=primary, rows=100,
                     data={}, reads=(), licence="test", fewshot="none")


BENCHES = {"arc": benchmark("arc", "acc_norm,none", 0.25), "piqa": benchmark("piqa", "acc,none", 0.5, 2.0),
           "group": benchmark("group", "exact_match,strict-match", 0.0)}
TASKS = {"arc": ["arc"], "piqa": ["piqa"], "group": ["group_a", "group_b"]}
SAMPLES = {"arc": [0, 1, 2, 3], "piqa": [0, 1], "group_a": [0, 1], "group_b": [0, 1, 2]}
REPORT = {"arc": {"contaminated": 1, "share": 0.25, "clean_samples": {"arc": [0, 1, 3]}},
          "piqa": {"contaminated": 0, "share": 0.0, "clean_samples": {"piqa": [0, 1]}},
          "group": {"contaminated": 2, "share": 0.4, "clean_samples": {"group_a": [], "group_b": [0, 1, 2]}}}


def prepared(names: list[str] = list(BENCHES)) -> Prepared:
    return Prepared(list(names), Path("/tasks"), {t: SAMPLES[t] for n in names for t in TASKS[n]},
                    {"benchmarks": {n: {"tasks": TASKS[n]} for n in names}}, {n: BENCHES[n] for n in names})


class Harness:
    """The stand-ins: Kiln's adapter (kept with its arguments) and lm-eval's evaluate, whose score of a benchmark is
    its sampled items / 10, its stderr 1 / items, its items what each task's sample holds."""

    def __init__(self, monkeypatch):
        self.lms: list[dict[str, Any]] = []
        self.evaluated: list[tuple[list[str], dict[str, list[int]], int]] = []
        self.model_training_during: list[bool] = []
        harness = self

        class FakeLM:
            def __init__(self, model, encoding, **kw):
                harness.lms.append({"model": model, "encoding": encoding, **kw})
                harness.model = model

        monkeypatch.setattr("kiln.evaluation.adapter.KilnLM", FakeLM)
        monkeypatch.setattr(suite, "evaluate_lm", self.evaluate)

    def evaluate(self, lm, prep: Prepared, seed: int) -> dict[str, Any]:
        self.evaluated.append((list(prep.names), dict(prep.samples), seed))
        self.model_training_during.append(self.model.training)
        results, n = {}, {}
        for name in prep.names:
            tasks = prep.record["benchmarks"][name]["tasks"]
            items = sum(len(prep.samples[t]) for t in tasks)
            metric, _, filt = prep.benchmarks[name].primary.partition(",")
            results[name] = {"alias": name, f"{metric},{filt}": items / 10, f"{metric}_stderr,{filt}": 1 / items}
            n.update({t: {"original": 100, "effective": len(prep.samples[t])} for t in tasks})
        return {"results": results, "n-samples": n}


def test_full_rows_take_the_shape_of_kilns_own_task_rows(monkeypatch):
    harness = Harness(monkeypatch)
    model = torch.nn.Linear(2, 2).train()
    full, clean = score_benchmarks(model, "ENC", prepared(), None, batch_size=5, seed=11, device="cpu")
    assert full == {
        "arc": {"acc_norm": 0.4, "acc_norm_stderr": 0.25, "chance": 0.25, "items": 4, "lm_eval_task": "arc",
                "version": 1.0},
        "piqa": {"acc": 0.2, "acc_stderr": 0.5, "chance": 0.5, "items": 2, "lm_eval_task": "piqa", "version": 2.0},
        "group": {"exact_match": 0.5, "exact_match_stderr": 0.2, "chance": 0.0, "items": 5, "lm_eval_task": "group",
                  "version": 1.0}}
    assert clean == {} and len(harness.evaluated) == 1  # unchecked: no clean rows, nothing rescored
    assert harness.lms == [{"model": model, "encoding": "ENC", "device": "cpu", "batch_size": 5, "seed": 11,
                            "progress": None}]
    assert harness.evaluated[0][2] == 11 and harness.model_training_during == [True] and model.training


def test_clean_rows_are_the_full_ones_rescored_on_the_clean_items_where_any_was_contaminated(monkeypatch):
    harness = Harness(monkeypatch)
    model = torch.nn.Linear(2, 2).eval()
    full, clean = score_benchmarks(model, "ENC", prepared(), REPORT)
    assert [names for names, _, _ in harness.evaluated] == [["arc", "piqa", "group"], ["arc"]]
    assert harness.evaluated[1][1] == {"arc": [0, 1, 3]}  # only arc: group's subtask group_a has no clean item
    assert full["arc"] == {"acc_norm": 0.4, "acc_norm_stderr": 0.25, "chance": 0.25, "items": 4, "lm_eval_task": "arc",
                           "version": 1.0, "contaminated": 1, "contaminated_share": 0.25}
    assert (full["group"]["contaminated"], full["group"]["contaminated_share"]) == (2, 0.4)
    assert clean["arc"] == {"acc_norm": pytest.approx(0.3), "acc_norm_stderr": pytest.approx(1 / 3), "chance": 0.25,
                            "items": 3, "lm_eval_task": "arc", "version": 1.0}
    assert clean["piqa"] == full["piqa"] and clean["piqa"] is not full["piqa"]  # nothing to remove: the same scores
    assert clean["group"] == {"chance": 0.0, "items": 0}  # no clean score
    assert not model.training


def test_with_nothing_contaminated_the_clean_rows_are_the_full_ones_and_nothing_is_rescored(monkeypatch):
    harness = Harness(monkeypatch)
    unseen = {name: {"contaminated": 0, "share": 0.0, "clean_samples": {t: SAMPLES[t] for t in TASKS[name]}}
              for name in BENCHES}
    full, clean = score_benchmarks(torch.nn.Linear(2, 2), "ENC", prepared(), unseen)
    assert clean == full and all(row["contaminated"] == 0 for row in full.values())
    assert len(harness.evaluated) == 1


def test_the_models_training_mode_is_restored_when_scoring_fails(monkeypatch):
    Harness(monkeypatch)

    def broken(lm, prep, seed):
        raise RuntimeError("lm-eval returned no results (not rank 0?)")

    monkeypatch.setattr(suite, "evaluate_lm", broken)
    model = torch.nn.Linear(2, 2).train()
    with pytest.raises(RuntimeError, match="lm-eval returned no results"):
        score_benchmarks(model, "ENC", prepared())
    assert model.training
