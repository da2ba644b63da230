"""Local lm-eval tasks built from held-out documents: perplexity, HellaSwag-style endings, LAMBADA-style last word.

``build_tasks(docs, Path("tasks"), n_items=200, seed=0)`` writes ``<task>.jsonl`` + ``<task>.yaml`` for ``run_suite``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Callable

import yaml

from kiln.common.files import atomic_write_text, sha256_file

PPL, CONTINUATION, LASTWORD = "kiln_heldout_ppl", "kiln_continuation", "kiln_lastword"
TASK_NAMES = (PPL, CONTINUATION, LASTWORD)
# Score of a model that knows nothing: 1 in 4 endings; a greedy word over the whole vocabulary ~0; none for perplexity.
LOCAL_CHANCE: dict[str, float | None] = {PPL: None, CONTINUATION: 0.25, LASTWORD: 0.0}

PPL_MIN_CHARS, PPL_MAX_CHARS = 100, 4000  # shorter documents are skipped, longer ones cut at a word boundary
CTX_MIN_CHARS, CTX_MAX_CHARS, CTX_MAX_SENTS = 150, 800, 6  # passage before an ending / the last word
END_MIN_WORDS, END_MAX_WORDS, END_MAX_CHARS = 4, 60, 300  # what counts as an ending sentence
N_DISTRACTORS = 3

_SENT_SPLIT = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))\s+(?=["'(\[]?[A-Z0-9])""")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]{3,})[.!?\"')\]]*$", re.S)


class NotEnoughDocumentsError(ValueError):
    """Too few held-out documents qualify for a task; the message names the task and the counts."""


def _sentences(text: str) -> list[str]:
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


def _ppl_items(doc: str, rng: random.Random, k: int) -> list[dict[str, Any]]:
    """The document itself (cut at a word boundary when long): one item per document whatever k is."""
    text = doc.strip()
    if len(text) < PPL_MIN_CHARS:
        return []
    if len(text) > PPL_MAX_CHARS:
        cut = text.rfind(" ", PPL_MAX_CHARS * 3 // 4, PPL_MAX_CHARS)
        text = text[: cut if cut > 0 else PPL_MAX_CHARS].rstrip()
    return [{"text": text}]


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


def _continuation_items(sents: list[str], rng: random.Random, k: int) -> list[dict[str, Any]]:
    spans = [(i, j + 1, {"context": " ".join(sents[i:j]), "ending": sents[j]}) for i, j in _windows(sents, rng)
             if j < len(sents) and _is_ending(sents[j]) and sents[j] not in sents[i:j]]
    return _disjoint(spans, k)


def _lastword_items(sents: list[str], rng: random.Random, k: int) -> list[dict[str, Any]]:
    """Passages ending in a word; those that mention the word earlier first, as LAMBADA's items do."""
    preferred, other = [], []
    for i, j in _windows(sents, rng):
        m = _LAST_WORD.match(" ".join(sents[i:j]))
        if not m:
            continue
        context, word = m.group(1), m.group(2)
        item = {"context": context, "target": " " + word, "in_context": word.lower() in context.lower().split()}
        (preferred if item["in_context"] else other).append((i, j, item))
    return _disjoint(preferred + other, k)


def _pick_items(
    task: str,
    docs: dict[int, str],
    n_items: int,
    min_items: int,
    per_doc: int,
    seed: int,
    make: Callable[[Any, random.Random, int], list[dict]],
    need: str,
) -> list[dict[str, Any]]:
    """Up to n_items items, at most per_doc per document: documents in a seeded order, round by round.

    Round 1 takes each document's first item, round 2 their second, and so on, so items spread over documents.
    Raises NotEnoughDocumentsError when fewer than min_items qualify.
    """
    rng = random.Random(f"{seed}:{task}")
    order = list(docs)
    rng.shuffle(order)
    items: list[dict[str, Any]] = []
    found: list[tuple[int, list[dict]]] = []  # (document, its items) in order; made lazily in round 1
    for rnd in range(per_doc):
        sources = order if rnd == 0 else [d for d, _ in found]
        for n, d in enumerate(sources):
            if rnd == 0:
                src = docs[d] if task == PPL else _sentences(docs[d])
                found.append((d, make(src, rng, per_doc)))
            got = found[n][1]
            if rnd < len(got):
                items.append({"id": len(items), "doc_index": d, **got[rnd]})
                if len(items) == n_items:
                    return items
    if len(items) < min_items:
        raise NotEnoughDocumentsError(
            f"{task}: needs n_items={min_items} items ({need}; at most {per_doc} per document) but only {len(items)} "
            f"come from the {len(docs)} distinct documents; pass more held-out documents or lower n_items"
        )
    return items


def _add_distractors(items: list[dict[str, Any]], docs: dict[int, str], seed: int) -> None:
    """Give each continuation item 3 endings from other documents, as close in length as the pool allows.

    Lengths are matched from a band symmetric around the true ending's (exact first), so summed log-probs do
    not favour either side; then the 4 choices are shuffled.
    """
    rng = random.Random(f"{seed}:{CONTINUATION}:distractors")
    by_len: dict[int, list[tuple[str, int]]] = {}
    for d, doc in docs.items():
        for s in _sentences(doc):
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


def _task_yaml(task: str, data: Path, n: int, seed: int) -> dict[str, Any]:
    base = {
        "task": task,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "metadata": {"version": 1.0, "items": n, "seed": seed, "data_sha256": sha256_file(data)},
    }
    mean_up = {"aggregation": "mean", "higher_is_better": True}
    if task == PPL:
        return base | {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "text",
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": False}
                for m, agg in (
                    ("word_perplexity", "weighted_perplexity"),
                    ("byte_perplexity", "weighted_perplexity"),
                    ("bits_per_byte", "bits_per_byte"),
                )
            ],
        }
    if task == CONTINUATION:
        return base | {
            "output_type": "multiple_choice",
            "doc_to_text": "context",
            "doc_to_target": "label",
            "doc_to_choice": "choices",
            "metric_list": [{"metric": "acc", **mean_up}, {"metric": "acc_norm", **mean_up}],
        }
    return base | {
        "output_type": "loglikelihood",
        "doc_to_text": "context",
        "doc_to_target": "target",
        "metric_list": [
            {"metric": "acc", **mean_up},
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
        ],
    }


def build_tasks(documents: list[str], out_dir: Path, n_items: int, seed: int, min_items: int | None = None,
                per_doc: int = 1) -> dict[str, dict[str, Any]]:
    """Write the three local tasks (JSONL data + lm-eval YAML) into out_dir, deterministically for a seed.

    Each task gets n_items items, at most per_doc per document (perplexity: one per document), or as many as
    the documents give when that is at least min_items (default n_items: exactly n_items or an error).
    Returns {task: {"items": n, "path": yaml path, "data": jsonl path, "chance": float | None}}.
    Raises NotEnoughDocumentsError when a task cannot get min_items items.
    """
    min_items = n_items if min_items is None else min_items
    if not 1 <= min_items <= n_items or per_doc < 1:
        raise ValueError(f"need 1 <= min_items <= n_items and per_doc >= 1, got {min_items}, {n_items}, {per_doc}")
    first: dict[str, int] = {}
    for i, d in enumerate(documents):  # exact duplicates would repeat items
        if d and d.strip():
            first.setdefault(d, i)
    docs = {i: d for d, i in first.items()}  # {index in documents: text}; items record that index
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = {
        PPL: (_ppl_items, f">= {PPL_MIN_CHARS} characters"),
        CONTINUATION: (_continuation_items, f"a {CTX_MIN_CHARS}-{CTX_MAX_CHARS} character passage + an ending sentence"),
        LASTWORD: (_lastword_items, f"a {CTX_MIN_CHARS}-{CTX_MAX_CHARS} character passage ending in a word"),
    }
    out: dict[str, dict[str, Any]] = {}
    for task, (make, need) in makers.items():
        items = _pick_items(task, docs, n_items, min_items, per_doc, seed, make, need)
        if task == CONTINUATION:
            _add_distractors(items, docs, seed)
        data, spec = out_dir / f"{task}.jsonl", out_dir / f"{task}.yaml"
        atomic_write_text(data, "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
        atomic_write_text(spec, yaml.safe_dump(_task_yaml(task, data, len(items), seed), sort_keys=False))
        out[task] = {"items": len(items), "path": str(spec), "data": str(data), "chance": LOCAL_CHANCE[task]}
    return out


def retarget_tasks(task_dir: Path, final_dir: Path) -> None:
    """Point each task YAML in task_dir at its JSONL file under final_dir, where the folder is about to be moved.

    lm-eval resolves ``data_files`` from the working directory, so task YAMLs carry absolute paths; a folder built in
    a staging place gets its final paths written before it is committed.
    """
    for spec in sorted(Path(task_dir).glob("*.yaml")):
        cfg = yaml.safe_load(spec.read_text()) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if not isinstance(files, dict):
            continue
        cfg["dataset_kwargs"]["data_files"] = {split: str(Path(final_dir).resolve() / Path(p).name) for split, p in files.items()}
        atomic_write_text(spec, yaml.safe_dump(cfg, sort_keys=False))
