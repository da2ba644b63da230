"""Run an lm-eval suite on a Kiln model and flatten the scores; draw sample generations (``run_suite(model, enc, dir, tasks)``).

Run: ``python -m kiln.evaluation.suite --model kiln --model_args checkpoint=PATH --tasks T --include_path TASK_DIR``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import tiktoken

from kiln.evaluation.adapter import KilnLM
from kiln.evaluation.registry import REGISTRY
from kiln.model.gpt2.model import GPT

# {task: expected score of a model that knows nothing}, read from the registry when asked; None where no such
# number exists (perplexity).
CHANCE = REGISTRY.chance_table()


def _clean(v: float) -> float | None:
    """JSON-able metric value: a float, or None for NaN/inf."""
    return float(v) if math.isfinite(v) else None


def _flatten(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lm-eval's results -> {task: {metric: value, metric_stderr: value, "chance": c, "items": n}}."""
    flat: dict[str, dict[str, Any]] = {}
    n_samples = out.get("n-samples", {})
    for task, metrics in out["results"].items():
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            name = key.split(",", 1)[0]  # "acc,none" -> "acc"
            if name in ("sample_len", "name") or name in row or not isinstance(value, (int, float)):
                continue  # alias/name strings, lm-eval's "N/A" stderr, the sample count (kept as "items")
            row[name] = _clean(value)
        row["chance"] = REGISTRY.chance(task)
        row["items"] = int(n_samples.get(task, {}).get("effective", 0)) or None
        flat[task] = row
    return flat


@contextlib.contextmanager
def _env(**values: str):
    """Set environment variables for the duration of a block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_suite(
    model: GPT,
    encoding: tiktoken.Encoding,
    task_dir: str | Path | list[str | Path] | None,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    bootstrap_iters: int = 1000,
    seed: int = 1234,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Evaluate ``model`` on ``tasks`` (local ones from task_dir, one folder or several; lm-eval's own names too).

    Returns flat scores {task: {metric: value, metric_stderr: value, "chance": c, "items": n}}. ``progress`` is told
    ``eval N/M: <request type> | R requests/s | T left`` lines as the model answers (KilnLM's RequestProgress).

    Standard task names (e.g. hellaswag) load lm-eval's defaults (~15 s of indexing) and need their data in
    the local Hugging Face cache. The model is put in eval mode on ``device`` and its train/eval mode restored.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("run_suite needs at least one task name")
    REGISTRY.check_names(tasks, "run_suite")
    dirs = [task_dir] if isinstance(task_dir, (str, Path)) else list(task_dir or [])
    include = [str(Path(d).resolve()) for d in dirs] or None
    tm = TaskManager(include_path=include, include_defaults=include is None)
    if include is not None and not set(tasks) <= set(tm.all_tasks):
        tm = TaskManager(include_path=include, include_defaults=True)
    missing = sorted(set(tasks) - set(tm.all_tasks))
    if missing:
        raise ValueError(
            f"unknown tasks {missing}: not in {include or 'lm-eval defaults'} (local: "
            f"{[t for t in tm.all_tasks if t.startswith('kiln_')]}) nor among lm-eval's own tasks"
        )
    was_training = model.training
    try:
        lm = KilnLM(model, encoding, device=device, batch_size=batch_size, seed=seed, progress=progress)
        # lm-eval bootstraps perplexity stderr in a forked multiprocessing pool unless DISABLE_MULTIPROC is
        # set; forking a process that holds torch threads and an orchestrator's signal handlers is unsafe.
        with _env(DISABLE_MULTIPROC="1"):
            out = simple_evaluate(
                model=lm,
                tasks=list(tasks),
                task_manager=tm,
                limit=limit,
                log_samples=False,
                bootstrap_iters=bootstrap_iters,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    finally:
        model.train(was_training)
    if out is None:  # only non-zero ranks get None; Kiln runs one process
        raise RuntimeError("lm-eval returned no results (not rank 0?)")
    return _flatten(out)


def score_full_and_clean(
    model: GPT,
    encoding: tiktoken.Encoding,
    task_dirs: list[str | Path],
    tasks: list[str],
    contamination: dict[str, dict[str, Any]] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Score ``tasks`` on all their items and, where the contamination check removed some, on the clean rest.

    contamination: the ``tasks`` part of a ``check_contamination`` report, whose ``<task>_clean`` tasks must be in
    task_dirs. Returns (full, clean): full rows gain ``contaminated`` and ``contaminated_share``; clean rows are
    the clean subset's scores (the full ones when nothing was contaminated; only chance and items=0 when nothing
    is clean). Tasks the report does not cover (lm-eval's own) appear in full only. kwargs go to ``run_suite``.
    """
    report = contamination or {}
    clean_names = {t: report[t]["clean_task"] for t in tasks
                   if t in report and report[t]["contaminated"] and report[t].get("clean_task")}
    res = run_suite(model, encoding, task_dirs, list(tasks) + list(clean_names.values()), **kwargs)
    full: dict[str, dict[str, Any]] = {}
    clean: dict[str, dict[str, Any]] = {}
    for t in tasks:
        full[t] = dict(res[t])
        if t not in report:
            continue
        full[t].update(contaminated=report[t]["contaminated"], contaminated_share=report[t]["share"])
        if not report[t]["contaminated"]:
            clean[t] = dict(res[t])
        elif t in clean_names:
            clean[t] = dict(res[clean_names[t]])
        else:
            clean[t] = {"chance": res[t]["chance"], "items": 0}
    return full, clean


def sample_generations(
    model: GPT,
    encoding: tiktoken.Encoding,
    prompts: list[str],
    max_new_tokens: int,
    seed: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    device: str = "cpu",
) -> list[dict[str, str]]:
    """[{prompt, completion}] per prompt: greedy at temperature 0, else sampled with a generator seeded seed + i."""
    was_training = model.training
    try:
        lm = KilnLM(model, encoding, device=device, seed=seed)
        out = []
        for i, prompt in enumerate(prompts):
            lm.generator.manual_seed(seed + i)
            out.append({"prompt": prompt, "completion": lm._generate(prompt, max_new_tokens, temperature, top_k, ())})
        return out
    finally:
        model.train(was_training)


def lm_eval_cli(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with the ``kiln`` model registered (lm-eval 0.4.13 has no plugin discovery)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    lm_eval_cli()
