"""Tests for kiln.evaluation.standard.contamination: the text of an lm-eval item that must not be in training data (its
prompt and gold answer, for every way a task states them), each benchmark's sampled items checked against the training
sources (counts, shares, sources, examples at the item's own index, the clean sample of each subtask), and the clean
benchmarks to rescore. Stand-in lm-eval tasks hold a few items; no package or model is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.evaluation.standard.contamination import check_benchmarks, clean_prepared, item_text
from kiln.evaluation.standard.run import Prepared


class Task:
    """The part of an lm-eval task item_text and check_benchmarks use: its output type, the item's prompt, target and
    choices (read from the item's "text", "target" and "choices"), and the scored items."""

    def __init__(self, output_type: str, docs: list[dict[str, Any]] = ()):
        self.output_type, self.eval_docs = output_type, list(docs)

    def get_config(self, key: str) -> Any:
        return {"output_type": self.output_type}[key]

    def doc_to_text(self, doc: dict[str, Any]) -> Any:
        return doc["text"]

    def doc_to_target(self, doc: dict[str, Any]) -> Any:
        return doc.get("target")

    def doc_to_choice(self, doc: dict[str, Any]) -> list[str]:
        return doc["choices"]


@pytest.mark.parametrize("output_type,doc,text", [
    ("multiple_choice", {"text": "Question: Which is red?", "target": 1, "choices": ["grass", "a ripe tomato"]},
     "Question: Which is red? a ripe tomato"),  # the right choice only
    ("multiple_choice", {"text": 0, "target": "went home.", "choices": ["Anna", "Ben"]},
     "Anna went home."),  # WinoGrande: the prompt is an index into the choices
    ("multiple_choice", {"text": "Pick one.", "target": 5, "choices": ["a", "b"]}, "Pick one. 5"),  # no such choice
    ("generate_until", {"text": "Q: 2 + 2?", "target": ["4", 4, "four"]}, "Q: 2 + 2? 4 four"),  # strings only
    ("loglikelihood", {"text": "The last", "target": " word"}, "The last  word"),
    ("loglikelihood_rolling", {"text": "A whole document."}, "A whole document."),
    ("generate_until", {"text": 3, "target": 7}, "3 7"),  # an index prompt of a task without choices stays a number
])
def test_an_item_is_its_prompt_and_gold_answer(output_type, doc, text):
    assert item_text(Task(output_type), doc) == text


LEAKED = "the quick brown fox jumps over the lazy dog near the river bank"


def mc(text: str, answer: str) -> dict[str, Any]:
    return {"text": text, "target": 0, "choices": [answer, "something else entirely"]}


def world(samples: dict[str, list[int]] | None) -> tuple[Prepared, dict[str, Any]]:
    """Two benchmarks: "solo" (one task, four items) and "group" (subtasks g1 and g2); SOURCES leaks two items."""
    tasks = {
        "solo": Task("multiple_choice", [mc("Which animal jumps", "a fox"), mc("Who sleeps", "a cat by the fire"),
                                         mc(f"Finish: {LEAKED}", "today"), mc("Where is the bank", "near the river")]),
        "g1": Task("generate_until", [{"text": "Q: 1 + 1?", "target": "2"}, {"text": "Q: 2 + 3?", "target": "5"}]),
        "g2": Task("loglikelihood", [{"text": "Some unseen words are here", "target": " now"},
                                     {"text": "Other unseen words are there", "target": " then"}]),
    }
    record = {"benchmarks": {"solo": {"tasks": ["solo"]}, "group": {"tasks": ["g1", "g2"]}}}
    return Prepared(["solo", "group"], Path("/unused"), samples, record, {"solo": "S", "group": "G"}), {"tasks": tasks}


SOURCES = {"web": [("page-1", f"As everyone knows, {LEAKED.upper()}! today.")],
           "books": [("book-9", "chapter one: q 2 3 5 was the answer"), ("book-10", "Nothing to see.")]}


def test_each_benchmark_counts_its_contaminated_items_by_source_with_examples():
    prepared, loaded = world(None)
    report = check_benchmarks(prepared, SOURCES, n=5, loaded=loaded)
    solo, group = report["solo"], report["group"]
    assert {k: solo[k] for k in ("items", "contaminated", "share", "clean_items", "by_source")} == {
        "items": 4, "contaminated": 1, "share": 0.25, "clean_items": 3, "by_source": {"web": 1}}
    assert solo["clean_samples"] == {"solo": [0, 1, 3]}
    assert solo["examples"] == [{"line": 2, "subtask": "solo", "source": "web", "document": "page-1",
                                 "ngram": "the quick brown fox jumps"}]
    assert {k: group[k] for k in ("items", "contaminated", "share", "clean_items", "by_source")} == {
        "items": 4, "contaminated": 1, "share": 0.25, "clean_items": 3, "by_source": {"books": 1}}
    assert group["clean_samples"] == {"g1": [0], "g2": [0, 1]}  # a short item counts only when it appears whole
    assert group["examples"] == [{"line": 1, "subtask": "g1", "source": "books", "document": "book-9",
                                  "ngram": "q 2 3 5"}]


def test_a_sample_is_checked_item_by_item_at_each_items_own_index():
    prepared, loaded = world({"solo": [1, 2, 3], "g1": [0], "g2": [1]})
    report = check_benchmarks(prepared, SOURCES, n=5, loaded=loaded)
    assert (report["solo"]["items"], report["solo"]["contaminated"]) == (3, 1)
    assert report["solo"]["clean_samples"] == {"solo": [1, 3]}
    assert report["solo"]["examples"][0]["line"] == 2  # the index in the task's set, not in the sample
    assert (report["group"]["items"], report["group"]["contaminated"], report["group"]["share"]) == (2, 0, 0.0)
    assert report["group"]["clean_samples"] == {"g1": [0], "g2": [1]}


def test_examples_are_capped_per_benchmark_and_the_default_is_13_grams():
    prepared, loaded = world(None)
    more = {"web": [("page-1", "Which animal jumps a fox; who sleeps a cat by the fire; finish: the quick brown")]}
    report = check_benchmarks(prepared, more, n=3, loaded=loaded, examples=2)
    assert report["solo"]["clean_samples"] == {"solo": [3]}
    assert [e["line"] for e in report["solo"]["examples"]] == [0, 1]  # three found, two shown
    assert check_benchmarks(prepared, SOURCES, loaded=loaded)["solo"]["contaminated"] == 1  # 13 words leaked
    assert check_benchmarks(prepared, {"web": [("p", LEAKED[:40])]}, loaded=loaded)["solo"]["contaminated"] == 0


def report_of(contaminated: dict[str, int], clean: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, Any]]:
    return {name: {"contaminated": contaminated[name], "clean_samples": clean[name]} for name in contaminated}


def test_only_contaminated_benchmarks_with_a_clean_item_in_every_subtask_are_rescored():
    benches = {"a": "A", "b": "B", "c": "C"}
    prepared = Prepared(["a", "b", "c"], Path("/tasks"), {"a": [0, 1, 2], "b": [0, 1], "c1": [0], "c2": [4]},
                        {"benchmarks": {}, "seed": 7}, benches)
    report = report_of({"a": 1, "b": 0, "c": 1}, {"a": {"a": [0, 2]}, "b": {"b": [0, 1]}, "c": {"c1": [0], "c2": []}})
    clean = clean_prepared(prepared, report)
    assert (clean.names, clean.samples, clean.benchmarks) == (["a"], {"a": [0, 2]}, {"a": "A"})
    assert clean.task_dir == prepared.task_dir and clean.record is prepared.record
    assert prepared.names == ["a", "b", "c"] and prepared.samples["a"] == [0, 1, 2]  # the prepared set is unchanged
    assert clean_prepared(prepared, report_of({"a": 0, "b": 0, "c": 1}, {"a": {}, "b": {}, "c": {"c1": []}})) is None
