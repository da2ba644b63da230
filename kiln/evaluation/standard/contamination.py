"""The standard benchmarks checked for contamination as Kiln's own tasks are (kiln.evaluation.contamination): each
scored item's text (the prompt lm-eval builds and its gold answer) against the training text, word 13-grams, case and
punctuation ignored; the clean items are the sample less the contaminated ones.

``check_benchmarks(prepared, sources, n)`` returns {benchmark: {items, contaminated, share, by_source, examples,
clean_samples}}; ``clean_prepared(prepared, report)`` is the same benchmarks restricted to their clean items, which
``evaluate_lm`` scores like any other sample.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from kiln.evaluation.contamination import DEFAULT_N, NgramIndex
from kiln.evaluation.standard.run import Prepared, load_tasks


def item_text(task: Any, doc: dict[str, Any]) -> str:
    """What must not appear in training data of one lm-eval item: its prompt and its gold answer (for a multiple
    choice the right choice; where the prompt is itself an index into the choices, as WinoGrande's, that choice)."""
    kind = task.get_config("output_type")
    text, target = task.doc_to_text(doc), task.doc_to_target(doc)
    parts = []
    choices = task.doc_to_choice(doc) if kind == "multiple_choice" else None
    parts.append(str(choices[text]) if isinstance(text, int) and choices else str(text))
    if isinstance(target, int) and choices and 0 <= target < len(choices):
        parts.append(str(choices[target]))
    elif isinstance(target, list):
        parts += [str(t) for t in target if isinstance(t, str)]
    elif target is not None:
        parts.append(str(target))
    return " ".join(parts)


def _benchmark_of(prepared: Prepared) -> dict[str, str]:
    """lm-eval task (a subtask of a group too) -> the benchmark it belongs to."""
    return {t: name for name, rec in prepared.record["benchmarks"].items() for t in rec["tasks"]}


def check_benchmarks(prepared: Prepared, sources: dict[str, Iterable[tuple[str, str]]], n: int = DEFAULT_N,
                     loaded: dict[str, Any] | None = None, examples: int = 3) -> dict[str, dict[str, Any]]:
    """Every scored item of every prepared benchmark against the (doc id, text) documents of each source."""
    loaded = loaded if loaded is not None else load_tasks(prepared)
    owner = _benchmark_of(prepared)
    index, docs_of = NgramIndex(n), {}
    for task_name, task in loaded["tasks"].items():
        docs = list(task.eval_docs)
        ids = prepared.samples[task_name] if prepared.samples is not None else list(range(len(docs)))
        docs_of[task_name] = ids
        index.add_task(task_name, (docs[i] for i in ids), text=lambda doc, t=task: item_text(t, doc))
    for source, documents in sources.items():
        index.scan(source, documents)
    per_task = index.report(examples)
    out: dict[str, dict[str, Any]] = {}
    for task_name, rep in per_task.items():
        b = out.setdefault(owner.get(task_name, task_name), {"items": 0, "contaminated": 0, "by_source": {},
                                                              "examples": [], "clean_samples": {}})
        ids = docs_of[task_name]
        dirty = {ids[line] for line in rep["contaminated_lines"]}
        b["items"] += rep["items"]
        b["contaminated"] += rep["contaminated"]
        for s, k in rep["by_source"].items():
            b["by_source"][s] = b["by_source"].get(s, 0) + k
        b["examples"] += [{**e, "line": ids[e["line"]], "subtask": task_name}  # line: the item's index in its set
                          for e in rep["examples"]][: max(0, examples - len(b["examples"]))]
        b["clean_samples"][task_name] = [i for i in ids if i not in dirty]
    for b in out.values():
        b["share"] = b["contaminated"] / b["items"] if b["items"] else 0.0
        b["clean_items"] = b["items"] - b["contaminated"]
    return out


def clean_prepared(prepared: Prepared, report: dict[str, dict[str, Any]]) -> Prepared | None:
    """The benchmarks with contaminated items, restricted to their clean items (a benchmark with none contaminated
    scores the same on its clean items: it is left out); None when there is nothing to rescore. A benchmark with a
    subtask left with no clean item is left out too (lm-eval cannot score an empty sample): it has no clean score."""
    samples: dict[str, list[int]] = {}
    names = []
    for name in prepared.names:
        clean = report[name]["clean_samples"]
        if report[name]["contaminated"] and all(clean.values()):
            samples.update(clean)
            names.append(name)
    if not names:
        return None
    return replace(prepared, names=names, samples=samples,
                   benchmarks={n: prepared.benchmarks[n] for n in names})
