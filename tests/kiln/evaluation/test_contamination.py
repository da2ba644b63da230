"""Tests for kiln.evaluation.contamination: planted 13-gram overlaps are found, near misses are not, clean subsets score.

Run: python -m pytest tests/kiln/evaluation/test_contamination.py -q   (tiny tasks; a few seconds on CPU)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import yaml

from kiln.evaluation import build_tasks, check_contamination, score_full_and_clean
from kiln.evaluation.contamination import NgramIndex, item_text, jsonl_documents, local_tasks, words
from tests.kiln.evaluation.evaluation_kit import NGramLM, enc, make_docs  # noqa: F401  (enc is a fixture)


def rows_of(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture()
def suite(tmp_path):
    """Held-out tasks from 60 made-up documents, and 60 other documents as the training corpus."""
    docs = make_docs(120, seed=3)
    task_dir = tmp_path / "tasks"
    info = build_tasks(docs[:60], task_dir, n_items=12, seed=0)
    train = [(f"train{i}", d) for i, d in enumerate(docs[60:])]
    return task_dir, info, train


def test_words_and_item_text():
    assert words("Don't STOP—believing, 42 times!") == ["don", "t", "stop", "believing", "42", "times"]
    mmlu = {"question": "Pick one", "choices": ["red", "blue"], "label": 1}
    assert item_text(mmlu) == "Pick one red blue"  # every choice is in the prompt
    cont = {"context": "It rained.", "choices": ["wrong end", "true end"], "label": 1}
    assert item_text(cont) == "It rained. true end"  # only the gold ending; distractors belong to other items
    assert item_text({"context": "The last", "target": " word"}) == "The last  word"
    with pytest.raises(ValueError, match="keys"):
        item_text({"label": 0})


def test_planted_overlaps_are_found_and_near_misses_are_not(suite, tmp_path):
    task_dir, info, train = suite
    cont = rows_of(info["kiln_continuation"]["data"])
    last = rows_of(info["kiln_lastword"]["data"])
    ppl = rows_of(info["kiln_heldout_ppl"]["data"])
    w3 = (cont[3]["context"] + " " + cont[3]["choices"][cont[3]["label"]]).split()
    leaked_docs = {cont[3]["doc_index"], ppl[7]["doc_index"]}  # items of other tasks from these documents may leak too
    near = next(i for i, r in enumerate(last) if r["doc_index"] not in leaked_docs)
    planted = [
        # 13 words of continuation item 3, re-cased and re-punctuated inside an unrelated training document
        ("plant-a", train[0][1] + " " + " ".join(w3[2:15]).upper().replace(" ", ", ") + " " + train[1][1]),
        # only 12 words of a lastword item: below the 13-gram, not contamination
        ("plant-b", " ".join((last[near]["context"] + last[near]["target"]).split()[:12])),
    ]
    pairs = tmp_path / "pairs.jsonl"  # an instruction pair quoting perplexity item 7 (train split), one quoting 8 (val)
    pairs.write_text(json.dumps({"prompt": "Explain this.", "response": ppl[7]["text"][:400], "split": "train"}) + "\n"
                     + json.dumps({"prompt": "And this.", "response": ppl[8]["text"][:400], "split": "val"}) + "\n")
    report = check_contamination(task_dir, {"corpus": iter(train + planted),
                                            "instructions": jsonl_documents(pairs, where={"split": "train"})},
                                 tmp_path / "clean")
    t = report["tasks"]
    assert t["kiln_continuation"]["contaminated_lines"] == [3]
    assert t["kiln_continuation"]["examples"][0]["document"] == "plant-a"
    assert t["kiln_continuation"]["share"] == pytest.approx(1 / 12)
    assert near not in t["kiln_lastword"]["contaminated_lines"]
    assert all(last[i]["doc_index"] in leaked_docs for i in t["kiln_lastword"]["contaminated_lines"])
    assert t["kiln_heldout_ppl"]["contaminated_lines"] == [7] and t["kiln_heldout_ppl"]["by_source"] == {"instructions": 1}
    assert report["sources"]["corpus"]["documents"] == 62 and report["sources"]["instructions"]["documents"] == 1

    clean = local_tasks(tmp_path / "clean")
    assert set(clean) == {"kiln_continuation_clean", "kiln_heldout_ppl_clean", "kiln_lastword_clean"}
    kept = rows_of(clean["kiln_continuation_clean"].data)
    assert len(kept) == 11 == t["kiln_continuation"]["clean_items"] and cont[3] not in kept and cont[4] in kept
    assert len(rows_of(clean["kiln_lastword_clean"].data)) == 12 - t["kiln_lastword"]["contaminated"]
    spec = yaml.safe_load(clean["kiln_continuation_clean"].spec.read_text())
    assert spec["metadata"]["subset_of"] == "kiln_continuation" and spec["doc_to_choice"] == "choices"
    assert json.loads((tmp_path / "clean" / "report.json").read_text())["tasks"]["kiln_continuation"]["contaminated"] == 1


def test_short_items_count_only_when_whole(tmp_path):
    index = NgramIndex(n=13)
    index.add_task("t", [{"text": "a short item of six words"}, {"text": " ".join(f"w{i}" for i in range(20))}])
    index.scan("corpus", [("d1", "before A SHORT item, of six words after"), ("d2", "a short item of six")])
    assert index.report()["t"]["contaminated_lines"] == [0]
    with pytest.raises(ValueError, match="n-gram length"):
        NgramIndex(n=0)


def test_every_item_contaminated_leaves_no_clean_task(suite, tmp_path):
    task_dir, info, _ = suite
    everything = [(f"eval{i}", json.dumps(r)) for t in info.values() for i, r in enumerate(rows_of(t["data"]))]
    report = check_contamination(task_dir, {"leak": iter(everything)}, tmp_path / "clean", tasks=["kiln_lastword"])
    row = report["tasks"]["kiln_lastword"]
    assert row["share"] == 1.0 and row["clean_items"] == 0 and row["clean_task"] is None
    assert set(report["tasks"]) == {"kiln_lastword"}
    with pytest.raises(ValueError, match="not local tasks"):
        check_contamination(task_dir, {}, tmp_path / "x", tasks=["hellaswag"])


def test_full_and_clean_scores_separate_a_memorising_model(suite, tmp_path, enc):  # noqa: F811
    """A model that memorised the contaminated items' passages aces them: full accuracy rises, clean stays at chance."""
    task_dir, info, train = suite
    cont = rows_of(info["kiln_continuation"]["data"])
    leaked = [0, 1, 2, 3, 4, 5]
    texts = [cont[i]["context"] + " " + cont[i]["choices"][cont[i]["label"]] for i in leaked]
    report = check_contamination(task_dir, {"corpus": iter(train + [(f"leak{i}", t) for i, t in zip(leaked, texts)])},
                                 tmp_path / "clean", tasks=["kiln_continuation"])
    assert report["tasks"]["kiln_continuation"]["contaminated_lines"] == leaked
    model = NGramLM([enc.encode(t) for t in texts])
    full, clean = score_full_and_clean(model, enc, [task_dir, tmp_path / "clean"], ["kiln_continuation"],
                                       report["tasks"], batch_size=8, bootstrap_iters=0)
    f, c = full["kiln_continuation"], clean["kiln_continuation"]
    assert f["items"] == 12 and c["items"] == 6 and f["contaminated"] == 6 and f["contaminated_share"] == 0.5
    right_on_leaked = round(f["acc"] * 12) - round(c["acc"] * 6)
    assert right_on_leaked >= 5  # the memorised items are (nearly) all right: only the full score counts them
    assert c["acc"] <= 0.5 and c["chance"] == 0.25  # the clean subset is a guess among four
