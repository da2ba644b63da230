"""Tests for kiln.evaluation.registry and spec: one TaskSpec + one registration make a task built, scored beside its
chance and checked for contamination; incomplete or unknown tasks are errors naming the task.

Run: python -m pytest tests/kiln/evaluation/test_registry.py -q   (tiny models and tasks; a few seconds on CPU)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import yaml

from kiln.evaluation import CHANCE, REGISTRY, FromDocuments, TaskRegistry, TaskSpec, TaskSpecError, UnknownTaskError
from kiln.evaluation import build_suite, build_tasks, check_contamination, run_suite, score_full_and_clean
from kiln.evaluation.checkpoints import runnable_suites
from kiln.evaluation.heldout import sentences
from kiln.evaluation.scores import primary_metric, score_rows
from tests.kiln.evaluation.evaluation_kit import NGramLM, enc, make_docs, tiny_gpt  # noqa: F401  (enc is a fixture)

# ---- the demonstration task: its item maker and its spec are all a new task needs ----------------------------


def order_items(doc: str, rng, k: int) -> list[dict]:
    """A sentence, then two candidates for the next one: the true next sentence and the one before it."""
    sents, out = sentences(doc), []
    for i in range(1, min(len(sents) - 1, k + 1)):
        choices = [sents[i + 1], sents[i - 1]]
        rng.shuffle(choices)
        out.append({"context": sents[i], "choices": choices, "label": choices.index(sents[i + 1])})
    return out


DEMO = TaskSpec(
    name="kiln_demo_order", chance=0.5, primary="acc", suite="demo",
    items=FromDocuments(order_items, need="three sentences"),
    lm_eval={"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_target": "label", "doc_to_choice": "choices",
             "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
    item_text=lambda row: f"{row['context']} {row['choices'][row['label']]}",
)


@pytest.fixture()
def demo_task():
    """DEMO registered for one test; the registry is restored afterwards."""
    saved = REGISTRY.snapshot()
    REGISTRY.register(DEMO)  # the registry line
    yield DEMO
    REGISTRY.restore(saved)


def rows_of(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_a_registered_task_is_built_scored_beside_chance_and_checked(demo_task, tmp_path, enc):  # noqa: F811
    docs = make_docs(80, seed=4)
    info = build_tasks(docs[:40], tmp_path / "tasks", n_items=12, seed=0)
    assert list(info)[-1] == "kiln_demo_order" and info["kiln_demo_order"]["items"] == 12
    assert info["kiln_demo_order"]["chance"] == 0.5 == CHANCE["kiln_demo_order"]
    cfg = yaml.safe_load(Path(info["kiln_demo_order"]["path"]).read_text())
    assert cfg["task"] == "kiln_demo_order" and cfg["doc_to_choice"] == "choices" and cfg["metadata"]["items"] == 12
    rows = rows_of(info["kiln_demo_order"]["data"])
    assert all(r["choices"][r["label"]] in " ".join(docs[r["doc_index"]].split()) for r in rows)

    # scored through the lm-eval adapter: a model that memorised each item's true order gets (nearly) all right
    cheat = NGramLM([enc.encode(r["context"] + " " + r["choices"][r["label"]]) for r in rows])
    res = run_suite(cheat, enc, tmp_path / "tasks", ["kiln_demo_order"], bootstrap_iters=0)
    assert res["kiln_demo_order"]["items"] == 12 and res["kiln_demo_order"]["chance"] == 0.5
    assert res["kiln_demo_order"]["acc"] >= 0.8
    guess = run_suite(tiny_gpt(64, seed=1), enc, tmp_path / "tasks", ["kiln_demo_order"], bootstrap_iters=0)
    assert 0.0 <= guess["kiln_demo_order"]["acc"] <= 1.0

    # checked for contamination with the spec's own item text; the clean copy scores beside the same chance
    leak = rows[0]["context"] + " " + rows[0]["choices"][rows[0]["label"]]
    train = [(f"train{i}", d) for i, d in enumerate(docs[40:])] + [("leak", "Before it. " + leak + " After it.")]
    report = check_contamination(tmp_path / "tasks", {"corpus": iter(train)}, tmp_path / "clean", tasks=["kiln_demo_order"])
    assert report["tasks"]["kiln_demo_order"]["contaminated_lines"] == [0]
    full, clean = score_full_and_clean(cheat, enc, [tmp_path / "tasks", tmp_path / "clean"], ["kiln_demo_order"],
                                       report["tasks"], bootstrap_iters=0)
    assert full["kiln_demo_order"]["contaminated"] == 1 and clean["kiln_demo_order"]["items"] == 11
    assert clean["kiln_demo_order"]["chance"] == 0.5
    (row,) = score_rows(full, clean)
    assert (row["task"], row["metric"], row["chance"], row["clean items"]) == ("kiln_demo_order", "acc", 0.5, 11)
    assert REGISTRY.suites()["demo"] == ["kiln_demo_order"] and primary_metric("kiln_demo_order_clean", row | {"acc": 1}) == "acc"


def test_the_registry_is_restored_after_the_demonstration():
    assert "kiln_demo_order" not in CHANCE and "demo" not in REGISTRY.suites()
    with pytest.raises(UnknownTaskError, match="'kiln_demo_order' is not registered"):
        REGISTRY.get("kiln_demo_order")


def test_the_registry_derives_the_tables_kiln_had():
    assert REGISTRY.suites() == {"heldout": ["kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"], "mmlu": ["kiln_mmlu"],
                                 "math": ["kiln_math_word", "kiln_math_expr"], "code": ["kiln_humaneval"]}
    assert {t: CHANCE[t] for t in ("kiln_heldout_ppl", "kiln_continuation", "kiln_lastword", "kiln_mmlu")} == {
        "kiln_heldout_ppl": None, "kiln_continuation": 0.25, "kiln_lastword": 0.0, "kiln_mmlu": 0.25}
    assert (CHANCE["hellaswag"], CHANCE["piqa"], CHANCE["lambada_openai"], CHANCE["wikitext"]) == (0.25, 0.5, 0.0, None)
    assert CHANCE.get("anli_r1") is None and REGISTRY.chance("anli_r1") is None  # lm-eval's own, not listed
    scores = {"acc": 0.3, "acc_norm": 0.4, "bits_per_byte": 2.0}
    assert {t: primary_metric(t, scores) for t in ("kiln_continuation", "kiln_lastword", "kiln_mmlu", "kiln_heldout_ppl",
                                                   "hellaswag", "kiln_continuation_clean")} == {
        "kiln_continuation": "acc_norm", "kiln_lastword": "acc", "kiln_mmlu": "acc", "kiln_heldout_ppl": "bits_per_byte",
        "hellaswag": "acc_norm", "kiln_continuation_clean": "acc_norm"}
    assert primary_metric("winogrande", {"acc": 0.5}) == "acc" and primary_metric("wikitext", {"bits_per_byte": 1.0}) is None


# ---- incomplete, duplicate and unknown tasks -----------------------------------------------------------------


def test_duplicate_and_unknown_names_are_errors(tmp_path, enc):  # noqa: F811
    with pytest.raises(TaskSpecError, match="'kiln_demo_order' is registered twice"):
        TaskRegistry([DEMO, DEMO])
    with pytest.raises(TaskSpecError, match="'kiln_continuation' is registered twice"):
        TaskRegistry(REGISTRY.local()).register(REGISTRY.get("kiln_continuation"))
    with pytest.raises(UnknownTaskError, match=r"suite 'mine': eval task 'kiln_contination' is not registered"):
        REGISTRY.check_suites({"ok": ["kiln_lastword", "hellaswag"], "mine": ["kiln_contination"]})
    with pytest.raises(UnknownTaskError, match="suite 'x'"):
        runnable_suites({"x": ["kiln_nope"]}, {}, log=None)
    for lookup in (REGISTRY.chance, CHANCE.get, lambda t: primary_metric(t, {"acc": 1.0})):
        with pytest.raises(UnknownTaskError, match="'kiln_nope' is not registered"):
            lookup("kiln_nope")
    with pytest.raises(UnknownTaskError, match="package_items: eval task 'kiln_mmlu_x'"):
        build_suite([], tmp_path / "none", tmp_path, n_items=1, seed=0, package_items={"kiln_mmlu_x": 3})
    # a task folder holding a kiln_* task nobody registered: refused before any scoring or checking
    build_tasks(make_docs(30, seed=2), tmp_path, n_items=5, seed=0)
    (tmp_path / "kiln_lastword.yaml").rename(tmp_path / "kiln_mine.yaml")
    spec = yaml.safe_load((tmp_path / "kiln_mine.yaml").read_text())
    (tmp_path / "kiln_mine.yaml").write_text(yaml.safe_dump({**spec, "task": "kiln_mine"}, sort_keys=False))
    with pytest.raises(UnknownTaskError, match="run_suite: eval task 'kiln_mine' is not registered"):
        run_suite(tiny_gpt(), enc, tmp_path, ["kiln_mine"])
    with pytest.raises(UnknownTaskError, match="'kiln_mine' is not registered"):
        check_contamination(tmp_path, {}, tmp_path / "clean")
