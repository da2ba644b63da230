"""Tests for kiln.evaluation.heldout: sentence splitting, the perplexity item (a document, cut at a word boundary when
long), HellaSwag-style passages with their true ending and three length-matched distractors from other documents,
LAMBADA-style passages that end in a word (those naming it earlier first), and the three TaskSpecs' fields.
"""

from __future__ import annotations

import random

import pytest

from kiln.evaluation.heldout import (
    CONTINUATION,
    CONTINUATION_TASK,
    LASTWORD_TASK,
    PPL_MAX_CHARS,
    PPL_TASK,
    add_distractors,
    continuation_items,
    lastword_items,
    ppl_items,
    sentences,
)
from kiln.evaluation.spec import NotEnoughDocumentsError

MILL = ["The miller carried grain to the old stone mill by the river.",
        "His daughter counted the sacks while the wheel turned slowly.",
        "A heron stood in the shallows and watched them both all morning.",
        "By noon the carts were loaded and the horses were restless.",
        "They set off along the valley road before the rain began.",
        "The bridge at the ford had been mended only that spring.",
        "At the market the grain fetched a better price than last year.",
        "On the way home the daughter sang the songs of the mill."]


def test_sentences_split_after_end_punctuation_before_a_capital_digit_or_opening_mark():
    text = 'He said "Go."  Then he left,\n e.g. at noon! (Later) they met. 3 dogs ran? yes it was late.'
    assert sentences(text) == ['He said "Go."', "Then he left, e.g. at noon!", "(Later) they met.",
                               "3 dogs ran? yes it was late."]
    assert sentences("   ") == []


def test_a_perplexity_item_is_the_whole_document_cut_at_a_word_boundary_when_long():
    assert ppl_items("Too short to measure.", random.Random(0), 5) == []
    doc = "  " + " ".join(MILL[:3]) + "\n"
    assert ppl_items(doc, random.Random(0), 5) == [{"text": doc.strip()}]  # one item per document whatever k is
    long = " ".join(MILL * 12)  # about 5,700 characters
    (item,) = ppl_items(long, random.Random(0), 1)
    cut = item["text"]
    assert PPL_MAX_CHARS * 3 // 4 <= len(cut) <= PPL_MAX_CHARS and long.startswith(cut) and long[len(cut)] == " "
    assert long.rfind(" ", 0, PPL_MAX_CHARS) == len(cut)  # the last word boundary before the limit
    assert ppl_items("x" * 5000, random.Random(0), 1) == [{"text": "x" * PPL_MAX_CHARS}]  # no boundary to cut at


def test_continuation_items_are_disjoint_passages_followed_by_their_true_ending():
    doc = " ".join(MILL)
    (one,) = continuation_items(doc, random.Random(0), 1)
    assert one == {"context": " ".join(MILL[4:7]), "ending": MILL[7]}
    items = continuation_items(doc, random.Random(0), 5)
    assert items == [one, {"context": " ".join(MILL[0:3]), "ending": MILL[3]}]  # no two share a sentence
    for seed in range(10):
        for item in continuation_items(doc, random.Random(seed), 5):
            assert f"{item['context']} {item['ending']}" in doc and 150 <= len(item["context"]) <= 800


def test_a_short_sentence_or_one_the_passage_holds_is_no_ending():
    short = " ".join(s for pair in zip(MILL[:4], ["Yes.", "No.", "Why not?", "Go."]) for s in pair)
    assert continuation_items(short, random.Random(0), 5) == []  # every sentence after a passage has < 4 words
    repeat = " ".join(MILL[:3] + [MILL[0]])
    assert continuation_items(repeat, random.Random(0), 5) == []


def test_last_word_items_prefer_passages_that_name_the_word_earlier():
    river = MILL[:2] + ["A heron waited where the river ran shallow and clear.", "Later the carts crossed the river."]
    doc = " ".join(river)
    for seed in range(5):
        first = lastword_items(doc, random.Random(seed), 1)
        assert first == [{"context": " ".join(river[1:3]) + " Later the carts crossed the", "target": " river",
                          "in_context": True}]
    items = lastword_items(" ".join(MILL), random.Random(0), 5)
    assert items == [
        {"context": " ".join(MILL[4:6]) + " At the market the grain fetched a better price than last",
         "target": " year", "in_context": False},
        {"context": " ".join(MILL[1:3]) + " By noon the carts were loaded and the horses were", "target": " restless",
         "in_context": False}]
    words = " ".join(MILL[:2] + ["They left the mill at half past five."])
    assert lastword_items(words, random.Random(0), 5) == [
        {"context": " ".join(MILL[:2]) + " They left the mill at half past", "target": " five", "in_context": False}]
    assert lastword_items(words.replace("five.", "5."), random.Random(0), 5) == []  # a number is not a word


ENDING = "The fox ran home at dusk."  # 25 characters
DOCS = {0: "A hen sat in the big barn. " + ENDING,  # 26 characters, but the item's own document
        1: "A cat sat down by a door. It was a cold and quiet night in the hills.",  # 25, 43
        2: "The rain fell on the hay. Two owls woke up at ten.",  # 25, 24
        3: "She read the letter twice. Old boats rest on the sand!"}  # 26, 27
CLOSEST = {"A cat sat down by a door.", "The rain fell on the hay.", "Two owls woke up at ten.",
           "She read the letter twice."}  # 25 and 25, then 24 and 26: the first band with 3 or more


def test_distractors_are_the_closest_in_length_from_other_documents_then_shuffled():
    labels = set()
    for seed in range(10):
        items = [{"context": "Dusk came early.", "ending": ENDING, "doc_index": 0}]
        add_distractors(items, DOCS, seed)
        (item,) = items
        assert set(item) == {"context", "doc_index", "choices", "label"}  # the ending became a choice and its label
        assert len(item["choices"]) == 4 and item["choices"][item["label"]] == ENDING
        assert set(item["choices"]) - {ENDING} <= CLOSEST and len(set(item["choices"])) == 4
        labels.add(item["label"])
        again = [{"context": "Dusk came early.", "ending": ENDING, "doc_index": 0}]
        add_distractors(again, DOCS, seed)
        assert again == items  # the same seed: the same distractors in the same order
    assert len(labels) > 1  # the true ending is not always in one place


def test_too_few_distractors_are_an_error_with_the_counts():
    items = [{"context": "Dusk came early.", "ending": ENDING, "doc_index": 0}]
    with pytest.raises(NotEnoughDocumentsError) as e:
        add_distractors(items, {0: DOCS[0], 1: "A cat sat down by a door. Yes."}, 0)
    assert str(e.value) == (f"{CONTINUATION}: needs 3 distractor endings from other documents but the 2 documents hold "
                            "only 1; pass more held-out documents")


def test_the_three_tasks_and_the_text_each_checks_for_contamination():
    assert [(t.name, t.chance, t.primary, t.suite) for t in (PPL_TASK, CONTINUATION_TASK, LASTWORD_TASK)] == [
        ("kiln_heldout_ppl", None, "bits_per_byte", "heldout"), ("kiln_continuation", 0.25, "acc_norm", "heldout"),
        ("kiln_lastword", 0.0, "acc", "heldout")]
    assert PPL_TASK.metrics == ["word_perplexity", "byte_perplexity", "bits_per_byte"]
    assert CONTINUATION_TASK.metrics == ["acc", "acc_norm"] and LASTWORD_TASK.metrics == ["acc", "perplexity"]
    assert PPL_TASK.item_text({"text": "All of it."}) == "All of it."
    row = {"context": "It rained.", "choices": ["wrong one", "true end", "other"], "label": 1}
    assert CONTINUATION_TASK.item_text(row) == "It rained. true end"  # the distractors belong to other documents
    assert LASTWORD_TASK.item_text({"context": "The last", "target": " word"}) == "The last  word"
    assert CONTINUATION_TASK.items.finish is add_distractors and PPL_TASK.items.finish is None
