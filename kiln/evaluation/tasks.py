"""Build the registered local lm-eval tasks: items from held-out documents or a pinned package, JSONL + YAML each.

``build_tasks(docs, Path("tasks"), n_items=200, seed=0)`` writes ``<task>.jsonl`` + ``<task>.yaml`` for ``run_suite``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

from kiln.common.files import atomic_write_text
from kiln.evaluation.heldout import CONTINUATION, LASTWORD, PPL
from kiln.evaluation.registry import REGISTRY
from kiln.evaluation.spec import FromDocuments, FromPackage, NotEnoughDocumentsError, TaskSpec, build_package_task, write_task

__all__ = ["CONTINUATION", "LASTWORD", "PPL", "TASK_NAMES", "NotEnoughDocumentsError", "build_suite", "build_tasks",
           "retarget_tasks"]

TASK_NAMES = tuple(s.name for s in REGISTRY.local(FromDocuments))  # the held-out tasks build_tasks writes


def _pick_items(spec: TaskSpec, docs: dict[int, str], n_items: int, min_items: int, per_doc: int,
                seed: int) -> list[dict[str, Any]]:
    """Up to n_items items, at most per_doc per document: documents in a seeded order, round by round.

    Round 1 takes each document's first item, round 2 their second, and so on, so items spread over documents.
    Raises NotEnoughDocumentsError when fewer than min_items qualify.
    """
    rng = random.Random(f"{seed}:{spec.name}")
    order = list(docs)
    rng.shuffle(order)
    items: list[dict[str, Any]] = []
    found: list[tuple[int, list[dict]]] = []  # (document, its items) in order; made lazily in round 1
    for rnd in range(per_doc):
        sources = order if rnd == 0 else [d for d, _ in found]
        for n, d in enumerate(sources):
            if rnd == 0:
                found.append((d, spec.items.make(docs[d], rng, per_doc)))
            got = found[n][1]
            if rnd < len(got):
                items.append({"id": len(items), "doc_index": d, **got[rnd]})
                if len(items) == n_items:
                    return items
    if len(items) < min_items:
        raise NotEnoughDocumentsError(
            f"{spec.name}: needs n_items={min_items} items ({spec.items.need}; at most {per_doc} per document) but only "
            f"{len(items)} come from the {len(docs)} distinct documents; pass more held-out documents or lower n_items"
        )
    return items


def build_tasks(documents: list[str], out_dir: Path, n_items: int, seed: int, min_items: int | None = None,
                per_doc: int = 1) -> dict[str, dict[str, Any]]:
    """Write every registered held-out task (JSONL data + lm-eval YAML) into out_dir, deterministically for a seed.

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
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    out: dict[str, dict[str, Any]] = {}
    for spec in REGISTRY.local(FromDocuments):
        items = _pick_items(spec, docs, n_items, min_items, per_doc, seed)
        if spec.items.finish is not None:
            spec.items.finish(items, docs, seed)
        out[spec.name] = write_task(spec, items, out_dir, seed)
    return out


def build_suite(documents: list[str], out_dir: Path, cache_dir: str | Path, n_items: int, seed: int,
                min_items: int | None = None, per_doc: int = 1,
                package_items: dict[str, int | None] | None = None) -> dict[str, dict[str, Any]]:
    """Every registered local task: the held-out ones (``build_tasks``), then each package task.

    package_items: {task: a seeded sample of this many items, None for all, 0 to leave the task out}; tasks not
    named get all their items. Returns ``build_tasks``'s shape for every task written.
    """
    sizes = package_items or {}
    REGISTRY.check_names(sizes, "package_items")
    out = build_tasks(documents, out_dir, n_items, seed, min_items, per_doc)
    for spec in REGISTRY.local(FromPackage):
        if sizes.get(spec.name) != 0:
            out[spec.name] = build_package_task(spec, out_dir, cache_dir, sizes.get(spec.name), seed)
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
