"""The eval task contract: a ``TaskSpec`` says all Kiln needs of one task, and ``write_task`` writes its lm-eval files.

Add a task: write its spec (see kiln/evaluation/heldout.py) and list it in kiln/evaluation/registry.py LOCAL_TASKS.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import yaml

from kiln.common.files import atomic_write_text, sha256_file

LOCAL_PREFIX = "kiln_"  # Kiln's own tasks are named kiln_*; every other name is one of lm-eval's tasks
CLEAN_SUFFIX = "_clean"  # the contamination check's copy of a task without its contaminated items
# YAML fields write_task sets itself, the same for every local task (a JSONL test split read by lm-eval's "json").
WRITER_FIELDS = ("task", "dataset_path", "dataset_kwargs", "test_split")
LM_EVAL_FIELDS = ("output_type", "doc_to_text", "doc_to_target", "metric_list")  # what every spec's lm_eval gives
OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")


class NotEnoughDocumentsError(ValueError):
    """Too few held-out documents qualify for a task; the message names the task and the counts."""


class TaskSpecError(ValueError):
    """An eval task is defined or registered incompletely; the message names the task and what is missing."""


@dataclass(frozen=True)
class FromDocuments:
    """Items cut from held-out documents (``build_tasks``): ``make(text, rng, k)`` gives up to k items of one document."""

    make: Callable[[str, random.Random, int], list[dict[str, Any]]]
    need: str  # what one item needs from a document, shown when too few documents qualify
    finish: Callable[[list[dict[str, Any]], dict[int, str], int], None] | None = None  # (items, documents, seed), in place


@dataclass(frozen=True)
class FromPackage:
    """Items of a pinned public package (``build_package_task``): ``load(cache_dir)`` gives all of them in file order."""

    load: Callable[[Path], list[dict[str, Any]]]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # the default of every TaskSpec field but name: a field left out, reported by name


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One local eval task: everything the suite, the chance table, plots, checkpoint suites and contamination use."""

    name: str  # lm-eval task name: kiln_<something>, not ending in _clean
    chance: float | None = UNSET  # score of a model that knows nothing; None where none exists (perplexity)
    primary: str = UNSET  # the metric the task is judged by (score tables, score-against-step plots)
    items: FromDocuments | FromPackage = UNSET  # how its items are made
    lm_eval: dict[str, Any] = UNSET  # lm-eval YAML fields: output_type, doc_to_text, doc_to_target, metric_list[, ...]
    item_text: Callable[[dict[str, Any]], str] = UNSET  # the text of an item that must not appear in training data
    suite: str = UNSET  # the default checkpoint suite it is scored in (one MLflow run per suite and checkpoint)

    def __post_init__(self) -> None:
        problems = spec_problems(self)
        if problems:
            raise TaskSpecError(f"eval task {self.name!r}: " + "; ".join(problems))

    @property
    def metrics(self) -> list[str]:
        return [m.get("metric") for m in self.lm_eval.get("metric_list", [])]


def _missing(spec: TaskSpec) -> list[str]:
    hints = {
        "chance": "chance=<expected score of uniform guessing> (None where no such number exists, as for perplexity)",
        "primary": "primary=<the metric it is judged by, one of metric_list>",
        "items": "items=FromDocuments(make, need) or FromPackage(load) (the item maker)",
        "lm_eval": f"lm_eval={{...}} with {', '.join(LM_EVAL_FIELDS)} (the lm-eval YAML fields)",
        "item_text": "item_text=<function of an item giving the text the contamination check compares>",
        "suite": "suite=<name of its default checkpoint suite>",
    }
    return [f"missing {hints[f.name]}" for f in fields(spec) if getattr(spec, f.name) is UNSET and f.name in hints]


def spec_problems(spec: TaskSpec) -> list[str]:
    """Everything incomplete or inconsistent in a spec, as sentences; empty when it is complete."""
    out = []
    if not isinstance(spec.name, str) or not spec.name.startswith(LOCAL_PREFIX) or spec.name.endswith(CLEAN_SUFFIX):
        out.append(f"the name must start with {LOCAL_PREFIX!r} (lm-eval's own tasks do not) and not end in {CLEAN_SUFFIX!r}")
    out += _missing(spec)
    if spec.chance is not None and spec.chance is not UNSET and not (isinstance(spec.chance, (int, float)) and 0 <= spec.chance <= 1):
        out.append(f"chance must be None or a score between 0 and 1, got {spec.chance!r}")
    if spec.items is not UNSET and not isinstance(spec.items, (FromDocuments, FromPackage)):
        out.append(f"items must be FromDocuments or FromPackage, got {type(spec.items).__name__}")
    if spec.item_text is not UNSET and not callable(spec.item_text):
        out.append("item_text must be a function of one item")
    if isinstance(spec.lm_eval, dict):
        out += _lm_eval_problems(spec)
    elif spec.lm_eval is not UNSET:
        out.append(f"lm_eval must be a dict of YAML fields, got {type(spec.lm_eval).__name__}")
    return out


def _lm_eval_problems(spec: TaskSpec) -> list[str]:
    fields_ = spec.lm_eval
    out = [f"lm_eval lacks {k!r}" for k in LM_EVAL_FIELDS if k not in fields_]
    if fields_.get("output_type", OUTPUT_TYPES[0]) not in OUTPUT_TYPES:
        out.append(f"lm_eval output_type {fields_['output_type']!r} is not one of {OUTPUT_TYPES}")
    if fields_.get("output_type") == "multiple_choice" and "doc_to_choice" not in fields_:
        out.append("lm_eval lacks 'doc_to_choice' (multiple_choice needs the choices)")
    taken = [k for k in WRITER_FIELDS if k in fields_]
    if taken:
        out.append(f"lm_eval must not set {taken}: write_task sets them")
    if spec.primary is not UNSET and "metric_list" in fields_ and spec.primary not in spec.metrics:
        out.append(f"primary metric {spec.primary!r} is not in its metric_list {spec.metrics}")
    return out


def task_yaml(spec: TaskSpec, data: Path, n: int, seed: int) -> dict[str, Any]:
    """The lm-eval task config: a JSONL test split, the spec's fields, metadata (with the spec's own metadata added)."""
    head = {"task": spec.name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
            "test_split": "test"}
    meta = {"version": 1.0, "items": n, "seed": seed, "data_sha256": sha256_file(data)}
    if "metadata" in spec.lm_eval:  # metadata stays where the spec put it, extended
        return {**head, **spec.lm_eval, "metadata": {**meta, **spec.lm_eval["metadata"]}}
    return {**head, "metadata": meta, **spec.lm_eval}


def write_task(spec: TaskSpec, rows: list[dict[str, Any]], out_dir: str | Path, seed: int) -> dict[str, Any]:
    """Write ``<task>.jsonl`` (one item a line) and ``<task>.yaml`` into out_dir.

    Returns {"items": n, "path": yaml path, "data": jsonl path, "chance": spec.chance}.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data, path = out_dir / f"{spec.name}.jsonl", out_dir / f"{spec.name}.yaml"
    atomic_write_text(data, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(path, yaml.safe_dump(task_yaml(spec, data, len(rows), seed), sort_keys=False))
    return {"items": len(rows), "path": str(path), "data": str(data), "chance": spec.chance}


def build_package_task(spec: TaskSpec, out_dir: str | Path, cache_dir: str | Path, n_items: int | None = None,
                       seed: int = 1234) -> dict[str, Any]:
    """Write a FromPackage task into out_dir: every item, or a seeded sample of n_items (in file order)."""
    if not isinstance(spec.items, FromPackage):
        raise TaskSpecError(f"eval task {spec.name!r}: its items come from documents; build it with build_tasks")
    rows = spec.items.load(Path(cache_dir))
    if n_items is not None:
        if not 1 <= n_items <= len(rows):
            raise ValueError(f"{spec.name}: n_items must be between 1 and {len(rows)} (the items available), got {n_items}")
        keep = set(random.Random(f"{seed}:{spec.name}").sample(range(len(rows)), n_items))
        rows = [r for i, r in enumerate(rows) if i in keep]
    return write_task(spec, rows, out_dir, seed)
