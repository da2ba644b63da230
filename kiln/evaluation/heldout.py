"""The held-out tasks: perplexity, HellaSwag-style endings, LAMBADA-style last word, each a TaskSpec over documents.

``build_tasks(docs, Path("tasks"), n_items=200, seed=0)`` (kiln/evaluation/tasks.py) writes them for ``run_suite``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from kiln.evaluation.spec import FromDocuments, NotEnoughDocumentsError, TaskSpec

PPL, CONTINUATION, LASTWORD = "kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"

PPL_MIN_CHARS, PPL_MAX_CHARS = 100, 4000  # shorter documents are skipped, longer ones cut at a word boundary
CTX_MIN_CHARS, CTX_MAX_CHARS, CTX_MAX_SENTS = 150, 800, 6  # passage before an ending / the last word
END_MIN_WORDS, END_MAX_WORDS, END_MAX_CHARS = 4, 60, 300  # what counts as an ending sentence
N_DISTRACTORS = 3

_SENT_SPLIT = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))\s+(?=["'(\[]?[A-Z0-9])""")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]{3,})[.!?\"')\]]*$", re.S)
_MEAN_UP = {"aggregation": "mean", "higher_is_better": True}


def sentences(text: str) -> list[str]:
    """Whitespace-normalised sentences of a document (a simple punctuation + capital-letter rule)."""
    return [s.strip() for s in _SENT_SPLIT.split(" ".join(text.split())) if s.strip()]


def _is_ending(s: str) -> bool:
    return END_MIN_WORDS <= len(s.split()) <= END_MAX_WORDS and len(s) <= END_MAX_CHARS


def _windows(sents: list[str], rng: random.Random) -> list[tuple[int, int]]:
    """(start, end) sentence spans with CTX_MIN_CHARS..CTX_MAX_CHARS of text, start positions shuffled."""
    starts = list(range(len(sents)))
    rng.shuffle(starts)
    spans = []
    for i in starts:
        j, n = i, 0
        while j < len(sents) and j - i < CTX_MAX_SENTS and n < CTX_MIN_CHARS:
            n += len(sents[j]) + 1
            j += 1
        if CTX_MIN_CHARS <= n <= CTX_MAX_CHARS:
            spans.append((i, j))
    return spans


def _disjoint(spans: list[tuple[int, int, dict]], k: int) -> list[dict[str, Any]]:
    """Up to k items whose sentence spans (start, end exclusive) do not overlap, in the given order."""
    taken: list[tuple[int, int]] = []
    out = []
    for i, j, item in spans:
        if len(out) == k:
            break
        if all(j <= a or i >= b for a, b in taken):
            taken.append((i, j))
            out.append(item)
    return out


# ---- perplexity ------------------------------------------------------------------------------------------


def ppl_items(doc: str, rng: random.Random, k: int) -> list[dict[str, Any]]:
    """The document itself (cut at a word boundary when long): one item per document whatever k is."""
    text = doc.strip()
    if len(text) < PPL_MIN_CHARS:
        return []
    if len(text) > PPL_MAX_CHARS:
        cut = text.rfind(" ", PPL_MAX_CHARS * 3 // 4, PPL_MAX_CHARS)
        text = text[: cut if cut > 0 else PPL_MAX_CHARS].rstrip()
    return [{"text": text}]


PPL_TASK = TaskSpec(
    name=PPL, chance=None, primary="bits_per_byte", suite="heldout",
    items=FromDocuments(ppl_items, need=f">= {PPL_MIN_CHARS} characters"),
    lm_eval={"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text", "metric_list": [
        {"metric": m, "aggregation": agg, "higher_is_better": False}
        for m, agg in (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                       ("bits_per_byte", "bits_per_byte"))]},
    item_text=lambda row: row["text"],
)


# ---- endings (HellaSwag-style) ---------------------------------------------------------------------------


def continuation_items(doc: str, rng: random.Random, k: int) -> list[dict[str, Any]]:
    """Passages followed by their true ending sentence (the distractors are added by add_distractors)."""
    sents = sentences(doc)
    spans = [(i, j + 1, {"context": " ".join(sents[i:j]), "ending": sents[j]}) for i, j in _windows(sents, rng)
             if j < len(sents) and _is_ending(sents[j]) and sents[j] not in sents[i:j]]
    return _disjoint(spans, k)


def add_distractors(items: list[dict[str, Any]], docs: dict[int, str], seed: int) -> None:
    """Give each continuation item 3 endings from other documents, as close in length as the pool allows.

    Lengths are matched from a band symmetric around the true ending's (exact first), so summed log-probs do
    not favour either side; then the 4 choices are shuffled.
    """
    rng = random.Random(f"{seed}:{CONTINUATION}:distractors")
    by_len: dict[int, list[tuple[str, int]]] = {}
    for d, doc in docs.items():
        for s in sentences(doc):
            if _is_ending(s):
                by_len.setdefault(len(s), []).append((s, d))
    for item in items:
        n, own = len(item["ending"]), item["doc_index"]
        cands: set[str] = set()
        for w in range(END_MAX_CHARS + 1):
            for length in {n - w, n + w}:
                cands.update(s for s, d in by_len.get(length, ()) if d != own and s != item["ending"])
            if len(cands) >= N_DISTRACTORS:
                break
        else:
            raise NotEnoughDocumentsError(
                f"{CONTINUATION}: needs {N_DISTRACTORS} distractor endings from other documents but the "
                f"{len(docs)} documents hold only {len(cands)}; pass more held-out documents"
            )
        choices = [item["ending"], *rng.sample(sorted(cands), N_DISTRACTORS)]
        rng.shuffle(choices)
        item["choices"], item["label"] = choices, choices.index(item.pop("ending"))


CONTINUATION_TASK = TaskSpec(
    name=CONTINUATION, chance=1 / (N_DISTRACTORS + 1), primary="acc_norm", suite="heldout",
    items=FromDocuments(continuation_items, f"a {CTX_MIN_CHARS}-{CTX_MAX_CHARS} character passage + an ending sentence",
                        finish=add_distractors),
    lm_eval={"output_type": "multiple_choice", "doc_to_text": "context", "doc_to_target": "label",
             "doc_to_choice": "choices", "metric_list": [{"metric": "acc", **_MEAN_UP}, {"metric": "acc_norm", **_MEAN_UP}]},
    item_text=lambda row: f"{row['context']} {row['choices'][row['label']]}",  # the gold ending only
)


# ---- last word (LAMBADA-style) ---------------------------------------------------------------------------


def lastword_items(doc: str, rng: random.Random, k: int) -> list[dict[str, Any]]:
    """Passages ending in a word; those that mention the word earlier first, as LAMBADA's items do."""
    sents = sentences(doc)
    preferred, other = [], []
    for i, j in _windows(sents, rng):
        m = _LAST_WORD.match(" ".join(sents[i:j]))
        if not m:
            continue
        context, word = m.group(1), m.group(2)
        item = {"context": context, "target": " " + word, "in_context": word.lower() in context.lower().split()}
        (preferred if item["in_context"] else other).append((i, j, item))
    return _disjoint(preferred + other, k)


LASTWORD_TASK = TaskSpec(
    name=LASTWORD, chance=0.0, primary="acc", suite="heldout",  # a greedy word over the whole vocabulary: ~0
    items=FromDocuments(lastword_items, f"a {CTX_MIN_CHARS}-{CTX_MAX_CHARS} character passage ending in a word"),
    lm_eval={"output_type": "loglikelihood", "doc_to_text": "context", "doc_to_target": "target", "metric_list": [
        {"metric": "acc", **_MEAN_UP}, {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}]},
    item_text=lambda row: f"{row['context']} {row['target']}",
)
