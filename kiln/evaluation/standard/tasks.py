"""lm-eval's own task YAMLs for the standard benchmarks, written into a folder with only their data source changed.

``write_benchmark(bench, root, out_dir)`` writes one benchmark (its task YAML, or a group's YAMLs, flattened; the
Python files their ``!function`` entries name, copied beside them) and returns its lineage record.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiln.common.files import atomic_write_text, sha256_file
from kiln.evaluation.standard.catalog import Benchmark
from kiln.evaluation.standard.data import (BenchmarkError, arrow_files, convert, file_in, missing_fields, read_split)

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")
CODE_TASKS = {"humaneval": "pass_at_k", "mbpp": "pass_at_1"}  # their metric runs code: Kiln's sandbox instead


def lm_eval_tasks_dir() -> Path:
    """lm_eval/tasks/ of the installed lm-eval (found without importing it)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkError("lm-eval is not installed; pip install lm-eval==0.4.13")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


class Function(str):
    """A YAML ``!function module.name`` entry, kept as written."""


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_constructor("!function", lambda loader, node: Function(loader.construct_scalar(node)))
_Dumper.add_representer(Function, lambda dumper, f: dumper.represent_scalar("!function", str(f)))


def load_flat(path: Path) -> dict[str, Any]:
    """A task YAML with its ``include`` chain merged as lm-eval merges it (the included file first, own keys win)."""
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506  (SafeLoader + one tag)
    if not isinstance(cfg, dict):
        raise BenchmarkError(f"{path}: not a YAML mapping")
    includes = cfg.pop("include", None)
    merged: dict[str, Any] = {}
    for inc in [includes] if isinstance(includes, str) else includes or []:
        base = load_flat(path.parent / inc)
        base.pop("task_list", None)
        merged.update(base)
    merged.update(cfg)
    return merged


def dump(cfg: dict[str, Any]) -> str:
    return yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)


def functions_of(cfg: Any) -> set[str]:
    """Module names of every ``!function module.name`` in a config."""
    if isinstance(cfg, Function):
        return {cfg.rpartition(".")[0]}
    if isinstance(cfg, dict):
        return set().union(*map(functions_of, cfg.values())) if cfg else set()
    if isinstance(cfg, list):
        return set().union(*map(functions_of, cfg)) if cfg else set()
    return set()


def sandboxed_utils(source: Path, metric: str) -> str:
    """lm-eval's humaneval/mbpp utils.py without its code execution: every function but ``metric`` copied verbatim
    (no ``import evaluate``, no check run at import), ``metric`` taken from kiln.evaluation.standard.code."""
    text = source.read_text(encoding="utf-8")
    tree = ast.parse(text)
    keep = [ast.get_source_segment(text, n) for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name != metric]
    return (f'"""lm-eval 0.4.13\'s {source.parent.name}/utils.py with its code execution replaced by Kiln\'s sandbox '
            "(written by kiln.evaluation.standard.tasks).\"\"\"\n\nimport re  # noqa: F401\nfrom typing import Union  "
            f"# noqa: F401\n\nfrom kiln.evaluation.standard.code import {metric}  # noqa: F401\n\n\n"
            + "\n\n\n".join(keep) + "\n")


@dataclass
class Leaf:
    """One lm-eval task of a benchmark, as written."""

    task: str
    split: str  # the split it scores
    items: int
    files: dict[str, list[str]]  # {split: data files}


def _data_for(bench: Benchmark, cfg: dict[str, Any], root: Path,
              out: Path) -> tuple[dict[str, list[Path]], dict[str, int]]:
    """Data files per split of one task (Arrow in the package, or converted JSONL under out/../.data); item counts."""
    files: dict[str, list[Path]] = {}
    counts: dict[str, int] = {}
    for split, template in bench.data.items():
        rel = template.format(dataset_name=cfg.get("dataset_name"))
        where = f"{bench.name} ({cfg['task']}, {split} split, {rel})"
        if bench.convert:
            rows = convert(bench.convert, read_split(root, rel))
            path = out.parent / ".data" / bench.name / f"{cfg['task']}.{split}.jsonl"
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            if not path.is_file() or path.read_text(encoding="utf-8") != text:  # unchanged: datasets' copy reused
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(path, text)
            files[split] = [path]
        else:
            folder = file_in(root, rel)
            rows = read_split(root, rel)
            files[split] = arrow_files(folder)
        lacking = missing_fields(rows, bench.reads) if rows else list(bench.reads)
        if lacking:
            raise BenchmarkError(f"{where}: items lack {lacking}, which lm-eval's {bench.yaml} reads; the data does "
                                 "not fit this task: fix the package pin or the benchmark's convert/data entry")
        counts[split] = len(rows)
    return files, counts


def _retarget(cfg: dict[str, Any], files: dict[str, list[Path]], dataset_path: str, cache: Path) -> dict[str, Any]:
    """The task config reading ``files``: splits the data lacks set to null, the data source swapped; ``datasets``
    keeps its prepared copy in ``cache`` (beside the tasks, not in the user's Hugging Face cache)."""
    new = {k: v for k, v in cfg.items() if k not in DATA_KEYS}
    for key in SPLIT_KEYS:
        if new.get(key) is not None and new[key] not in files:
            new[key] = None
    if not (new.get("test_split") or new.get("validation_split")):
        raise BenchmarkError(f"{cfg['task']}: none of its scored splits is in the data ({sorted(files)})")
    head = {"task": new.pop("task"), "dataset_path": dataset_path,
            "dataset_kwargs": {"data_files": {s: [str(p) for p in ps] for s, ps in files.items()},
                               "cache_dir": str(cache)}}
    return {**head, **new}


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
            if k not in ("dataset_kwargs",) and old.get(k) != new.get(k)}


def _copy_functions(cfg: dict[str, Any], src_dir: Path, out: Path, bench: Benchmark) -> list[str]:
    written = []
    for module in sorted(functions_of(cfg)):
        src = src_dir / f"{module.replace('.', '/')}.py"
        dst = out / src.name
        if bench.name in CODE_TASKS:
            atomic_write_text(dst, sandboxed_utils(src, CODE_TASKS[bench.name]))
        elif not dst.exists():
            shutil.copyfile(src, dst)
        written.append(dst.name)
    return written


def _where(path: Path, root: Path) -> str:
    """A data file named by its path in the package, or by its name when Kiln wrote it."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def write_benchmark(bench: Benchmark, root: Path, out_dir: str | Path) -> dict[str, Any]:
    """Write ``bench`` into out_dir/<name>/ reading its items from the unpacked package at ``root``.

    Returns its record: the lm-eval YAMLs and versions, the tasks written with their data files (sha256) and item
    counts, what differs from lm-eval's own config, where few-shot examples come from, the licence.
    """
    tasks_dir = lm_eval_tasks_dir()
    out = Path(out_dir) / bench.name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    top = load_flat(tasks_dir / bench.yaml)
    version = (top.get("metadata") or {}).get("version")
    if version != bench.version:
        raise BenchmarkError(f"{bench.name}: lm-eval's {bench.yaml} is version {version}, the registry pins "
                             f"{bench.version}; read what changed in the task and update its entry in "
                             "kiln/evaluation/standard/catalog.py")
    sources = sorted(tasks_dir.glob(bench.subtasks)) if bench.subtasks else [tasks_dir / bench.yaml]
    leaves: list[Leaf] = []
    changes: dict[str, list[Any]] = {}
    modules: set[str] = set()
    sub_versions: set[Any] = set()
    for src in sources:
        cfg = load_flat(src)
        files, counts = _data_for(bench, cfg, root, out)
        new = _retarget(cfg, files, "json" if bench.convert else "arrow", Path(out_dir).resolve() / ".datasets-cache")
        scored = new.get("test_split") or new.get("validation_split")
        atomic_write_text(out / f"{cfg['task']}.yaml", dump(new))
        modules.update(_copy_functions(new, src.parent, out, bench))
        for key, pair in _changes(cfg, new).items():  # a group's value that differs by subtask is said so
            changes[key] = pair if changes.get(key, pair) == pair else ["(per subtask)", pair[1]]
        sub_versions.add((cfg.get("metadata") or {}).get("version"))
        leaves.append(Leaf(cfg["task"], scored, counts[scored], {s: [str(p) for p in ps] for s, ps in files.items()}))
    for group in (bench.yaml, *bench.groups) if bench.subtasks else ():
        shutil.copyfile(tasks_dir / group, out / Path(group).name)
    items = sum(leaf.items for leaf in leaves)
    if items != bench.rows:
        raise BenchmarkError(f"{bench.name}: the package holds {items} items of its scored split, the registry says "
                             f"{bench.rows}; the data changed: check it and update rows in its catalog entry")
    data = sorted({f for leaf in leaves for fs in leaf.files.values() for f in fs})
    return {
        "name": bench.name, "lm_eval_yaml": bench.yaml, "version": bench.version,
        "subtask_versions": sorted(v for v in sub_versions if v is not None) if bench.subtasks else None,
        "tasks": [leaf.task for leaf in leaves], "split": leaves[0].split, "items": items,
        "items_per_task": {leaf.task: leaf.items for leaf in leaves} if bench.subtasks else None,
        "lm_eval_split": bench.lm_eval_split or leaves[0].split, "fewshot": bench.fewshot, "licence": bench.licence,
        "converted": bench.convert or None, "changed": changes, "python_files": sorted(modules), "note": bench.note,
        "data": {_where(Path(f), root): sha256_file(Path(f)) for f in data},
        "package_paths": sorted({t.format(dataset_name="*") if bench.subtasks else t for t in bench.data.values()}),
        "folder": str(out),
    }
