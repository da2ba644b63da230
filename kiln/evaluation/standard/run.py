"""Run the standard benchmarks on any lm-eval model: check and write everything first, then load and score.

``prepare(names, cache_dir, out_dir, limit, seed)`` validates the names, fetches and checks the data, writes the
tasks and draws the seeded subsample, all before a model exists; ``evaluate_lm(lm, prepared)`` scores an lm-eval
``LM``; ``scores(out, prepared)`` flattens lm-eval's output. ``run_standard(model_or_checkpoint, ...)`` does all three
with Kiln's adapter.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kiln.common.files import stable_hash
from kiln.evaluation.standard.catalog import Benchmark
from kiln.evaluation.suite import _env  # environment variables set for a block, then restored
from kiln.evaluation.standard.data import PACKAGE, BenchmarkError, math_extra, package_root
from kiln.sources.packages import pin

DEFAULT_CACHE = ".kiln/storage/cache/sources"
MIN_PER_SUBTASK = 2  # a group's limit gives each subtask this many items at least: lm-eval's stderr needs two


@dataclass
class Prepared:
    """Benchmarks written and checked, ready for any model."""

    names: list[str]
    task_dir: Path
    samples: dict[str, list[int]] | None  # {lm-eval task: doc indices scored}; None: every item
    record: dict[str, Any]  # lineage: the package, each benchmark's record, the limit, seed and sample
    benchmarks: dict[str, Benchmark] = field(default_factory=dict)


def _registry():
    from kiln.evaluation.registry import REGISTRY

    return REGISTRY


def allocate(sizes: dict[str, int], limit: int, least: int = 1) -> dict[str, int]:
    """``limit`` items shared over tasks in proportion to their sizes beyond ``least`` each (largest remainder)."""
    total, free = sum(sizes.values()), limit - least * len(sizes)
    exact = {t: free * (n - least) / max(total - least * len(sizes), 1) for t, n in sizes.items()}
    out = {t: least + int(x) for t, x in exact.items()}
    for t in sorted(sizes, key=lambda t: (int(exact[t]) - exact[t], t))[: limit - sum(out.values())]:
        out[t] += 1
    return out


def fitting_limit(bench: Benchmark, want: int) -> int:
    """``want`` items of ``bench``, raised for a group to MIN_PER_SUBTASK per subtask (what ``draw`` asks of a group)
    and cut to the set's size: the limit to ask for when one number of items is wanted of every benchmark."""
    from kiln.evaluation.standard.tasks import lm_eval_tasks_dir

    subtasks = len(list(lm_eval_tasks_dir().glob(bench.subtasks))) if bench.subtasks else 1
    return min(bench.rows, max(want, MIN_PER_SUBTASK * subtasks if subtasks > 1 else 1))


def draw(sizes: dict[str, int], limit: int, seed: int, name: str) -> dict[str, list[int]]:
    """The seeded subsample: {task: sorted doc indices}; a group's limit is shared over its tasks in proportion to
    their sizes, each at least MIN_PER_SUBTASK."""
    total = sum(sizes.values())
    if limit > total:
        raise BenchmarkError(f"{name}: limit {limit} is more than its {total} items; give at most {total}, or no limit "
                             "for every item")
    least = MIN_PER_SUBTASK * len(sizes)
    if len(sizes) > 1 and limit < least:
        raise BenchmarkError(f"{name}: limit {limit} is too few for its {len(sizes)} subtasks; give at least {least} "
                             f"({MIN_PER_SUBTASK} items each, so that each has a standard error)")
    take = allocate(sizes, limit, MIN_PER_SUBTASK) if len(sizes) > 1 else {t: limit for t in sizes}
    return {t: sorted(random.Random(f"{seed}:{t}").sample(range(sizes[t]), k)) for t, k in take.items()}


def prepare(names: list[str], cache_dir: str | Path = DEFAULT_CACHE, out_dir: str | Path | None = None,
            limit: int | None = None, seed: int = 1234) -> Prepared:
    """Check names and limit, fetch and check the data, write the tasks into out_dir, draw the subsample.

    Every problem is a BenchmarkError (or UnknownBenchmarkError) with a one-line message, raised before any model
    is loaded. ``limit``: a seeded sample of that many items per benchmark (shared over a group's subtasks, at
    least two each), not lm-eval's first N; None scores every item.
    """
    registry = _registry()
    if not names:
        raise BenchmarkError(f"no benchmark named; known: {', '.join(registry.benchmark_names())}")
    benches = {n: registry.benchmark(n) for n in dict.fromkeys(names)}
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise BenchmarkError(f"limit must be a whole number >= 1 (items per benchmark) or None for all, got {limit!r}")
    root = package_root(cache_dir)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="kiln-standard-"))
    from kiln.evaluation.standard.tasks import write_benchmark

    records = {n: write_benchmark(b, root, out) for n, b in benches.items()}
    samples: dict[str, list[int]] | None = None
    if limit is not None:
        samples = {}
        for n, rec in records.items():
            sizes = rec["items_per_task"] or {rec["tasks"][0]: rec["items"]}
            samples.update(draw(sizes, limit, seed, n))
    extras = [str(p) for b in benches.values() if "math" in b.requires for p in math_extra(cache_dir)]
    import lm_eval

    record = {
        "package": {"name": PACKAGE.package, "version": PACKAGE.version, "sha256": PACKAGE.sha256, "pin": pin(PACKAGE),
                    "license": PACKAGE.license, "root": str(root)},
        "lm_eval": lm_eval.__version__, "benchmarks": records, "limit": limit, "seed": seed,
        "sample_sha256": stable_hash(samples) if samples is not None else None, "task_dir": str(out),
        "extra_paths": sorted(set(extras)),
    }
    return Prepared(list(benches), out, samples, record, benches)


def load_tasks(prepared: Prepared) -> dict[str, Any]:
    """lm-eval's loaded task dict ({"tasks", "groups", ...}) of the written benchmarks (reusable across models)."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(prepared.task_dir), include_defaults=False)
    with _env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"):
        return tm.load(list(prepared.names))


def evaluate_lm(lm: Any, prepared: Prepared, loaded: dict[str, Any] | None = None, seed: int = 1234,
                bootstrap_iters: int = 1000, max_gen_toks: int | None = None,
                log_samples: bool = False) -> dict[str, Any]:
    """lm-eval's ``evaluate`` of ``lm`` on the prepared benchmarks, set up as ``simple_evaluate`` sets it up (default
    few-shot counts, few-shot seed, seeded random/numpy/torch). ``max_gen_toks`` caps generation for quick checks
    (it changes lm-eval's definition; the record says so). Returns lm-eval's output dict."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate

    loaded = loaded if loaded is not None else load_tasks(prepared)
    for task in loaded["tasks"].values():
        if max_gen_toks is not None and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value={"max_gen_toks": int(max_gen_toks)}, update=True)
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    random.seed(0)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # bootstrap stderr (lambada's perplexity) forks a pool unless DISABLE_MULTIPROC is set; forking a process that
    # holds torch threads is unsafe. Code tasks' programs run in Kiln's sandbox, so lm-eval's unsafe flag is given.
    with _env(DISABLE_MULTIPROC="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"):
        out = evaluate(lm=lm, task_dict=loaded, samples=prepared.samples, bootstrap_iters=bootstrap_iters,
                       log_samples=log_samples, confirm_run_unsafe_code=True, verbosity="WARNING")
    if out is None:
        raise RuntimeError("lm-eval returned no results (not rank 0?)")
    out["kiln_max_gen_toks"] = max_gen_toks
    return out


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def scores(out: dict[str, Any], prepared: Prepared) -> dict[str, dict[str, Any]]:
    """{benchmark: {score, stderr, items, primary, chance, lm_eval_task, version, metrics}} from lm-eval's output."""
    rows = {}
    n_samples = out.get("n-samples", {})
    for name, bench in prepared.benchmarks.items():
        res = {**out.get("groups", {}).get(name, {}), **out["results"].get(name, {})}
        metrics = {k: _number(v) for k, v in res.items() if k != "alias" and _number(v) is not None}
        metric, _, filt = bench.primary.partition(",")
        tasks = prepared.record["benchmarks"][name]["tasks"]
        rows[name] = {
            "lm_eval_task": name, "version": bench.version, "primary": bench.primary,
            "score": metrics.get(bench.primary), "stderr": metrics.get(f"{metric}_stderr,{filt}"),
            "items": sum(int(n_samples.get(t, {}).get("effective", 0)) for t in tasks), "chance": bench.chance,
            "metrics": metrics, "max_gen_toks": out.get("kiln_max_gen_toks"),
        }
    return rows


def run_standard(model: Any, encoding: Any = None, names: list[str] | None = None,
                 cache_dir: str | Path = DEFAULT_CACHE, out_dir: str | Path | None = None, limit: int | None = None,
                 seed: int = 1234, batch_size: int = 16, device: str = "cpu", max_gen_toks: int | None = None,
                 bootstrap_iters: int = 1000,
                 progress: Callable[[str], None] | None = None) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Score a Kiln model on standard benchmarks (all registered ones when ``names`` is None).

    ``model``: a Kiln GPT (with its tiktoken ``encoding``) or a checkpoint folder, loaded only after every check
    passed. Returns (scores, record): scores as ``scores`` gives them, record as ``prepare`` gives it.
    """
    from kiln.evaluation.adapter import KilnLM

    names = list(names) if names is not None else _registry().benchmark_names()
    if not isinstance(model, (str, os.PathLike)) and encoding is None:
        raise BenchmarkError("run_standard needs the model's tiktoken encoding beside a Kiln GPT")
    prepared = prepare(names, cache_dir, out_dir, limit, seed)
    was_training = bool(getattr(model, "training", False))
    if isinstance(model, (str, os.PathLike)):
        lm = KilnLM.from_checkpoint(model, device=device, batch_size=batch_size, seed=seed, progress=progress)
    else:
        lm = KilnLM(model, encoding, device=device, batch_size=batch_size, seed=seed, progress=progress)
    try:
        out = evaluate_lm(lm, prepared, seed=seed, bootstrap_iters=bootstrap_iters, max_gen_toks=max_gen_toks)
    finally:
        lm.model.train(was_training)
    return scores(out, prepared), {**prepared.record, "max_gen_toks": max_gen_toks}
