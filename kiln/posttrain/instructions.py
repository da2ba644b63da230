"""Instruction pairs built from public data: documentation heading -> section, and checkable arithmetic.

Every pair records where it came from; the split is a hash of the prompt, so it never moves as data grows.
``build_pairs(docs, ..., exclude=EvalOverlap.from_task_dir(suite_dir))`` drops pairs that share text with eval items.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Iterable, Iterator

from kiln.common.files import atomic_path

HEADINGS = ("h1", "h2", "h3")


def split_of(prompt: str, val_permille: int) -> str:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 1000
    return "val" if h < val_permille else "train"


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _has_heading(node) -> bool:
    """True for a heading or an element holding one (a wrapped heading starts the next section)."""
    return isinstance(node.tag, str) and next(node.iter(*HEADINGS), None) is not None


def heading_sections(doc_id: str, html: str, min_chars: int = 80, max_chars: int = 600) -> Iterator[dict]:
    """Yield {prompt, response} for each heading whose following paragraphs hold enough text."""
    import lxml.html

    try:
        root = lxml.html.fromstring(html)
    except (ValueError, lxml.etree.ParserError):
        return
    for h in root.iter(*HEADINGS):
        title = _clean(h.text_content())
        title = re.sub(r"^[\d.]+\s*", "", title)  # drop section numbers such as "3.2."
        if not (3 <= len(title) <= 80):
            continue
        parts: list[str] = []
        node = h.getnext() if h.getnext() is not None else h.getparent().getnext()
        while node is not None and not _has_heading(node) and sum(map(len, parts)) < max_chars:
            if node.tag in ("p", "div", "dl", "ul"):
                parts.append(_clean(node.text_content()))
            node = node.getnext()
        text = " ".join(p for p in parts if p)
        body = text[:max_chars]
        if len(text) > max_chars:  # cut mid-sentence: end at the last full stop that keeps min_chars
            end = text.rfind(". ", min_chars, max_chars + 1)
            body = text[: end + 1] if end != -1 else body
        if len(body) >= min_chars:
            yield {"prompt": f"Explain {title}.", "response": body, "kind": "doc_section", "source_id": doc_id}


def arithmetic(n: int, seed: int, max_operand: int = 99) -> Iterator[dict]:
    """Addition and subtraction with exact answers (checkable: the answer is the last number)."""
    rng = random.Random(seed)
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        c = a + b if op == "+" else a - b
        yield {"prompt": f"What is {a} {op} {b}?", "response": f"{a} {op} {b} = {c}.", "kind": "arithmetic",
               "source_id": f"arithmetic/{seed}", "answer": str(c)}


class EvalOverlap:
    """Word n-grams of evaluation items, to keep them out of instruction pairs.

    Uses the contamination check's own index and word rule (kiln.evaluation.contamination), so a pair kept here is
    one the contamination report cannot flag: it shares no run of ``n`` words with any item (an item shorter than
    ``n`` words counts when it appears whole).
    """

    def __init__(self, index):
        self.index = index
        self.n = index.n
        self.items = sum(index.items.values())

    @classmethod
    def from_task_dir(cls, task_dir: str | Path, n: int | None = None) -> "EvalOverlap":
        """Every item of the local lm-eval tasks (YAML + JSONL) in ``task_dir``, as the eval_suite asset writes them."""
        from kiln.evaluation.contamination import DEFAULT_N, NgramIndex, local_tasks, read_jsonl

        tasks = local_tasks(task_dir)
        if not tasks:
            raise ValueError(f"{task_dir}: no local lm-eval tasks to deduplicate against; materialize eval_suite first")
        index = NgramIndex(n or DEFAULT_N)
        for name, task in tasks.items():
            index.add_task(name, read_jsonl(task.data))
        return cls(index)

    @classmethod
    def from_texts(cls, texts: Iterable[str], n: int) -> "EvalOverlap":
        from kiln.evaluation.contamination import NgramIndex

        index = NgramIndex(n)
        index.add_task("texts", ({"text": t} for t in texts))
        return cls(index)

    def overlaps(self, text: str) -> bool:
        from kiln.evaluation.contamination import words

        w = words(text)
        owners = self.index.owners
        return any(" ".join(w[i : i + k]) in owners for k in self.index.lengths for i in range(len(w) - k + 1))


def final_number(text: str) -> str | None:
    """The last integer in a response (how arithmetic answers are checked), or None when there is none."""
    nums = re.findall(r"-?\d+", text)
    return nums[-1] if nums else None


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 when the response's last integer is the exact answer, else 0.0 (a verifiable reward)."""
    return 1.0 if final_number(response) == str(answer) else 0.0


def build_pairs(html_docs: Iterable[tuple[str, str]], n_arithmetic: int, seed: int, val_permille: int,
                max_doc_pairs: int, exclude: EvalOverlap | None = None, dropped: list[dict] | None = None,
                max_operand: int = 99, kind_val_permille: dict[str, int] | None = None) -> list[dict]:
    """All pairs, deduplicated by prompt, each with an id and a split (``val_permille`` of them held out by prompt
    hash, or ``kind_val_permille[kind]`` for the kinds it names).

    With ``exclude``, a pair whose prompt or response shares an n-gram with an evaluation item is left out
    (and appended to ``dropped`` when given), before the ``max_doc_pairs`` cap counts it.
    """
    seen: set[str] = set()
    pairs: list[dict] = []
    doc_pairs = 0
    sources = [heading_sections(i, h) for i, h in html_docs]
    for stream in [*sources, arithmetic(n_arithmetic, seed, max_operand)]:
        for p in stream:
            if p["prompt"] in seen:
                continue
            if exclude is not None and (exclude.overlaps(p["prompt"]) or exclude.overlaps(p["response"])):
                if dropped is not None:
                    dropped.append({**p, "reason": f"shares {exclude.n} consecutive words with an eval item"})
                seen.add(p["prompt"])
                continue
            if p["kind"] == "doc_section":
                if doc_pairs >= max_doc_pairs:
                    continue
                doc_pairs += 1
            seen.add(p["prompt"])
            p["id"] = hashlib.sha256(p["prompt"].encode()).hexdigest()[:16]
            p["split"] = split_of(p["prompt"], (kind_val_permille or {}).get(p["kind"], val_permille))
            pairs.append(p)
    return pairs


def write_jsonl(rows: list[dict], path: Path) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def training_pages(raw_documents: str | Path, val_permille: int) -> tuple[int, list[tuple[str, str]]]:
    """(HTML pages in the raw documents parquet, the (id, html) of those in the train split): held-out pages are
    evaluation material (the split is kiln.tokens.shards.split_of, the token shards' own)."""
    import pyarrow.parquet as pq

    from kiln.tokens.shards import split_of as doc_split

    t = pq.read_table(raw_documents, columns=["id", "text", "content_type"])
    html = [(i, x) for i, x, c in zip(t.column("id").to_pylist(), t.column("text").to_pylist(),
                                      t.column("content_type").to_pylist()) if c == "text/html"]
    return len(html), [(i, x) for i, x in html if doc_split(i, val_permille) == "train"]


def split_counts(rows: list[dict], key: str) -> dict[str, dict[str, int]]:
    """{value of ``key``: {"train": n, "val": n}} in first-seen order."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        counts.setdefault(r[key], {"train": 0, "val": 0})[r["split"]] += 1
    return counts


def first_of_each(rows: list[dict], key: str) -> list[dict]:
    """The first row of each value of ``key``, in first-seen order (examples for a metadata table)."""
    seen: dict[str, dict] = {}
    for r in rows:
        seen.setdefault(r[key], r)
    return list(seen.values())
