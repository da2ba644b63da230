"""Preference pairs built honestly from instruction pairs: the correct response is chosen, a wrong one rejected.

Arithmetic gets the same sentence with a wrong number (an off-by-a-little, a sign or an operator slip);
a documentation heading gets another section's text. ``build_preferences(pairs, seed=0)``; a pair keeps its prompt's split.
"""

from __future__ import annotations

import random
import re
from typing import Iterable

ERRORS = ("off_by_small", "off_by_ten", "wrong_operator", "sign")  # how a wrong arithmetic answer is made


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
