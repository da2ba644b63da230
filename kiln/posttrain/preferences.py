"""Preference pairs built honestly from instruction pairs: the correct response is chosen, a wrong one rejected.

Arithmetic gets the same sentence with a wrong number (an off-by-a-little, a sign or an operator slip);
a documentation heading gets another section's text. ``build_preferences(pairs, seed=0)``; a pair keeps its prompt's split.
``feedback_files`` says which pair files a preference stage trains on: these checkable ones, an AI judge's, or both.
"""

from __future__ import annotations

import random
import re
from typing import Iterable

ERRORS = ("off_by_small", "off_by_ten", "wrong_operator", "sign")  # how a wrong arithmetic answer is made
# which pairs train a preference stage (dpo_model, reward_model): preference_data's (labels checkable by
# construction), judged_preferences' (labelled by an AI judge) or both; the held-out pairs are always preference_data's
FEEDBACK = ("checkable", "judged", "mixed")


def wrong_answer(prompt: str, answer: int, rng: random.Random) -> tuple[int, str]:
    """(a wrong integer, the error kind) for an arithmetic prompt 'What is A op B?'."""
    m = re.fullmatch(r"What is (-?\d+) ([+-]) (-?\d+)\?", prompt)
    kinds = list(ERRORS)
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "off_by_small":
            wrong = answer + rng.choice([-2, -1, 1, 2])
        elif kind == "off_by_ten":
            wrong = answer + rng.choice([-10, 10])
        elif kind == "wrong_operator" and m:
            a, op, b = int(m[1]), m[2], int(m[3])
            wrong = a - b if op == "+" else a + b
        elif kind == "sign":
            wrong = -answer
        else:
            continue
        if wrong != answer:
            return wrong, kind
    return answer + 1, "off_by_small"  # answer 0 with a symmetric operator slip: still wrong by one


def arithmetic_preference(pair: dict, rng: random.Random) -> dict:
    answer = int(pair["answer"])
    wrong, kind = wrong_answer(pair["prompt"], answer, rng)
    head, _, _ = pair["response"].rpartition("= ")
    rejected = f"{head}= {wrong}." if head else f"{wrong}."
    return {"chosen": pair["response"], "rejected": rejected, "error": kind, "answer": pair["answer"],
            "rejected_answer": str(wrong)}


def build_preferences(pairs: Iterable[dict], seed: int = 0) -> list[dict]:
    """One preference per instruction pair; unsupported kinds are skipped.

    A doc-section pair's rejected response is the section of another heading from a different source document
    and the same split, so held-out responses never appear in training pairs.
    """
    rng = random.Random(seed)
    pairs = list(pairs)
    sections: dict[str, list[dict]] = {}
    for p in pairs:
        if p["kind"] == "doc_section":
            sections.setdefault(p["split"], []).append(p)
    out = []
    for p in pairs:
        if p["kind"] == "arithmetic":
            extra = arithmetic_preference(p, rng)
        elif p["kind"] == "doc_section":
            others = [o for o in sections[p["split"]] if o["source_id"] != p["source_id"] and o["response"] != p["response"]]
            if not others:
                continue
            other = rng.choice(others)
            extra = {"chosen": p["response"], "rejected": other["response"], "error": "other_section",
                     "rejected_from": other["id"]}
        else:
            continue
        out.append({"id": p["id"], "prompt": p["prompt"], "kind": p["kind"], "split": p["split"],
                    "source_id": p["source_id"], **extra})
    return out


def check_feedback(feedback: str, where: str = "feedback") -> str:
    """``feedback`` when it is one of FEEDBACK; otherwise a ConfigError naming ``where`` and the choices."""
    from kiln.common.config import ConfigError

    if feedback not in FEEDBACK:
        raise ConfigError(f"{where}: {feedback!r} is not a feedback choice; choose one of {', '.join(FEEDBACK)}")
    return feedback


def feedback_files(feedback: str, checkable: str, judged: str | None, where: str = "feedback") -> dict[str, list[str]]:
    """The job's data files for ``feedback`` (check_feedback): ``train_files`` (checkable: ``checkable`` alone, as
    before there was a choice; judged: ``judged`` alone; mixed: both) and, when judged pairs train, ``val_files`` =
    [``checkable``], so held-out measures stay on pairs whose right answer is known. ``judged`` empty (never made)
    with judged or mixed is a ValueError."""
    if check_feedback(feedback, where) == "checkable":
        return {"train_files": [checkable]}
    if not judged:
        raise ValueError(f"{where}: {feedback} needs judged preference pairs, and there are none")
    return {"train_files": [judged] if feedback == "judged" else [checkable, judged], "val_files": [checkable]}


def pairs_by_source(feedback: str, train_by_file: list[int]) -> dict[str, int]:
    """{"checkable": n, "judged": m}: the training pairs a job took from each source, from its per-file counts
    (train_files in feedback_files' order)."""
    sources = {"checkable": ["checkable"], "judged": ["judged"], "mixed": ["checkable", "judged"]}[feedback]
    return {"checkable": 0, "judged": 0, **dict(zip(sources, train_by_file))}
