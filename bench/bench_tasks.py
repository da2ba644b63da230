"""Benchmark: the tasks that execute or check answers (word problems, expressions, HumanEval) and the red-team suite,
scored for several models side by side, each score beside its chance level.

python bench/bench_tasks.py --model NAME=PATH [--model NAME=PATH ...] [--tiny-import] [--json out.json]

PATH is anything kiln.posttrain.judge.load_judge reads: a Kiln checkpoint or run folder, a release bundle, a Hugging
Face folder. ``--tiny-import`` adds a tiny random transformers llama (Llama-3-style tokenizer) saved to a temporary
folder and imported as Kiln imports released weights. Every model answers the same items: the pinned word problems
(20) and expressions (100) of the evals wheel, ``--humaneval-items`` HumanEval problems (a seeded sample; 0: all 164)
run in the sandbox, and the red-team probes of conf/redteam/probes.yaml, judged by the model itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_import(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from hfmodels import save_tiny

    save_tiny(folder, "llama", style="llama3", seed=0)
    return folder


def score(name: str, path: str, task_dir: Path, tasks: list[str], cache: Path, args) -> dict:
    from kiln.evaluation import redteam as krt
    from kiln.evaluation import run_suite
    from kiln.evaluation.registry import REGISTRY
    from kiln.posttrain.judge import load_judge

    m = load_judge(path)
    t0 = time.perf_counter()
    res = run_suite(m.model, m.enc, task_dir, tasks, batch_size=16, seed=1234)
    rows = []
    for task in tasks:
        r = res[task]
        metric = REGISTRY.primary(task, r)
        rows.append({"model": name, "task": task, "metric": metric, "score": r[metric],
                     "stderr": r.get(f"{metric}_stderr"), "chance": r.get("chance"), "items": r.get("items")})
    t1 = time.perf_counter()
    spec = krt.read_probes()
    probes = krt.build_probes(spec, krt.load_naughty_strings(cache), args.malformed_items, args.injection_items, 0)
    summary = krt.summarize(krt.answer_and_score(m.model, m.enc, probes, spec, m, 48))
    for kind, k in summary["kinds"].items():
        rows.append({"model": name, "task": f"red team: {kind}", "metric": "failure rate (rules)",
                     "score": k["rules"]["rate"], "stderr": k["rules"]["stderr"], "chance": None, "items": k["n"],
                     "by judge": (k["judge"] or {}).get("rate"), "judge orders references": k["judge_orders_references"]})
    return {"model": name, "path": path, "params": m.identity["params"], "family": m.identity["family"],
            "tasks_s": round(t1 - t0, 1), "red_team_s": round(time.perf_counter() - t1, 1), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", default=[], help="NAME=PATH")
    p.add_argument("--tiny-import", action="store_true")
    p.add_argument("--cache-dir", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    p.add_argument("--humaneval-items", type=int, default=40)
    p.add_argument("--malformed-items", type=int, default=40)
    p.add_argument("--injection-items", type=int, default=20)
    p.add_argument("--json", default="")
    args = p.parse_args()
    from kiln.evaluation.coding import HUMANEVAL, build_humaneval_task
    from kiln.evaluation.mathematics import MATH_EXPR, MATH_EXPR_TASK, MATH_WORD, MATH_WORD_TASK
    from kiln.evaluation.spec import build_package_task

    cache = Path(args.cache_dir)
    with tempfile.TemporaryDirectory(prefix="bench-tasks-") as tmp:
        task_dir = Path(tmp) / "tasks"
        for spec in (MATH_WORD_TASK, MATH_EXPR_TASK):
            build_package_task(spec, task_dir, cache)
        build_humaneval_task(task_dir, cache, args.humaneval_items or None, seed=1234)
        models = [m.split("=", 1) for m in args.model]
        if args.tiny_import:
            models.append(["tiny import (random llama)", str(tiny_import(Path(tmp) / "tiny"))])
        out = []
        for name, path in models:
            got = score(name, path, task_dir, [MATH_WORD, MATH_EXPR, HUMANEVAL], cache, args)
            print(f"{name}: {got['family']}, {got['params']:,} parameters; tasks {got['tasks_s']} s, red team "
                  f"{got['red_team_s']} s", flush=True)
            out.append(got)
    print("\n| model | task | metric | score ± stderr | chance | items | red team: by judge |")
    print("|---|---|---|---:|---:|---:|---:|")
    for got in out:
        for r in got["rows"]:
            se = f" ± {r['stderr']:.3f}" if isinstance(r["stderr"], float) else ""
            chance = "-" if r["chance"] is None else f"{r['chance']:g}"
            judge = r.get("by judge")
            print(f"| {r['model']} | {r['task']} | {r['metric']} | {r['score']:.3f}{se} | {chance} | {r['items']} | "
                  f"{'-' if judge is None else f'{judge:.3f}'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
