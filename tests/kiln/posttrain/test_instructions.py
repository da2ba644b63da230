"""Tests for kiln.posttrain.instructions: heading -> section pairs, checkable arithmetic, dedup and stable splits.

Run: python -m pytest tests/kiln/posttrain/test_instructions.py -q
"""

from __future__ import annotations

import json
import re

from kiln.posttrain.instructions import arithmetic, build_pairs, heading_sections, split_of, write_jsonl

P1 = ("The river runs slowly through the valley, carrying silt from the mountains to the sea. "
      "Farmers along its banks rely on the spring floods.")
P2 = "Boats carry grain   downstream\n in the autumn."
PAGE = f"""<html><head><title>Rivers</title></head><body>
<h1>Guide</h1>
<h2>2.1. Rivers and floods</h2><p>{P1}</p><!-- a comment --><p>{P2}</p>
<h2>Short</h2><p>Too short to teach anything.</p>
<div class="hdr"><h3>Mountain passes</h3></div>
<p>Mountain passes close in winter when the snow is deep, and travellers wait in the villages below.</p>
</body></html>"""


def test_heading_sections_pairs_heading_with_its_paragraphs() -> None:
    pairs = list(heading_sections("doc/1", PAGE))
    assert [p["prompt"] for p in pairs] == ["Explain Rivers and floods.", "Explain Mountain passes."]
    first = pairs[0]
    # whitespace collapsed; both paragraphs kept whole (the last sentence is not dropped); number stripped
    assert first["response"] == P1 + " Boats carry grain downstream in the autumn."
    assert first["kind"] == "doc_section" and first["source_id"] == "doc/1"
    # a heading wrapped in its own div takes the paragraphs after the wrapper
    assert pairs[1]["response"].startswith("Mountain passes close in winter")


def test_long_sections_are_cut_at_a_sentence_end_within_max_chars() -> None:
    body = " ".join(f"Sentence {i} is about the valley and the river." for i in range(40))
    (pair,) = heading_sections("d", f"<h2>Long section</h2><p>{body}</p>", min_chars=80, max_chars=300)
    text = pair["response"]
    assert len(text) <= 300 and text.endswith("river.")
    assert body.startswith(text)
    assert len(text) > 250  # the cut is at the last sentence end, not an early one


def test_no_pairs_from_empty_or_headingless_html() -> None:
    assert list(heading_sections("d", "")) == []
    assert list(heading_sections("d", "<p>" + "word " * 50 + "</p>")) == []


def test_arithmetic_answers_are_correct_and_reproducible() -> None:
    items = list(arithmetic(200, seed=7))
    assert len(items) == 200
    assert items == list(arithmetic(200, seed=7))
    assert items != list(arithmetic(200, seed=8))
    ops = set()
    for it in items:
        m = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", it["prompt"])
        assert m, it["prompt"]
        expr = f"{m[1]} {m[2]} {m[3]}"
        ops.add(m[2])
        value = eval(expr)  # noqa: S307 - digits and one operator, matched above
        assert it["answer"] == str(value)
        assert it["response"] == f"{expr} = {value}."
        assert int(it["response"].rstrip(".").split()[-1]) == value  # "the answer is the last number"
        assert 0 <= int(m[1]) <= 99 and 0 <= int(m[3]) <= 99
        assert it["kind"] == "arithmetic" and it["source_id"] == "arithmetic/7"
    assert ops == {"+", "-"}


def test_build_pairs_dedups_prompts_and_caps_doc_pairs() -> None:
    docs = [("a", PAGE), ("b", PAGE)]  # the same sections twice
    pairs = build_pairs(docs, n_arithmetic=300, seed=1, val_permille=200, max_doc_pairs=10)
    prompts = [p["prompt"] for p in pairs]
    assert len(prompts) == len(set(prompts))
    doc = [p for p in pairs if p["kind"] == "doc_section"]
    assert [p["source_id"] for p in doc] == ["a", "a"]  # the first occurrence wins
    n_unique_arith = len({a["prompt"] for a in arithmetic(300, 1)})
    assert n_unique_arith < 300  # 300 draws from 100*100*2 repeat some prompts
    assert len(pairs) == 2 + n_unique_arith
    capped = build_pairs(docs, n_arithmetic=0, seed=1, val_permille=200, max_doc_pairs=1)
    assert [p["prompt"] for p in capped] == ["Explain Rivers and floods."]


def test_split_and_id_depend_only_on_the_prompt() -> None:
    pairs = build_pairs([("a", PAGE)], n_arithmetic=500, seed=2, val_permille=200, max_doc_pairs=10)
    more = build_pairs([("z", "<p>x</p>"), ("a", PAGE)], n_arithmetic=2000, seed=2, val_permille=200, max_doc_pairs=10)
    by_prompt = {p["prompt"]: p for p in more}
    for p in pairs:  # growing the data never moves a pair between splits or changes its id
        assert by_prompt[p["prompt"]]["split"] == p["split"] == split_of(p["prompt"], 200)
        assert by_prompt[p["prompt"]]["id"] == p["id"]
        assert re.fullmatch(r"[0-9a-f]{16}", p["id"])
    val = sum(p["split"] == "val" for p in more) / len(more)
    assert 0.15 < val < 0.25
    assert all(split_of(p["prompt"], 0) == "train" for p in pairs)
    assert all(split_of(p["prompt"], 1000) == "val" for p in pairs)


def test_write_jsonl_round_trips_unicode(tmp_path) -> None:
    rows = [{"prompt": "Explain Zürich.", "response": "Ça va."}, {"prompt": "b", "response": "c"}]
    path = tmp_path / "out" / "pairs.jsonl"
    write_jsonl(rows, path)
    assert "Zürich" in path.read_text(encoding="utf-8")
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == rows
    assert [p.name for p in path.parent.iterdir()] == ["pairs.jsonl"]  # no temp file left behind


def test_eval_overlap_drops_pairs_that_share_text_with_eval_items() -> None:
    from kiln.posttrain.instructions import EvalOverlap

    heldout = ["Intro text. The river runs slowly through the valley, carrying silt from the mountains to the sea."]
    index = EvalOverlap.from_texts(heldout, n=8)
    assert index.items == 1
    assert index.overlaps("the RIVER runs slowly through the valley, carrying silt")  # case and punctuation ignored
    assert not index.overlaps("The river runs slowly through the town")  # 6 shared words < 8
    dropped: list[dict] = []
    pairs = build_pairs([("a", PAGE)], n_arithmetic=50, seed=1, val_permille=200, max_doc_pairs=1,
                        exclude=index, dropped=dropped)
    assert [d["prompt"] for d in dropped] == ["Explain Rivers and floods."]
    assert "shares 8 consecutive words" in dropped[0]["reason"]
    doc = [p for p in pairs if p["kind"] == "doc_section"]
    assert [p["prompt"] for p in doc] == ["Explain Mountain passes."]  # the cap counts only kept pairs
    assert len(pairs) == 1 + len({a["prompt"] for a in arithmetic(50, 1)})  # short arithmetic never matches 8 words


def test_final_number_and_reward() -> None:
    from kiln.posttrain.instructions import arithmetic_reward, final_number

    assert final_number("12 - 19 = -7.") == "-7"
    assert final_number("no digits") is None
    assert arithmetic_reward("The answer is 42", "42") == 1.0
    assert arithmetic_reward("42 or 41", "42") == 0.0  # the last number counts
    assert arithmetic_reward("", "0") == 0.0


def test_eval_overlap_reads_the_eval_suite_tasks_and_agrees_with_the_contamination_check(tmp_path) -> None:
    from kiln.evaluation.contamination import check_contamination
    from kiln.evaluation.tasks import build_tasks
    from kiln.posttrain.instructions import EvalOverlap
    from tests.conftest import make_docs

    docs = [t for _, t in make_docs(60, seed=3)]
    build_tasks(docs, tmp_path / "suite", 10, 0)
    index = EvalOverlap.from_task_dir(tmp_path / "suite")
    assert index.n == 13 and index.items == 30
    pairs = [{"prompt": f"Explain doc {i}.", "response": d, "kind": "doc_section"} for i, d in enumerate(docs)]
    kept = [p for p in pairs if not (index.overlaps(p["prompt"]) or index.overlaps(p["response"]))]
    assert 0 < len(kept) < len(pairs)
    report = check_contamination(tmp_path / "suite", {"pairs": ((p["prompt"], p["response"]) for p in kept)}, tmp_path / "out")
    assert all(t["contaminated"] == 0 for t in report["tasks"].values())  # nothing kept is flagged
    report = check_contamination(tmp_path / "suite", {"pairs": ((p["prompt"], p["response"]) for p in pairs)}, tmp_path / "out2")
    assert sum(t["contaminated"] for t in report["tasks"].values()) > 0


def test_a_kind_can_hold_out_its_own_share() -> None:
    pairs = build_pairs([("a", PAGE)], n_arithmetic=2000, seed=3, val_permille=50, max_doc_pairs=10,
                        max_operand=20, kind_val_permille={"arithmetic": 200})
    arith = [p for p in pairs if p["kind"] == "arithmetic"]
    docs = [p for p in pairs if p["kind"] == "doc_section"]
    assert all(p["split"] == split_of(p["prompt"], 200) for p in arith)
    assert all(p["split"] == split_of(p["prompt"], 50) for p in docs)
    share = sum(p["split"] == "val" for p in arith) / len(arith)
    assert 0.15 < share < 0.25, share
