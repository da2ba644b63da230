"""Contamination check: which evaluation items share a word n-gram (13 by default) with the training data.

Run: ``python -m kiln.evaluation.contamination TASK_DIR OUT_DIR --corpus clean.parquet [--pairs pairs.jsonl]``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.common.files import atomic_write_json, atomic_write_text, sha256_file
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.spec import CLEAN_SUFFIX, LOCAL_PREFIX
from kiln.tokens.shards import split_of

DEFAULT_N = 13  # GPT-3's and lm-eval's decontamination n-gram length
_WORD = re.compile(r"\w+")  # case and punctuation are ignored, as in GPT-3's and lm-eval's overlap checks


def words(text: str) -> list[str]:
    """Lower-cased word tokens: the unit n-grams are made of."""
    return _WORD.findall(text.lower())


def item_text(row: dict[str, Any]) -> str:
    """The text of one item of a task outside the registry that must not appear in training data: prompt and gold answer.

    Registered tasks say this themselves (``TaskSpec.item_text``); this rule agrees with them. Multiple-choice items with a ``question`` show every choice in the prompt (MMLU), so all choices count;
    continuation items (``context`` + ``choices``) count only the true ending (distractors come from other items).
    """
    parts = [row[k] for k in ("question", "context", "text") if isinstance(row.get(k), str)]
    choices, label = row.get("choices"), row.get("label")
    if isinstance(choices, list):
        if "question" in row:
            parts += [str(c) for c in choices]
        elif isinstance(label, int) and 0 <= label < len(choices):
            parts.append(str(choices[label]))
    if isinstance(row.get("target"), str):
        parts.append(row["target"])
    if not parts:
        raise ValueError(f"eval item has none of question/context/text/target fields (keys {sorted(row)})")
    return " ".join(parts)


@dataclass
class LocalTask:
    """A local lm-eval task as build_tasks/build_mmlu_task write it: one YAML naming one JSONL test file."""

    name: str  # lm-eval task name
    spec: Path  # the task's YAML file
    data: Path  # its JSONL items, one per line
    config: dict[str, Any] = field(repr=False, default_factory=dict)  # the parsed YAML


def text_of(task: str) -> Callable[[dict[str, Any]], str]:
    """How the items of ``task`` are read for the check: its spec's item_text for kiln_* tasks (which must be
    registered), the generic ``item_text`` for any other name (ad-hoc indexes)."""
    return REGISTRY.get(task).item_text if task.startswith(LOCAL_PREFIX) else item_text


def local_tasks(task_dir: str | Path) -> dict[str, LocalTask]:
    """{task: LocalTask} for every ``*.yaml`` in task_dir that reads a local JSONL test split."""
    out = {}
    for spec in sorted(Path(task_dir).glob("*.yaml")):
        cfg = yaml.safe_load(spec.read_text()) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
        test = files.get(cfg.get("test_split", "test")) if isinstance(files, dict) else None
        if "task" in cfg and isinstance(test, str):
            out[cfg["task"]] = LocalTask(cfg["task"], spec, Path(test), cfg)
    return out


class NgramIndex:
    """Word n-grams of every eval item, and which items each belongs to; training text is scanned against it.

    Written by hand: lm-eval's ``decontamination`` package works on pre-bucketed Pile n-gram files and prints a
    traceback on import without its C++ extension; here the eval side is small, so a set lookup per training
    n-gram is all that is needed. Items shorter than n words are contaminated only if they appear whole.
    """

    def __init__(self, n: int = DEFAULT_N):
        if n < 1:
            raise ValueError(f"n-gram length must be >= 1, got {n}")
        self.n = n
        self.owners: dict[str, set[tuple[str, int]]] = {}  # n-gram -> {(task, item line)}
        self.lengths: set[int] = set()  # n-gram lengths in use (n, and shorter whole items)
        self.items: dict[str, int] = {}  # task -> items indexed
        self.hits: dict[tuple[str, int], dict[str, Any]] = {}  # (task, line) -> first training match
        self.scanned: dict[str, dict[str, int]] = {}  # source -> {"documents": k, "words": w}

    def add_task(self, task: str, rows: Iterable[dict[str, Any]],
                 text: Callable[[dict[str, Any]], str] | None = None) -> None:
        """Index every row of a task by the text ``text(row)`` gives (default: ``text_of(task)``)."""
        text = text or text_of(task)
        count = 0
        for line, row in enumerate(rows):
            w = words(text(row))
            k = min(self.n, len(w))
            count += 1
            if k == 0:
                continue
            self.lengths.add(k)
            for i in range(len(w) - k + 1):
                self.owners.setdefault(" ".join(w[i : i + k]), set()).add((task, line))
        self.items[task] = self.items.get(task, 0) + count

    def scan(self, source: str, documents: Iterable[tuple[str, str]]) -> None:
        """Mark every item sharing an n-gram with one of the (doc id, text) documents of ``source``."""
        stats = self.scanned.setdefault(source, {"documents": 0, "words": 0})
        owners, hits = self.owners, self.hits
        for doc_id, text in documents:
            w = words(text)
            stats["documents"] += 1
            stats["words"] += len(w)
            for k in self.lengths:
                for i in range(len(w) - k + 1):
                    gram = " ".join(w[i : i + k])
                    found = owners.get(gram)
                    if found:
                        for key in found:
                            hits.setdefault(key, {"source": source, "document": doc_id, "ngram": gram})

    def report(self, examples: int = 3) -> dict[str, dict[str, Any]]:
        """{task: {items, contaminated, share, by_source, contaminated_lines, examples}}."""
        out: dict[str, dict[str, Any]] = {}
        for task, n_items in self.items.items():
            lines = sorted(line for (t, line) in self.hits if t == task)
            by_source: dict[str, int] = {}
            for line in lines:
                src = self.hits[(task, line)]["source"]
                by_source[src] = by_source.get(src, 0) + 1
            out[task] = {
                "items": n_items,
                "contaminated": len(lines),
                "share": len(lines) / n_items if n_items else 0.0,
                "by_source": by_source,
                "contaminated_lines": lines,
                "examples": [{"line": ln, **self.hits[(task, ln)]} for ln in lines[:examples]],
            }
        return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON ({e}); rebuild the eval tasks") from e
    return rows


def write_clean_tasks(tasks: dict[str, LocalTask], report: dict[str, dict[str, Any]], out_dir: Path) -> dict[str, str]:
    """Write ``<task>_clean`` (YAML + JSONL without the contaminated items) for each task with any left.

    Returns {task: clean task name}; tasks with no clean item left get none (their clean score is undefined).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    names = {}
    for name, task in tasks.items():
        bad = set(report[name]["contaminated_lines"])
        rows = [r for i, r in enumerate(read_jsonl(task.data)) if i not in bad]
        report[name]["clean_items"] = len(rows)
        if not rows:
            continue
        clean = name + CLEAN_SUFFIX
        data, spec = out_dir / f"{clean}.jsonl", out_dir / f"{clean}.yaml"
        atomic_write_text(data, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        cfg = {**task.config, "task": clean, "dataset_kwargs": {"data_files": {"test": str(data.resolve())}}}
        cfg["metadata"] = {**(task.config.get("metadata") or {}), "items": len(rows), "data_sha256": sha256_file(data),
                           "subset_of": name, "removed_items": len(bad)}
        atomic_write_text(spec, yaml.safe_dump(cfg, sort_keys=False))
        names[name] = clean
    return names


def check_contamination(
    task_dir: str | Path,
    sources: dict[str, Iterable[tuple[str, str]]],
    out_dir: str | Path,
    n: int = DEFAULT_N,
    tasks: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Check every item of the local tasks in task_dir against each source's (doc id, text) documents.

    Writes ``<task>_clean`` tasks and ``report.json`` into out_dir and returns the report:
    {"n", "tasks": {task: {items, contaminated, share, clean_items, clean_task, by_source, ...}}, "sources", "seconds"}
    plus ``extra`` (settings to record with it, such as the release threshold).
    """
    t0 = time.perf_counter()
    found = local_tasks(task_dir)
    if tasks is not None:
        missing = sorted(set(tasks) - set(found))
        if missing:
            raise ValueError(f"tasks {missing} are not local tasks in {task_dir} (found {sorted(found)})")
        found = {t: found[t] for t in tasks}
    if not found:
        raise ValueError(f"{task_dir}: no local lm-eval task YAMLs (with a JSONL test file) to check")
    index = NgramIndex(n)
    for name, task in found.items():
        index.add_task(name, read_jsonl(task.data))
    for source, docs in sources.items():
        index.scan(source, docs)
    per_task = index.report()
    clean = write_clean_tasks(found, per_task, Path(out_dir))
    for name in per_task:
        per_task[name]["clean_task"] = clean.get(name)
    report = {"n": n, "tasks": per_task, "sources": index.scanned, **(extra or {})}
    atomic_write_json(Path(out_dir) / "report.json", report)  # content only (no timings): it is content-addressed
    return {**report, "seconds": time.perf_counter() - t0}


def jsonl_documents(path: str | Path, fields: tuple[str, ...] = ("prompt", "response"),
                    where: dict[str, Any] | None = None) -> Iterable[tuple[str, str]]:
    """(id, text) per JSONL record: the given fields joined; records not matching ``where`` are skipped."""
    for i, row in enumerate(read_jsonl(Path(path))):
        if where and any(row.get(k) != v for k, v in where.items()):
            continue
        yield str(row.get("id", i)), " ".join(str(row[f]) for f in fields if f in row)


def parquet_documents(path: str | Path, keep_id=None) -> Iterable[tuple[str, str]]:
    """(id, text) per row of a corpus Parquet file (columns id, text), one row group at a time."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g, columns=["id", "text"])
        for doc_id, text in zip(t.column("id").to_pylist(), t.column("text").to_pylist()):
            if keep_id is None or keep_id(doc_id):
                yield doc_id, text


def training_sources(corpus: str | Path, val_permille: int,
                     pairs: str | Path | None = None) -> dict[str, Iterable[tuple[str, str]]]:
    """What evaluation items are checked against: the corpus's training split (kiln.tokens.shards.split_of), and the
    instruction pairs' training split when ``pairs`` is given. Read lazily, once."""
    sources = {"corpus": parquet_documents(corpus, lambda i: split_of(i, val_permille) == "train")}
    if pairs is not None:
        sources["instructions"] = jsonl_documents(pairs, where={"split": "train"})
    return sources


def report_tables(tasks: dict[str, dict[str, Any]], sources: Iterable[str]) -> tuple[list[dict], list[dict]]:
    """Rows for the report's two tables: counts per task (by source), and the example matches of every task."""
    rows = [{"task": t, "items": r["items"], "contaminated": r["contaminated"], "share": r["share"],
             "clean items": r["clean_items"], **{f"from {s}": r["by_source"].get(s, 0) for s in sources}}
            for t, r in tasks.items()]
    examples = [{"task": t, "item": e["line"], "source": e["source"], "document": e["document"], "shared n-gram": e["ngram"]}
                for t, r in tasks.items() for e in r["examples"]]
    return rows, examples


def worst_task(tasks: dict[str, dict[str, Any]]) -> str:
    """The task with the largest contaminated share (the first of equals)."""
    return max(tasks, key=lambda t: tasks[t]["share"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task_dir")
    p.add_argument("out_dir")
    p.add_argument("--corpus", action="append", default=[], help="Parquet corpus (id, text); repeatable")
    p.add_argument("--pairs", action="append", default=[], help="instruction pairs JSONL (prompt, response); repeatable")
    p.add_argument("--n", type=int, default=DEFAULT_N)
    args = p.parse_args(argv)
    sources: dict[str, Iterable[tuple[str, str]]] = {}
    for path in args.corpus:
        sources[f"corpus:{Path(path).name}"] = parquet_documents(path)
    for path in args.pairs:
        sources[f"pairs:{Path(path).name}"] = jsonl_documents(path)
    report = check_contamination(args.task_dir, sources, args.out_dir, args.n)
    for task, row in report["tasks"].items():
        print(f"{task}: {row['contaminated']}/{row['items']} contaminated ({row['share']:.1%}); by source {row['by_source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
